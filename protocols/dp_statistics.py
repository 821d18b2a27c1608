"""Differentially private graph statistics for FedHF-Impute: clipped records, distributed noise.

FedHF-Impute builds its feature graph from pairwise-complete sufficient statistics (paper 002,
section III-B a) and names differentially private graph construction as future work (sections
V-VI). :class:`StatisticsNoise` is that mechanism; it implements the core's
:class:`~secure_vfl.methods.imputation.statistics.StatisticsPrivacy` hook, so the core never
imports this module. Each of the three statistics exchanges (moments, deviations, pairs) is one
Gaussian mechanism (Dwork & Roth 2014, Thm A.1) per client:

- Input clipping (done by the core, with this mechanism's public parameters): in exchanges 1-2
  each value is clipped to the federation's declared :class:`FeatureRanges` and mapped onto
  [-1, 1]; in exchange 3 the standardised values are clipped to +-``standard_bound`` std.
- Record clipping: each row's whole contribution vector to an exchange is scaled down to L2 norm
  ``clip`` (C) if longer, so adding or removing one record moves its client's sum by at most C
  (add/remove adjacency, Opacus' convention): the L2 sensitivity is C. A scaled row counts as a
  fractional row (its counts shrink with its sums), so the statistics stay a weighted, valid set.
- Noise on the sum, distributed: each of ``shares`` (K >= 2) clients adds
  N(0, (sigma C)^2 / (K - 1)) per coordinate, so any K - 1 of the shares carry N(0, (sigma C)^2).
  With secure aggregation (masks, Paillier, CKKS) the server sees only the sum, and every client
  sees the released sum too and knows its own share: what either cannot subtract is the noise of
  at least K - 1 clients, so every client's records are protected by the full noise against the
  server and against any one other client, while each client adds 1/(K - 1) of its variance: the
  released sum's error is K / (K - 1) times a central Gaussian mechanism's variance, not K times.
  (Shares of 1/K each would leave a client that subtracts its own share sigma sqrt((K - 1) / K):
  epsilon 4.70 where 3.98 was claimed, at K = 4.) Without secure aggregation the server sees each
  client's vector, so ``shares`` must be 1 (every client adds all the noise: local DP, K times
  the variance in the sum).
- Accounting: one :class:`~protocols.dp.GaussianRelease` (``kind="statistics"``, noise
  multiplier sigma, sample rate 1: the statistics cover every training row, no subsampling) per
  client and exchange, priced per client by its own :class:`~protocols.dp.PrivacyAccountant`
  (:class:`ClientStatisticsNoise` makes each client's mechanism, installed inside the client);
  :data:`STATISTICS_RELEASES` per graph. Every release covers every row, so one record's
  privacy is the composition of the three Gaussian mechanisms, exactly one Gaussian with
  z = sigma / sqrt(3) under add/remove (:meth:`~protocols.dp.PrivacyAccountant.
  statistics_guarantee`). The releases compose adaptively (exchange 2 uses the released mean,
  exchange 3 the released standardisation), which that composition covers.
- Noise: each client's from its own :mod:`protocols.noise` source (AES-128-CTR keyed from the
  operating system), never from the run's seed.

Trust, stated: the distributed guarantee assumes semi-honest clients that add their share and a
server that sees only the secure sum (DESIGN section 4). A server colluding with c clients can
remove their shares, leaving noise multiplier sigma * sqrt((K - c) / (K - 1)) on the others'
records (sigma itself for c = 1: one client, alone or with the server; the server alone
faces sigma sqrt(K / (K - 1))).
The ranges must be public (declared by the federation, e.g. physical units); ranges measured on
the data, as :func:`observed_ranges` does for experiments, are themselves not private.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from protocols.dp import EventCallback, GaussianRelease, PrivacyAccountant, clip_rows
from protocols.noise import NoiseSource, noise_source
from protocols.party_privacy import SECURE_SOURCE, check_guarantees
from secure_vfl.data.imputation import ClientData
from secure_vfl.data.party_files import read_table
from secure_vfl.errors import ConfigError, DataError, ProtocolError, RunWarning
from secure_vfl.io import check_keys
from secure_vfl.methods.imputation.statistics import FeatureRanges, ReleaseTerms

if TYPE_CHECKING:
    from secure_vfl.methods.imputation.clients import ImputationClient

STATISTICS_RELEASES = 3
"""Releases per client for one graph: moments, deviations, pairs."""

EXCHANGES = ("moments", "deviations", "pairs")

DEFAULT_STANDARD_BOUND = 3.0


class StatisticsNoise:
    """Clip each record's contribution to L2 norm ``clip`` and add this client's share of
    N(0, (noise_multiplier * clip)^2) to its summed statistics (see the module docstring).

    ``ranges`` are the public feature ranges, ``standard_bound`` the |z| clip of the pair
    exchange, ``shares`` the number of clients whose noise shares add up in the released sum
    (K under secure aggregation, 1 without), ``noise`` draws the noise, ``on_event``
    receives one :class:`GaussianRelease` per call.
    """

    def __init__(
        self,
        noise_multiplier: float,
        clip: float,
        *,
        ranges: FeatureRanges,
        shares: int,
        noise: NoiseSource,
        on_event: EventCallback,
        standard_bound: float = DEFAULT_STANDARD_BOUND,
    ) -> None:
        if not (noise_multiplier > 0 and math.isfinite(noise_multiplier)):
            raise ConfigError(
                f"the noise multiplier (SIGMA) of a private release must be a positive number. "
                f"Found {noise_multiplier}."
            )
        if not (clip > 0 and math.isfinite(clip)):
            raise ConfigError(f"the clip norm (CLIP) must be a positive number. Found {clip}.")
        if isinstance(shares, bool) or not isinstance(shares, int) or shares < 1:
            raise ConfigError(f"`shares` must be a positive integer. Found {shares!r}.")
        if not (standard_bound > 0 and math.isfinite(standard_bound)):
            raise ConfigError(
                f"`standard_bound` must be a positive number of std. Found {standard_bound}."
            )
        self.noise_multiplier = float(noise_multiplier)
        self.clip = float(clip)
        self.ranges = ranges
        self.shares = shares
        self.standard_bound = float(standard_bound)
        self.noise = noise
        self.on_event = on_event

    @property
    def noise_std(self) -> float:
        """sigma C: the noise std in every coordinate of a sum of all ``shares`` clients'
        releases (the central Gaussian mechanism's)."""
        return self.noise_multiplier * self.clip

    @property
    def share_std(self) -> float:
        """The std of the noise one client adds per coordinate (:func:`share_std`)."""
        return share_std(self.noise_std, self.shares)

    def privatise(self, client: str, exchange: str, rows: np.ndarray) -> np.ndarray:
        """``client``'s noisy share of an exchange: its clipped rows summed, plus its noise."""
        if exchange not in EXCHANGES:
            raise ConfigError(
                f"`exchange` must be one of {', '.join(EXCHANGES)}. Found {exchange!r}."
            )
        contributions = torch.from_numpy(np.asarray(rows, dtype=np.float64))
        if contributions.dim() != 2 or not bool(torch.isfinite(contributions).all()):
            raise DataError(
                f"{client}: the {exchange} contributions must be a finite (rows, values) array. "
                f"Found shape {tuple(contributions.shape)}."
            )
        total = clip_rows(contributions, self.clip).sum(dim=0)
        draws = self.noise.gaussian(tuple(total.shape), dtype=torch.float64)
        step = EXCHANGES.index(exchange)
        self.on_event(GaussianRelease(client, self.noise_multiplier, 1.0, "statistics", step))
        return (total + draws * self.share_std).numpy()


def share_std(noise_std: float, shares: int) -> float:
    """The std of the noise each of ``shares`` clients adds per coordinate so that any
    ``shares - 1`` of them (what the sum holds beyond one client's own share) carry
    ``noise_std``: noise_std / sqrt(shares - 1), all of it when one client adds it alone."""
    return noise_std / math.sqrt(max(shares - 1, 1))


class ClientStatisticsNoise:
    """Makes each client's own :class:`StatisticsNoise` (a
    :data:`~secure_vfl.methods.imputation.statistics.StatisticsPrivacyFactory`): the same public
    terms for every client, and per client its own noise source (``noise(k)`` for the k-th
    client made) and its own :class:`~protocols.dp.PrivacyAccountant` (``accountants``, by
    client), which records only that client's releases."""

    def __init__(
        self,
        noise_multiplier: float,
        clip: float,
        *,
        ranges: FeatureRanges,
        shares: int,
        noise: Callable[[int], NoiseSource],
        standard_bound: float = DEFAULT_STANDARD_BOUND,
    ) -> None:
        self.noise_multiplier = noise_multiplier
        self.clip = clip
        self.ranges = ranges
        self.shares = shares
        self.noise = noise
        self.standard_bound = standard_bound
        self.accountants: dict[str, PrivacyAccountant] = {}

    def __call__(self, client: str) -> StatisticsNoise:
        """``client``'s mechanism, made once."""
        if client in self.accountants:
            raise ConfigError(
                f"one statistics mechanism per client expected; {client!r} asked for a second."
            )
        accountant = PrivacyAccountant()
        mechanism = StatisticsNoise(
            self.noise_multiplier,
            self.clip,
            ranges=self.ranges,
            shares=self.shares,
            noise=self.noise(len(self.accountants)),
            on_event=accountant.on_event,
            standard_bound=self.standard_bound,
        )
        self.accountants[client] = accountant
        return mechanism


def read_feature_ranges(path: Path, features: Sequence[str]) -> FeatureRanges:
    """Declared ranges from a CSV (or a Parquet file, by its suffix ``.parquet``/``.pq``) with
    columns ``feature``, ``lower``, ``upper`` (one row per feature of the task, in the units the
    clients hold), in the order of ``features``. The file is read as a party file is (its
    checks and messages: UTF-8, one field per column in every row, ...)."""
    import pandas as pd

    table = read_table(Path(path), what="feature ranges file", id_column="feature")
    missing_columns = {"feature", "lower", "upper"} - set(table.columns)
    if missing_columns:
        raise DataError(
            f"{path}: columns feature, lower, upper expected; missing {sorted(missing_columns)}."
        )
    if table["feature"].duplicated().any():
        repeated = sorted(set(table["feature"][table["feature"].duplicated()].astype(str)))
        raise DataError(f"{path}: every feature once expected; found {repeated} repeated.")
    by_name = table.set_index(table["feature"].astype(str))
    absent = [f for f in features if f not in by_name.index]
    if absent:
        raise DataError(f"{path}: no range for feature(s) {absent}; every task feature needs one.")
    unused = [name for name in by_name.index if name not in set(features)]
    if unused:  # a list of more features than these files have, or a name that is not theirs
        warnings.warn(
            f"{path}: ranges of {len(unused)} feature(s) no client file has, unused: "
            f"{unused[:5]}{' ...' if len(unused) > 5 else ''}.",
            RunWarning,
            stacklevel=2,
        )
    bounds = []
    for column in ("lower", "upper"):
        values = by_name.loc[list(features), column]
        if not pd.api.types.is_numeric_dtype(values) or pd.api.types.is_bool_dtype(values):
            # read as text, every cell is a str: the one shown is one no number reads
            numbers = pd.to_numeric(values, errors="coerce")
            odd = [
                (f, v)
                for f, v, n in zip(features, values, numbers, strict=True)
                if pd.isna(n) and not pd.isna(v)
            ]
            feature, shown = odd[0] if odd else (features[0], values.iloc[0])
            text = pd.api.types.is_string_dtype(values) or values.dtype == object
            raise DataError(
                f"{path}: `{column}` must hold numbers; found {'text' if text else values.dtype} "
                f"such as {str(shown)[:40]!r} (feature {feature!r})."
            )
        empty = [f for f, missing in zip(features, values.isna(), strict=True) if missing]
        if empty:
            raise DataError(
                f"{path}: `{column}` must hold a number for every feature; found none for "
                f"{empty[:5]}{' ...' if len(empty) > 5 else ''}."
            )
        bounds.append(values.to_numpy(dtype=np.float64))
    lower, upper = bounds
    reversed_ = [
        f"{f} [{lo:g}, {hi:g}]"
        for f, lo, hi in zip(features, lower, upper, strict=True)
        if not hi > lo
    ]
    if reversed_:  # named by the file's own feature names, not by their place
        raise DataError(
            f"{path}: every feature range needs lower < upper. Found {', '.join(reversed_)}."
        )
    try:
        return FeatureRanges(lower=lower, upper=upper, names=tuple(features))
    except DataError as error:
        raise DataError(f"{path}: {error}") from None


def observed_ranges(clients: Sequence[ClientData]) -> FeatureRanges:
    """Per-feature [min, max] of the observed training values, widened by 0.5 where degenerate.

    For experiments only: ranges measured on the data are not private (they reveal extreme
    records); a deployment declares its ranges from public knowledge of the units instead.
    """
    if not clients:
        raise DataError("observed ranges need at least one client, found none.")
    values = np.concatenate([c.values.astype(np.float64) for c in clients])
    finite = np.where(np.isfinite(values), values, np.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # an all-NaN column: never observed
        lower, upper = np.nanmin(finite, axis=0), np.nanmax(finite, axis=0)
    lower = np.where(np.isfinite(lower), lower, 0.0)
    upper = np.where(np.isfinite(upper), upper, 0.0)
    flat = ~(upper > lower)
    return FeatureRanges(
        lower=np.where(flat, lower - 0.5, lower), upper=np.where(flat, upper + 0.5, upper)
    )


# -- a deployed imputation: each client makes its own mechanism from the label party's plan ----

PLAN_KEYS: Mapping[str, type | tuple[type, ...]] = {
    "noise_multiplier": (int, float),
    "clip": (int, float),
    "shares": int,
    "standard_bound": (int, float),
    "lower": list,
    "upper": list,
    "delta": (int, float),
}
"""The ``privacy`` part of a client's ``impute-setup`` (:meth:`StatisticsPlan.to_json`)."""
ENTRY_KEYS: Mapping[str, type | tuple[type, ...]] = {
    "guarantees": list,
    "releases": dict,
    "noise_source": str,
}
"""A deployed client's report about its own releases (:meth:`ServedStatistics.entry`)."""


@dataclass(frozen=True)
class StatisticsPlan:
    """What every client of a deployed imputation makes its own :class:`StatisticsNoise` from:
    the public terms, the same for every client (SIGMA as calibrated, CLIP, the number of
    clients whose noise shares add up in a released sum, the |z| bound of exchange 3, the
    declared feature ranges), and the delta of the guarantees. The label party sends it in each
    client's ``impute-setup`` (:meth:`to_json`); the client checks it as another party's bytes
    (:meth:`from_json`)."""

    noise_multiplier: float
    clip: float
    shares: int
    ranges: FeatureRanges
    delta: float
    standard_bound: float = DEFAULT_STANDARD_BOUND

    def to_json(self) -> dict[str, Any]:
        return {
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "shares": self.shares,
            "standard_bound": self.standard_bound,
            "lower": [float(v) for v in self.ranges.lower],
            "upper": [float(v) for v in self.ranges.upper],
            "delta": self.delta,
        }

    @classmethod
    def from_json(cls, body: Any, *, features: int, names: Sequence[str] = ()) -> StatisticsPlan:
        """The plan in ``body``, for a run of ``features`` features (``names``: theirs, for
        messages); ProtocolError naming what
        is wrong (keys, types, a SIGMA, CLIP or bound that is not a finite number > 0, a count
        of shares < 1, ranges of another width or not lower < upper, a delta outside (0, 1))."""

        def refuse(what: str) -> ProtocolError:
            return ProtocolError(f"impute-setup: the `privacy` part: {what}.")

        check_keys(body, PLAN_KEYS, refuse=refuse)
        for key in ("noise_multiplier", "clip", "standard_bound"):
            if not (math.isfinite(body[key]) and body[key] > 0):
                raise refuse(f"`{key}` a finite number > 0 expected, found {body[key]!r}")
        if body["shares"] < 1:
            raise refuse(f"`shares` >= 1 expected, found {body['shares']}")
        if not 0 < body["delta"] < 1:
            raise refuse(f"`delta` in (0, 1) expected, found {body['delta']!r}")
        bounds = [body["lower"], body["upper"]]
        if any(len(b) != features for b in bounds) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for b in bounds for v in b
        ):
            raise refuse(
                f"`lower` and `upper` as {features} numbers each expected (one per feature)"
            )
        try:
            ranges = FeatureRanges(
                lower=np.array(body["lower"], dtype=np.float64),
                upper=np.array(body["upper"], dtype=np.float64),
                names=tuple(names),
            )
        except DataError as error:
            raise refuse(str(error)) from None
        return cls(
            noise_multiplier=float(body["noise_multiplier"]),
            clip=float(body["clip"]),
            shares=body["shares"],
            ranges=ranges,
            delta=float(body["delta"]),
            standard_bound=float(body["standard_bound"]),
        )

    def terms(self) -> ReleaseTerms:
        """What the coordinator knows of the clients' mechanisms: the same terms
        :meth:`ReleaseTerms.of` reads off each client's :class:`StatisticsNoise`."""
        return ReleaseTerms(
            ranges=FeatureRanges(lower=self.ranges.lower.copy(), upper=self.ranges.upper.copy()),
            standard_bound=self.standard_bound,
            share_std=share_std(self.noise_multiplier * self.clip, self.shares),
        )


class ServedStatistics:
    """A deployed client's own statistics mechanism and accountant, in its own process: its
    noise from fresh operating-system entropy (never from the seed), its releases priced by its
    own :class:`~protocols.dp.PrivacyAccountant`, which it reports at the end of the run
    (:meth:`entry`)."""

    def __init__(self, name: str, plan: StatisticsPlan) -> None:
        self.name = name
        self.plan = plan
        self.accountant = PrivacyAccountant()
        self.mechanism = StatisticsNoise(
            plan.noise_multiplier,
            plan.clip,
            ranges=plan.ranges,
            shares=plan.shares,
            noise=noise_source(None),
            on_event=self.accountant.on_event,
            standard_bound=plan.standard_bound,
        )

    def entry(self) -> dict[str, Any]:
        """What its accountant priced, as JSON (the ``privacy`` of its end-of-run report;
        :func:`read_statistics_entry` checks it)."""
        guarantee = self.accountant.statistics_guarantee(self.name, delta=self.plan.delta)
        return {
            "guarantees": [guarantee.to_json()] if guarantee is not None else [],
            "releases": {"statistics": len(self.accountant.events)},
            "noise_source": SECURE_SOURCE,
        }


def served_statistics(
    name: str, part: Any, client: ImputationClient, *, features: Sequence[str]
) -> ServedStatistics:
    """Client ``name``'s own mechanism, made from the ``privacy`` part of its ``impute-setup``
    for a run of the features ``features`` (checked: ProtocolError), installed in ``client``."""
    plan = StatisticsPlan.from_json(part, features=len(features), names=features)
    served = ServedStatistics(name, plan)
    client.privacy = served.mechanism
    return served


def read_statistics_entry(name: str, entry: Any, *, delta: float) -> dict[str, Any]:
    """Client ``name``'s report about its own releases (:meth:`ServedStatistics.entry`), checked
    as another party's bytes: ProtocolError for a malformed one, a guarantee of another
    mechanism or delta, or an epsilon that is not a number >= 0."""

    def refuse(what: str) -> ProtocolError:
        return ProtocolError(f"report from {name}: its privacy entry: {what}.")

    check_keys(entry, ENTRY_KEYS, refuse=refuse)
    check_guarantees(entry["guarantees"], delta=delta, refuse=refuse)
    if len(entry["guarantees"]) > 1 or any(
        g["mechanisms"] != ["statistics"] for g in entry["guarantees"]
    ):
        raise refuse("at most one guarantee, of the statistics mechanism, expected")
    count = entry["releases"].get("statistics")
    if set(entry["releases"]) != {"statistics"} or not (
        isinstance(count, int) and not isinstance(count, bool) and count >= 0
    ):
        raise refuse("`releases` as {'statistics': a count >= 0} expected")
    if bool(entry["guarantees"]) != (count > 0):
        raise refuse(f"a guarantee exactly when it made releases expected, found {count} releases")
    return entry
