"""Imputation baselines and the one evaluation protocol: every method keeps the rule of eq. 7."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sklearn.impute import KNNImputer
from test_fedhf import QUICK, synthetic_task

from secure_vfl.data.imputation import (
    ClientData,
    ImputationTask,
    load_imputation_dataset,
    make_imputation_task,
)
from secure_vfl.errors import ConfigError, DataError
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.methods.imputation import (
    IMPUTERS,
    ImputeConfig,
    Imputer,
    ReconstructionImputer,
    evaluate,
    federated_statistics,
    hidden_test_entries,
)

ALL = ("fedhf", "mean", "knn", "mice", "dae", "fed-mean", "fed-dae")
TINY = ImputeConfig(rounds=1, local_epochs=1, hidden=16, layers=1)


@pytest.fixture(scope="module")
def task() -> ImputationTask:
    return synthetic_task(seed=0)


@pytest.fixture(scope="module")
def scores(task) -> dict[str, float]:
    """Overall test RMSE of every method but FedHF (tested in test_fedhf) after QUICK training."""
    standardisation = federated_statistics(task.train).standardisation
    out = {}
    for name in ALL[1:]:
        imputer = IMPUTERS.get(name)(task, QUICK, seed=0)
        imputer.fit()
        out[name] = evaluate(imputer, task, standardisation=standardisation, seed=0)["rmse"]
    return out


def test_registry_holds_every_method() -> None:
    assert set(IMPUTERS.names()) == set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_observed_values_are_kept_and_unavailable_features_never_imputed(task, name) -> None:
    imputer = IMPUTERS.get(name)(task, TINY, seed=1)
    curve = imputer.fit()
    assert len(curve) == (TINY.rounds if name in ("fedhf", "dae", "fed-dae") else 0)
    for k, (corrupted, hidden) in enumerate(hidden_test_entries(task, seed=0)):
        out = imputer.impute(k, corrupted)
        assert out.dtype == np.float32 and out.shape == corrupted.values.shape
        observed = corrupted.observed
        np.testing.assert_array_equal(out[observed], corrupted.values[observed])
        assert np.all(np.isnan(out[:, ~corrupted.available]))
        assert np.all(np.isfinite(out[:, corrupted.available]))
        assert hidden.any()


@pytest.mark.parametrize("name", ["knn", "mice", "dae", "fed-dae"])
def test_baseline_beats_column_means_on_correlated_data(scores, name) -> None:
    # over seeds 0-8: mice 0.23-0.33, dae 0.46-0.56, fed-dae 0.46-0.56, knn 0.53-0.63
    assert scores[name] < 0.75 * min(scores["mean"], scores["fed-mean"]), scores


def test_knn_is_scikit_learn_knn_on_the_clients_standardised_columns(task) -> None:
    """Regression: the reference code's kNN silently returned column means."""
    imputer = IMPUTERS.get("knn")(task, QUICK, seed=0)
    imputer.fit()
    standardisation = federated_statistics(task.train).standardisation
    corrupted, _ = hidden_test_entries(task, seed=0)[1]
    columns = task.train[1].available
    reference = KNNImputer(n_neighbors=5).fit(
        standardisation.standardise(task.train[1].values)[:, columns]
    )
    z = reference.transform(standardisation.standardise(corrupted.values)[:, columns])
    expected = (z * standardisation.std[columns] + standardisation.mean[columns]).astype(np.float32)
    # float32 de-standardisation: values near 0 carry the rounding of mean (~1e-7 relative)
    atol = 1e-6 * np.abs(standardisation.mean[columns]).max()
    np.testing.assert_allclose(
        imputer.impute(1, corrupted)[:, columns], expected, rtol=1e-5, atol=atol
    )
    means = np.nanmean(task.train[1].values[:, columns], axis=0)
    missing = ~corrupted.observed[:, columns]
    assert not np.allclose(expected[missing], np.broadcast_to(means, expected.shape)[missing])


@pytest.mark.parametrize("name", ["mean", "knn", "mice"])
def test_available_but_never_observed_feature_gets_the_federated_mean(task, name) -> None:
    values = task.train[0].values.copy()
    feature = int(np.flatnonzero(task.train[0].available)[0])
    values[:, feature] = np.nan
    train = (dataclasses.replace(task.train[0], values=values), *task.train[1:])
    blind = dataclasses.replace(task, train=train)
    imputer = IMPUTERS.get(name)(blind, QUICK, seed=0)
    imputer.fit()
    out = imputer.impute(0, task.test[0])
    missing = np.isnan(task.test[0].values[:, feature])
    assert missing.any()
    global_mean = federated_statistics(train).standardisation.mean[feature]
    np.testing.assert_allclose(out[missing, feature], global_mean, rtol=1e-6)


def test_mice_stays_finite_and_in_range_on_wide_collinear_data() -> None:
    """Regression: unclipped chained regressions diverged to infinity on chorizon (raw scale)."""
    frame = load_imputation_dataset("chorizon")
    task = make_imputation_task(frame, name="chorizon", rng=np.random.default_rng(0))
    imputer = IMPUTERS.get("mice")(task, QUICK, seed=0)
    imputer.fit()
    corrupted, _ = hidden_test_entries(task, seed=0)[0]
    out = imputer.impute(0, corrupted)
    columns = task.train[0].available & task.train[0].observed.any(axis=0)
    assert np.all(np.isfinite(out[:, columns]))
    low = np.nanmin(task.train[0].values[:, columns], axis=0)
    high = np.nanmax(task.train[0].values[:, columns], axis=0)
    missing = ~corrupted.observed[:, columns]
    filled = out[:, columns][missing]
    tolerance = 1e-4 * (np.abs(out[:, columns][missing]) + 1)
    assert np.all(filled >= np.broadcast_to(low, missing.shape)[missing] - tolerance)
    assert np.all(filled <= np.broadcast_to(high, missing.shape)[missing] + tolerance)


class _Oracle:
    """Knows the truth: scores RMSE 0 under the protocol."""

    name = "oracle"

    def __init__(self, task: ImputationTask) -> None:
        self.task = task

    def fit(self, *, on_round=None) -> list[float]:
        return []

    def impute(self, client_index: int, client: ClientData) -> np.ndarray:
        return self.task.test[client_index].values.copy()


def test_evaluation_protocol_is_fixed_by_the_seed_and_scores_the_hidden_entries(task) -> None:
    standardisation = federated_statistics(task.train).standardisation
    first = hidden_test_entries(task, seed=5)
    again = hidden_test_entries(task, seed=5)
    other = hidden_test_entries(task, seed=6)
    for (a, mask_a), (b, mask_b), (_, mask_c) in zip(first, again, other, strict=True):
        np.testing.assert_array_equal(mask_a, mask_b)
        assert not np.array_equal(mask_a, mask_c)
        count = int(np.sum(~np.isnan(b.values) & ~np.isnan(a.values)))
        assert mask_a.sum() == round(0.2 * (count + mask_a.sum()))
    oracle: Imputer = _Oracle(task)
    perfect = evaluate(oracle, task, standardisation=standardisation, seed=5)
    assert perfect["rmse"] == 0.0 and perfect["rmse_client_mean"] == 0.0
    fed_mean = IMPUTERS.get("fed-mean")(task, QUICK, seed=0)
    scores = evaluate(fed_mean, task, standardisation=standardisation, seed=5)
    squared, total = 0.0, 0
    features = len(task.features)
    raw_squared, raw_total = np.zeros(features), np.zeros(features, dtype=np.int64)
    for k, (corrupted, hidden) in enumerate(first):
        z = standardisation.standardise(task.test[k].values)
        squared += float((z[hidden].astype(np.float64) ** 2).sum())  # global mean is z = 0
        total += int(hidden.sum())
        assert scores["hidden_per_client"][corrupted.name] == int(hidden.sum())
        # in the data's own units: the distance to the global mean, feature by feature
        raw = np.where(hidden, task.test[k].values - standardisation.mean, 0.0)
        raw_squared += (raw.astype(np.float64) ** 2).sum(axis=0)
        raw_total += hidden.sum(axis=0)
    assert scores["rmse"] == pytest.approx(np.sqrt(squared / total), rel=1e-5)
    assert list(scores["hidden_per_feature"].values()) == raw_total.tolist()
    assert sum(raw_total) == total and (raw_total > 0).all()
    assert list(scores["rmse_per_feature_in_units"].values()) == pytest.approx(
        np.sqrt(raw_squared / raw_total), rel=1e-5
    )
    assert list(scores["rmse_per_feature"].values()) == pytest.approx(
        np.sqrt(raw_squared / raw_total) / standardisation.std, rel=1e-5
    )
    assert list(scores["rmse_per_feature"]) == list(task.features)
    per_client = list(scores["rmse_per_client"].values())
    assert scores["rmse_client_mean"] == pytest.approx(np.mean(per_client))


def test_impute_refuses_rows_of_another_schema(task) -> None:
    imputer = IMPUTERS.get("mean")(task, QUICK, seed=0)
    with pytest.raises(DataError, match="must have the availability mask of client-0"):
        imputer.impute(0, task.test[1])
    with pytest.raises(DataError, match=r"`client_index` must be in \[0, 4\). Found 4."):
        imputer.impute(4, task.test[0])


@pytest.mark.parametrize("seed", [-1, 1.5, "0"])
@pytest.mark.parametrize("name", ["fedhf", "mice", "dae", "fed-dae", "mean", "fed-mean", "knn"])
def test_a_seed_that_is_not_a_non_negative_integer_is_refused_before_any_message(
    task, name, seed
) -> None:
    """Regression: a negative seed reached numpy's SeedSequence (a raw ValueError), and MICE's
    only once fitted, after the statistics had been exchanged."""
    recorder = RecordingLayer()
    with pytest.raises(ConfigError, match=r"`seed` must be an integer >= 0\. Found "):
        IMPUTERS.get(name)(task, TINY, seed=seed, channel=Channel([recorder])).fit()
    assert recorder.messages == []


@pytest.mark.parametrize("name", ["fedhf", "mean"])
def test_evaluate_refuses_a_seed_that_is_not_a_non_negative_integer(task, name) -> None:
    standardisation = federated_statistics(task.train).standardisation
    imputer = IMPUTERS.get(name)(task, TINY, seed=0)
    imputer.fit()
    for seed in (-1, 1.5):
        with pytest.raises(ConfigError, match=r"`seed` must be an integer >= 0\. Found "):
            evaluate(imputer, task, standardisation=standardisation, seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5, float("nan"), True])
@pytest.mark.parametrize("name", ["fedhf", "mean"])
def test_evaluate_refuses_a_hidden_fraction_outside_0_1_alike_for_every_method(
    task, name, fraction
) -> None:
    """Regression: a method whose clients score themselves refused it as a malformed
    score-request (a ProtocolError naming the coordinator, after marking a client as asked for
    a score), while the evaluator's path scored fraction 1 and called 0 too few test rows."""
    standardisation = federated_statistics(task.train).standardisation
    imputer = IMPUTERS.get(name)(task, TINY, seed=0)
    imputer.fit()
    with pytest.raises(ConfigError, match=r"`fraction` must be in \(0, 1\)\. Found "):
        evaluate(imputer, task, standardisation=standardisation, seed=0, fraction=fraction)
    if isinstance(imputer, ReconstructionImputer):
        with pytest.raises(ConfigError, match=r"`fraction` must be in \(0, 1\)\. Found "):
            imputer.score(standardisation, seed=0, fraction=fraction)
        assert imputer.federation.own.scoring == set()
    assert evaluate(imputer, task, standardisation=standardisation, seed=0)["rmse"] > 0
