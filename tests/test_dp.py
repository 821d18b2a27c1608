"""Differential privacy: the accountant against Opacus' own, noise scale, clipping, the channel
layers, an integration run of LASER, and DP-SGD of a data party in the split pattern."""

from __future__ import annotations

import math
from dataclasses import replace as dataclass_replace

import numpy as np
import pytest
import torch
from conftest import MakeData
from opacus.accountants import PRVAccountant, RDPAccountant
from torch import nn

from protocols.dp import (
    EmbeddingNoise,
    GaussianRelease,
    GradientNoise,
    PrivacyAccountant,
    calibrate_noise,
    clip_rows,
    make_private_party,
    parse_noise,
)
from secure_vfl.errors import ConfigError
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    GradientMessage,
    RepresentationMessage,
    RepresentRequest,
    SumMessage,
    UpdateRequest,
)
from secure_vfl.federation.parties import DataParty, Party
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.metrics import accuracy

DELTA = 1e-5
SEQUENCE = [(1.1, 0.01)] * 30 + [(0.8, 0.02)] * 10 + [(1.1, 0.01)] * 5


def discard(event: GaussianRelease) -> None:
    """An event sink for tests that do not look at events."""


def representation(rows: torch.Tensor, sender: str = "party-1") -> RepresentationMessage:
    return RepresentationMessage(
        sender=sender,
        receiver="aggregator",
        round=0,
        batch_id=0,
        positions=torch.arange(rows.shape[0]),
        representation=rows,
    )


def gradient(rows: torch.Tensor, receiver: str = "party-1") -> GradientMessage:
    return GradientMessage(
        sender="party-0",
        receiver=receiver,
        round=0,
        batch_id=0,
        positions=torch.arange(rows.shape[0]),
        gradient=rows,
    )


def record(accountant: PrivacyAccountant, party: str, sequence: list[tuple[float, float]]) -> None:
    for sigma, rate in sequence:
        accountant.on_event(GaussianRelease(party, sigma, rate, "embedding"))


@pytest.mark.parametrize("name,oracle", [("rdp", RDPAccountant), ("prv", PRVAccountant)])
def test_epsilon_equals_opacus_accountant_stepped_with_the_same_releases(
    name: str, oracle: type[RDPAccountant] | type[PRVAccountant]
) -> None:
    accountant = PrivacyAccountant(accountant=name)  # type: ignore[arg-type]
    record(accountant, "party-1", SEQUENCE)
    reference = oracle()
    for sigma, rate in SEQUENCE:
        reference.step(noise_multiplier=sigma, sample_rate=rate)
    expected = reference.get_epsilon(delta=DELTA)
    assert accountant.epsilon("party-1", DELTA) == pytest.approx(expected, rel=1e-9)
    assert 0 < expected < math.inf


def test_parties_are_priced_separately_and_more_releases_cost_more() -> None:
    accountant = PrivacyAccountant()
    record(accountant, "party-1", SEQUENCE)
    record(accountant, "party-2", SEQUENCE[:10])
    alone = PrivacyAccountant()
    record(alone, "party-2", SEQUENCE[:10])
    epsilons = accountant.epsilons(DELTA)
    assert set(epsilons) == {"party-1", "party-2"}
    assert epsilons["party-2"] == pytest.approx(alone.epsilon("party-2", DELTA), rel=1e-12)
    assert epsilons["party-1"] > epsilons["party-2"]
    assert accountant.epsilon("party-3", DELTA) == 0.0
    accountant.on_event(GaussianRelease("party-3", 0.0, 0.1, "gradient"))
    assert accountant.epsilon("party-3", DELTA) == math.inf


def test_calibrated_noise_reaches_the_target_epsilon() -> None:
    target, rate, steps = 2.0, 0.05, 200
    sigma = calibrate_noise(target, DELTA, sample_rate=rate, steps=steps)
    accountant = PrivacyAccountant()
    record(accountant, "party-1", [(sigma, rate)] * steps)
    epsilon = accountant.epsilon("party-1", DELTA)
    assert 0.99 * target <= epsilon <= target


def test_noise_std_and_norm_match_sigma_times_clip() -> None:
    sigma, clip, n, d = 1.5, 2.0, 20_000, 16
    layer = EmbeddingNoise(
        sigma, clip, sample_rate=0.1, generator=torch.Generator().manual_seed(0), on_event=discard
    )
    noisy = layer.on_message(representation(torch.zeros(n, d))).representation
    assert float(noisy.std()) == pytest.approx(sigma * clip, rel=0.02)
    assert float(noisy.mean()) == pytest.approx(0.0, abs=5 * sigma * clip / math.sqrt(n * d))
    # E||N(0, s^2 I_d)|| = s sqrt(2) Gamma((d+1)/2) / Gamma(d/2) ~ s sqrt(d)
    expected = sigma * clip * math.sqrt(2) * math.exp(math.lgamma((d + 1) / 2) - math.lgamma(d / 2))
    assert float(noisy.norm(dim=1).mean()) == pytest.approx(expected, rel=0.02)
    assert expected == pytest.approx(sigma * clip * math.sqrt(d), rel=0.05)


def test_clipping_caps_long_rows_at_the_clip_norm_and_leaves_short_rows() -> None:
    rows = torch.randn(50, 8, generator=torch.Generator().manual_seed(1)) * 3
    rows[:5] *= 0.01
    clip = 2.0
    layer = GradientNoise(
        0.0, clip, sample_rate=0.1, generator=torch.Generator().manual_seed(0), on_event=discard
    )
    out = layer.on_message(gradient(rows)).gradient
    norms = rows.norm(dim=1)
    long = norms > clip
    assert bool(long.any()) and bool((~long).any())
    torch.testing.assert_close(out.norm(dim=1)[long], torch.full((int(long.sum()),), clip))
    torch.testing.assert_close(out[~long], rows[~long])
    torch.testing.assert_close(clip_rows(rows, clip), out)


def test_layers_pass_other_messages_and_never_mutate_the_input() -> None:
    events: list[GaussianRelease] = []
    generator = torch.Generator().manual_seed(0)
    embedding = EmbeddingNoise(
        1.0, 1.0, sample_rate=0.2, generator=generator, on_event=events.append
    )
    grads = GradientNoise(0.5, 1.0, sample_rate=0.2, generator=generator, on_event=events.append)
    rows = torch.randn(4, 3, generator=generator)
    rep, grad = representation(rows.clone(), sender="party-2"), gradient(rows.clone())
    summed = SumMessage(
        sender="aggregator",
        receiver="party-0",
        round=0,
        batch_id=0,
        sums=torch.zeros(1, 4, 3),
        counts=torch.ones(1, 4, dtype=torch.int64),
    )
    assert embedding.on_message(grad) is grad
    assert embedding.on_message(summed) is summed
    assert grads.on_message(rep) is rep
    assert grads.on_message(summed) is summed
    assert events == []
    noisy_rep = embedding.on_message(rep)
    noisy_grad = grads.on_message(grad)
    assert noisy_rep is not rep and noisy_grad is not grad
    torch.testing.assert_close(rep.representation, rows)
    torch.testing.assert_close(grad.gradient, rows)
    assert not torch.equal(noisy_rep.representation, rows)
    assert not torch.equal(noisy_grad.gradient, rows)
    assert noisy_rep.positions is rep.positions and noisy_rep.sender == "party-2"
    assert events == [
        GaussianRelease("party-2", 1.0, 0.2, "embedding"),
        GaussianRelease("party-0", 0.5, 0.2, "gradient"),
    ]
    own = gradient(rows, receiver="party-0")  # the label party's own bottom: no boundary
    assert grads.on_message(own) is own
    assert len(events) == 2


def test_noise_is_reproducible_from_the_injected_generator() -> None:
    def noisy(seed: int) -> torch.Tensor:
        layer = EmbeddingNoise(
            1.0,
            1.0,
            sample_rate=0.1,
            generator=torch.Generator().manual_seed(seed),
            on_event=discard,
        )
        return layer.on_message(representation(torch.zeros(3, 2))).representation

    torch.testing.assert_close(noisy(3), noisy(3))
    assert not torch.equal(noisy(3), noisy(4))


def test_parse_noise_reads_sigma_and_clip_and_refuses_malformed_input() -> None:
    assert parse_noise("1.1:1.0") == (1.1, 1.0)
    assert parse_noise("0:2") == (0.0, 2.0)
    for bad in ("1.1", "1:2:3", "a:1", "1.1:0", "-1:1", "nan:1", "1:inf"):
        with pytest.raises(ConfigError, match="Found"):
            parse_noise(bad)


def test_invalid_settings_are_refused() -> None:
    generator = torch.Generator()
    with pytest.raises(ConfigError, match="sample_rate"):
        EmbeddingNoise(1.0, 1.0, sample_rate=0.0, generator=generator, on_event=discard)
    with pytest.raises(ConfigError, match="kind"):
        GaussianRelease("party-1", 1.0, 0.1, "weights")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="accountant"):
        PrivacyAccountant(accountant="gdp")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="delta"):
        PrivacyAccountant().epsilon("party-1", 0.0)


def laser_accuracy(data: object, channel: Channel | None) -> float:
    method = METHODS.get("laser")(
        data,  # type: ignore[arg-type]
        MethodConfig(epochs=1, heads="active", batch_size=32, lr=0.05),
        seed=0,
        channel=channel,
    )
    method.fit()
    return accuracy(method.predict("mcar:0"), data.tests["mcar:0"].labels)  # type: ignore[attr-defined]


def noisy_channel(sigma: float, rate: float, accountant: PrivacyAccountant) -> Channel:
    return Channel(
        [
            EmbeddingNoise(
                sigma,
                1.0,
                sample_rate=rate,
                generator=torch.Generator().manual_seed(1),
                on_event=accountant.on_event,
            ),
            GradientNoise(
                sigma,
                0.05,
                sample_rate=rate,
                generator=torch.Generator().manual_seed(2),
                on_event=accountant.on_event,
            ),
        ]
    )


def test_laser_trains_through_noise_layers_and_every_party_gets_an_epsilon(
    make_data: MakeData,
) -> None:
    data = make_data()
    rate = 32 / data.train.n
    plain = laser_accuracy(data, None)
    mild = PrivacyAccountant()
    laser_accuracy(data, noisy_channel(1.0, rate, mild))
    epsilons = mild.epsilons(DELTA)
    assert set(epsilons) == {f"party-{k}" for k in range(4)}
    assert all(0 < e < math.inf for e in epsilons.values())
    kinds = {(e.party, e.kind) for e in mild.events}
    assert ("party-0", "gradient") in kinds and ("party-2", "embedding") in kinds
    loud = PrivacyAccountant()
    drowned = laser_accuracy(data, noisy_channel(3.0, rate, loud))
    assert plain > 90.0  # chance is 33 %
    assert drowned < plain - 30.0
    assert all(loud.epsilons(DELTA)[p] < epsilons[p] for p in epsilons)


def test_dp_sgd_clips_each_sample_gradient() -> None:
    model = nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))
    x = torch.randn(20, 5, generator=torch.Generator().manual_seed(0))
    party = DataParty("party-1", {"train": x}, model, torch.optim.SGD(model.parameters(), lr=0.1))
    events: list[GaussianRelease] = []
    max_norm = 0.01
    make_private_party(
        party, noise_multiplier=0.0, max_grad_norm=max_norm, sample_rate=0.1, on_event=events.append
    )
    channel, label = Channel(), Party("party-0")
    party.connect(channel)
    label.connect(channel)
    rows = torch.arange(20)
    label.send(
        RepresentRequest(
            sender="party-0",
            receiver="party-1",
            round=0,
            batch_id=0,
            split="train",
            rows=rows,
            positions=rows,
            reply_to="party-0",
        )
    )
    message = label.take("representation", sender="party-1", round=0, batch_id=0)
    upstream = torch.randn(20, 3, generator=torch.Generator().manual_seed(1))
    label.send(gradient(upstream, receiver="party-1"))
    party.backpropagate(0)
    assert isinstance(message, RepresentationMessage)
    assert message.representation.shape == (20, 3)
    params = [p for p in party.model.parameters() if p.requires_grad]
    per_sample = torch.cat([p.grad_sample.reshape(20, -1) for p in params], dim=1)  # type: ignore[attr-defined]
    assert bool((per_sample.norm(dim=1) > max_norm).all())  # clipping has work to do
    assert party.optimizer is not None
    party.optimizer.pre_step()  # type: ignore[attr-defined]
    summed = torch.cat([p.grad.flatten() for p in params])  # type: ignore[union-attr]
    assert float(summed.norm()) <= max_norm * 20 * (1 + 1e-5)
    factors = (max_norm / per_sample.norm(dim=1)).clamp(max=1.0)
    torch.testing.assert_close(summed, (factors[:, None] * per_sample).sum(0), rtol=1e-4, atol=1e-7)
    assert float(summed.norm()) < float(per_sample.sum(0).norm())


def test_dp_sgd_party_trains_in_laser_and_reports_one_event_per_step(make_data: MakeData) -> None:
    data = make_data()
    rate = 32 / data.train.n
    method = METHODS.get("laser")(
        data, MethodConfig(epochs=1, heads="active", batch_size=32, lr=0.05), seed=0
    )
    accountant = PrivacyAccountant()
    party = in_process_parties(method.fed.channel)[2]  # type: ignore[attr-defined]
    before = [p.detach().clone() for p in party.model.parameters()]
    make_private_party(
        party,
        noise_multiplier=1.0,
        max_grad_norm=0.05,
        sample_rate=rate,
        generator=torch.Generator().manual_seed(0),
        on_event=accountant.on_event,
    )
    losses = method.fit()
    assert math.isfinite(losses[0])
    steps = len(list(method.sampler.epoch(np.random.default_rng(0))))
    # party-2 observes 70 % of rows, so it has rows (and releases) in every batch of 32
    assert [e.kind for e in accountant.events] == ["dp-sgd"] * steps
    assert set(accountant.epsilons(DELTA)) == {"party-2"}
    after = list(party.model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert accuracy(method.predict("mcar:0"), data.tests["mcar:0"].labels) > 80.0


def test_dp_sgd_step_without_gradients_releases_nothing() -> None:
    model = nn.Linear(4, 2)
    x = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))
    party = DataParty("party-1", {"train": x}, model, torch.optim.SGD(model.parameters(), lr=0.1))
    events: list[GaussianRelease] = []
    make_private_party(
        party, noise_multiplier=1.0, max_grad_norm=1.0, sample_rate=0.1, on_event=events.append
    )
    before = [p.detach().clone() for p in party.model.parameters()]
    channel, label = Channel(), Party("party-0")
    party.connect(channel)
    label.connect(channel)

    def request(rows: torch.Tensor, round: int) -> None:
        label.send(
            RepresentRequest(
                sender="party-0",
                receiver="party-1",
                round=round,
                batch_id=0,
                split="train",
                rows=rows,
                positions=torch.arange(rows.numel()),
                reply_to="party-0",
            )
        )

    def update(round: int) -> None:
        label.send(UpdateRequest(sender="party-0", receiver="party-1", round=round, batch_id=0))

    request(torch.arange(10), 0)
    update(0)  # its gradient never came: nothing is released
    assert events == []
    assert all(torch.equal(a, b) for a, b in zip(before, party.model.parameters(), strict=True))
    request(torch.arange(6), 1)
    label.send(dataclass_replace(gradient(torch.ones(6, 2)), round=1))
    update(1)
    assert events == [GaussianRelease("party-1", 1.0, 0.1, "dp-sgd")]
    assert any(not torch.equal(a, b) for a, b in zip(before, party.model.parameters(), strict=True))


def test_prediction_releases_are_noised_but_not_priced_against_training_records() -> None:
    accountant = PrivacyAccountant()
    layer = EmbeddingNoise(
        1.0,
        1.0,
        sample_rate=0.1,
        generator=torch.Generator().manual_seed(0),
        on_event=accountant.on_event,
    )
    rows = torch.zeros(4, 3)
    for phase in ("train", "predict"):
        message = RepresentationMessage(
            sender="party-1",
            receiver="aggregator",
            round=0,
            batch_id=0,
            positions=torch.arange(4),
            phase=phase,
            representation=rows,
        )
        assert not torch.equal(layer.on_message(message).representation, rows)
    assert [event.kind for event in accountant.events] == ["embedding"]
