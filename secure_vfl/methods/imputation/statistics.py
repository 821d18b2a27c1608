"""Federated sufficient statistics: global standardisation and the feature graph without pooling.

Every client sends plain sums (counts, sums, squares and cross-products over co-observed pairs)
and the sums are formed only through :func:`sum_vectors`, so a secure-sum backend or a DP layer
can replace the plain aggregator without changing this code. Three short exchanges:

1. per feature: count and sum of the observed values -> global mean;
2. per feature: sum of squared deviations from that mean -> global std (no cancellation);
3. per pair (i, j) over rows where both are observed: n_ij, sum z_i, sum z_j, sum z_i^2,
   sum z_j^2 and sum z_i z_j of the standardised values z -> pairwise-complete Pearson
   correlations (the graph of paper section III-B a).

Clients compute in float64; the seam carries float32. Sending centred and scaled values keeps
every transported number O(n) in standardised units, so the float32 rounding of a sum (relative
6e-8) moves a correlation by about 1e-7 even for features whose mean is far from zero, where raw
sums of squares would cancel catastrophically. Counts are exact up to 2^24 rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from secure_vfl.data.imputation import ClientData
from secure_vfl.errors import DataError
from secure_vfl.federation.aggregator import Aggregator, PlainAggregator, sum_vectors
from secure_vfl.federation.channel import Channel
from secure_vfl.models.feature_graph import FeatureGraph

SERVER = "server"
"""The party that receives the federated sums, builds the graph and averages models."""

# A pair's variance below this share of its second moment is float32 rounding, not signal.
_RELATIVE_VARIANCE_FLOOR = 1e-6


@dataclass(frozen=True)
class Standardisation:
    """Global per-feature mean and std (population std, ddof 0) of the pooled training entries.

    A feature never observed anywhere gets mean 0 and std 1; a constant feature gets std 1.
    """

    mean: np.ndarray
    std: np.ndarray

    def __post_init__(self) -> None:
        if self.mean.shape != self.std.shape or self.mean.ndim != 1:
            raise DataError(
                f"`mean` and `std` must be vectors of one shape. "
                f"Found {self.mean.shape} and {self.std.shape}."
            )
        if not np.all(self.std > 0):
            raise DataError(f"`std` must be > 0 everywhere. Found minimum {self.std.min()}.")

    def standardise(self, values: np.ndarray) -> np.ndarray:
        """(x - mean) / std as float32; NaN stays NaN."""
        return ((values - self.mean) / self.std).astype(np.float32)

    def destandardise(self, z: np.ndarray) -> np.ndarray:
        """z * std + mean as float32 (back to the raw scale)."""
        return (z * self.std + self.mean).astype(np.float32)


@dataclass(frozen=True)
class FederatedStatistics:
    """What the server derives from the summed statistics.

    ``counts`` (F, F) int64: rows where both features are observed (diagonal: per feature);
    ``correlation`` (F, F) float64: pairwise-complete Pearson correlation, NaN where a pair has
    fewer than 2 co-observed rows or no variance (as pandas' ``corr(min_periods=2)``).
    """

    counts: np.ndarray
    correlation: np.ndarray
    standardisation: Standardisation

    def graph(self, *, top_k: int) -> FeatureGraph:
        """The global feature graph: top-k neighbours by |corr|, weights |corr| / max |corr|."""
        return FeatureGraph.from_correlation(self.correlation, top_k=top_k)


def _check_clients(clients: Sequence[ClientData]) -> int:
    if not clients:
        raise DataError("federated statistics need at least one client, found none.")
    widths = {c.values.shape[1] for c in clients}
    if len(widths) != 1:
        raise DataError(f"every client must have the same F columns. Found widths {widths}.")
    names = [c.name for c in clients]
    if len(set(names)) != len(names):
        raise DataError(f"client names must be distinct. Found {names}.")
    return widths.pop()


def _observed_values(client: ClientData) -> tuple[np.ndarray, np.ndarray]:
    """Float64 values with 0 where not observed, and the observed indicator as float64."""
    observed = client.observed
    values = np.where(observed, client.values.astype(np.float64), 0.0)
    return values, observed.astype(np.float64)


def client_moments(client: ClientData) -> np.ndarray:
    """Exchange 1: [count (F), sum (F)] of the client's observed values."""
    values, observed = _observed_values(client)
    return np.concatenate([observed.sum(axis=0), values.sum(axis=0)])


def client_deviations(client: ClientData, mean: np.ndarray) -> np.ndarray:
    """Exchange 2: per feature, the sum of squared deviations from the global ``mean``."""
    values, observed = _observed_values(client)
    return (((values - mean) * observed) ** 2).sum(axis=0)


def client_pair_statistics(client: ClientData, standardisation: Standardisation) -> np.ndarray:
    """Exchange 3: co-observed pair statistics of the standardised values, flattened.

    With O the observed indicator and Z the standardised values (0 where unobserved):
    N = O'O and C = Z'Z (upper triangles, symmetric), S = Z'O (S[i, j] = sum of z_i over rows
    where j is observed too) and Q = (Z*Z)'O, in full.
    """
    values, observed = _observed_values(client)
    z = (values - standardisation.mean) / standardisation.std * observed
    upper = np.triu_indices(z.shape[1])
    return np.concatenate(
        [
            (observed.T @ observed)[upper],
            (z.T @ z)[upper],
            (z.T @ observed).ravel(),
            ((z * z).T @ observed).ravel(),
        ]
    )


def _federated_sum(
    vectors: dict[str, np.ndarray],
    *,
    aggregator: Aggregator,
    channel: Channel,
    receiver: str,
    round: int,
    tag: str,
) -> np.ndarray:
    contributions = {name: torch.from_numpy(v.astype(np.float32)) for name, v in vectors.items()}
    total = sum_vectors(aggregator, channel, contributions, receiver=receiver, round=round, tag=tag)
    return total.numpy().astype(np.float64)


def _symmetric(upper_values: np.ndarray, features: int) -> np.ndarray:
    matrix = np.zeros((features, features))
    matrix[np.triu_indices(features)] = upper_values
    return matrix + np.triu(matrix, 1).T


def pairwise_correlation(
    n: np.ndarray, cross: np.ndarray, sums: np.ndarray, squares: np.ndarray
) -> np.ndarray:
    """Pearson correlation of every pair from its co-observed sums (NaN where undefined).

    ``sums[i, j]`` / ``squares[i, j]``: sum of z_i / z_i^2 over rows where j is observed too.
    """
    with np.errstate(divide="ignore", invalid="ignore"):
        count = np.where(n > 0, n, np.nan)
        mean_i = sums / count
        mean_j = sums.T / count
        second_i = squares / count
        second_j = squares.T / count
        var_i = second_i - mean_i**2
        var_j = second_j - mean_j**2
        covariance = cross / count - mean_i * mean_j
        correlation = covariance / np.sqrt(var_i * var_j)
    valid = (
        (n >= 2)
        & (var_i > _RELATIVE_VARIANCE_FLOOR * second_i)
        & (var_j > _RELATIVE_VARIANCE_FLOOR * second_j)
    )
    return np.where(valid, np.clip(correlation, -1.0, 1.0), np.nan)


def federated_statistics(
    clients: Sequence[ClientData],
    *,
    aggregator: Aggregator | None = None,
    channel: Channel | None = None,
    receiver: str = SERVER,
    tag: str = "statistics",
) -> FederatedStatistics:
    """Global standardisation and pairwise correlations from the clients' summed statistics."""
    features = _check_clients(clients)
    aggregator = aggregator if aggregator is not None else PlainAggregator()
    channel = channel if channel is not None else Channel()
    route = partial(
        _federated_sum, aggregator=aggregator, channel=channel, receiver=receiver, tag=tag
    )

    moments = route({c.name: client_moments(c) for c in clients}, round=0)
    count, total = moments[:features], moments[features:]
    mean = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    squares = route({c.name: client_deviations(c, mean) for c in clients}, round=1)
    std = np.sqrt(np.where(count > 0, squares / np.maximum(count, 1), 0.0))
    std = np.where(std > 0, std, 1.0)
    standardisation = Standardisation(mean=mean, std=std)

    pairs = route({c.name: client_pair_statistics(c, standardisation) for c in clients}, round=2)
    triangle = features * (features + 1) // 2
    square = features * features
    n = _symmetric(pairs[:triangle], features)
    cross = _symmetric(pairs[triangle : 2 * triangle], features)
    sums = pairs[2 * triangle : 2 * triangle + square].reshape(features, features)
    seconds = pairs[2 * triangle + square :].reshape(features, features)
    return FederatedStatistics(
        counts=np.rint(n).astype(np.int64),
        correlation=pairwise_correlation(n, cross, sums, seconds),
        standardisation=standardisation,
    )
