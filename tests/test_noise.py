"""Noise nobody can regenerate: every DP mechanism draws from a secure source, never from the
run's seed; reproducible noise only behind the explicit insecure option."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import MakeData
from scipy import stats

from protocols.noise import SecureNoise, SeededNoise, noise_source, secure_generator
from protocols.privacy import PrivacyEngine, PrivacySpec
from secure_vfl.data.imputation import ClientData, ImputationTask
from secure_vfl.data.samplers import PoissonSampler
from secure_vfl.federation.messages import GradientMessage, RepresentationMessage
from secure_vfl.federation.parties import DataParty
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties

pytestmark = pytest.mark.os_entropy  # these test the secure source itself

CONFIG = MethodConfig(heads="active", epochs=1, batch_size=32, representation_dim=8)


def test_secure_noise_is_standard_normal_and_never_repeats() -> None:
    draws = SecureNoise().gaussian((200_000,), dtype=torch.float64).numpy()
    assert abs(draws.mean()) < 5 / math.sqrt(draws.size)
    assert draws.std() == pytest.approx(1.0, rel=0.01)
    # Unseeded by design: the threshold is what a correct source fails by chance (1e-6 a run),
    # far above what any other law gives over 200 000 draws (the mean and std are pinned above).
    assert stats.kstest(draws, "norm").pvalue > 1e-6
    assert not torch.equal(
        SecureNoise().gaussian((8,), dtype=torch.float32),
        SecureNoise().gaussian((8,), dtype=torch.float32),
    )
    assert SecureNoise().gaussian((2, 3), dtype=torch.float32).dtype == torch.float32
    single = SecureNoise().gaussian((200_000,), dtype=torch.float32).double().numpy()
    assert single.std() == pytest.approx(1.0, rel=0.01)  # float32 draws: the same law
    assert stats.kstest(single, "norm").pvalue > 1e-6
    first, second = secure_generator().random(4), secure_generator().random(4)
    assert not np.array_equal(first, second)


def test_only_an_explicit_insecure_seed_makes_noise_reproducible() -> None:
    assert isinstance(noise_source(None), SecureNoise) and noise_source(None).secure
    seeded = noise_source([0, 1])
    assert isinstance(seeded, SeededNoise) and not seeded.secure
    torch.testing.assert_close(
        SeededNoise([0, 1]).gaussian((5,), dtype=torch.float32),
        SeededNoise([0, 1]).gaussian((5,), dtype=torch.float32),
    )


@dataclass
class Built:
    """One run's parties and engine, built from the same seed as any other."""

    engine: PrivacyEngine
    parties: list[DataParty]
    initial: list[torch.Tensor]
    sampler: PoissonSampler


def _build(make_data: MakeData, *, insecure: bool) -> Built:
    spec = PrivacySpec(
        dp_embeddings=(1.0, 1.0),
        dp_gradients=(1.0, 0.1),
        dp_sgd=(1.0, 0.1),
        insecure_reproducible_noise=insecure,
        seed=7,
    )
    engine = PrivacyEngine(spec)
    data = make_data(seed=7)
    method = METHODS.get("laser")(data, CONFIG, seed=7)
    parties = in_process_parties(method.fed.channel)  # type: ignore[attr-defined]
    initial = [p.detach().clone() for party in parties for p in party.model.parameters()]
    sampler = engine.sampler(method.sampler, n=data.train.n, epochs=1)
    assert isinstance(sampler, PoissonSampler)
    engine.make_private(parties, method="laser", method_config=CONFIG, predictions=0)
    return Built(engine, parties, initial, sampler)


def _noise_of_every_mechanism(built: Built) -> dict[str, torch.Tensor]:
    """What each mechanism adds to the same zero message (and the Poisson sample drawn)."""
    label, data_party = built.parties[0], built.parties[1]
    zeros = torch.zeros(6, 4)
    header = {"round": 0, "batch_id": 0, "positions": torch.arange(6)}
    representation = data_party.release(
        RepresentationMessage(
            sender=data_party.name, receiver="aggregator", representation=zeros, **header
        )
    )
    gradient = label.release(
        GradientMessage(sender=label.name, receiver=data_party.name, gradient=zeros, **header)
    )
    optimizer = data_party.optimizer
    dp_sgd = optimizer._noise.gaussian((6, 4), dtype=torch.float32)  # type: ignore[union-attr]
    return {
        "embedding": representation.representation,
        "gradient": gradient.gradient,
        "dp-sgd": dp_sgd,
        "poisson sample": torch.from_numpy(np.concatenate(built.sampler.schedule[:3])),
    }


def test_two_runs_with_one_seed_share_data_and_initialisation_but_not_noise(
    make_data: MakeData,
) -> None:
    first, second = _build(make_data, insecure=False), _build(make_data, insecure=False)
    for before, again in zip(first.initial, second.initial, strict=True):
        assert torch.equal(before, again)  # initialisation comes from the seed
    noise, other = _noise_of_every_mechanism(first), _noise_of_every_mechanism(second)
    for mechanism, drawn in noise.items():
        # a mechanism seeded from the config would draw the same noise in both runs
        assert not torch.equal(drawn, other[mechanism]), mechanism


def test_the_insecure_option_regenerates_every_mechanisms_noise_from_the_seed(
    make_data: MakeData,
) -> None:
    first, second = _build(make_data, insecure=True), _build(make_data, insecure=True)
    noise, other = _noise_of_every_mechanism(first), _noise_of_every_mechanism(second)
    for mechanism, drawn in noise.items():
        assert torch.equal(drawn, other[mechanism]), mechanism
    report = first.engine.report()
    assert report is not None and report["insecure_reproducible_noise"] is True


def _statistics_noise(insecure: bool) -> np.ndarray:
    rng = np.random.default_rng(0)
    clients = tuple(
        ClientData(f"client-{k}", rng.normal(size=(20, 3)).astype(np.float32), np.ones(3, bool))
        for k in range(2)
    )
    task = ImputationTask(name="t", features=("a", "b", "c"), train=clients, test=clients)
    spec = PrivacySpec(dp_statistics=(1.0, 1.0), insecure_reproducible_noise=insecure, seed=7)
    factory = PrivacyEngine(spec).statistics_mechanisms(task)
    assert factory is not None
    return factory("client-0").privatise("client-0", "moments", np.zeros((0, 5)))


def test_statistics_noise_is_fresh_per_run_unless_the_insecure_option_is_given() -> None:
    assert not np.array_equal(_statistics_noise(False), _statistics_noise(False))
    np.testing.assert_array_equal(_statistics_noise(True), _statistics_noise(True))
