"""LASER-VFL: task sampling, loss weights, the seam it trains through, inference on any subset."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import MakeData

from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ConfigError, ProtocolError
from secure_vfl.federation.aggregator import PlainAggregator
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import GradientMessage, Message, PredictionMessage, SumMessage
from secure_vfl.federation.releases import ReleaseBlocks, partition
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.laser import MeanFusionMethod, laser_weights, sample_tasks
from secure_vfl.metrics import accuracy

FAST = MethodConfig(epochs=3, batch_size=64, lr=0.05)


def test_loss_weights_match_the_closed_form() -> None:
    for n in range(1, 7):
        for s in range(1, 8):
            weight = float(laser_weights(torch.tensor([n]), torch.tensor([s]))[0])
            if s > n:
                assert weight == 0.0
            else:
                assert weight == pytest.approx(math.comb(n - 1, s - 1) / s)
                assert weight == pytest.approx(math.comb(n, s) / n)  # the single-head form


def test_sampled_tasks_contain_their_head_have_their_size_and_stay_observed() -> None:
    generator = torch.Generator().manual_seed(0)
    mask = torch.from_numpy(np.random.default_rng(0).random((200, 5)) < 0.6)
    mask[mask.sum(1) == 0, 0] = True
    selection, weights = sample_tasks(mask, list(range(5)), generator)
    assert selection.shape == (5, 5, 200, 5) and weights.shape == (5, 5, 200)
    n = mask.sum(1)
    for h in range(5):
        for s in range(5):
            active = weights[h, s] > 0
            assert torch.equal(active, mask[:, h] & (s + 1 <= n))
            chosen = selection[h, s]
            assert bool(chosen[active, h].all())
            assert torch.equal(chosen[active].sum(1), torch.full((int(active.sum()),), s + 1))
            assert not bool((chosen & ~mask).any())
            assert not bool(chosen[~active].any())


def test_task_sampling_is_an_unbiased_estimate_of_the_full_objective() -> None:
    """E[sum_s a_s 1{S_s = I}] must equal eq. 5's weight 1/|I| for every I containing the head."""
    draws = 20000
    mask = torch.ones(draws, 4, dtype=torch.bool)
    selection, weights = sample_tasks(mask, [0], torch.Generator().manual_seed(1))
    totals: Counter[tuple[int, ...]] = Counter()
    for s in range(4):
        for row, weight in zip(selection[0, s].tolist(), weights[0, s].tolist(), strict=True):
            totals[tuple(k for k in range(4) if row[k])] += weight
    for size in range(1, 5):
        for rest in itertools.combinations(range(1, 4), size - 1):
            subset = (0, *rest)
            assert totals[subset] / draws == pytest.approx(1 / size, rel=0.05)
    assert all(0 in subset for subset in totals)


def test_single_head_tasks_cover_every_subset_with_weight_one_over_n() -> None:
    draws = 20000
    mask = torch.ones(draws, 3, dtype=torch.bool)
    selection, weights = sample_tasks(mask, None, torch.Generator().manual_seed(2))
    totals: Counter[tuple[int, ...]] = Counter()
    for s in range(3):
        for row, weight in zip(selection[0, s].tolist(), weights[0, s].tolist(), strict=True):
            totals[tuple(k for k in range(3) if row[k])] += weight
    assert len(totals) == 7
    for subset, total in totals.items():
        assert total / draws == pytest.approx(1 / 3, rel=0.05), subset


def test_partition_cuts_pairs_and_one_triple_and_exposes_at_most_size_minus_two() -> None:
    rng = np.random.default_rng(0)
    others = rng.random((3000, 9)) < 0.6
    block, exposable = partition(others, rng.random((3000, 9)))
    assert (block[~others] == -1).all() and not exposable[~others].any()
    for row in range(3000):
        members = Counter(block[row][others[row]].tolist())
        count = int(others[row].sum())
        assert sorted(members) == list(range(len(members)))
        if count == 1:  # a lone party: its own block, never usable, exposable
            assert members == {0: 1} and exposable[row].sum() == 1
            continue
        sizes = sorted(members.values())
        assert set(sizes) <= {2, 3} and sizes.count(3) == count % 2
        for number, size in members.items():
            assert exposable[row][block[row] == number].sum() == size - 2


def _releasable_subsets(block: list[int], observed: list[bool]) -> set[tuple[int, ...]]:
    """Brute force: every non-empty S of the observed set whose other parties are a union of
    wholly observed blocks of >= 2 (party 0 is the receiver)."""
    usable = [
        number
        for number in set(block) - {-1}
        if block.count(number) >= 2
        and all(observed[k] for k in range(len(block)) if block[k] == number)
    ]
    subsets = set()
    for size in range(len(usable) + 1):
        for chosen in itertools.combinations(usable, size):
            rest = tuple(k for k in range(len(block)) if block[k] in chosen)
            for own in ((0,), ()) if observed[0] else ((),):
                if own or rest:
                    subsets.add(own + rest)
    return subsets


def test_secure_tasks_are_every_union_of_usable_blocks_with_laser_mass() -> None:
    """LASER's single-head objective with its subsets conditioned on being releasable: each
    releasable subset once, the row's plaintext mass (2^n - 1) / n shared equally among them,
    nothing else; prediction uses their union."""
    generator = torch.Generator().manual_seed(4)
    start = torch.rand(400, 8, generator=generator) < 0.7
    blocks = ReleaseBlocks(start.numpy(), receiver=0, seed=2)
    now = start.clone()
    now[:, 3] = False  # party 3 dropped since: its blocks are unusable, not re-cut
    rows = torch.arange(400)
    for split, mask in (
        ("train", now),
        ("mcar:0.5", torch.rand(400, 8, generator=generator) < 0.6),
    ):
        plan = blocks.plan(split, rows, mask)
        selection, weights = plan.tasks()
        block, _ = blocks.blocks_of(split, rows)
        for b in range(400):
            got = {
                tuple(int(k) for k in torch.nonzero(selection[0, t, b]).flatten()): float(w)
                for t, w in enumerate(weights[0, :, b])
                if w > 0
            }
            expected = _releasable_subsets(block[b].tolist(), mask[b].tolist())
            assert set(got) == expected, (split, b)
            n = int(mask[b].sum())
            for weight in got.values():  # (got and expected are the same subsets)
                assert weight == pytest.approx((2**n - 1) / (n * len(expected)))
            union = tuple(int(k) for k in torch.nonzero(plan.union()[b]).flatten())
            assert union == tuple(sorted(set().union(*expected)))
        assert not bool(plan.exposed.any())  # drop: no DP release


def test_blocks_are_one_fixed_partition_outside_training_and_the_starting_one_inside() -> None:
    start = np.random.default_rng(1).random((50, 6)) < 0.7
    blocks = ReleaseBlocks(start, receiver=0, seed=5)
    rows = torch.arange(50)
    test_block, _ = blocks.blocks_of("mcar:0", rows)
    assert (test_block == test_block[0]).all()
    assert torch.equal(blocks.blocks_of("mcar:0.5", rows[:7])[0], test_block[:7])
    assert Counter(test_block[0, 1:].tolist()) == Counter({0: 2, 1: 3})  # 5 others: 2 + 3
    train_block, _ = blocks.blocks_of("train", rows)
    others = start.copy()
    others[:, 0] = False
    assert torch.equal(train_block >= 0, torch.from_numpy(others))
    same = ReleaseBlocks(start, receiver=0, seed=5).blocks_of("train", rows)[0]
    assert torch.equal(same, train_block)  # from the seed and the data alone (resume, deploy)


@pytest.mark.parametrize(
    ("method", "heads"),
    [
        ("laser", "all"),
        ("local", "all"),
        ("ensemble", "all"),
        ("standard", "active"),
        ("plugvfl", "active"),
        ("combinatorial", "all"),
    ],
)
def test_methods_that_would_reveal_a_party_refuse_secure_sums(
    make_data: MakeData, method: str, heads: str
) -> None:
    config = dataclasses.replace(FAST, heads=heads, secure_sums=True)
    with pytest.raises(ConfigError, match="cannot run under secure aggregation"):
        METHODS.get(method)(make_data(), config, seed=0)


@pytest.mark.parametrize("method", ["laser", "false-vfl-1"])
def test_secure_sums_need_two_parties_to_hide_each_other(make_data: MakeData, method: str) -> None:
    config = dataclasses.replace(FAST, heads="active", secure_sums=True)
    with pytest.raises(ConfigError, match="needs at least 3 parties"):
        METHODS.get(method)(make_data(parties=2), config, seed=0)


def test_secure_laser_learns_through_sums_that_hide_every_other_party(
    make_data: MakeData,
) -> None:
    data = make_data(train_missing="mcar:0.3", test_missing=("mcar:0", "mcar:0.5"))
    released: list[torch.Tensor] = []

    class Watching(PlainAggregator):
        def combine(self, contributions, selection, **kwargs):  # type: ignore[no-untyped-def]
            released.append(selection)
            return super().combine(contributions, selection, **kwargs)

    config = dataclasses.replace(FAST, heads="active", secure_sums=True)
    method = _train(data, config, aggregator=Watching())
    assert len(released) > 10
    for selection in released:
        assert not bool((selection[..., 1:].sum(dim=2) == 1).any())
    for name, split in data.tests.items():
        assert accuracy(method.predict(name), split.labels) > 55.0, name  # chance is 33 %


def _parameters(method: MeanFusionMethod) -> list[torch.Tensor]:
    models = [p.model for p in in_process_parties(method.fed.channel)] + [
        h.module for p in in_process_parties(method.fed.channel) for h in p.heads.values()
    ]
    return [t.detach().clone() for m in models for t in m.parameters()]


def _train(data: VerticalData, config: MethodConfig, **kwargs: object) -> MeanFusionMethod:
    method = METHODS.get("laser")(data, config, seed=3, **kwargs)  # type: ignore[arg-type]
    method.fit()
    assert isinstance(method, MeanFusionMethod)
    return method


@pytest.mark.parametrize("batching", ["grouped", "mixed"])
def test_vectorised_and_looped_task_forward_train_the_same_model(
    make_data: MakeData, batching: str
) -> None:
    data = make_data()
    config = dataclasses.replace(FAST, epochs=1, batching=batching)
    fast = _train(data, config)
    slow = _train(data, dataclasses.replace(config, vectorised=False))
    for a, b in zip(_parameters(fast), _parameters(slow), strict=True):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("heads", ["all", "active"])
@pytest.mark.parametrize("batching", ["grouped", "mixed"])
def test_laser_learns_and_predicts_from_every_subset_of_blocks(
    make_data: MakeData, heads: str, batching: str
) -> None:
    data = make_data(train_missing="mcar:0.3")
    parties = data.train.parties
    base = data.tests["mcar:0"]
    tests = {}
    for size in range(1, parties + 1):
        for subset in itertools.combinations(range(parties), size):
            mask = np.zeros_like(base.mask)
            mask[:, list(subset)] = True
            blocks = tuple(
                np.where(mask[:, k].reshape(-1, 1), b, 0).astype(np.float32)
                for k, b in enumerate(base.blocks)
            )
            tests[str(subset)] = dataclasses.replace(base, blocks=blocks, mask=mask)
    data = dataclasses.replace(data, tests=tests)
    config = dataclasses.replace(FAST, heads=heads, batching=batching)
    method = _train(data, config)
    for name, split in tests.items():
        predictions = method.predict(name)
        assert np.array_equal(predictions >= 0, split.mask), name
        assert accuracy(predictions, split.labels) > 55.0, name  # chance is 33 %


def test_a_training_step_sends_every_message_through_the_channel(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0")
    recorder = RecordingLayer()
    method = METHODS.get("laser")(data, FAST, seed=0, channel=Channel([recorder]))
    assert isinstance(method, MeanFusionMethod)
    rows = np.arange(32)
    method.train_step(rows, 0, 0)
    method.fed.flush(round=0)  # the gradients its head held, which close the others' steps
    parties = [f"party-{k}" for k in range(4)]
    others = parties[1:]  # what the label party (party-0) does for itself crosses no boundary
    routes = Counter((m.kind, m.sender, m.receiver) for m in recorder.messages)
    expected = Counter(
        [("ticket-key", "party-0", "aggregator")]  # once per session: its first step's
        + [("represent-request", "party-0", p) for p in others]
        + [("representation", p, "aggregator") for p in parties]
        + [("head-task", "party-0", p) for p in others]
        + [("sum-request", "party-0", "aggregator") for _ in parties]
        + [("sum", "aggregator", p) for p in parties]
        + [("gradient", h, p) for h in parties for p in parties if h != p]
        + [("loss", p, "party-0") for p in others]
    )  # no update: the label party's head's gradients close the others' steps, heads and all
    assert routes == expected
    closing = [m for m in recorder.messages if isinstance(m, GradientMessage) and m.step]
    assert sorted(m.receiver for m in closing) == others
    assert all(m.sender == "party-0" and m.heads for m in closing)
    for message in recorder.messages:
        assert message.round == 0 and message.batch_id == 0
        # The label party's requests carry rows and plans: no feature or label values.
        if message.kind in ("represent-request", "sum-request", "update"):
            tensors = [v for v in vars(message).values() if isinstance(v, torch.Tensor)]
            assert not any(v.is_floating_point() for v in tensors), message.kind
        if isinstance(message, GradientMessage):
            assert message.positions.tolist() == list(range(32))
        if isinstance(message, SumMessage):
            assert message.sums.shape == (4, 32, FAST.representation_dim)


def test_with_the_label_partys_head_alone_a_step_is_twelve_messages(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0")
    recorder = RecordingLayer()
    config = dataclasses.replace(FAST, heads="active")
    method = METHODS.get("laser")(data, config, seed=0, channel=Channel([recorder]))
    assert isinstance(method, MeanFusionMethod)
    parties = [f"party-{k}" for k in range(4)]
    others = parties[1:]
    closing = [("gradient", "party-0", p) for p in others]
    routes = [
        ("representation", "party-0", "aggregator"),
        *[
            route
            for p in others
            for route in [("represent-request", "party-0", p), ("representation", p, "aggregator")]
        ],
        ("sum-request", "party-0", "aggregator"),
        ("sum", "aggregator", "party-0"),
    ]

    def crossed() -> list[tuple[str, str, str]]:
        found = [(m.kind, m.sender, m.receiver) for m in recorder.messages]
        recorder.messages.clear()
        return found

    # In the order they crossed: the sum request goes with the representation requests (the
    # aggregator serves it once the last representation is in). Each data party's gradient
    # closes its step (no update follows) and is held back to go ahead of its next request
    # (over the network: in the same delivery), or until the label party flushes. The session's
    # first step begins with the driver's ticket key, to the aggregator.
    method.train_step(np.arange(32), 0, 0)
    assert crossed() == [("ticket-key", "party-0", "aggregator"), *routes]
    assert [(m.kind, m.sender, m.receiver) for m in method.fed.own.deferred] == closing
    method.train_step(np.arange(32, 64), 1, 1)
    first = recorder.messages[:3]
    assert crossed() == [*closing, *routes]
    assert all(isinstance(m, GradientMessage) and m.step and m.round == 0 for m in first)
    method.fed.flush(round=1)
    assert crossed() == closing and not method.fed.own.deferred
    assert all(m.step for m in recorder.messages if isinstance(m, GradientMessage))


class _ZeroGradients:
    """A channel layer that replaces every gradient message's content with zeros."""

    def on_message(self, message):  # type: ignore[no-untyped-def]
        if isinstance(message, GradientMessage):
            return dataclasses.replace(message, gradient=torch.zeros_like(message.gradient))
        return message


def test_bottom_models_learn_only_from_the_gradient_messages_they_receive(
    make_data: MakeData,
) -> None:
    data = make_data()
    config = dataclasses.replace(FAST, epochs=1, momentum=0.0, heads="active")
    method = METHODS.get("laser")(data, config, seed=0, channel=Channel([_ZeroGradients()]))
    assert isinstance(method, MeanFusionMethod)
    label_party, *passive = in_process_parties(method.fed.channel)

    def snapshot(modules: list[torch.nn.Module]) -> list[torch.Tensor]:
        return [t.detach().clone() for m in modules for t in m.parameters()]

    passive_before = snapshot([p.model for p in passive])
    own_before = snapshot([label_party.model, label_party.heads[""].module])
    method.fit()
    passive_after = snapshot([p.model for p in passive])
    own_after = snapshot([label_party.model, label_party.heads[""].module])
    # The passive parties got only zeroed gradient messages; the label party's own bottom and
    # head learn from its own head, which crosses no boundary.
    assert all(torch.equal(a, b) for a, b in zip(passive_before, passive_after, strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(own_before, own_after, strict=True))


class _PerturbingAggregator(PlainAggregator):
    """Adds a constant to every sum: a stand-in for a faulty secure backend."""

    def combine(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        message = super().combine(*args, **kwargs)
        return dataclasses.replace(message, sums=message.sums + 0.5)


def test_swapping_the_aggregator_changes_the_trained_model(make_data: MakeData) -> None:
    data = make_data()
    config = dataclasses.replace(FAST, epochs=1)
    plain = _parameters(_train(data, config))
    again = _parameters(_train(data, config))
    perturbed = _parameters(_train(data, config, aggregator=_PerturbingAggregator()))
    assert all(torch.equal(a, b) for a, b in zip(plain, again, strict=True))
    assert not all(torch.allclose(a, b) for a, b in zip(plain, perturbed, strict=True))


def test_a_representation_wider_than_the_wire_carries_is_refused_before_anything_is_built(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A width that cannot be allocated (or sent) is a ConfigError, not torch's allocator
    failing deep inside the bottom model's construction."""
    from secure_vfl.cli import main
    from secure_vfl.methods.base import MAX_REPRESENTATION_DIM

    MethodConfig(representation_dim=MAX_REPRESENTATION_DIM)  # the widest is accepted
    with pytest.raises(ConfigError, match=r"`representation_dim` must be at most 65536\. Found"):
        MethodConfig(representation_dim=MAX_REPRESENTATION_DIM + 1)
    argv = ["train", "--method", "laser", "--dataset", "breast-cancer", "--quiet"]
    assert main([*argv, "--representation-dim", "99999999999"]) == 2
    assert "`representation_dim` must be at most 65536" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["epochs", "pretrain_epochs"])
def test_more_epochs_than_a_run_can_plan_are_refused_before_anything_is_drawn(name: str) -> None:
    """--epochs 100000000 --dp-sgd drew its Poisson schedule until the memory ran out."""
    from secure_vfl.methods.base import MAX_EPOCHS

    MethodConfig(**{name: MAX_EPOCHS})  # the most is accepted
    with pytest.raises(ConfigError, match=rf"`{name}` must be at most 100000\. Found 100001\."):
        MethodConfig(**{name: MAX_EPOCHS + 1})


class _TamperedPrediction:
    """party-2's outgoing hook: its head's answers changed by ``change`` (a curious or faulty
    head party)."""

    def __init__(self, **change: object) -> None:
        self.change = change

    def on_message(self, message: Message) -> Message:
        if not isinstance(message, PredictionMessage):
            return message
        values = {k: v(message) if callable(v) else v for k, v in self.change.items()}
        return dataclasses.replace(message, **values)


@pytest.mark.parametrize(
    ("change", "probabilities", "expected"),
    [
        (  # a row of the batch left out: taken as a head with no prediction for it
            {
                "positions": lambda m: m.positions[:-1],
                "predictions": lambda m: m.predictions[:-1],
            },
            False,
            r"predictions for \d+ batch positions .* expected, found \d+",
        ),
        (  # rows beyond the batch: an IndexError
            {"positions": lambda m: m.positions + 5000},
            False,
            r"predictions for \d+ batch positions .* expected",
        ),
        (  # classes the task has not: counted as wrong answers
            {"predictions": lambda m: m.predictions + 100},
            False,
            r"classes in \[0, 3\) expected, found \[\d+, \d+\]",
        ),
        (  # probabilities over other classes: a numpy broadcast error
            {"probabilities": lambda m: torch.full((m.positions.numel(), 7), 1 / 7)},
            True,
            r"probabilities over its 3 classes .* expected, found shape \(\d+, 7\)",
        ),
    ],
)
def test_a_head_partys_prediction_is_refused_unless_it_answers_what_was_asked(
    make_data: MakeData, change: dict[str, object], probabilities: bool, expected: str
) -> None:
    config = MethodConfig(heads="all", epochs=1, batch_size=64, representation_dim=8)
    method = _train(make_data(), config)
    party = method.fed.channel.parties["party-2"]
    party.outgoing.append(_TamperedPrediction(**change))
    with pytest.raises(
        ProtocolError, match=f"^party-0: party-2's answer to its predict task .*{expected}"
    ):
        if probabilities:
            method.predict_proba("mcar:0")
        else:
            method.head_predictions("mcar:0")
