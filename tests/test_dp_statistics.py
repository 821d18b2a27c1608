"""DP graph statistics: record clipping, the noise scale of distributed shares, accounting
against Opacus, and a graph and standardisation that stay valid under heavy noise."""

from __future__ import annotations

import logging
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from protocols.dp import GaussianRelease, PrivacyAccountant, calibrate_noise
from protocols.dp_statistics import (
    STATISTICS_RELEASES,
    ClientStatisticsNoise,
    StatisticsNoise,
    observed_ranges,
    read_feature_ranges,
)
from protocols.noise import SeededNoise
from protocols.secagg import MaskingAggregator
from secure_vfl.data.imputation import ClientData, ImputationTask
from secure_vfl.errors import ConfigError, DataError
from secure_vfl.methods.imputation import (
    IMPUTERS,
    ImputeConfig,
    build_imputation_federation,
    federated_statistics,
    in_process_clients,
)
from secure_vfl.methods.imputation.statistics import FeatureRanges

DELTA = 1e-5


def discard(event: GaussianRelease) -> None:
    """An event sink for tests that do not look at events."""


def _clients(rows: int = 240, features: int = 6, seed: int = 0) -> list[ClientData]:
    """Four clients of correlated rows (two latent factors), 15 % missing, one unavailable
    feature each; feature 1 has mean 500 and std ~30 (a raw scale)."""
    rng = np.random.default_rng(seed)
    latent = rng.normal(size=(rows, 2))
    x = latent @ rng.normal(size=(2, features)) + 0.4 * rng.normal(size=(rows, features))
    x[:, 1] = 500 + 30 * x[:, 1]
    x[rng.random(x.shape) < 0.15] = np.nan
    clients = []
    for k in range(4):
        values = x[k::4].astype(np.float32)
        available = np.ones(features, dtype=bool)
        available[(k + 2) % features] = False
        values[:, ~available] = np.nan
        clients.append(ClientData(f"client-{k}", values, available))
    return clients


def _mechanism(
    sigma: float,
    clip: float,
    *,
    ranges: FeatureRanges,
    shares: int = 4,
    seed: int = 0,
    accountant: PrivacyAccountant | None = None,
    standard_bound: float = 3.0,
) -> StatisticsNoise:
    return StatisticsNoise(
        sigma,
        clip,
        ranges=ranges,
        shares=shares,
        noise=SeededNoise(seed),
        on_event=accountant.on_event if accountant is not None else discard,
        standard_bound=standard_bound,
    )


def _mechanisms(
    sigma: float,
    clip: float,
    *,
    ranges: FeatureRanges,
    shares: int = 4,
    seed: int = 0,
    standard_bound: float = 3.0,
) -> ClientStatisticsNoise:
    """Each client's own mechanism (its own noise and accountant), made as it is built; the
    k-th client's noise reproducible from ``[seed, k]`` (for the tests)."""
    return ClientStatisticsNoise(
        sigma,
        clip,
        ranges=ranges,
        shares=shares,
        noise=lambda k: SeededNoise([seed, k]),
        standard_bound=standard_bound,
    )


RANGES = FeatureRanges(lower=np.full(3, -1.0), upper=np.full(3, 1.0))


def test_any_k_minus_one_shares_carry_sigma_clip_so_no_client_can_strip_the_noise() -> None:
    """A client knows its own share of the released sum's noise: what is left to it, the
    others' K - 1 shares, must carry sigma C (shares of 1/K each left sigma sqrt((K-1)/K))."""
    sigma, clip, shares = 1.5, 2.0, 4
    mechanism = _mechanism(sigma, clip, ranges=RANGES, shares=shares)
    no_rows = np.zeros((0, 50_000))
    parts = [mechanism.privatise(f"client-{k}", "pairs", no_rows) for k in range(shares)]
    assert np.std(parts[0]) == pytest.approx(sigma * clip / math.sqrt(shares - 1), rel=0.02)
    others = np.sum(parts[1:], axis=0)  # the sum, less client-0's own share
    assert np.std(others) == pytest.approx(sigma * clip, rel=0.02)
    total = np.sum(parts, axis=0)
    assert np.std(total) == pytest.approx(sigma * clip * math.sqrt(shares / (shares - 1)), rel=0.02)
    assert abs(float(np.mean(total))) < 5 * np.std(total) / math.sqrt(total.size)
    # one client adding all the noise (no secure sum) adds sigma C
    alone = _mechanism(sigma, clip, ranges=RANGES, shares=1).privatise("c", "pairs", no_rows)
    assert np.std(alone) == pytest.approx(sigma * clip, rel=0.02)


def test_one_record_moves_a_clients_release_by_at_most_the_clip_norm() -> None:
    rng = np.random.default_rng(1)
    rows = rng.normal(size=(30, 8)) * 3
    extra = rng.normal(size=(1, 8)) * 50  # far longer than the clip
    clip = 1.25
    without = _mechanism(0.7, clip, ranges=RANGES, seed=5).privatise("c", "moments", rows)
    with_it = _mechanism(0.7, clip, ranges=RANGES, seed=5).privatise(
        "c", "moments", np.concatenate([rows, extra])
    )
    moved = float(np.linalg.norm(with_it - without))
    assert moved == pytest.approx(clip, rel=1e-9)  # the long row is scaled to exactly C
    short = rng.normal(size=(1, 8)) * 0.01
    with_short = _mechanism(0.7, clip, ranges=RANGES, seed=5).privatise(
        "c", "moments", np.concatenate([rows, short])
    )
    np.testing.assert_allclose(with_short - without, short[0], atol=1e-12)  # left as it is


def test_epsilon_per_client_equals_opacus_accountant_for_the_same_releases() -> None:
    # every release covers every row: three Gaussian releases at sample rate 1, add/remove
    clients = _clients()
    sigma = 2.0
    mechanisms = _mechanisms(sigma, 1.0, ranges=observed_ranges(clients))
    federated_statistics(clients, aggregator=MaskingAggregator(), privacy=mechanisms)
    assert list(mechanisms.accountants) == [c.name for c in clients]
    reference = RDPAccountant()
    for _ in range(STATISTICS_RELEASES):
        reference.step(noise_multiplier=sigma, sample_rate=1.0)
    expected = reference.get_epsilon(delta=DELTA)
    for name, accountant in mechanisms.accountants.items():
        # each client's own accountant records its own releases only
        assert accountant.parties() == [name] and len(accountant.events) == STATISTICS_RELEASES
        assert all(e.kind == "statistics" and e.sample_rate == 1.0 for e in accountant.events)
        assert [e.round for e in accountant.events] == [0, 1, 2]  # one per exchange
        guarantee = accountant.statistics_guarantee(name, delta=DELTA)
        assert guarantee is not None and guarantee.releases == STATISTICS_RELEASES
        assert guarantee.epsilon == pytest.approx(expected, rel=1e-9)
        assert guarantee.noise_multiplier == pytest.approx(sigma / math.sqrt(3))


def test_each_client_holds_its_own_mechanism_and_noise_source() -> None:
    clients = _clients()
    federation = build_imputation_federation(
        clients, privacy=_mechanisms(1.0, 1.0, ranges=observed_ranges(clients))
    )
    held = [client.privacy for client in in_process_clients(federation.channel)]
    assert all(isinstance(m, StatisticsNoise) for m in held)
    sources = {id(m.noise) for m in held if isinstance(m, StatisticsNoise)}
    assert len({id(m) for m in held}) == len(sources) == len(clients)
    # The coordinator knows only the public terms (a copy), no mechanism or generator.
    assert federation.release_terms is not None
    assert federation.release_terms.share_std == pytest.approx(1.0 / math.sqrt(3.0))
    shared = _mechanism(1.0, 1.0, ranges=observed_ranges(clients))
    with pytest.raises(ConfigError, match="each client needs its own statistics mechanism"):
        build_imputation_federation(clients, privacy=lambda name: shared)


def test_calibrated_sigma_spends_the_target_over_the_three_releases() -> None:
    for target in (1.0, 4.0, 10.0):
        sigma = calibrate_noise(target, DELTA, sample_rate=1.0, steps=STATISTICS_RELEASES)
        accountant = PrivacyAccountant()
        for step in range(STATISTICS_RELEASES):
            accountant.on_event(GaussianRelease("client-0", sigma, 1.0, "statistics", step))
        guarantee = accountant.statistics_guarantee("client-0", delta=DELTA)
        assert guarantee is not None and 0.99 * target <= guarantee.epsilon <= target


def _pooled_global_moment_correlation(
    clients: list[ClientData], mean: np.ndarray, std: np.ndarray
) -> np.ndarray:
    """The oracle of the private pair estimator, on pooled rows: z standardised globally,
    cov_ij = mean of z_i z_j over co-observed rows, corr_ij = cov_ij / sqrt(cov_ii cov_jj)."""
    z = (np.concatenate([c.values for c in clients]).astype(np.float64) - mean) / std
    observed = np.isfinite(z)
    z = np.where(observed, z, 0.0)
    covariance = (z.T @ z) / (observed.T.astype(float) @ observed)
    variance = np.diagonal(covariance)
    return covariance / np.sqrt(np.outer(variance, variance))


def test_almost_noiseless_unclipped_release_gives_the_exact_statistics() -> None:
    """The private path computes the statistics it claims when clipping and noise do nothing:
    the exact standardisation, the exact counts, the global-moment correlations of the pool."""
    clients = _clients()
    exact = federated_statistics(clients)
    wide = FeatureRanges(
        lower=observed_ranges(clients).lower - 1, upper=observed_ranges(clients).upper + 1
    )
    mechanisms = _mechanisms(1e-13, 1e6, ranges=wide, standard_bound=50.0)
    private = federated_statistics(clients, privacy=mechanisms)
    mean, std = private.standardisation.mean, private.standardisation.std
    np.testing.assert_allclose(mean, exact.standardisation.mean, rtol=1e-6)
    np.testing.assert_allclose(std, exact.standardisation.std, rtol=1e-5)
    np.testing.assert_array_equal(private.counts, exact.counts)
    oracle = _pooled_global_moment_correlation(clients, mean, std)
    np.testing.assert_allclose(private.correlation, oracle, atol=1e-5)
    # and, with random availability, near the pairwise-complete ones (240 rows: within 0.1)
    np.testing.assert_allclose(private.correlation, exact.correlation, atol=0.1)


def test_each_client_tells_its_operator_of_values_outside_the_declared_ranges(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A declared range that misses the data clips values silently into a large imputation
    error: each client whose observed values fall outside says how many, where and against
    which range, naming the feature (only in its own log: nothing of it is sent)."""
    clients = _clients()
    observed = observed_ranges(clients)
    names = tuple(f"f{j}" for j in range(6))
    fits = FeatureRanges(lower=observed.lower, upper=observed.upper, names=names)
    with caplog.at_level(logging.WARNING):
        federated_statistics(clients, privacy=_mechanisms(1.0, 1.0, ranges=fits))
    assert caplog.records == []
    # Feature 1 (mean 500) declared in [0, 100]: every observed value of it is above.
    upper = observed.upper.copy()
    upper[1] = 100.0
    lower = np.minimum(observed.lower, 0.0)
    narrow = FeatureRanges(lower=lower, upper=upper, names=names)
    with caplog.at_level(logging.WARNING):
        federated_statistics(clients, privacy=_mechanisms(1.0, 1.0, ranges=narrow))
    warned = {record.getMessage().split(":")[0]: record.getMessage() for record in caplog.records}
    assert sorted(warned) == [client.name for client in clients]
    for client in clients:
        seen = int((~np.isnan(client.values[:, 1])).sum())
        assert f"f1: {seen} of {seen} values, in [" in warned[client.name]
        assert "against [0, 100]" in warned[client.name]
        assert "f0" not in warned[client.name] and "f2" not in warned[client.name]


def test_record_clipping_down_weights_records_without_biasing_the_std() -> None:
    """Regression: exchange 2 divided its clipped sums by exchange 1's counts, whose records
    were clipped more, and inflated every std by ~1.5x; each exchange now carries its counts."""
    clients = _clients(rows=400)
    exact = federated_statistics(clients).standardisation
    mechanisms = _mechanisms(1e-13, 0.5, ranges=observed_ranges(clients))  # clips every record
    private = federated_statistics(clients, privacy=mechanisms).standardisation
    np.testing.assert_allclose(private.std / exact.std, 1.0, atol=0.1)
    assert np.all(np.abs(private.mean - exact.mean) < 0.05 * exact.std)


def test_heavy_noise_still_gives_a_valid_standardisation_and_graph() -> None:
    clients = _clients(rows=40)
    ranges = observed_ranges(clients)
    mechanisms = _mechanisms(50.0, 1.0, ranges=ranges, shares=1)
    statistics = federated_statistics(clients, privacy=mechanisms)
    mean, std = statistics.standardisation.mean, statistics.standardisation.std
    assert np.all(np.isfinite(mean)) and np.all(np.isfinite(std)) and np.all(std > 0)
    assert np.all((ranges.lower <= mean) & (mean <= ranges.upper))
    assert np.all(statistics.counts >= 0)
    correlation = statistics.correlation
    finite = np.isfinite(correlation)
    assert np.all(np.abs(correlation[finite]) <= 1.0)
    np.testing.assert_array_equal(finite, finite.T)
    graph = statistics.graph(top_k=3)
    assert np.all((graph.weights >= 0) & (graph.weights <= 1))


def test_moderate_noise_keeps_the_strongest_correlations() -> None:
    """Utility control: at sigma 1 the noisy graph's correlations stay near the exact ones."""
    clients = _clients(rows=2000)
    exact = federated_statistics(clients)
    mechanisms = _mechanisms(1.0, 4.0, ranges=observed_ranges(clients))
    private = federated_statistics(clients, aggregator=MaskingAggregator(), privacy=mechanisms)
    both = np.isfinite(exact.correlation) & np.isfinite(private.correlation)
    np.fill_diagonal(both, False)
    gap = np.abs(private.correlation[both] - exact.correlation[both])
    # over noise seeds 0-11 and data seeds 0-1: largest gap 0.088-0.123, mean 0.043-0.076
    # (sigma 10: largest 0.14-0.32); it was < 0.1, which seed 0's 0.098 passed by chance
    assert float(gap.max()) < 0.15 and float(gap.mean()) < 0.1, gap


def test_fedhf_trains_on_private_statistics_and_every_client_spends_three_releases() -> None:
    clients = _clients(rows=80)
    task = ImputationTask(
        name="synthetic",
        features=tuple(f"x{j}" for j in range(6)),
        train=tuple(clients),
        test=tuple(_clients(rows=40, seed=1)),
    )
    mechanisms = _mechanisms(3.0, 2.0, ranges=observed_ranges(clients))
    config = ImputeConfig(rounds=2, local_epochs=1, hidden=8, layers=1)
    imputer = IMPUTERS.get("fedhf")(task, config, seed=0, privacy=mechanisms)
    curve = imputer.fit()
    assert len(curve) == 2 and all(np.isfinite(curve))
    releases = {name: [e.party for e in a.events] for name, a in mechanisms.accountants.items()}
    assert releases == {c.name: [c.name] * STATISTICS_RELEASES for c in clients}


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"noise multiplier \(SIGMA\) of a private release"):
        _mechanism(0.0, 1.0, ranges=RANGES)
    with pytest.raises(ConfigError, match=r"clip norm \(CLIP\) must be a positive number"):
        _mechanism(1.0, -1.0, ranges=RANGES)
    with pytest.raises(ConfigError, match="`shares` must be a positive integer"):
        _mechanism(1.0, 1.0, ranges=RANGES, shares=0)
    with pytest.raises(ConfigError, match="`standard_bound`"):
        _mechanism(1.0, 1.0, ranges=RANGES, standard_bound=math.inf)
    with pytest.raises(ConfigError, match="`exchange` must be one of"):
        _mechanism(1.0, 1.0, ranges=RANGES).privatise("c", "graph", np.zeros((1, 2)))
    with pytest.raises(DataError, match="lower < upper"):
        FeatureRanges(lower=np.array([0.0, 1.0]), upper=np.array([1.0, 1.0]))
    with pytest.raises(DataError, match="ranges cover 3 features"):
        federated_statistics(_clients(), privacy=_mechanisms(1.0, 1.0, ranges=RANGES))


def test_the_core_offers_the_hook_without_importing_the_mechanism() -> None:
    """Dependency direction (DESIGN section 2): statistics and FedHF never import protocols."""
    code = (
        "import sys, secure_vfl.methods.imputation, secure_vfl.experiment; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'protocols'))"
    )
    found = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert found == "[]"


# -- a deployed imputation: the plan each client makes its own mechanism from ------------------


def _plan_body(**change: object) -> dict[str, object]:
    from protocols.dp_statistics import StatisticsPlan

    plan = StatisticsPlan(
        noise_multiplier=1.5, clip=2.0, shares=3, ranges=RANGES, delta=DELTA, standard_bound=3.0
    )
    return {**plan.to_json(), **change}


def test_a_served_client_makes_its_own_mechanism_from_the_plan_under_the_coordinators_terms() -> (
    None
):
    from protocols.dp_statistics import StatisticsPlan, read_statistics_entry, served_statistics
    from secure_vfl.methods.imputation.clients import ImputationClient
    from secure_vfl.methods.imputation.statistics import ReleaseTerms

    body = _plan_body()
    plan = StatisticsPlan.from_json(body, features=3)
    assert plan.to_json() == body  # what the label party sent, exactly
    client = ImputationClient(_clients(features=3)[0])
    served = served_statistics("client-0", body, client, features=("a", "b", "c"))
    assert client.privacy is served.mechanism
    # The coordinator's view of the clients' mechanisms is what each client made.
    assert plan.terms().matches(ReleaseTerms.of(served.mechanism))
    assert served.mechanism.share_std == pytest.approx(1.5 * 2.0 / math.sqrt(2))
    # Its noise is fresh OS entropy: two clients of one plan draw different noise.
    other = served_statistics(
        "client-1", body, ImputationClient(_clients(features=3)[1]), features=("a", "b", "c")
    )
    no_rows = np.zeros((0, 20_000))
    mine = served.mechanism.privatise("client-0", "pairs", no_rows)
    theirs = other.mechanism.privatise("client-1", "pairs", no_rows)
    assert np.std(mine) == pytest.approx(served.mechanism.share_std, rel=0.03)
    assert not np.allclose(mine, theirs)
    # It reports what its own accountant priced: one release so far, and its guarantee.
    entry = served.entry()
    assert entry["releases"] == {"statistics": 1}
    [guarantee] = entry["guarantees"]
    expected = PrivacyAccountant()
    expected.on_event(GaussianRelease("client-0", 1.5, 1.0, "statistics", 2))
    held = expected.statistics_guarantee("client-0", delta=DELTA)
    assert held is not None and guarantee["epsilon"] == pytest.approx(held.epsilon)
    assert read_statistics_entry("client-0", entry, delta=DELTA) == entry
    # Before any release: no guarantee, and the label party accepts that too.
    assert other.entry()["guarantees"] != [] and served_statistics(
        "client-2", body, ImputationClient(_clients(features=3)[2]), features=("a", "b", "c")
    ).entry() == {
        "guarantees": [],
        "releases": {"statistics": 0},
        "noise_source": entry["noise_source"],
    }


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"noise_multiplier": 0.0}, "`noise_multiplier` a finite number > 0 expected"),
        ({"clip": float("inf")}, "`clip` a finite number > 0 expected"),
        ({"shares": 0}, "`shares` >= 1 expected"),
        ({"shares": True}, "`shares` of type"),
        ({"delta": 1.0}, "`delta` in (0, 1) expected"),
        ({"lower": [0.0, 0.0]}, "as 3 numbers each expected"),
        ({"upper": ["1", 1.0, 1.0]}, "as 3 numbers each expected"),
        ({"lower": [2.0, -1.0, -1.0]}, "lower < upper"),
        ({"extra": 1}, "keys ["),
    ],
)
def test_a_malformed_plan_is_refused_as_another_partys_bytes(
    change: dict[str, object], expected: str
) -> None:
    from protocols.dp_statistics import StatisticsPlan
    from secure_vfl.errors import ProtocolError

    with pytest.raises(ProtocolError, match=re.escape(expected)):
        StatisticsPlan.from_json(_plan_body(**change), features=3)


def test_a_clients_report_is_checked_before_the_label_party_lists_it() -> None:
    from protocols.dp_statistics import ServedStatistics, StatisticsPlan, read_statistics_entry
    from secure_vfl.errors import ProtocolError

    served = ServedStatistics("shop", StatisticsPlan.from_json(_plan_body(), features=3))
    for exchange in ("moments", "deviations", "pairs"):
        served.mechanism.privatise("shop", exchange, np.zeros((4, 3)))
    good = served.entry()
    assert good["releases"] == {"statistics": STATISTICS_RELEASES}
    [guarantee] = good["guarantees"]
    for entry, expected in [
        ({**good, "extra": 1}, "keys ["),
        ({**good, "guarantees": [{**guarantee, "epsilon": -1.0}]}, "an epsilon >= 0 expected"),
        ({**good, "guarantees": [{**guarantee, "epsilon": math.nan}]}, "an epsilon >= 0"),
        ({**good, "guarantees": [{**guarantee, "delta": 1e-3}]}, "the run's delta"),
        (
            {**good, "guarantees": [{**guarantee, "mechanisms": ["embedding"]}]},
            "of the statistics mechanism",
        ),
        ({**good, "releases": {"statistics": -1}}, "a count >= 0"),
        ({**good, "releases": {"statistics": 0}}, "exactly when it made releases"),
        ({**good, "guarantees": []}, "exactly when it made releases"),
    ]:
        with pytest.raises(ProtocolError, match=re.escape(expected)):
            read_statistics_entry("shop", entry, delta=DELTA)


def test_the_label_partys_engine_plans_declared_ranges_and_lists_what_clients_reported(
    tmp_path: Path,
) -> None:
    from protocols.dp_statistics import ServedStatistics, StatisticsPlan
    from protocols.privacy import PrivacyEngine, PrivacySpec
    from secure_vfl.errors import ProtocolError

    ranges = tmp_path / "ranges.csv"
    ranges.write_text("feature,lower,upper\nb,0,10\na,-5,5\n")
    # Observed ranges would take every client's extremes: a deployment declares them.
    undeclared = PrivacyEngine(PrivacySpec(secure_agg="masks", dp_statistics=(1.0, 1.0)))
    with pytest.raises(ConfigError, match="--feature-ranges"):
        undeclared.statistics_plan(["a", "b"], ["shop", "insurer"])
    spec = PrivacySpec(
        secure_agg="masks", dp_statistics=(1.0, 2.0), feature_ranges=ranges, target_epsilon=4.0
    )
    engine = PrivacyEngine(spec)
    plan = engine.statistics_plan(["a", "b"], ["shop", "insurer", "telco"], records=240)
    assert isinstance(plan, StatisticsPlan)
    # SIGMA calibrated over the three releases, as in one process; the noise shared by the
    # three clients under secure sums; the ranges in the run's feature order.
    assert plan.noise_multiplier == pytest.approx(
        calibrate_noise(4.0, DELTA, sample_rate=1.0, steps=STATISTICS_RELEASES)
    )
    assert (plan.clip, plan.shares) == (2.0, 3)
    assert plan.ranges.lower.tolist() == [-5.0, 0.0] and plan.ranges.upper.tolist() == [5.0, 10.0]
    assert (
        PrivacyEngine(PrivacySpec(dp_statistics=(1.0, 2.0), feature_ranges=ranges))
        .statistics_plan(["a", "b"], ["shop", "insurer", "telco"])
        .shares
        == 1
    )  # type: ignore[union-attr]
    assert PrivacyEngine(PrivacySpec(secure_agg="masks")).statistics_plan(["a"], ["shop"]) is None

    entries = {}
    for name in ("shop", "insurer"):  # telco was lost mid-run: it reports nothing
        served = ServedStatistics(name, StatisticsPlan.from_json(plan.to_json(), features=2))
        for exchange in ("moments", "deviations", "pairs"):
            served.mechanism.privatise(name, exchange, np.zeros((3, 2)))
        entries[name] = served.entry()
    with pytest.raises(ProtocolError, match="its privacy entry expected"):
        engine.take_statistics_reports({"shop": None})
    engine.take_statistics_reports(entries)
    report = engine.report()
    assert report is not None
    assert set(report["epsilon"]) == {"shop", "insurer"}
    assert max(report["epsilon"].values()) <= 4.0 + 1e-6
    assert report["releases"] == {n: {"statistics": 3} for n in ("shop", "insurer")}
    assert report["noise_shares"] == 3 and report["ranges"] == f"declared in {ranges}"
    assert report["accounted_by"]["telco"].startswith("none: it reported nothing")
    assert report["accounted_by"]["shop"].startswith("its own accountant in its own process")
    # The clients' training rows, which they told the coordinator: what delta is weighed
    # against (a deployed imputation never warned of a delta not below 1/n).
    assert report["sampling"]["records"] == 240


def test_feature_ranges_read_from_csv_or_parquet_alike(tmp_path: Path) -> None:
    """A Parquet file was read as CSV ("'utf-8' codec can't decode byte ...")."""
    import pandas as pd

    table = pd.DataFrame({"feature": ["b", "a"], "lower": [-1.0, 0.0], "upper": [2.0, 5.0]})
    table.to_csv(tmp_path / "ranges.csv", index=False)
    table.to_parquet(tmp_path / "ranges.parquet", index=False)
    read = [
        read_feature_ranges(tmp_path / name, ["a", "b"])
        for name in ("ranges.csv", "ranges.parquet")
    ]
    for ranges in read:
        np.testing.assert_array_equal(ranges.lower, [0.0, -1.0])
        np.testing.assert_array_equal(ranges.upper, [5.0, 2.0])


@pytest.mark.parametrize(
    ("text", "message"),
    [
        # pandas' and numpy's own words, or a NaN range: "could not convert", "[nan, 10]"
        ("feature,lower,upper\na,,5\nb,0,1\n", r"`lower` must hold a number for every feature; "
         r"found none for \['a'\]"),
        ("feature,lower,upper\na,0,five\nb,0,1\n", "`upper` must hold numbers; found text such "
         r"as 'five' \(feature 'a'\)"),
        # it showed the first cell, '0', a number read as text like every other
        ("feature,lower,upper\na,0,5\nb,abc,1\n", "`lower` must hold numbers; found text such "
         r"as 'abc' \(feature 'b'\)"),
        ("feature,lower,upper\na,0,5\nb,0\n", "line 3 has 2 fields; expected 3"),
        (b"feature,lower,upper\na,0,5\nb,\xe9,1\n", "could not be read as UTF-8 text"),
        ("", "a header and rows expected; found an empty file"),
        ("feature,lower,upper\na,0,inf\nb,0,1\n", "finite"),
    ],
)  # fmt: skip
def test_a_malformed_feature_ranges_file_is_refused_in_words(
    tmp_path: Path, text: str | bytes, message: str
) -> None:
    path = tmp_path / "ranges.csv"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(DataError, match=message):
        read_feature_ranges(path, ["a", "b"])
