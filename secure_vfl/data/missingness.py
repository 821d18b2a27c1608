"""Per-sample availability masks: which parties hold each sample (True = block observed).

Mechanisms follow the papers: MCAR with one rate or one rate per party; per-party rates drawn
from Beta(2, 2) (LASER-VFL's non-uniform study) or from a Dirichlet (FALSE-VFL's heterogeneity
study); the two variance-threshold MAR procedures and the mean-sign MNAR rule of FALSE-VFL
(section 5.1 and appendix D.4). Every function takes the ``rng`` it draws from.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from secure_vfl.errors import ConfigError, DataError
from secure_vfl.io import plain_number

MechanismName = Literal["mcar", "beta", "dirichlet", "mar1", "mar2", "mnar"]

_MAX_DIRICHLET_DRAWS = 10_000


def _check_rate(name: str, value: float, *, closed: bool = False) -> None:
    upper_ok = value <= 1.0 if closed else value < 1.0
    if not (value >= 0.0 and upper_ok):
        interval = "[0, 1]" if closed else "[0, 1)"
        raise ConfigError(f"`{name}` must be in {interval}. Found {value}.")


def mcar(
    n: int, parties: int, p: float | Sequence[float], *, rng: np.random.Generator
) -> np.ndarray:
    """Missing completely at random: block k of each sample is missing with probability p[k]."""
    if n < 0 or parties < 1:
        raise ConfigError(f"`n` must be >= 0 and `parties` >= 1. Found n={n}, parties={parties}.")
    rates = np.full(parties, p, dtype=np.float64) if np.ndim(p) == 0 else np.asarray(p, np.float64)
    if rates.shape != (parties,):
        raise ConfigError(
            f"`p` must be one rate or one rate per party ({parties}). Found {len(rates)} rates."
        )
    for rate in rates:
        _check_rate("p", float(rate))
    return rng.random((n, parties)) >= rates


def beta_rates(
    parties: int, *, rng: np.random.Generator, a: float = 2.0, b: float = 2.0
) -> np.ndarray:
    """Per-party missing rates drawn i.i.d. from Beta(a, b) (LASER-VFL: Beta(2, 2), mean 0.5)."""
    if parties < 1:
        raise ConfigError(f"`parties` must be >= 1. Found {parties}.")
    if not (0 < a < math.inf and 0 < b < math.inf):
        raise ConfigError(f"Beta parameters must be finite and > 0. Found a={a}, b={b}.")
    # A draw of exactly 1.0 would make a party never observed; keep rates in [0, 1).
    return np.minimum(rng.beta(a, b, size=parties), np.nextafter(1.0, 0.0))


def dirichlet_rates(
    parties: int, alpha: float, *, mean_rate: float = 0.2, rng: np.random.Generator
) -> np.ndarray:
    """Per-party missing rates ``p = K * mean_rate * omega`` with ``omega ~ Dir(alpha)``.

    ``omega`` is redrawn while any rate is >= 1 (FALSE-VFL's heterogeneity study, where K = 8
    and mean 0.2 give p = 1.6 omega). ``alpha = inf`` gives the uniform rates ``mean_rate``.
    """
    if parties < 1:
        raise ConfigError(f"`parties` must be >= 1. Found {parties}.")
    if not alpha > 0:
        raise ConfigError(f"`alpha` must be > 0 (or inf). Found {alpha}.")
    _check_rate("mean_rate", mean_rate)
    if math.isinf(alpha):
        return np.full(parties, mean_rate)
    for _ in range(_MAX_DIRICHLET_DRAWS):
        omega = rng.dirichlet(np.full(parties, alpha))
        rates = parties * mean_rate * omega
        if np.all(rates < 1.0):
            return rates
    raise ConfigError(
        f"no Dirichlet({alpha}) draw gave all {parties} rates below 1 with mean {mean_rate} "
        f"in {_MAX_DIRICHLET_DRAWS} tries; expected a larger `alpha` or a smaller `mean_rate`."
    )


def _check_blocks(blocks: Sequence[np.ndarray]) -> int:
    """Return N after checking there is at least one block and all have N rows."""
    if len(blocks) == 0:
        raise DataError("expected at least one block. Found none.")
    n = blocks[0].shape[0]
    sizes = [b.shape[0] for b in blocks]
    if any(size != n for size in sizes):
        raise DataError(f"every block must have the same number of rows. Found {sizes}.")
    return int(n)


def block_variances(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """(N, K): the variance of each sample's features within each block."""
    n = _check_blocks(blocks)
    return np.stack(
        [b.reshape(n, -1).astype(np.float64, copy=False).var(axis=1) for b in blocks], axis=1
    )


def block_means(blocks: Sequence[np.ndarray]) -> np.ndarray:
    """(N, K): the mean of each sample's features within each block."""
    n = _check_blocks(blocks)
    return np.stack(
        [b.reshape(n, -1).astype(np.float64, copy=False).mean(axis=1) for b in blocks], axis=1
    )


def _visit_order(n: int, parties: int, rng: np.random.Generator) -> np.ndarray:
    """(N, K): an independent uniformly random order of the parties for each sample."""
    return np.argsort(rng.random((n, parties)), axis=1)


def mar1(
    blocks: Sequence[np.ndarray],
    *,
    rng: np.random.Generator,
    threshold: float = 1.1,
    decrement: float = 0.15,
) -> np.ndarray:
    """FALSE-VFL MAR type 1 (appendix D.4, Algorithm 2): stop at the first informative piece.

    Each sample visits its blocks in random order; every visited block is observed. It stops
    after the first block whose variance exceeds the threshold, which drops by ``decrement``
    after each block that did not stop it. Blocks should be standardised.
    """
    variances = block_variances(blocks)
    n, parties = variances.shape
    order = _visit_order(n, parties, rng)
    rows = np.arange(n)
    mask = np.zeros((n, parties), dtype=bool)
    active = np.ones(n, dtype=bool)
    level = threshold
    for step in range(parties):
        chosen = order[:, step]
        mask[rows[active], chosen[active]] = True
        active &= ~(variances[rows, chosen] > level)
        level -= decrement
    return mask


def mar2(
    blocks: Sequence[np.ndarray],
    *,
    rng: np.random.Generator,
    threshold: float = 0.5,
    budget: float = 0.7,
    decrement: float = 0.15,
) -> np.ndarray:
    """FALSE-VFL MAR type 2 (appendix D.4, Algorithm 3): accumulate moderately informative pieces.

    Each sample visits its blocks in random order; every visited block is observed. A block of
    variance v above the threshold T spends ``v - T`` of the budget; the sample stops once the
    budget is <= 0, else T drops by ``decrement`` and it visits the next block.
    """
    variances = block_variances(blocks)
    n, parties = variances.shape
    order = _visit_order(n, parties, rng)
    rows = np.arange(n)
    mask = np.zeros((n, parties), dtype=bool)
    active = np.ones(n, dtype=bool)
    remaining = np.full(n, budget, dtype=np.float64)
    level = threshold
    for step in range(parties):
        chosen = order[:, step]
        mask[rows[active], chosen[active]] = True
        excess = np.maximum(variances[rows, chosen] - level, 0.0)
        remaining = np.where(active, remaining - excess, remaining)
        active &= remaining > 0
        level -= decrement
    return mask


def mnar_mean_sign(
    blocks: Sequence[np.ndarray], p: float, *, rng: np.random.Generator
) -> np.ndarray:
    """FALSE-VFL MNAR: a block whose mean is < 0 is missing with probability p, else with 1 - p."""
    _check_rate("p", p, closed=True)
    means = block_means(blocks)
    missing_rate = np.where(means < 0, p, 1.0 - p)
    return rng.random(means.shape) >= missing_rate


def drop_unobserved(mask: np.ndarray) -> tuple[np.ndarray, int]:
    """Indices of samples with at least one observed block, and how many were dropped."""
    if mask.dtype != np.bool_ or mask.ndim != 2:
        raise DataError(f"`mask` must be bool of shape (N, K). Found {mask.dtype} {mask.shape}.")
    keep = np.flatnonzero(mask.any(axis=1)).astype(np.int64)
    return keep, int(mask.shape[0] - keep.size)


_DEFAULTS: dict[str, tuple[float, ...]] = {
    "beta": (2.0, 2.0),
    "mar1": (1.1, 0.15),
    "mar2": (0.5, 0.7, 0.15),
}
_DIRICHLET_MEAN = 0.2

ACCEPTED_FORMS = (
    "mcar:P (e.g. mcar:0.2), mcar:P1,...,PK (one rate per party), beta, beta:A,B, "
    "dirichlet:ALPHA (ALPHA may be inf), dirichlet:ALPHA,MEAN, mar1, mar1:T,DELTA, mar2, "
    "mar2:T,BUDGET,DELTA, mnar:P (e.g. mnar:0.7)"
)


def _format(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.12g}"


@dataclass(frozen=True)
class Mechanism:
    """A named missingness mechanism with its parameters; ``sample`` draws an (N, K) mask.

    ``params`` by name: ``mcar`` one rate or one per party; ``beta`` (a, b); ``dirichlet``
    (alpha, mean_rate); ``mar1`` (threshold, decrement); ``mar2`` (threshold, budget, decrement);
    ``mnar`` (p,). Empty params take the papers' defaults. ``beta`` and ``dirichlet`` draw fresh
    per-party rates at every ``sample`` call, so train and test rates are independent (as in
    LASER-VFL's non-uniform study).
    """

    name: MechanismName
    params: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.name not in get_args(MechanismName):
            raise ConfigError(
                f"unknown missingness mechanism {self.name!r}; expected one of: {ACCEPTED_FORMS}."
            )
        params = tuple(float(v) + 0.0 for v in self.params)  # -0.0 is 0.0: one label
        if not params:
            if self.name in ("mcar", "mnar", "dirichlet"):
                raise ConfigError(
                    f"{self.name!r} needs a parameter; expected one of: {ACCEPTED_FORMS}."
                )
            params = _DEFAULTS[self.name]
        if self.name == "dirichlet" and len(params) == 1:
            params = (params[0], _DIRICHLET_MEAN)
        expected = {"beta": 2, "dirichlet": 2, "mar1": 2, "mar2": 3, "mnar": 1}.get(self.name)
        if expected is not None and len(params) != expected:
            raise ConfigError(
                f"{self.name!r} takes {expected} parameters. Found {len(params)}: {params}. "
                f"Accepted forms: {ACCEPTED_FORMS}."
            )
        if self.name in ("beta", "mar1", "mar2") and not all(map(math.isfinite, params)):
            # NaN/inf drew NaN rates (beta) or never ended a visit (MAR): every block observed
            raise ConfigError(
                f"{self.name!r} parameters must be finite numbers. Found {params}. "
                f"Accepted forms: {ACCEPTED_FORMS}."
            )
        if self.name == "mcar":
            for rate in params:
                _check_rate("p", rate)
        elif self.name == "mnar":
            _check_rate("p", params[0], closed=True)
        elif self.name == "beta" and min(params) <= 0:
            raise ConfigError(f"Beta parameters must be > 0. Found {params}.")
        elif self.name == "dirichlet":
            if not params[0] > 0:
                raise ConfigError(f"`alpha` must be > 0 (or inf). Found {params[0]}.")
            _check_rate("mean_rate", params[1])
        elif self.name == "mar2" and params[1] <= 0:
            raise ConfigError(f"the MAR-2 budget must be > 0. Found {params[1]}.")
        object.__setattr__(self, "params", params)

    @property
    def label(self) -> str:
        """Canonical text form, e.g. ``mcar:0.2``, ``dirichlet:inf``, ``mar1``."""
        params = self.params
        if self.name in _DEFAULTS and params == _DEFAULTS[self.name]:
            return self.name
        if self.name == "dirichlet" and params[1] == _DIRICHLET_MEAN:
            params = params[:1]
        return f"{self.name}:" + ",".join(_format(v) for v in params)

    @property
    def asks_for_none(self) -> bool:
        """Whether the mechanism asks that no block be missing: ``mcar`` with every rate 0, or
        ``dirichlet`` with mean rate 0. Every other one asks for missing blocks."""
        if self.name == "mcar":
            return all(rate == 0.0 for rate in self.params)
        return self.name == "dirichlet" and self.params[1] == 0.0

    def sample(self, blocks: Sequence[np.ndarray], *, rng: np.random.Generator) -> np.ndarray:
        """Draw a bool (N, K) availability mask for the samples of ``blocks`` (K arrays, N rows)."""
        n = _check_blocks(blocks)
        parties = len(blocks)
        if self.name == "mcar":
            rates: float | Sequence[float] = self.params if len(self.params) > 1 else self.params[0]
            return mcar(n, parties, rates, rng=rng)
        if self.name == "beta":
            a, b = self.params
            return mcar(n, parties, beta_rates(parties, rng=rng, a=a, b=b).tolist(), rng=rng)
        if self.name == "dirichlet":
            alpha, mean_rate = self.params
            drawn = dirichlet_rates(parties, alpha, mean_rate=mean_rate, rng=rng)
            return mcar(n, parties, drawn.tolist(), rng=rng)
        if self.name == "mar1":
            threshold, decrement = self.params
            return mar1(blocks, rng=rng, threshold=threshold, decrement=decrement)
        if self.name == "mar2":
            threshold, budget, decrement = self.params
            return mar2(blocks, rng=rng, threshold=threshold, budget=budget, decrement=decrement)
        return mnar_mean_sign(blocks, self.params[0], rng=rng)

    def __str__(self) -> str:
        return self.label


def parse_mechanism(text: str) -> Mechanism:
    """Parse ``mcar:0.2``, ``mcar:0.1,0.2,0.3,0.4``, ``beta``, ``dirichlet:inf``, ``mar1``,
    ``mar2``, ``mnar:0.7`` (and the parameterised forms in ``ACCEPTED_FORMS``)."""
    name, separator, rest = text.strip().lower().partition(":")
    if name not in get_args(MechanismName):
        raise ConfigError(
            f"unknown missingness mechanism {text!r}; expected one of: {ACCEPTED_FORMS}."
        )
    params: list[float] = []
    if rest:
        for piece in rest.split(","):
            try:
                params.append(plain_number(piece))
            except ValueError:
                raise ConfigError(
                    f"mechanism parameters must be numbers. Found {piece!r} in {text!r}; "
                    f"expected one of: {ACCEPTED_FORMS}."
                ) from None
    elif separator:
        raise ConfigError(
            f"{text!r} has an empty parameter list; expected one of: {ACCEPTED_FORMS}."
        )
    return Mechanism(name, tuple(params))  # type: ignore[arg-type]
