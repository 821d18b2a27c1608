"""FALSE-VFL-I/II: the bound, the aggregated posterior, the mask term, SNIS, the seam, learning."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from functools import partial

import numpy as np
import pytest
import torch
from aggregator_contract import TamperedSum
from conftest import MakeData

from protocols.ckks import CkksAggregator
from protocols.secagg import MaskingAggregator
from secure_vfl.data.vertical import VerticalData, labeled_subset
from secure_vfl.errors import ConfigError, IntegrityError, ProtocolError
from secure_vfl.federation.aggregator import PlainAggregator
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import (
    AGGREGATOR,
    GradientMessage,
    LatentGradientMessage,
    LatentMessage,
    LikelihoodMessage,
    Message,
    RepresentationMessage,
    RepresentRequest,
    SumMessage,
    SumRequest,
    TicketKeyMessage,
    UpdateRequest,
)
from secure_vfl.federation.parties import ROLES
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.false_vfl import (
    FalseVflConfig,
    FalseVflMethod,
    LatentLabelParty,
    LatentParty,
)
from secure_vfl.metrics import accuracy
from secure_vfl.models.latent import gaussian_log_prob, generator_draws

SMALL = FalseVflConfig(latent_dim=6, global_latent_dim=3, hidden=32, kappa=3)
FAST = MethodConfig(epochs=1, batch_size=64, labeled=100)
LEARNING = dataclasses.replace(
    SMALL, latent_dim=8, global_latent_dim=4, kappa=10, pretrain_epochs=10, train_epochs=40
)


def _method(
    data: VerticalData,
    variant: int = 1,
    config: MethodConfig = FAST,
    options: FalseVflConfig = SMALL,
    **kwargs: object,
) -> FalseVflMethod:
    method = METHODS.get(f"false-vfl-{variant}")(
        data,
        config,
        seed=5,
        false_vfl=options,  # type: ignore[call-arg]
        **kwargs,  # type: ignore[arg-type]
    )
    assert isinstance(method, FalseVflMethod)
    return method


def _parties(method: FalseVflMethod) -> list[LatentParty]:
    """Every party of the run, in order (the composition root's view, not the label party's)."""
    parties = in_process_parties(method.fed.channel)
    assert all(isinstance(p, LatentParty) for p in parties)
    return parties  # type: ignore[return-value]


def _with_test_mask(data: VerticalData, masks: dict[str, np.ndarray]) -> VerticalData:
    """``data`` whose test splits are the ``mcar:0`` split under each crafted mask."""
    base = data.tests["mcar:0"]
    tests = {}
    for name, mask in masks.items():
        blocks = tuple(
            np.where(mask[:, k].reshape(-1, 1), b, 0).astype(np.float32)
            for k, b in enumerate(base.blocks)
        )
        tests[name] = dataclasses.replace(base, blocks=blocks, mask=mask)
    return dataclasses.replace(data, tests=tests)


def _subset_mask(data: VerticalData, parties: list[int]) -> np.ndarray:
    mask = np.zeros_like(data.tests["mcar:0"].mask)
    mask[:, parties] = True
    return mask


def test_configuration_errors_say_what_was_expected() -> None:
    with pytest.raises(ConfigError, match=r"`kappa` must be a positive integer. Found 0."):
        FalseVflConfig(kappa=0)
    with pytest.raises(ConfigError, match=r"`train_epochs` must be a positive integer"):
        FalseVflConfig(train_epochs=-1)
    with pytest.raises(ConfigError, match=r"`pretrain_lr` must be a positive number"):
        FalseVflConfig(pretrain_lr=float("nan"))
    with pytest.raises(ConfigError, match=r"`labeled` must be a positive integer. Found 0."):
        MethodConfig(labeled=0)
    with pytest.raises(ConfigError, match=r"`labeled` must be an integer in \[1, 10\]"):
        labeled_subset(10, 11, rng=np.random.default_rng(0))
    # each row's samples are held at once: 10^8 asked the allocator for 1.6 TB, with a traceback
    with pytest.raises(ConfigError, match=r"`kappa` must be at most 10000 latent samples"):
        FalseVflConfig(kappa=10**8)
    with pytest.raises(ConfigError, match=r"`inference_samples` must be at most 10000"):
        FalseVflConfig(inference_samples=10**8)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"pretrain_epochs": 1}, "has no bottom model for SimSiam to pretrain"),
    ],
)
def test_split_network_settings_are_refused_not_recorded_and_ignored(
    make_data: MakeData, change: dict[str, int], expected: str
) -> None:
    """Both ran, were written into result.json, and changed nothing."""
    with pytest.raises(ConfigError, match=expected):
        _method(make_data(n=40), config=dataclasses.replace(FAST, **change))


def test_the_labelled_subset_is_seeded_sorted_and_all_rows_by_default() -> None:
    first = labeled_subset(500, 40, rng=np.random.default_rng(3))
    again = labeled_subset(500, 40, rng=np.random.default_rng(3))
    other = labeled_subset(500, 40, rng=np.random.default_rng(4))
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    assert first.size == 40 and np.all(np.diff(first) > 0)
    assert np.array_equal(labeled_subset(7, None, rng=np.random.default_rng(0)), np.arange(7))


@pytest.mark.parametrize("variant", [1, 2])
def test_the_bound_increases_with_kappa_on_a_fixed_model(make_data: MakeData, variant: int) -> None:
    """Theorem 3.1: E[log R_kappa] is non-decreasing in kappa (here strictly, at initialisation)."""
    data = make_data(train_missing="mcar:0.3")
    method = _method(data, variant)
    rows = np.arange(200)
    means = {}
    for kappa in (1, 5, 50):
        draws = [method.bound("train", rows, kappa).mean().item() for _ in range(10)]
        means[kappa] = float(np.mean(draws))
    assert means[1] < means[5] < means[50], means
    assert means[50] - means[1] > 0.3, means  # an ELBO (no log-mean-exp) would give ~0


def test_the_posterior_ignores_absent_parties(make_data: MakeData) -> None:
    data = make_data()
    mask = _subset_mask(data, [0, 2])
    clean = _with_test_mask(data, {"subset": mask})
    split = clean.tests["subset"]
    noisy_blocks = list(split.blocks)
    for k in (1, 3):  # absent everywhere: fill the blocks the parties do not hold with garbage
        noisy_blocks[k] = np.random.default_rng(k).normal(size=split.blocks[k].shape)
        noisy_blocks[k] = noisy_blocks[k].astype(np.float32) * 100
    noisy = dataclasses.replace(
        clean, tests={"subset": dataclasses.replace(split, blocks=tuple(noisy_blocks))}
    )
    rows = np.arange(50)
    mean_a, precision_a = _method(clean).posterior("subset", rows)
    mean_b, precision_b = _method(noisy).posterior("subset", rows)
    assert torch.equal(mean_a, mean_b) and torch.equal(precision_a, precision_b)


def test_the_posterior_averages_means_and_tightens_as_parties_are_added(
    make_data: MakeData,
) -> None:
    """Eq. 1: mean = average of the observed means, precision = sum of observed precisions."""
    data = make_data()
    masks = {f"{k}": _subset_mask(data, [k]) for k in range(4)}
    masks |= {f"0-{last}": _subset_mask(data, list(range(last + 1))) for last in range(1, 4)}
    method = _method(_with_test_mask(data, masks))
    rows = np.arange(40)
    single = [method.posterior(str(k), rows) for k in range(4)]
    previous = single[0][1]
    for last in range(1, 4):
        mean, precision = method.posterior(f"0-{last}", rows)
        expected_mean = torch.stack([single[k][0] for k in range(last + 1)]).mean(dim=0)
        expected_precision = torch.stack([single[k][1] for k in range(last + 1)]).sum(dim=0)
        assert torch.allclose(mean, expected_mean, atol=1e-5)
        assert torch.allclose(precision, expected_precision, atol=1e-5)
        assert bool((precision > previous).all())
        previous = precision


def _constant_missingness(method: FalseVflMethod, logit: float) -> None:
    """Make every party's p(m^k = 1 | x^k) = sigmoid(logit), whatever x^k."""
    for party in _parties(method):
        assert party.latent_model.missingness is not None
        last = party.latent_model.missingness.net[-1]
        assert isinstance(last, torch.nn.Linear)
        with torch.no_grad():
            last.weight.zero_()
            last.bias.fill_(logit)


def test_the_mnar_bound_includes_the_mask_term_and_the_mar_bound_does_not(
    make_data: MakeData,
) -> None:
    data = make_data(train_missing="mcar:0.4")
    rows = np.arange(120)
    mask = torch.from_numpy(data.train.mask[rows])
    mar = _method(data, 1).log_weights("train", rows, 4)
    mnar = _method(data, 2)
    for logit in (-1.0, 2.0):
        _constant_missingness(mnar, logit)
        weights = _reseeded(mnar).log_weights("train", rows, 4)  # the MAR model's h and z
        p = torch.sigmoid(torch.tensor(logit))
        mask_term = torch.where(mask, torch.log(1 - p), torch.log(p)).sum(dim=1, keepdim=True)
        assert torch.allclose(weights - mar, mask_term.expand_as(mar), atol=1e-4)
    # A missing block is drawn from its party's decoder: with a missingness model that reads
    # x^k, changing party 3's decoder moves the MNAR weights of rows where party 3 is missing,
    # never the MAR weights of those rows (party 3 takes no part in them).
    absent = ~mask[:, 3]
    assert bool(absent.any())
    results = {}
    for variant in (1, 2):
        method = _method(data, variant)
        before = _reseeded(method).log_weights("train", rows, 4)
        decoder_output = _parties(method)[3].latent_model.decoder.net[-1]
        assert isinstance(decoder_output, torch.nn.Linear)
        with torch.no_grad():
            decoder_output.bias.add_(3.0)
        results[variant] = (before, _reseeded(method).log_weights("train", rows, 4))
    mar_before, mar_after = results[1]
    assert torch.equal(mar_before[absent], mar_after[absent])
    mnar_before, mnar_after = results[2]
    assert not torch.allclose(mnar_before[absent], mnar_after[absent])


def _reseeded(method: FalseVflMethod) -> FalseVflMethod:
    """Reset every party's random draws, so two evaluations use the same h, z and x~."""
    method.label_party.latent_generator.manual_seed(5)
    for k, party in enumerate(_parties(method)):
        party.generator.manual_seed(100 + k)
    return method


def test_snis_weights_are_normalised_and_do_not_depend_on_labels(make_data: MakeData) -> None:
    data = make_data()
    permuted = dataclasses.replace(
        data,
        tests={
            name: dataclasses.replace(
                split, labels=np.random.default_rng(1).permutation(split.labels)
            )
            for name, split in data.tests.items()
        },
    )
    first, second = _method(data), _method(permuted)
    first.fit()
    second.fit()
    for name in data.tests:
        a, b = first.infer(name), second.infer(name)
        assert a.weights.shape == (data.tests[name].n, SMALL.inference_samples)
        assert np.allclose(a.weights.sum(axis=1), 1.0, atol=1e-5)
        assert np.allclose(a.probabilities.sum(axis=1), 1.0, atol=1e-5)
        assert np.array_equal(a.weights, b.weights)
        assert np.array_equal(a.probabilities, b.probabilities)


def test_the_label_party_holds_only_the_labelled_rows(make_data: MakeData) -> None:
    data = make_data()
    method = _method(data)
    assert method.labeled_rows.size == 100
    unlabelled = np.setdiff1d(np.arange(data.train.n), method.labeled_rows)
    with pytest.raises(ProtocolError, match="unlabelled row"):
        method.label_party.labels(torch.from_numpy(unlabelled[:3]))
    seen = np.concatenate(list(method.labeled_sampler.epoch(np.random.default_rng(0))))
    assert np.array_equal(np.sort(seen), method.labeled_rows)


def _parameters(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def test_stage_two_trains_only_the_discriminator(make_data: MakeData) -> None:
    data = make_data()
    method = _method(data, 2)
    generative = [p.latent_model for p in _parties(method)] + [
        method.label_party.label_model.global_encoder,
        method.label_party.label_model.global_decoder,
    ]
    discriminator = [method.label_party.label_model.discriminator]
    start_generative = _parameters(generative)
    start_discriminator = _parameters(discriminator)
    method.train_step(np.arange(64), 0, 0)
    method.fed.flush(round=0)  # the step's closing gradients, held back for the next message
    after_stage_one = _parameters(generative)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_parameters(discriminator), start_discriminator, strict=True)
    )
    assert not all(
        torch.equal(a, b) for a, b in zip(after_stage_one, start_generative, strict=True)
    )
    method.stage = 2
    method.train_step(method.labeled_rows[:32], 1, 0)
    assert all(
        torch.equal(a, b) for a, b in zip(_parameters(generative), after_stage_one, strict=True)
    )
    assert not all(
        torch.equal(a, b)
        for a, b in zip(_parameters(discriminator), start_discriminator, strict=True)
    )


def _centralised_loss(
    method: FalseVflMethod, data: VerticalData, rows: np.ndarray, state: torch.Tensor
) -> torch.Tensor:
    """-L_kappa of FALSE-VFL-I computed in one autograd graph, with the same random draws."""
    generator = torch.Generator()
    generator.set_state(state)
    mask = torch.from_numpy(data.train.mask[rows])
    batch, latent, kappa = len(rows), method.options.latent_dim, method.options.kappa
    mean_sum, precision_sum = torch.zeros(batch, latent), torch.zeros(batch, latent)
    blocks = [torch.from_numpy(b[rows]) for b in data.train.blocks]
    for k, party in enumerate(_parties(method)):
        observed = torch.nonzero(mask[:, k]).flatten()
        m, p = party.latent_model.encoder(blocks[k][observed])
        mean_sum = mean_sum.index_add(0, observed, m)
        precision_sum = precision_sum.index_add(0, observed, p)
    mean = mean_sum / mask.sum(dim=1, keepdim=True)
    scale = precision_sum.rsqrt().unsqueeze(1)
    h = mean.unsqueeze(1) + torch.randn((batch, kappa, latent), generator=generator) * scale
    total = torch.zeros(batch, kappa)
    for k, party in enumerate(_parties(method)):
        observed = torch.nonzero(mask[:, k]).flatten()
        x = blocks[k][observed].flatten(1).unsqueeze(1)
        total = total.index_add(0, observed, party.latent_model.decoder.log_prob(x, h[observed]))
    label = method.label_party.label_model
    log_weights = (
        total
        + label.latent_log_ratio(h, generator_draws(generator))
        - gaussian_log_prob(h, mean.unsqueeze(1), scale)
    )
    return -(torch.logsumexp(log_weights, dim=1) - math.log(kappa)).mean()


def test_gradients_through_the_seam_equal_those_of_the_centralised_model(
    make_data: MakeData, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = make_data(train_missing="mcar:0.4")
    method = _method(data, 1)
    modules: list[torch.nn.Module] = [p.latent_model for p in _parties(method)] + [
        method.label_party.label_model.global_encoder,
        method.label_party.label_model.global_decoder,
    ]
    rows = np.arange(48)
    state = method.label_party.latent_generator.get_state()
    _centralised_loss(method, data, rows, state).backward()
    expected = [p.grad.clone() for m in modules for p in m.parameters()]  # type: ignore[union-attr]
    for m in modules:
        m.zero_grad(set_to_none=True)
    label = method.label_party
    optimizers = [p.optimizer for p in _parties(method)] + [label.generative_optimizer]
    for optimizer in optimizers:  # keep the gradients the step leaves (no step, no zeroing)
        monkeypatch.setattr(optimizer, "step", lambda: None)
        monkeypatch.setattr(optimizer, "zero_grad", lambda set_to_none=True: None)
    method.train_step(rows, 0, 0)
    method.fed.flush(round=0)  # the step's closing gradients, held back for the next message
    found = [p.grad for m in modules for p in m.parameters()]
    for a, b in zip(expected, found, strict=True):
        assert b is not None
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", [1, 2])
def test_false_vfl_learns_from_few_labels_and_predicts_on_any_missingness(
    make_data: MakeData, variant: int
) -> None:
    data = make_data(train_missing="mcar:0.3")
    method = _method(data, variant, FAST, LEARNING)
    losses = method.fit()
    assert len(losses) == 50
    assert losses[9] < losses[0] and losses[-1] < losses[10]  # each stage ascends its bound
    for name, split in data.tests.items():
        predictions = method.predict(name)
        assert np.array_equal(predictions >= 0, split.mask)
        assert accuracy(predictions, split.labels) > 80.0, name  # chance is 33 %


def test_messages_follow_the_papers_communication_pattern(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0.3")
    recorder = RecordingLayer()
    method = _method(data, 1, channel=Channel([recorder]))
    rows = np.arange(32)
    mask = data.train.mask[rows]
    method.train_step(rows, 0, 0)
    method.fed.flush(round=0)  # the closing gradients, held back for the next message
    parties = [f"party-{k}" for k in range(4)]
    others = parties[1:]  # the label party's messages to itself never cross the wire
    routes = Counter((m.kind, m.sender, m.receiver) for m in recorder.messages)
    expected = Counter(
        [("ticket-key", "party-0", "aggregator")]  # once per session: its first step's
        + [("represent-request", "party-0", p) for p in others]
        + [("representation", p, "aggregator") for p in parties]
        + [("sum-request", "party-0", "aggregator"), ("sum", "aggregator", "party-0")]
        + [("latent", "party-0", p) for p in others]
        + [("likelihood", p, "party-0") for p in others]
        + [("gradient", "party-0", p) for p in others] * 2
        + [("latent-gradient", p, "party-0") for p in others]
    )
    assert routes == expected
    # The gradient w.r.t. each party's posterior factor closes its step (no update follows).
    closing = [m for m in recorder.messages if isinstance(m, GradientMessage) and m.step]
    assert sorted(m.receiver for m in closing) == others
    assert all(m.tag == "stage1/posterior" for m in closing)
    latent, kappa = SMALL.latent_dim, SMALL.kappa
    block_width = data.train.blocks[0].shape[1]
    assert block_width not in (latent, 2 * latent, kappa)  # a block could not hide in a message
    for message in recorder.messages:
        assert message.round == 0 and message.batch_id == 0
        if isinstance(message, TicketKeyMessage):
            assert message.sender == "party-0" and message.receiver == "aggregator"
        elif isinstance(message, RepresentRequest):
            k = parties.index(message.receiver)
            assert message.rows.tolist() == rows[mask[:, k]].tolist()  # ids of rows, no values
        elif isinstance(message, UpdateRequest | SumRequest):
            assert message.receiver != "party-0"
        elif isinstance(message, RepresentationMessage):
            k = parties.index(message.sender)
            assert message.positions.tolist() == np.flatnonzero(mask[:, k]).tolist()
            assert message.representation.shape == (int(mask[:, k].sum()), 2 * latent)
            assert bool((message.representation[:, latent:] > 0).all())  # precisions
        elif isinstance(message, SumMessage):
            assert message.sums.shape == (1, 32, 2 * latent)
            assert message.counts[0].tolist() == mask.sum(axis=1).tolist()
        elif isinstance(message, LatentMessage):
            k = parties.index(message.receiver)
            assert message.positions.tolist() == np.flatnonzero(mask[:, k]).tolist()
            assert message.rows.tolist() == rows[mask[:, k]].tolist()
            assert message.samples.shape[1:] == (kappa, latent)
        elif isinstance(message, LikelihoodMessage):
            assert message.log_likelihood.shape[1:] == (kappa,)
        elif isinstance(message, LatentGradientMessage):
            assert message.gradient.shape[1:] == (kappa, latent)
        else:
            assert isinstance(message, GradientMessage)
            assert message.tag in ("stage1/likelihood", "stage1/posterior")
            width = kappa if message.tag.endswith("likelihood") else 2 * latent
            assert message.gradient.shape[1] == width
    # Stage 2 and prediction send no gradient anywhere.
    recorder.messages.clear()
    method.stage = 2
    method.train_step(method.labeled_rows[:32], 1, 0)
    method.predict("mcar:0.5")
    kinds = set(recorder.kinds())
    assert kinds == {
        "represent-request",
        "representation",
        "sum-request",
        "sum",
        "latent",
        "likelihood",
    }


def test_mnar_parties_also_score_the_rows_they_miss(make_data: MakeData) -> None:
    """FALSE-VFL-II sends h to the parties missing a row too (appendix A.2's extra exchange)."""
    data = make_data(train_missing="mcar:0.3")
    recorder = RecordingLayer()
    method = _method(data, 2, channel=Channel([recorder]))
    method.train_step(np.arange(32), 0, 0)
    latents = [m for m in recorder.messages if isinstance(m, LatentMessage)]
    assert len(latents) == 3  # the label party's own is handed over without the wire
    assert all(m.positions.tolist() == list(range(32)) for m in latents)


class _RecordingAggregator(PlainAggregator):
    """A stand-in secure backend that records what it was asked to sum."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, torch.Tensor, int]] = []

    def combine(self, contributions, selection, **kwargs):  # type: ignore[no-untyped-def]
        width = contributions[0].representation.shape[1]
        self.calls.append((kwargs["tag"], selection.clone(), width))
        return super().combine(contributions, selection, **kwargs)


def test_the_posterior_sums_go_through_the_given_aggregator(make_data: MakeData) -> None:
    data = make_data()
    aggregator = _RecordingAggregator()
    method = _method(data, 1, aggregator=aggregator)
    method.fit()
    method.predict("mcar:0.5")
    tags = Counter(tag for tag, _, _ in aggregator.calls)
    assert tags["stage1"] == len(method.sampler)
    assert tags["stage2"] == len(method.labeled_sampler)
    assert tags["predict/mcar:0.5"] == 1
    assert all(width == 2 * SMALL.latent_dim for _, _, width in aggregator.calls)
    _, selection, _ = aggregator.calls[-1]
    assert torch.equal(selection[0], torch.from_numpy(data.tests["mcar:0.5"].mask))


def test_under_secure_sums_no_posterior_sum_reveals_a_single_party(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0.3")
    aggregator = _RecordingAggregator()
    config = dataclasses.replace(FAST, secure_sums=True)
    method = _method(data, 2, config, LEARNING, aggregator=aggregator)
    method.fit()
    predictions = {name: method.predict(name) for name in data.tests}
    assert len(aggregator.calls) > 10
    for _, selection, _ in aggregator.calls:
        assert not bool((selection[..., 1:].sum(dim=2) == 1).any())
    # Rows seen by one passive party only are predicted from the prior, with equal weights.
    split = data.tests["mcar:0.5"]
    lone = (~split.mask[:, 0]) & (split.mask[:, 1:].sum(axis=1) == 1)
    assert lone.any()
    inference = method.infer("mcar:0.5")
    assert np.allclose(inference.weights[lone], 1.0 / SMALL.inference_samples)
    assert np.array_equal(predictions["mcar:0.5"] >= 0, split.mask)
    assert accuracy(predictions["mcar:0"], data.tests["mcar:0"].labels) > 70.0


def test_false_vfl_trained_through_masks_matches_false_vfl_trained_in_the_clear(
    make_data: MakeData,
) -> None:
    data = make_data(train_missing="mcar:0.3")
    config = dataclasses.replace(FAST, secure_sums=True)
    models = []
    for aggregator in (
        PlainAggregator(),
        MaskingAggregator(entropy=np.random.default_rng(0).bytes),  # type: ignore[arg-type]
    ):
        method = _method(data, 1, config, aggregator=aggregator)
        method.fit()
        modules = [p.latent_model for p in _parties(method)] + [method.label_party.label_model]
        models.append(_parameters(modules))
    plain, secure = models
    assert all(
        torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in zip(plain, secure, strict=True)
    )


def test_the_new_messages_refuse_malformed_content() -> None:
    header = {"sender": "party-1", "receiver": "party-0", "round": 0, "batch_id": 0}
    positions = torch.tensor([0, 2])
    LikelihoodMessage(**header, positions=positions, log_likelihood=torch.zeros(2, 3)).validate()
    with pytest.raises(ProtocolError, match="log_likelihood must be a 2-d"):
        LikelihoodMessage(
            **header, positions=positions, log_likelihood=torch.zeros(2, 3, 1)
        ).validate()
    with pytest.raises(ProtocolError, match="2 rows announced, found 3"):
        LatentMessage(
            **header,
            positions=positions,
            samples=torch.zeros(3, 4, 5),
            split="train",
            rows=positions,
        ).validate()
    with pytest.raises(ProtocolError, match="one row >= 0 per position expected"):
        LatentMessage(
            **header,
            positions=positions,
            samples=torch.zeros(2, 4, 5),
            split="train",
            rows=torch.tensor([0, -1]),
        ).validate()
    with pytest.raises(IntegrityError, match="finite values expected"):
        Channel().send(
            LatentGradientMessage(
                **header, positions=positions, gradient=torch.full((2, 4, 5), float("nan"))
            )
        )
    with pytest.raises(ProtocolError, match="autograd graph"):
        LatentMessage(
            **header,
            positions=positions,
            samples=torch.zeros(2, 4, 5, requires_grad=True),
            split="train",
            rows=positions,
        ).validate()


def test_fit_reports_every_step_of_both_stages_in_order(make_data: MakeData) -> None:
    method = _method(make_data(), 1, FAST, dataclasses.replace(SMALL, train_epochs=3))
    rounds: list[int] = []
    losses = method.fit(on_step=lambda round, loss: rounds.append(round))
    assert len(losses) == 1 + 3
    assert rounds == list(range(1, method.total_steps + 1))
    assert method.total_steps == len(method.sampler) + 3 * len(method.labeled_sampler)


def _latent_step(make_data: MakeData) -> tuple[FalseVflMethod, RecordingLayer]:
    """A FALSE-VFL-II run stopped after the latent samples of a stage-1 step went out."""
    recorder = RecordingLayer()
    method = _method(make_data(train_missing="mcar:0.3"), 2, channel=Channel([recorder]))
    rows = torch.arange(32)
    mask = torch.from_numpy(method.data.train.mask[:32])
    method._forward("train", rows, mask, 3, round=0, batch_id=0, tag="stage1", train=True)
    return method, recorder


def _pending(party: LatentParty) -> dict[tuple[int, str], tuple[torch.Tensor, ...]]:
    return dict(party._likelihood_pending)


def test_a_party_refuses_bad_or_replayed_latent_messages_and_keeps_its_state(
    make_data: MakeData,
) -> None:
    method, recorder = _latent_step(make_data)
    party = _parties(method)[2]
    latent = next(
        m for m in recorder.messages if isinstance(m, LatentMessage) and m.receiver == party.name
    )
    before = _pending(party)
    assert list(before) == [(0, "stage1")]
    bad = {
        r"a second latent from party-0 .*\(a replay\?\)": latent,
        # Another batch id: a message it has not taken, for latent samples it holds.
        "second latent samples": dataclasses.replace(latent, batch_id=1),
        "split 'nope'": dataclasses.replace(latent, split="nope", batch_id=2),
        "rows < ": dataclasses.replace(latent, rows=latent.rows + 10_000, batch_id=3),
    }
    for expected, message in bad.items():
        with pytest.raises(ProtocolError, match=expected):
            party.receive(message)
        assert _pending(party) == before, expected


def test_latent_samples_of_another_width_are_refused_before_the_open_step_is_forgotten(
    make_data: MakeData,
) -> None:
    """Latent samples for the next step, of a width its decoder does not read: the party
    forgot its open step (likelihoods, forward pass, gradients) first, then torch failed on the
    decoder's matrix product (a RuntimeError, not a refusal)."""
    method, recorder = _latent_step(make_data)
    party = _parties(method)[2]
    latent = next(
        m for m in recorder.messages if isinstance(m, LatentMessage) and m.receiver == party.name
    )
    before = _pending(party)
    assert list(before) == [(0, "stage1")]
    generator = party.generator.get_state()
    rows, kappa, width = latent.samples.shape
    wider = dataclasses.replace(
        latent, round=1, samples=torch.zeros(rows, kappa, width + 1), batch_id=4
    )
    with pytest.raises(
        ProtocolError,
        match=f"^{party.name}: latent samples of width {width} expected, found {width + 1}",
    ):
        party.receive(wider)
    assert _pending(party) == before
    assert torch.equal(party.generator.get_state(), generator)


def test_a_party_refuses_a_likelihood_gradient_it_is_not_owed(make_data: MakeData) -> None:
    method, recorder = _latent_step(make_data)
    party = _parties(method)[1]
    reply = next(
        m for m in recorder.messages if isinstance(m, LikelihoodMessage) and m.sender == party.name
    )
    gradient = GradientMessage(
        sender="party-0",
        receiver=party.name,
        round=0,
        batch_id=0,
        positions=reply.positions,
        tag="stage1/likelihood",
        gradient=torch.ones_like(reply.log_likelihood),
    )
    before = _pending(party)
    wrong = {
        "no pending likelihoods": dataclasses.replace(gradient, round=5),
        "expected, found": dataclasses.replace(gradient, gradient=torch.ones(1, 3)),
    }
    for expected, message in wrong.items():
        with pytest.raises(ProtocolError, match=expected):
            party.receive(message)
        assert _pending(party) == before, expected
        assert all(p.grad is None for p in party.latent_model.parameters())
    # The one it is owed (as the driver sends it, expecting its answer): answered, then forgotten.
    method.fed.own.expect(
        "latent-gradient", senders=[party.name], round=0, batch_id=0, tag="stage1"
    )
    party.receive(gradient)
    assert _pending(party) == {}
    answer = [m for m in recorder.messages if isinstance(m, LatentGradientMessage)]
    assert [m.sender for m in answer] == [party.name]
    with pytest.raises(ProtocolError, match="no pending likelihoods"):
        party.receive(gradient)  # a replay


class _CuriousLatentParty(LatentParty):
    """A party that keeps every latent sample it is sent (what an attacker would study)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.seen: list[LatentMessage] = []

    def on_latent(self, message: LatentMessage) -> None:
        self.seen.append(message)
        super().on_latent(message)


ROLES.register("test-curious-latent-party", _CuriousLatentParty)


def test_false_vfl_parties_are_replaceable_roles(make_data: MakeData) -> None:
    method = _method(make_data(), 1, roles={"party-3": "test-curious-latent-party"})
    method.train_step(np.arange(32), 0, 0)
    curious = _parties(method)[3]
    assert isinstance(curious, _CuriousLatentParty)
    assert [m.kind for m in curious.seen] == ["latent"]
    assert [type(p) for p in _parties(method)[:3]] == [LatentLabelParty, LatentParty, LatentParty]
    with pytest.raises(ConfigError, match="keeps its role"):
        _method(make_data(), 1, roles={"party-0": "test-curious-latent-party"})


class _TamperedReplies:
    """An outgoing hook that rewrites a party's replies of one kind: what a faulty or malicious
    party could send the label party in place of the answer it was asked for."""

    def __init__(self, kind: str, change: Callable[[Message], Message]) -> None:
        self.kind = kind
        self.change = change

    def on_message(self, message: Message) -> Message:
        return self.change(message) if message.kind == self.kind else message


def _a_row_left_out(message: Message, field: str) -> Message:
    rows = message.positions[1:]  # type: ignore[attr-defined]
    return dataclasses.replace(message, positions=rows, **{field: getattr(message, field)[1:]})


def _a_sample_left_out(message: Message, field: str) -> Message:
    return dataclasses.replace(message, **{field: getattr(message, field)[:, :-1].contiguous()})


def _rows_beyond_the_batch(message: Message, field: str) -> Message:
    rows = message.positions + 10_000  # type: ignore[attr-defined]
    return dataclasses.replace(message, positions=rows)


@pytest.mark.parametrize("change", [_a_row_left_out, _a_sample_left_out, _rows_beyond_the_batch])
@pytest.mark.parametrize(
    ("kind", "field", "when"),
    [
        ("likelihood", "log_likelihood", "training"),
        ("likelihood", "log_likelihood", "prediction"),
        ("latent-gradient", "gradient", "training"),
    ],
)
def test_the_label_party_refuses_a_reply_that_does_not_answer_what_it_sent(
    make_data: MakeData,
    change: Callable[[Message, str], Message],
    kind: str,
    field: str,
    when: str,
) -> None:
    """A party's log-likelihoods (or their latent gradient) for other rows or another number of
    samples than it was sent were taken as they came: a row left out was scored without that
    party's term (or trained without its gradient), silently; other shapes stopped the run with
    torch's RuntimeError. Now a ProtocolError names the sender, what was expected and what was
    found, and nothing is applied."""
    method = _method(make_data(train_missing="mcar:0.3"), 1)
    party = _parties(method)[2]
    party.outgoing.append(_TamperedReplies(kind, partial(change, field=field)))
    modules = [p.latent_model for p in _parties(method)] + [method.label_party.label_model]
    before = _parameters(modules)
    with pytest.raises(ProtocolError, match=rf"party-0: .* from {party.name} .*expected.* found"):
        if when == "training":
            method.train_step(np.arange(32), 0, 0)
        else:
            method.predict("mcar:0.5")
    assert all(torch.equal(a, b) for a, b in zip(_parameters(modules), before, strict=True))
    assert not method.fed.dropped  # a refusal, not a lost party


@pytest.mark.parametrize("batching", ["grouped", "mixed"])
def test_an_epochs_loss_is_the_mean_over_the_rows_its_steps_trained(
    make_data: MakeData, batching: str
) -> None:
    """Under secure sums a row without a posterior is skipped: each step's loss is the mean over
    the rows it trained, but the epoch weighed it by every row drawn and counted a batch of
    skipped rows only as a loss of 0 (grouped batches: 16.41 reported for 17.18)."""
    data = make_data(n=300, test_missing=("mcar:0",))
    config = MethodConfig(epochs=1, batch_size=64, labeled=100, secure_sums=True, batching=batching)
    method = METHODS.get("false-vfl-1")(data, config, seed=5, false_vfl=SMALL)
    steps: list[tuple[int, float, int, int]] = []
    seen: list[float] = []
    step = method.train_step

    def recorded(rows: np.ndarray, round: int, batch_id: int) -> float:
        loss = step(rows, round, batch_id)
        trained = method._with_posterior("train", rows).size
        steps.append((method.stage, loss, trained, len(rows)))
        return loss

    method.train_step = recorded  # type: ignore[method-assign]
    losses = method.fit(on_step=lambda _, loss: seen.append(loss))
    assert sum(n - trained for _, _, trained, n in steps) > 0  # some rows were skipped
    for stage in (1, 2):
        ours = [(loss, trained) for s, loss, trained, _ in steps if s == stage]
        expected = sum(loss * n for loss, n in ours) / sum(n for _, n in ours)
        assert losses[stage - 1] == pytest.approx(expected, rel=1e-12)
    skipped = [i for i, (_, _, trained, _) in enumerate(steps) if trained == 0]
    assert all(math.isnan(seen[i]) for i in skipped)
    assert not any(math.isnan(loss) for i, loss in enumerate(seen) if i not in skipped)


def test_a_step_finds_its_rows_with_a_posterior_once(make_data: MakeData) -> None:
    """Under secure sums each step's rows with a posterior come from the step's block plan;
    the epoch's count of rows trained reuses the attempt's, not a second plan of the batch."""
    data = make_data(n=200, test_missing=("mcar:0",))
    config = MethodConfig(epochs=1, batch_size=64, labeled=100, secure_sums=True)
    method = METHODS.get("false-vfl-1")(data, config, seed=5, false_vfl=SMALL)
    plans: list[int] = []
    steps: list[int] = []
    find, step = method._with_posterior, method.train_step

    def counted(split: str, rows: np.ndarray) -> np.ndarray:
        plans.append(len(rows))
        return find(split, rows)

    def stepped(rows: np.ndarray, round: int, batch_id: int) -> float:
        steps.append(len(rows))
        return step(rows, round, batch_id)

    method._with_posterior = counted  # type: ignore[method-assign]
    method.train_step = stepped  # type: ignore[method-assign]
    method.fit()
    assert steps and plans == steps


@pytest.mark.parametrize("fault", ["another width", "other members"])
@pytest.mark.parametrize("backend", ["plain", "masks", "ckks"])
def test_a_posterior_sum_not_as_asked_is_refused_before_it_is_opened_and_still_awaited(
    make_data: MakeData, backend: str, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The label party sliced its posterior sum as it came: one of another width was opened
    (a decryption for nothing) and then split into means and precisions of the wrong width, one
    over other members was taken as the posterior. Its width and members are checked against
    what it asked for before its key opens it, and its expectation kept for the right sum."""
    aggregator = {
        "plain": PlainAggregator(),
        "masks": MaskingAggregator(),
        "ckks": CkksAggregator(),
    }[backend]
    config = dataclasses.replace(FAST, secure_sums=True)
    method = _method(make_data(train_missing="mcar:0.3"), 1, config, aggregator=aggregator)
    label = method.label_party
    opened: list[int] = []
    if label.opener is not None:
        real_open = label.opener.open
        monkeypatch.setattr(
            label.opener, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k)
        )
    server = method.fed.channel.parties[AGGREGATOR]
    tamper = TamperedSum(fault)
    server.outgoing.append(tamper)
    said = (
        r"width 12 \(what it asked for\) expected, found 13"
        if fault == "another width"
        else "its request selected expected, found other "
        + ("counts" if backend == "plain" else "members")
    )
    with pytest.raises(
        ProtocolError, match=rf"^party-0: the sum 'stage1' of round 0 from aggregator: .*{said}"
    ):
        method.train_step(np.arange(32), 0, 0)
    assert opened == []  # its key did no work on it
    original = tamper.kept[0]
    method.fed.channel.post(original, sender=server)  # the right sum is still taken
    summed = label.take("sum", sender=AGGREGATOR, round=0, batch_id=original.batch_id, tag="stage1")
    assert isinstance(summed, SumMessage) and summed.sums.shape[2] == 2 * SMALL.latent_dim
