"""Federated sufficient statistics: global standardisation and the feature graph without pooling.

Every client computes its own sums (counts, sums, squares and cross-products over co-observed
pairs) on request (:func:`exchange_contribution`, run inside the client) and the coordinator
learns only their sum (:func:`collect_statistics`, through any :class:`ClientSums`: the
imputation federation's secure sums), so a secure-sum backend can replace the plain aggregator,
and each client's own privacy mechanism (:class:`StatisticsPrivacy`) can clip and noise what it
sends, without changing this code. Three exchanges:

1. per feature: count and sum of the observed values -> global mean;
2. per feature: sum of squared deviations from that mean -> global std (no cancellation);
3. per pair (i, j) over rows where both are observed: n_ij, sum z_i, sum z_j, sum z_i^2,
   sum z_j^2 and sum z_i z_j of the standardised values z -> pairwise-complete Pearson
   correlations (the graph of paper section III-B a).

Ranges. Secure backends take bounded fixed-point values (Paillier +-32768, CKKS +-4096), and
raw sums are not bounded (Ozone's sum of pressure heights is ~4e5 per client, its sums of
squared deviations ~2e8). So every value a client sends has |value| <= :data:`WIRE_LIMIT`
(512, within both backends for up to 64 clients), whatever the data:

- exchanges 1 and 2 (raw units) travel as balanced base-2^10 digits of v * 2^20
  (:func:`wide_digits`, :func:`split_digits`): v * 2^20 = d_0 + 2^10 d_1 + ... + 2^60 d_6 with
  integer d_1..d_6 in [-512, 512] and a real d_0 in [-512, 512]. Digit sums are linear, so the
  receiver rounds the integer digit sums (exact: every backend's error is far below 1/2) and
  recombines them: a raw sum up to ~5e14 (chorizon's sums of squared deviations reach 2e12)
  arrives within K * 2^-35 in raw units (:data:`WIDE_STEP`: float32 rounding of d_0, plus the
  backend's step, Paillier 2^-17 and CKKS 2^-20 per digit, over 2^20), which is tighter than
  float32 transport of the raw sum itself. A feature whose summed squared deviations are below
  2 K * 2^-35 (a std below ~1e-5 raw units) is treated as constant;
- exchange 3's values are standardised, so each client's |value| is at most the largest
  feature count M (|sum z_i z_j| <= sqrt(sum z_i^2 sum z_j^2) <= M, and so on); M is public
  after exchange 1, and clients send value * 256 / M, which the receiver scales back. The
  precision loss: float32 (relative 6e-8) plus the backend's absolute step on values <= 256,
  at most K * 2^-17 * M / 256 per pair sum (Paillier; CKKS 8x less), i.e. a relative
  K * 2^-17 * M / (256 n_ij) on a pair's sums: about 3e-7 on Ozone.

Clients compute in float64; the seam carries float32. Counts are exact up to 2^24 rows.

Privacy. With a :class:`StatisticsPrivacy` mechanism inside each client (its own noise
generator; the mechanism lives in ``protocols.dp_statistics``) every exchange becomes one
clipped, noised release per client (this module only hands it each row's contribution, and the
mechanism clips and noises; the coordinator knows only the public :class:`ReleaseTerms`):
values are first clipped to the mechanism's public :class:`FeatureRanges` and mapped to u in
[-1, 1] (exchange 1: counts and sums of u; exchange 2: counts and squared deviations of u, each
exchange with its own counts because record clipping down-weights a record's counts with its
sums), or standardised with the released mean and std and clipped to +-``standard_bound``
(exchange 3). Exchange 3 then releases only N = O'O and C = Z'Z and estimates
corr_ij = (C_ij / N_ij) / sqrt(v_i v_j), v_i = C_ii / N_ii, taking pairwise means and
variances from the global standardisation (right when availability is random) instead of
releasing them: a record's contribution is about half as long, so the same noise costs half
the signal. The server repairs what noise can break: counts are floored at 0, means kept
inside the ranges, variances floored at twice their own noise std (the sum's noise std over
the count: a smaller estimate cannot be told from noise, and an underestimated std would blow
the standardised values up), correlations whose noisy count is below 2 or whose noisy
variance is not positive are left undefined (NaN), the rest clipped to [-1, 1]. The graph only
ranks and weights neighbours by |correlation| (nothing is inverted or factorised), so the
matrix need not be positive semi-definite.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from secure_vfl.data.imputation import ClientData
from secure_vfl.errors import DataError, ProtocolError
from secure_vfl.models.feature_graph import FeatureGraph

logger = logging.getLogger(__name__)

SERVER = "server"
"""The coordinator: the party that receives the federated sums, builds the graph and averages
models."""

EXCHANGES: tuple[str, ...] = ("moments", "deviations", "pairs")
"""The three statistics exchanges, in order (module docstring)."""

WIRE_LIMIT = 512.0
"""Every value a client sends through the aggregator has magnitude <= this."""

DIGIT_BASE = 1024.0
"""The base of :func:`split_digits`: balanced digits lie in [-512, 512]."""

WIDE_DIGITS = 7
"""Digits per wide value: magnitudes up to ~5.6e14 (512 * 1024^6 / 2^20)."""

WIDE_FRACTION_BITS = 20
"""Wide values are sent as digits of v * 2^20: 20 more fraction bits than the lowest digit has."""

WIDE_CAPACITY = WIRE_LIMIT * DIGIT_BASE ** (WIDE_DIGITS - 1) / 2.0**WIDE_FRACTION_BITS
"""The largest magnitude a wide value carries (~5.6e14)."""

WIDE_STEP = 2.0**-35
"""Each client's part of a sum of :func:`wide_digits` arrives within this (raw units)."""

_PAIR_SCALE = 256.0  # exchange 3's values are sent in [-256, 256] (half of WIRE_LIMIT: noise room)

# A pair's variance below this share of its second moment (or, in standardised units where
# variances are O(1), below this absolute value) is transport rounding, not signal.
_VARIANCE_FLOOR = 1e-6
# Under DP, a std below this share of the feature's public half-range is noise, not signal.
_PRIVATE_STD_FLOOR = 1e-3
# Under DP, a variance is floored at this many std of its own noise: a smaller estimate cannot
# be told from noise, and an underestimated std blows the standardised values up, while an
# overestimated one only compresses them.
_NOISE_FLOOR = 2.0


@dataclass(frozen=True)
class Standardisation:
    """Global per-feature mean and std (population std, ddof 0) of the pooled training entries.

    A feature never observed anywhere gets mean 0 and std 1; a constant feature gets std 1,
    and ``constant`` (bool, one per feature; None: no feature known to be one) marks it, so
    that its imputed values are its mean exactly, whatever a model makes of it.
    """

    mean: np.ndarray
    std: np.ndarray
    constant: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.mean.shape != self.std.shape or self.mean.ndim != 1:
            raise DataError(
                f"`mean` and `std` must be vectors of one shape. "
                f"Found {self.mean.shape} and {self.std.shape}."
            )
        if not np.all(self.std > 0):
            raise DataError(f"`std` must be > 0 everywhere. Found minimum {self.std.min()}.")
        if self.constant is not None and (
            self.constant.dtype != np.bool_ or self.constant.shape != self.mean.shape
        ):
            raise DataError(
                f"`constant` must be bool of shape {self.mean.shape}. Found "
                f"{self.constant.dtype} of shape {self.constant.shape}."
            )

    def standardise(self, values: np.ndarray) -> np.ndarray:
        """(x - mean) / std as float32; NaN stays NaN."""
        return ((values - self.mean) / self.std).astype(np.float32)

    def destandardise(self, z: np.ndarray) -> np.ndarray:
        """z * std + mean as float32 (back to the raw scale); a constant feature's mean."""
        raw = z * self.std + self.mean
        if self.constant is not None:
            raw = np.where(self.constant, self.mean, raw)
        return raw.astype(np.float32)


@dataclass(frozen=True)
class FeatureRanges:
    """Public per-feature ranges [lower, upper] that values are clipped to before a private
    release (as a bounded mean needs declared bounds); agreed by the federation, not measured."""

    lower: np.ndarray
    upper: np.ndarray
    names: tuple[str, ...] = field(default=(), compare=False)
    """The features' names, for messages (empty: features are named by their place)."""

    def __post_init__(self) -> None:
        if self.lower.shape != self.upper.shape or self.lower.ndim != 1:
            raise DataError(
                f"`lower` and `upper` must be vectors of one shape. "
                f"Found {self.lower.shape} and {self.upper.shape}."
            )
        if not (np.all(np.isfinite(self.lower)) and np.all(np.isfinite(self.upper))):
            raise DataError("feature ranges must be finite numbers; found NaN or inf.")
        if not np.all(self.upper > self.lower):
            j = int(np.argmax(~(self.upper > self.lower)))
            raise DataError(
                f"every feature range needs lower < upper. Found [{self.lower[j]}, "
                f"{self.upper[j]}] for feature {j}."
            )

    @property
    def centre(self) -> np.ndarray:
        return (self.lower + self.upper) / 2

    @property
    def half_width(self) -> np.ndarray:
        return (self.upper - self.lower) / 2

    def scaled(self, values: np.ndarray) -> np.ndarray:
        """Values clipped to their range and mapped affinely onto [-1, 1] (NaN stays NaN)."""
        return np.clip((values - self.centre) / self.half_width, -1.0, 1.0)

    def outside(self, values: np.ndarray) -> list[str]:
        """For each feature with observed ``values`` (rows x features, NaN: unobserved) outside
        its range, what they are: how many, where they lie, and the range."""
        found = []
        with np.errstate(invalid="ignore"):
            beyond = (values < self.lower) | (values > self.upper)
        for j in np.flatnonzero(beyond.any(axis=0)):
            column = values[:, j][~np.isnan(values[:, j])]
            name = self.names[j] if j < len(self.names) else f"feature {j}"
            found.append(
                f"{name}: {int(beyond[:, j].sum())} of {column.size} values, in "
                f"[{column.min():g}, {column.max():g}] against [{self.lower[j]:g}, "
                f"{self.upper[j]:g}]"
            )
        return found


class StatisticsPrivacy(Protocol):
    """A client-side mechanism on the statistics: what a client releases instead of exact sums.

    ``ranges`` are the public feature ranges of exchanges 1-2, ``standard_bound`` the |z| at
    which exchange 3 clips standardised values, ``share_std`` the noise each client adds (the
    server floors noisy variances at the noise level of the sum, ``share_std * sqrt(K)``).
    :meth:`privatise` receives one client's per-row contributions (n, d) to an exchange
    (``"moments"``, ``"deviations"`` or ``"pairs"``) and returns the (d,) vector the client
    sends (e.g. its rows clipped, summed and noised); it is called once per client and
    exchange, in order. The pair exchange's rows take n x F(F+1) floats per client (40 MB for
    500 rows of 100 features). Each client holds its own mechanism (its own noise generator).
    """

    ranges: FeatureRanges
    standard_bound: float

    @property
    def share_std(self) -> float:
        """The std of the noise each client adds to every coordinate it sends (public)."""
        ...

    def privatise(self, client: str, exchange: str, rows: np.ndarray) -> np.ndarray: ...


StatisticsPrivacyFactory = Callable[[str], StatisticsPrivacy]
"""Makes the statistics mechanism of the client it names: called once per client as the
federation is built, and the mechanism is installed inside that client."""


@dataclass(frozen=True, eq=False)
class ReleaseTerms:
    """The public terms of the clients' private releases, the same at every client and all the
    coordinator knows of their mechanisms: the feature ranges values are clipped to, the |z|
    at which exchange 3 clips, and the std of the noise each client adds."""

    ranges: FeatureRanges
    standard_bound: float
    share_std: float

    @classmethod
    def of(cls, mechanism: StatisticsPrivacy) -> ReleaseTerms:
        """The public terms of ``mechanism`` (copied: no reference to it is kept)."""
        return cls(
            ranges=FeatureRanges(
                lower=mechanism.ranges.lower.copy(), upper=mechanism.ranges.upper.copy()
            ),
            standard_bound=float(mechanism.standard_bound),
            share_std=float(mechanism.share_std),
        )

    def matches(self, other: ReleaseTerms) -> bool:
        """Whether ``other`` states the same terms (every client must release under one)."""
        return (
            np.array_equal(self.ranges.lower, other.ranges.lower)
            and np.array_equal(self.ranges.upper, other.ranges.upper)
            and (self.standard_bound, self.share_std) == (other.standard_bound, other.share_std)
        )


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


def split_digits(values: np.ndarray, digits: int = WIDE_DIGITS) -> np.ndarray:
    """Balanced base-1024 digits of ``values``, lowest first, concatenated: (digits * len,).

    The lowest digit keeps the fraction (real, in [-512, 512]); the others are integers in
    [-512, 512]. Refuses magnitudes that ``digits`` digits cannot hold.
    """
    values = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(values)):
        raise DataError("a statistic to send is not finite (NaN or inf in the client's data?).")
    parts = []
    rest = values
    for _ in range(digits):
        high = np.rint(rest / DIGIT_BASE)
        parts.append(rest - high * DIGIT_BASE)
        rest = high
    if np.any(rest != 0):
        largest = float(np.abs(values).max())
        capacity = WIRE_LIMIT * DIGIT_BASE ** (digits - 1)
        raise DataError(
            f"a statistic of magnitude {largest:.6g} exceeds what {digits} base-"
            f"{DIGIT_BASE:g} digits carry (~{capacity:.3g}); rescale that feature's units, or "
            "add less noise to the statistics (a --dp-statistics SIGMA x CLIP that large swamps "
            "them)."
        )
    return np.concatenate(parts)


def join_digits(digit_sums: np.ndarray, digits: int = WIDE_DIGITS) -> np.ndarray:
    """Recombine summed digits: integer digit sums are rounded (removing the backend's error)."""
    parts = np.asarray(digit_sums, dtype=np.float64).reshape(digits, -1)
    total = parts[0].copy()
    for i in range(1, digits):
        total += np.rint(parts[i]) * DIGIT_BASE**i
    return total


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


def _pair_layout(z: np.ndarray, observed: np.ndarray) -> np.ndarray:
    """Exchange 3's statistics of rows z (standardised, 0 where unobserved), flattened."""
    upper = np.triu_indices(z.shape[1])
    return np.concatenate(
        [
            (observed.T @ observed)[upper],
            (z.T @ z)[upper],
            (z.T @ observed).ravel(),
            ((z * z).T @ observed).ravel(),
        ]
    )


def client_pair_statistics(client: ClientData, standardisation: Standardisation) -> np.ndarray:
    """Exchange 3: co-observed pair statistics of the standardised values, flattened.

    With O the observed indicator and Z the standardised values (0 where unobserved):
    N = O'O and C = Z'Z (upper triangles, symmetric), S = Z'O (S[i, j] = sum of z_i over rows
    where j is observed too) and Q = (Z*Z)'O, in full.
    """
    return _pair_layout(*_standardised(client, standardisation))


def _standardised(client: ClientData, standardisation: Standardisation) -> tuple[np.ndarray, ...]:
    values, observed = _observed_values(client)
    return (values - standardisation.mean) / standardisation.std * observed, observed


def wide_digits(values: np.ndarray) -> np.ndarray:
    """What a client sends for unbounded float64 ``values``: the digits of values * 2^20, each
    within :data:`WIRE_LIMIT` (:func:`split_digits`)."""
    return split_digits(np.asarray(values, dtype=np.float64) * float(2**WIDE_FRACTION_BITS))


def from_wide_digits(digit_sums: np.ndarray) -> np.ndarray:
    """The sum of the clients' values from the sum of their :func:`wide_digits`; each client's
    part arrives within :data:`WIDE_STEP`."""
    summed = np.asarray(digit_sums, dtype=np.float64)
    return join_digits(summed) / float(2**WIDE_FRACTION_BITS)


def wide_width(values: int) -> int:
    """How many digits :func:`wide_digits` sends for ``values`` values."""
    return WIDE_DIGITS * values


def _expect_arguments(client: ClientData, exchange: str, arguments: np.ndarray, count: int) -> None:
    if arguments.shape != (count,):
        raise ProtocolError(
            f"{client.name}: {count} arguments for the {exchange} exchange expected, found "
            f"shape {arguments.shape}."
        )


def _scaled(client: ClientData, privacy: StatisticsPrivacy) -> tuple[np.ndarray, np.ndarray]:
    """Values clipped to the public ranges and mapped to u in [-1, 1] (0 where unobserved),
    and the observed indicator (exchanges 1-2 under privacy)."""
    u = np.where(client.observed, privacy.ranges.scaled(client.values.astype(np.float64)), 0.0)
    return u, client.observed.astype(np.float64)


class FeatureScaleError(DataError):
    """A client's statistic of one feature is beyond what a wide value carries (the feature's
    values are too large); ``feature`` is the feature's index in the task's features, which
    :meth:`naming` turns into its name."""

    def __init__(self, client: str, feature: int, largest: float, exchange: str) -> None:
        self.client, self.feature, self.largest, self.exchange = client, feature, largest, exchange
        super().__init__(self._text(f"feature {feature} (0-based, of the task's features)"))

    def _text(self, feature: str) -> str:
        return (
            f"client {self.client!r}: {feature} holds values up to {self.largest:.3g}, too "
            f"large for the statistics' sums (its {self.exchange} statistic exceeds "
            f"{WIDE_CAPACITY:.3g}); rescale that feature's units (e.g. thousands) and run again."
        )

    def naming(self, features: Sequence[str]) -> DataError:
        """The same refusal naming the feature by its name in ``features``."""
        return DataError(self._text(f"feature {features[self.feature]!r}"))


def _wide_statistic(client: ClientData, exchange: str, values: np.ndarray) -> np.ndarray:
    """:func:`wide_digits` of a per-feature statistic (``values``: one or more blocks of one
    value per feature); one too large to carry is refused naming its feature
    (:class:`FeatureScaleError`)."""
    try:
        return wide_digits(values)
    except DataError:
        if not np.all(np.isfinite(values)):
            raise
        features = client.values.shape[1]
        feature = int(np.argmax(np.abs(values))) % features
        largest = float(np.nanmax(np.abs(client.values[:, feature])))
        raise FeatureScaleError(client.name, feature, largest, exchange) from None


def exchange_contribution(
    client: ClientData,
    exchange: str,
    arguments: np.ndarray,
    privacy: StatisticsPrivacy | None,
) -> np.ndarray:
    """What ``client`` sends for one statistics exchange (:data:`EXCHANGES`), computed on its
    own rows with its own ``privacy`` mechanism (if any) and the coordinator's public
    ``arguments``: none for ``"moments"``; the released mean (of u in [-1, 1] under privacy)
    for ``"deviations"``; the released mean, std and the scale of the values for ``"pairs"``.

    Exchanges 1-2 go as :func:`wide_digits`, exchange 3 times the scale (module docstring).
    """
    features = client.values.shape[1]
    if exchange == "moments":
        _expect_arguments(client, exchange, arguments, 0)
        if privacy is None:
            return _wide_statistic(client, exchange, client_moments(client))
        outside = privacy.ranges.outside(client.values.astype(np.float64))
        if outside:  # told to this client's own operator only: nothing of it is sent
            logger.warning(
                "%s: observed values outside the declared feature ranges are clipped to them, "
                "which biases the private statistics and the imputation; check the ranges "
                "(--feature-ranges). %s.",
                client.name,
                "; ".join(outside),
            )
        u, observed = _scaled(client, privacy)
        rows = np.concatenate([observed, u], axis=1)
        return wide_digits(privacy.privatise(client.name, "moments", rows))
    if exchange == "deviations":
        _expect_arguments(client, exchange, arguments, features)
        if privacy is None:
            return _wide_statistic(client, exchange, client_deviations(client, arguments))
        # Each exchange carries its own counts: clipping scales a record's counts with its
        # sums, so the counts of exchange 1 would not match exchange 2's down-weighted records.
        u, observed = _scaled(client, privacy)
        rows = np.concatenate([observed, ((u - arguments) * observed) ** 2], axis=1)
        return wide_digits(privacy.privatise(client.name, "deviations", rows))
    if exchange == "pairs":
        _expect_arguments(client, exchange, arguments, 2 * features + 1)
        std, scale = arguments[features : 2 * features], float(arguments[-1])
        if not (np.all(std > 0) and scale > 0):
            raise ProtocolError(
                f"{client.name}: a std > 0 for every feature and a scale > 0 expected for the "
                f"pairs exchange, found minimum std {float(std.min())} and scale {scale}."
            )
        standardisation = Standardisation(mean=arguments[:features], std=std)
        if privacy is None:
            return client_pair_statistics(client, standardisation) * scale
        bound = float(privacy.standard_bound)
        z, observed = _standardised(client, standardisation)
        z = np.clip(z, -bound, bound)
        upper = np.triu_indices(features)
        rows = np.concatenate(
            [
                np.einsum("ri,rj->rij", observed, observed)[:, upper[0], upper[1]],
                np.einsum("ri,rj->rij", z, z)[:, upper[0], upper[1]],
            ],
            axis=1,
        )
        return privacy.privatise(client.name, "pairs", rows) * scale
    raise ProtocolError(f"{client.name}: an exchange in {EXCHANGES} expected, found {exchange!r}.")


# -- the coordinator's side: it asks for the exchanges and derives the statistics from sums ----


class ClientSums(Protocol):
    """The coordinator's side of a federation: it asks every client to run a local computation
    and receives only the sum of their contributions (``width`` values, refused otherwise).
    ``features`` is the public schema width, ``release_terms`` the public terms of the clients'
    private releases (None: exact statistics)."""

    features: int
    release_terms: ReleaseTerms | None

    @property
    def clients(self) -> int:
        """How many clients contribute to every sum."""
        ...

    def sum(
        self, computation: str, arguments: np.ndarray, *, width: int, round: int, tag: str
    ) -> np.ndarray: ...


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
        & (var_i > _VARIANCE_FLOOR * np.maximum(second_i, 1.0))
        & (var_j > _VARIANCE_FLOOR * np.maximum(second_j, 1.0))
    )
    return np.where(valid, np.clip(correlation, -1.0, 1.0), np.nan)


_NO_ARGUMENTS = np.zeros(0)


def _exact_standardisation(sums: ClientSums, tag: str) -> tuple[Standardisation, np.ndarray]:
    features = sums.features
    moments = from_wide_digits(
        sums.sum("moments", _NO_ARGUMENTS, width=wide_width(2 * features), round=0, tag=tag)
    )
    count, total = moments[:features], moments[features:]
    mean = np.where(count > 0, total / np.maximum(count, 1), 0.0)
    squares = from_wide_digits(
        sums.sum("deviations", mean, width=wide_width(features), round=1, tag=tag)
    )
    # Below the transport's precision, a sum of squared deviations is 0: a constant feature.
    spread = (count > 0) & (squares > 2 * sums.clients * WIDE_STEP)
    std = np.where(spread, np.sqrt(np.maximum(squares, 0.0) / np.maximum(count, 1)), 1.0)
    return Standardisation(mean=mean, std=std, constant=(count > 0) & ~spread), count


def _private_standardisation(
    sums: ClientSums, terms: ReleaseTerms, tag: str
) -> tuple[Standardisation, np.ndarray]:
    """Exchanges 1-2 on values clipped to the public ranges and mapped to u in [-1, 1]."""
    ranges = terms.ranges
    features = sums.features
    moments = from_wide_digits(
        sums.sum("moments", _NO_ARGUMENTS, width=wide_width(2 * features), round=0, tag=tag)
    )
    count = np.maximum(moments[:features], 0.0)
    mean_u = np.clip(np.where(count >= 1, moments[features:] / np.maximum(count, 1), 0.0), -1, 1)
    deviations = from_wide_digits(
        sums.sum("deviations", mean_u, width=wide_width(2 * features), round=1, tag=tag)
    )
    spread_count = np.maximum(deviations[:features], 0.0)
    var_u = np.where(spread_count >= 1, deviations[features:] / np.maximum(spread_count, 1), 1.0)
    noise = terms.share_std * np.sqrt(sums.clients)  # the std of the noise in each sum
    floor = np.maximum(_PRIVATE_STD_FLOOR**2, _NOISE_FLOOR * noise / np.maximum(spread_count, 1))
    std_u = np.sqrt(np.clip(var_u, np.minimum(floor, 4.0), 4.0))
    mean = ranges.centre + ranges.half_width * mean_u
    return Standardisation(mean=mean, std=ranges.half_width * std_u), count


STATISTICS_ROUNDS = 3
"""The message rounds :func:`collect_statistics` takes (0-2): a driver's later exchanges on the
same federation are numbered from here (an aggregation server never goes back to a round)."""


def collect_statistics(sums: ClientSums, *, tag: str = "statistics") -> FederatedStatistics:
    """The coordinator's program: global standardisation and pairwise correlations from the
    clients' summed statistics, three exchanges (rounds 0-2, :data:`STATISTICS_ROUNDS`) under
    ``tag``.

    With ``sums.release_terms`` every exchange is a clipped, noised release per client (see the
    module docstring); without, the statistics are exact up to the stated precision.
    """
    terms = sums.release_terms
    if terms is None:
        standardisation, count = _exact_standardisation(sums, tag)
    else:
        standardisation, count = _private_standardisation(sums, terms, tag)

    # Public after exchange 1: bounds every client's exchange-3 value (module docstring).
    largest_count = max(1.0, float(count.max()) if count.size else 1.0)
    if terms is None:
        n, correlation = _exact_pairs(sums, standardisation, largest_count, tag)
    else:
        n, correlation = _private_pairs(sums, standardisation, largest_count, terms, tag)
    return FederatedStatistics(
        counts=np.rint(np.maximum(n, 0.0)).astype(np.int64),
        correlation=correlation,
        standardisation=standardisation,
    )


def _pair_arguments(standardisation: Standardisation, scale: float) -> np.ndarray:
    return np.concatenate([standardisation.mean, standardisation.std, [scale]])


def _exact_pairs(
    sums: ClientSums, standardisation: Standardisation, largest_count: float, tag: str
) -> tuple[np.ndarray, np.ndarray]:
    """Exchange 3: pairwise-complete sums, each client's values sent times 256 / M."""
    scale = _PAIR_SCALE / largest_count
    features = len(standardisation.mean)
    triangle = features * (features + 1) // 2
    square = features * features
    summed = sums.sum(
        "pairs",
        _pair_arguments(standardisation, scale),
        width=2 * triangle + 2 * square,
        round=2,
        tag=tag,
    )
    pairs = summed.astype(np.float64) / scale
    n = _symmetric(pairs[:triangle], features)
    cross = _symmetric(pairs[triangle : 2 * triangle], features)
    sums_i = pairs[2 * triangle : 2 * triangle + square].reshape(features, features)
    seconds = pairs[2 * triangle + square :].reshape(features, features)
    return n, pairwise_correlation(n, cross, sums_i, seconds)


def _private_pairs(
    sums: ClientSums,
    standardisation: Standardisation,
    largest_count: float,
    terms: ReleaseTerms,
    tag: str,
) -> tuple[np.ndarray, np.ndarray]:
    """Exchange 3 under DP: only N = O'O and C = Z'Z of the (released) standardised values,
    clipped to +-b, are released, and corr_ij = (C_ij / N_ij) / sqrt(v_i v_j) with v_i =
    C_ii / N_ii. Pairwise means and variances are taken from the global standardisation
    (exact when availability is random) rather than released: a record's contribution is then
    about half as long (no S and Q terms), so the same noise costs half as much signal."""
    bound = float(terms.standard_bound)
    scale = _PAIR_SCALE / (largest_count * max(1.0, bound * bound))
    features = len(standardisation.mean)
    triangle = features * (features + 1) // 2
    summed = sums.sum(
        "pairs",
        _pair_arguments(standardisation, scale),
        width=2 * triangle,
        round=2,
        tag=tag,
    )
    pairs = summed.astype(np.float64) / scale
    n = _symmetric(pairs[:triangle], features)
    cross = _symmetric(pairs[triangle:], features)
    with np.errstate(divide="ignore", invalid="ignore"):
        covariance = cross / np.where(n > 0, n, np.nan)
        variance = np.diagonal(covariance)
        positive = variance > _VARIANCE_FLOOR
        noise = terms.share_std * np.sqrt(sums.clients)
        floor = _NOISE_FLOOR * noise / np.diagonal(n)
        variance = np.maximum(variance, floor)
        correlation = covariance / np.sqrt(np.outer(variance, variance))
    valid = (n >= 2) & positive[:, None] & positive[None, :]
    return n, np.where(valid, np.clip(correlation, -1.0, 1.0), np.nan)
