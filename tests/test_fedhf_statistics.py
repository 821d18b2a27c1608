"""Federated statistics and the feature graph equal what pooling the clients' rows would give."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from test_paillier import paillier_aggregator

from protocols.ckks import CkksAggregator
from secure_vfl.data.imputation import ClientData
from secure_vfl.errors import ConfigError, DataError
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import RepresentationMessage
from secure_vfl.methods.imputation import ImputeConfig, federated_statistics
from secure_vfl.methods.imputation.statistics import (
    WIDE_DIGITS,
    WIDE_STEP,
    WIRE_LIMIT,
    client_moments,
    from_wide_digits,
    wide_digits,
)
from secure_vfl.models.feature_graph import FeatureGraph


def _clients() -> list[ClientData]:
    """Three clients, nine features: NaNs, heterogeneous schemas and the awkward cases.

    Feature 2 has mean 1e4 and std 1 (raw float32 sums of squares would cancel); feature 6 is
    constant (no correlation defined); features 7 and 8 are never co-observed except in one row
    (n = 1: undefined); features 0 and 1 are never available at the same client.
    """
    rng = np.random.default_rng(3)
    latent = rng.normal(size=(90, 2))
    x = latent @ rng.normal(size=(2, 9)) + 0.3 * rng.normal(size=(90, 9))
    x[:, 2] = 1e4 + x[:, 2]
    x[:, 6] = 7.0
    x[rng.random(x.shape) < 0.25] = np.nan
    availability = [
        [1, 0, 1, 1, 1, 0, 1, 1, 0],
        [0, 1, 1, 1, 0, 1, 1, 0, 1],
        [0, 1, 1, 0, 1, 1, 1, 1, 1],
    ]
    clients = []
    for k, rows in enumerate((slice(0, 25), slice(25, 55), slice(55, 90))):
        available = np.array(availability[k], dtype=bool)
        values = x[rows].astype(np.float32)
        values[:, ~available] = np.nan
        if k == 2:  # features 7 and 8 share exactly one observed row
            values[:, 8] = np.nan
            values[0, 7] = values[0, 8] = 1.5
        clients.append(ClientData(f"client-{k}", values, available))
    return clients


def _pooled(clients: list[ClientData]) -> pd.DataFrame:
    return pd.DataFrame(np.concatenate([c.values for c in clients]).astype(np.float64))


def _reference_graph(correlation: np.ndarray, top_k: int) -> dict[int, dict[int, float]]:
    """Top-k |corr| neighbours of each feature, written the plain way, weights / global max."""
    features = correlation.shape[0]
    edges = {}
    for i in range(features):
        scored = [
            (abs(correlation[i, j]), j)
            for j in range(features)
            if j != i and np.isfinite(correlation[i, j])
        ]
        scored.sort(key=lambda item: (-item[0], item[1]))
        edges[i] = dict((j, s) for s, j in scored[:top_k])
    largest = max(s for row in edges.values() for s in row.values())
    return {i: {j: s / largest for j, s in row.items()} for i, row in edges.items()}


def test_federated_statistics_equal_pooled_statistics() -> None:
    clients = _clients()
    statistics = federated_statistics(clients)
    pooled = _pooled(clients)
    np.testing.assert_allclose(statistics.standardisation.mean, pooled.mean(), rtol=1e-6)
    np.testing.assert_allclose(statistics.standardisation.std[:6], pooled.std(ddof=0)[:6], 1e-5)
    assert statistics.standardisation.std[6] == 1.0  # constant feature: std 1, not 0
    observed = pooled.notna().to_numpy().astype(np.int64)
    np.testing.assert_array_equal(statistics.counts, observed.T @ observed)
    expected = pooled.corr(min_periods=2).to_numpy().copy()
    np.fill_diagonal(expected, np.nan)
    got = statistics.correlation.copy()
    np.fill_diagonal(got, np.nan)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_allclose(got[~np.isnan(got)], expected[~np.isnan(expected)], atol=1e-5)
    assert np.isnan(got[0, 1]) and np.isnan(got[7, 8]) and np.all(np.isnan(got[6]))


@pytest.mark.parametrize("top_k", [2, 8])
def test_feature_graph_from_federated_statistics_equals_graph_from_pooled_data(top_k) -> None:
    clients = _clients()
    graph = federated_statistics(clients).graph(top_k=top_k)
    reference = _reference_graph(_pooled(clients).corr(min_periods=2).to_numpy(), top_k)
    assert graph.neighbours.shape == (9, top_k)
    for i in range(9):
        got = {
            int(j): float(w)
            for j, w, valid in zip(
                graph.neighbours[i], graph.weights[i], graph.mask[i], strict=True
            )
            if valid
        }
        assert set(got) == set(reference[i])
        for j, weight in reference[i].items():
            assert got[j] == pytest.approx(weight, abs=1e-5)
    assert float(graph.weights.max()) == pytest.approx(1.0)
    assert not graph.mask[6].any()  # the constant feature has no neighbours at all


def test_statistics_travel_as_sums_through_the_seam() -> None:
    clients = _clients()
    recorder = RecordingLayer()
    federated_statistics(clients, channel=Channel([recorder]))
    sent = [m for m in recorder.messages if isinstance(m, RepresentationMessage)]
    assert [m.round for m in sent] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    features = 9
    sizes = {m.round: m.representation.shape for m in sent}
    assert sizes == {  # exchanges 1-2 as WIDE_DIGITS digits each
        0: (1, WIDE_DIGITS * 2 * features),
        1: (1, WIDE_DIGITS * features),
        2: (1, features * (features + 1) + 2 * features * features),
    }
    assert recorder.kinds().count("sum") == 3
    # feature 2 has mean 1e4: its raw sums still travel within the secure backends' range
    assert max(float(m.representation.abs().max()) for m in sent) <= WIRE_LIMIT


def test_feature_graph_keeps_the_strongest_neighbours_and_pads_the_rest() -> None:
    correlation = np.array(
        [
            [1.0, -0.9, 0.3, np.nan],
            [-0.9, 1.0, 0.3, 0.3],
            [0.3, 0.3, 1.0, np.nan],
            [np.nan, 0.3, np.nan, 1.0],
        ]
    )
    graph = FeatureGraph.from_correlation(correlation, top_k=3)
    assert graph.neighbours[0].tolist()[:2] == [1, 2] and graph.mask[0].tolist() == [1, 1, 0]
    assert graph.neighbours[0, 2] == 0 and graph.weights[0, 2] == 0.0  # padding: self, weight 0
    assert graph.neighbours[1].tolist() == [0, 2, 3]  # the tie 0.3 / 0.3 goes to the lower index
    np.testing.assert_allclose(graph.weights[1], [1.0, 1 / 3, 1 / 3], rtol=1e-6)
    assert graph.mask[3].tolist() == [True, False, False]


def test_feature_graph_refuses_inconsistent_tables() -> None:
    with pytest.raises(DataError, match="`weights` must be a float32 array of shape"):
        FeatureGraph(
            neighbours=np.zeros((2, 1), dtype=np.int64),
            weights=np.zeros((2, 2), dtype=np.float32),
            mask=np.zeros((2, 1), dtype=bool),
        )
    with pytest.raises(ConfigError, match=r"`top_k` must be a positive integer\. Found 0\."):
        FeatureGraph.from_correlation(np.eye(3), top_k=0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rounds", 0, "`rounds` must be a positive integer. Found 0."),
        ("local_epochs", 1.5, "`local_epochs` must be a positive integer. Found 1.5."),
        ("batch_size", True, "`batch_size` must be a positive integer. Found True."),
        ("top_k", -1, "`top_k` must be a positive integer. Found -1."),
        (
            "lr",
            0.0,
            r"`lr` must be a positive number, at most 3.40282e\+38 \(float32's largest\). "
            r"Found 0.0.",
        ),
        (
            "lr",
            float("nan"),
            r"`lr` must be a positive number, at most 3.40282e\+38 \(float32's largest\). "
            r"Found nan.",
        ),
        ("block_fraction", 0.0, r"`block_fraction` must be in \(0, 1\]. Found 0.0."),
        ("client_fraction", 1.5, r"`client_fraction` must be in \(0, 1\]. Found 1.5."),
        ("validation_fraction", 1.0, r"`validation_fraction` must be in \(0, 1\). Found 1.0."),
    ],
)
def test_config_refuses_bad_values(field, value, message) -> None:
    with pytest.raises(ConfigError, match=message):
        ImputeConfig(**{field: value})


def test_config_defaults_follow_the_design() -> None:
    config = ImputeConfig()
    assert (config.rounds, config.local_epochs, config.batch_size, config.lr) == (30, 2, 16, 1e-3)
    assert (config.hidden, config.layers, config.top_k, config.block_fraction) == (128, 3, 8, 0.25)


@pytest.mark.parametrize("backend", ["paillier", "ckks"])
def test_statistics_under_paillier_and_ckks_equal_plain_within_the_stated_bound(
    backend: str,
) -> None:
    clients = _clients()
    # Raw sums are far outside both fixed-point ranges (feature 2 has mean 1e4): sent as they
    # are, Paillier (+-32768) and CKKS (+-4096) would refuse them.
    assert max(float(np.abs(client_moments(c)).max()) for c in clients) > 2 * 32768
    aggregator = paillier_aggregator() if backend == "paillier" else CkksAggregator()
    plain = federated_statistics(clients)
    secure = federated_statistics(clients, aggregator=aggregator)
    np.testing.assert_array_equal(secure.counts, plain.counts)
    # Exchanges 1-2: every raw sum within K * WIDE_STEP (module docstring), on both sides.
    count = np.diagonal(plain.counts).astype(np.float64)
    sum_bound = 2 * len(clients) * WIDE_STEP
    mean_gap = np.abs(secure.standardisation.mean - plain.standardisation.mean)
    # Each side also rounds in float64 as it joins its digits and divides by the count: a few
    # units in the last place of the mean (feature 2's, ~1e4, has ulps of 1.8e-12, near
    # sum_bound / count itself), so a sum that differs by far less may move the mean by 2 ulps.
    rounding = 8 * np.spacing(np.abs(plain.standardisation.mean))
    assert np.all(mean_gap <= sum_bound / count + rounding), mean_gap
    variance_gap = np.abs(secure.standardisation.std**2 - plain.standardisation.std**2)
    mean_shift = 2 * np.abs(secure.standardisation.mean) * mean_gap  # from the centring
    assert np.all(variance_gap <= (sum_bound + mean_shift * count) / count + 1e-9), variance_gap
    # Exchange 3: pair sums within K * 2^-17 * M / 256 of values O(n): correlations to 1e-5.
    both = np.isfinite(plain.correlation)
    np.testing.assert_array_equal(np.isfinite(secure.correlation), both)
    np.testing.assert_allclose(secure.correlation[both], plain.correlation[both], atol=1e-5)


def test_wide_sums_carry_any_magnitude_within_the_wire_limit_and_the_stated_step() -> None:
    """What each client sends (its digits, float32 on the wire) and what the coordinator
    recovers from their float32 sum, as the aggregator forms it."""
    rng = np.random.default_rng(0)
    vectors = {
        f"client-{k}": rng.normal(size=50) * 10.0 ** rng.integers(-3, 14, size=50) for k in range(4)
    }
    sent = [torch.from_numpy(wide_digits(v).astype(np.float32)) for v in vectors.values()]
    assert max(float(digits.abs().max()) for digits in sent) <= WIRE_LIMIT
    assert torch.equal(sent[0][50:], torch.round(sent[0][50:]))  # integer digits above the lowest
    total = from_wide_digits(torch.stack(sent).sum(dim=0).numpy())
    exact = np.sum(list(vectors.values()), axis=0)
    np.testing.assert_allclose(total, exact, rtol=1e-15, atol=4 * WIDE_STEP)
    with pytest.raises(DataError, match="exceeds what 7 base-1024 digits carry"):
        wide_digits(np.array([1e15]))


def test_a_client_holds_its_rows_and_sends_only_its_sums() -> None:
    """The statistics through client actors: every request comes from the coordinator, every
    contribution goes to the aggregator, only the aggregator's sums reach the coordinator."""
    clients = _clients()
    recorder = RecordingLayer()
    federated_statistics(clients, channel=Channel([recorder]))
    names = {c.name for c in clients}
    kinds = {message.kind for message in recorder.messages}
    assert kinds == {"compute-request", "representation", "sum-request", "sum", "ticket-key"}
    for message in recorder.messages:
        route = (message.kind, message.sender in names, message.receiver)
        assert route in {
            ("compute-request", False, message.receiver),
            ("representation", True, "aggregator"),
            ("sum-request", False, "aggregator"),
            ("ticket-key", False, "aggregator"),
            ("sum", False, "server"),
        }, route
        if message.kind == "compute-request":
            assert message.sender == "server" and message.receiver in names
