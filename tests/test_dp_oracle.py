"""An independent oracle for the accounting: Google's ``dp_accounting`` (RDP and PLD) prices the
same releases, composed its own way, and our epsilon must never be below it.

For each pattern (DP-SGD only, gradient noise to K-1 receivers, embedding noise, all three
together, combinatorial's several releases per step, FedHF's statistics, --release dp's exposed
rows, prediction-time representations) a small run records its releases; the test rebuilds,
from the raw events and the Poisson schedule alone, every release that touched the worst record
as its own ``GaussianDpEvent`` (multiplier sigma / shift: dp_accounting's sensitivity is 1),
composes them with dp_accounting, and compares. Tolerances: PLD (pessimistic, discretisation
1e-3: over this file's events never below 1e-4's epsilons and within 1e-5 of them, at a tenth of
the time) is an upper bound of the exact epsilon, so ours must be >= it; RDP differs from
Opacus' only by the grid of orders, so ours must be >= 99 % of it.
"""

from __future__ import annotations

import logging
import math
from collections import Counter

import dp_accounting
import numpy as np
import pytest
from conftest import MakeData

from protocols.dp import ROW_SHIFT, GaussianRelease, PrivacyAccountant
from protocols.privacy import PrivacyEngine, PrivacySpec, release_plan
from secure_vfl.data.samplers import PoissonSampler
from secure_vfl.experiment import TrainConfig, run_training
from secure_vfl.methods import MethodConfig

DELTA = 1e-5
PLD_INTERVAL = 1e-3
logging.getLogger("absl").setLevel(logging.ERROR)  # RDP orders it skips, said per order


def independent(event: dp_accounting.DpEvent) -> tuple[float, float]:
    """dp_accounting's (RDP, PLD) epsilon of ``event`` at DELTA, add/remove."""
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(event)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
    pld.compose(event)
    return float(rdp.get_epsilon(DELTA)), float(pld.get_epsilon(DELTA))


def at_least_independent(ours: float, event: dp_accounting.DpEvent) -> None:
    rdp, pld = independent(event)
    assert ours >= pld, (ours, pld)
    assert ours >= 0.99 * rdp, (ours, rdp)


def private_run(
    make_data: MakeData, spec: PrivacySpec, *, method: str = "laser", heads: str = "active"
) -> PrivacyEngine:
    engine = PrivacyEngine(spec)
    config = TrainConfig(
        method=method,
        dataset="synthetic",
        test_missing=("mcar:0", "mcar:0.5"),
        seed=0,
        method_config=MethodConfig(
            heads=heads,  # type: ignore[arg-type]
            epochs=2,
            batch_size=32,
            lr=0.05,
            representation_dim=8,
        ),
    )
    run_training(config, data=make_data(train_missing="mcar:0", n=400), privacy=engine)
    return engine


def worst_record_releases(
    events: list[GaussianRelease], schedule: list[np.ndarray], kinds: set[str]
) -> list[GaussianRelease]:
    """Every training release of ``kinds`` in a step that used the record used in the most
    steps (each step's releases are the same kinds, so that record is the worst)."""
    steps = {e.round for e in events if e.kind in kinds and e.phase == "train"}
    uses: Counter[int] = Counter()
    for step in steps:
        uses.update(int(r) for r in schedule[step])
    worst, _ = uses.most_common(1)[0]
    held = {step for step in steps if worst in set(schedule[step].tolist())}
    return [e for e in events if e.kind in kinds and e.phase == "train" and e.round in held]


def composed(releases: list[GaussianRelease], shift: float) -> dp_accounting.DpEvent:
    """Each release on its own, not subsampled (the receivers know the sample), composed. The
    releases of one multiplier go in as one self-composition: the same event to dp_accounting,
    which composes it by exponentiation instead of one convolution per release (a combinatorial
    run's several hundred releases took minutes one by one)."""
    counts = Counter(e.noise_multiplier / shift for e in releases)
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(multiplier), count)
            for multiplier, count in sorted(counts.items())
        ]
    )


def guarantees(engine: PrivacyEngine, party: str) -> dict[str, dict[str, object]]:
    report = engine.report()
    assert report is not None
    by_view = {}
    for g in report["guarantees"][party]:
        view = "model" if g["amplification"] else g["protects"].split()[1]
        by_view[view] = g
    return by_view


def check_receivers(engine: PrivacyEngine, party: str, kinds: set[str]) -> float:
    accountant = engine.accountants[party]
    poisson = engine.poisson
    assert isinstance(poisson, PoissonSampler)
    releases = worst_record_releases(accountant.events, poisson.schedule, kinds)
    ours = guarantees(engine, party)["training"]
    assert isinstance(ours["epsilon"], float)
    at_least_independent(ours["epsilon"], composed(releases, ROW_SHIFT[engine.spec.adjacency]))
    return ours["epsilon"]


def check_model(engine: PrivacyEngine, party: str) -> None:
    poisson = engine.poisson
    assert isinstance(poisson, PoissonSampler)
    sigma = engine.noise["dp-sgd"][0]
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(poisson.rate, dp_accounting.GaussianDpEvent(sigma)),
        poisson.draws,
    )
    ours = guarantees(engine, party)["model"]["epsilon"]
    assert isinstance(ours, float)
    at_least_independent(ours, event)


def test_dp_sgd_alone_is_at_least_the_independent_poisson_subsampled_price(
    make_data: MakeData,
) -> None:
    engine = private_run(make_data, PrivacySpec(dp_sgd=(1.0, 0.1)))
    for party in ("party-0", "party-1", "party-3"):
        check_model(engine, party)
        assert set(guarantees(engine, party)) == {"model"}  # it sends nothing noised


@pytest.mark.parametrize("adjacency", ["replace-one", "add-remove"])
def test_gradients_to_k_minus_1_receivers_are_at_least_their_composition(
    make_data: MakeData, adjacency: str
) -> None:
    spec = PrivacySpec(dp_gradients=(2.0, 0.05), adjacency=adjacency)
    engine = private_run(make_data, spec)
    ours = check_receivers(engine, "party-0", {"gradient"})
    # three gradient messages per step about one batch
    report = engine.report()
    assert report is not None and report["releases"]["party-0"]["gradient"] % 3 == 0
    # and never below the pricing (one joint event per step, subsampled, add/remove)
    poisson = engine.poisson
    assert poisson is not None
    amplified = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(
            poisson.rate, dp_accounting.GaussianDpEvent(2.0 / math.sqrt(3))
        ),
        poisson.draws,
    )
    at_least_independent(ours, amplified)


def test_embedding_noise_is_at_least_its_composition_for_every_sender(
    make_data: MakeData,
) -> None:
    engine = private_run(make_data, PrivacySpec(dp_embeddings=(1.5, 1.0)))
    for party in ("party-0", "party-1", "party-2", "party-3"):
        check_receivers(engine, party, {"embedding"})


def test_all_mechanisms_together_and_prediction_time_releases(make_data: MakeData) -> None:
    spec = PrivacySpec(dp_embeddings=(3.0, 1.0), dp_gradients=(2.0, 0.05), dp_sgd=(1.5, 0.1))
    engine = private_run(make_data, spec)
    shift = ROW_SHIFT["replace-one"]
    check_receivers(engine, "party-0", {"embedding", "gradient", "dp-sgd"})
    check_receivers(engine, "party-2", {"embedding", "dp-sgd"})
    for party in ("party-0", "party-2"):
        check_model(engine, party)
        # prediction: every release about the test row released most often, all splits
        events = [e for e in engine.accountants[party].events if e.phase == "predict"]
        counts = Counter(row for e in events for row in e.rows)
        worst, _ = counts.most_common(1)[0]
        held = [e for e in events if worst in e.rows]
        ours = guarantees(engine, party)["test"]["epsilon"]
        assert isinstance(ours, float)
        at_least_independent(ours, composed(held, shift))
        assert {e.split for e in held} == {"mcar:0", "mcar:0.5"}


def test_combinatorial_prices_its_several_releases_per_step(make_data: MakeData) -> None:
    spec = PrivacySpec(dp_embeddings=(1.0, 1.0), dp_gradients=(1.0, 0.05))
    engine = private_run(make_data, spec, method="combinatorial", heads="all")
    for party in ("party-0", "party-3"):
        check_receivers(engine, party, {"embedding", "gradient"})


def test_fedhf_statistics_are_at_least_three_independent_gaussians() -> None:
    accountant = PrivacyAccountant()
    for step in range(3):
        accountant.on_event(GaussianRelease("client-0", 2.0, 1.0, "statistics", step))
    guarantee = accountant.statistics_guarantee("client-0", delta=DELTA)
    assert guarantee is not None
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(2.0), 3)
    at_least_independent(guarantee.epsilon, event)


@pytest.mark.parametrize(
    ("method", "heads", "vectorised"),
    [
        ("laser", "active", True),
        ("laser", "all", True),
        ("laser", "active", False),
        ("local", "all", True),
        ("ensemble", "all", True),
        ("standard", "active", True),
        ("plugvfl", "active", True),
        ("combinatorial", "all", True),
    ],
)
def test_the_release_plan_bounds_what_every_method_releases_per_step(
    make_data: MakeData, method: str, heads: str, vectorised: bool
) -> None:
    """The target epsilon is calibrated to the plan; no step may release more than planned,
    and some step releases as many as planned (a plan above what is sent calibrates more noise
    than the target needs: Standard VFL's label party was planned an embedding it never sends)."""
    gradients = None if method in ("local", "ensemble") else (1.0, 0.05)  # they send none
    spec = PrivacySpec(dp_embeddings=(1.0, 1.0), dp_gradients=gradients)
    engine = PrivacyEngine(spec)
    config = MethodConfig(
        heads=heads,  # type: ignore[arg-type]
        epochs=1,
        batch_size=64,
        representation_dim=8,
        vectorised=vectorised,
    )
    train = TrainConfig(method=method, dataset="synthetic", method_config=config)
    run_training(train, data=make_data(train_missing="mcar:0", n=300), privacy=engine)
    plan = release_plan(method, config, 4)
    assert len(engine.accountants) == 4
    for k, (name, accountant) in enumerate(engine.accountants.items()):
        per_step: Counter[tuple[int, str]] = Counter(
            (e.round, e.kind) for e in accountant.events if e.phase == "train"
        )
        assert per_step, name  # it released something in training
        for (_, kind), count in per_step.items():
            assert count <= plan[k][kind], (name, kind, count, plan[k])
        for kind in ("embedding", "gradient") if gradients is not None else ("embedding",):
            most = max((n for (_, made), n in per_step.items() if made == kind), default=0)
            assert most == plan[k][kind], (name, kind, most, plan[k])


def test_exposed_row_releases_are_at_least_their_composition_per_record(
    make_data: MakeData,
) -> None:
    """--release dp: each release names the records it exposed; the worst record's releases,
    each its own Gaussian (the receiver knows which rows were exposed), composed."""
    engine = PrivacyEngine(PrivacySpec(secure_agg="masks", release="dp", release_noise=(2.0, 0.5)))
    config = TrainConfig(
        method="laser",
        dataset="synthetic",
        test_missing=("mcar:0.5",),
        seed=0,
        method_config=MethodConfig(
            heads="active",
            epochs=2,
            batch_size=32,
            lr=0.05,
            representation_dim=8,
            secure_sums=True,
            release="dp",
        ),
    )
    run_training(config, data=make_data(train_missing="mcar:0.3", n=400), privacy=engine)
    shift = ROW_SHIFT["replace-one"]
    for party in ("party-1", "party-2", "party-3"):
        events = [
            e
            for e in engine.accountants[party].events
            if e.kind == "exposure" and e.phase == "train"
        ]
        counts = Counter(row for e in events for row in e.rows)
        worst, _ = counts.most_common(1)[0]
        held = [e for e in events if worst in e.rows]
        ours = guarantees(engine, party)["training"]["epsilon"]
        assert isinstance(ours, float)
        at_least_independent(ours, composed(held, shift))
        # and the per-record pricing is exact: no looser than the worst record's composition
        rdp, _ = independent(composed(held, shift))
        assert ours <= 1.01 * rdp, (ours, rdp)
