"""Batch samplers: each epoch is an iterator of index arrays into the training set.

``grouped`` is LASER-VFL's batching, where every batch shares one observed set of parties;
``mixed`` is plain shuffling, leaving per-sample subsets of parties to the method (DESIGN §5).
Differentially private training replaces either by a :class:`PoissonSampler`
(:func:`poisson_like`), the sampling that DP-SGD's subsampling bound is a proof for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, Protocol

import numpy as np

from secure_vfl.errors import ConfigError, DataError

SamplerKind = Literal["grouped", "mixed"]


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"`batch_size` must be >= 1. Found {batch_size}.")


class BatchSampler(Protocol):
    """What a training loop needs from a sampler: the batches of one epoch and their count."""

    def epoch(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """Yield int64 index arrays that together cover every training sample once."""
        ...

    def __len__(self) -> int: ...

    def check_order(self, order: Sequence[Any]) -> None:
        """DataError unless ``order`` is an epoch's batches this sampler could have yielded (a
        resumed run's, from its checkpoint)."""
        ...


def _check_indices(batch: Any, n: int, what: str) -> None:
    """DataError unless ``batch`` is a 1-D array of integers in [0, n)."""
    if not (
        isinstance(batch, np.ndarray) and batch.ndim == 1 and np.issubdtype(batch.dtype, np.integer)
    ):
        found = (
            f"{batch.dtype} of shape {batch.shape}"
            if isinstance(batch, np.ndarray)
            else type(batch).__name__
        )
        raise DataError(f"{what}: a 1-D array of row indices expected, found {found}.")
    outside = batch[(batch < 0) | (batch >= n)]
    if outside.size:
        raise DataError(f"{what}: row indices in [0, {n}) expected, found {outside[0]}.")


def _check_epoch(order: Sequence[Any], rows: np.ndarray, n: int) -> None:
    """DataError unless ``order`` is batches of row indices in [0, n) that together hold each
    of ``rows`` (distinct) once."""
    for k, batch in enumerate(order):
        _check_indices(batch, n, f"batch {k + 1} of the epoch's order")
    joined = np.concatenate([np.zeros(0, dtype=np.int64), *order]).astype(np.int64)
    values, counts = np.unique(joined, return_counts=True)
    if values.size == joined.size == rows.size and np.array_equal(values, np.sort(rows)):
        return
    stray, twice = np.setdiff1d(values, rows), values[counts > 1]
    found = (
        f"row {stray[0]}, not one of them"
        if stray.size
        else f"row {twice[0]} more than once"
        if twice.size
        else f"{rows.size - values.size} of them missing"
    )
    raise DataError(
        f"an epoch's batch order that holds each of its {rows.size} rows once expected; found "
        f"{found}."
    )


def _cut(size: int, batch_size: int) -> list[int]:
    """The sizes of the batches ``size`` rows are cut into (the last one smaller)."""
    return [min(batch_size, size - start) for start in range(0, size, batch_size)]


def _sizes(sizes: list[int]) -> str:
    return f"{len(sizes)} batch(es) of {sizes[:8]}{'...' if len(sizes) > 8 else ''} rows"


class GroupedSampler:
    """Batches in which all samples have the same availability-mask row (LASER-VFL).

    Samples are bucketed by identical mask row; every epoch each bucket is reshuffled and cut
    into batches (its last partial batch kept), and the batches of all buckets are shuffled.
    """

    def __init__(self, mask: np.ndarray, batch_size: int) -> None:
        if mask.dtype != np.bool_ or mask.ndim != 2:
            raise DataError(
                f"`mask` must be bool of shape (N, K). Found {mask.dtype} {mask.shape}."
            )
        _check_batch_size(batch_size)
        self.batch_size = batch_size
        patterns, inverse = np.unique(mask, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        self.patterns: np.ndarray = patterns
        """(B, K): the distinct mask rows, one per bucket."""
        self.bucket_of: np.ndarray = inverse
        """(N,) the bucket of each sample."""
        by_bucket = np.argsort(inverse, kind="stable").astype(np.int64)
        ends = np.cumsum(np.bincount(inverse, minlength=len(patterns)))[:-1]
        self.buckets: list[np.ndarray] = np.split(by_bucket, ends) if len(patterns) else []
        """Indices of the samples sharing each pattern."""

    def __len__(self) -> int:
        return sum(-(-bucket.size // self.batch_size) for bucket in self.buckets)

    def epoch(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """Yield this epoch's batches, each from one bucket, in a shuffled order."""
        batches: list[np.ndarray] = []
        for bucket in self.buckets:
            shuffled = rng.permutation(bucket)
            batches.extend(
                shuffled[start : start + self.batch_size]
                for start in range(0, shuffled.size, self.batch_size)
            )
        for position in rng.permutation(len(batches)):
            yield batches[position]

    def check_order(self, order: Sequence[Any]) -> None:
        """Every sample once, each batch from one bucket, each bucket cut into batches of
        ``batch_size`` (its last one smaller)."""
        _check_epoch(order, np.arange(self.bucket_of.size), self.bucket_of.size)
        sizes: dict[int, list[int]] = {}
        for k, batch in enumerate(order):
            buckets = np.unique(self.bucket_of[batch])
            if buckets.size != 1:
                raise DataError(
                    f"batch {k + 1} of the epoch's order: samples of one observed set of parties "
                    f"expected (grouped batching), found {buckets.size} sets."
                )
            sizes.setdefault(int(buckets[0]), []).append(batch.size)
        for b, bucket in enumerate(self.buckets):
            expected = _cut(bucket.size, self.batch_size)
            if sorted(sizes.get(b, [])) != sorted(expected):
                raise DataError(
                    f"the {bucket.size} samples of observed set {b + 1} in "
                    f"{_sizes(sorted(expected))} expected; found "
                    f"{_sizes(sorted(sizes.get(b, [])))}."
                )


class MixedSampler:
    """Plain shuffled batches over ``n`` samples; the last partial batch is kept."""

    def __init__(self, n: int, batch_size: int) -> None:
        if n < 0:
            raise ConfigError(f"`n` must be >= 0. Found {n}.")
        _check_batch_size(batch_size)
        self.n = n
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-self.n // self.batch_size)

    def epoch(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """Yield this epoch's batches of a fresh permutation."""
        order = rng.permutation(self.n).astype(np.int64)
        for start in range(0, self.n, self.batch_size):
            yield order[start : start + self.batch_size]

    def check_order(self, order: Sequence[Any]) -> None:
        """Every sample once, in batches of ``batch_size`` (the last one smaller)."""
        _check_epoch(order, np.arange(self.n), self.n)
        expected, found = _cut(self.n, self.batch_size), [len(batch) for batch in order]
        if found != expected:
            raise DataError(
                f"an epoch's batch order of {_sizes(expected)} expected; found {_sizes(found)}."
            )


class SubsetSampler:
    """A sampler over some training rows (``rows``), yielding indices into the full set."""

    def __init__(self, inner: BatchSampler, rows: np.ndarray) -> None:
        self.inner = inner
        self.rows = rows

    def __len__(self) -> int:
        return len(self.inner)

    def epoch(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        for batch in self.inner.epoch(rng):
            yield self.rows[batch]

    def check_order(self, order: Sequence[Any]) -> None:
        """Every one of ``rows`` once, cut into batches as the inner sampler cuts them."""
        n = int(self.rows.max(initial=-1)) + 1
        _check_epoch(order, self.rows, n)
        position = np.zeros(n, dtype=np.int64)
        position[self.rows] = np.arange(self.rows.size)
        self.inner.check_order([position[batch] for batch in order])


def make_sampler(
    kind: SamplerKind, mask: np.ndarray, batch_size: int, *, rows: np.ndarray | None = None
) -> BatchSampler:
    """The sampler named ``kind`` for a training set with availability ``mask`` (N, K).

    With ``rows``, only those training rows are drawn (e.g. the labelled ones); indices still
    refer to the full set.
    """
    if rows is not None:
        return SubsetSampler(make_sampler(kind, mask[rows], batch_size), rows)
    if kind == "grouped":
        return GroupedSampler(mask, batch_size)
    if kind == "mixed":
        return MixedSampler(int(mask.shape[0]), batch_size)
    raise ConfigError(f"`batching` must be 'grouped' or 'mixed'. Found {kind!r}.")


MAX_SCHEDULE_BYTES = 2**30
"""The most memory a :class:`PoissonSampler`'s schedule may take (1 GiB): it is drawn whole
before the first step, each draw an array of its row indices (8 bytes each) costing
:data:`DRAW_BYTES` besides (measured: 168 bytes and 4 us a draw)."""
DRAW_BYTES = 168


class PoissonSampler:
    """Poisson sampling (as Opacus' ``DPDataLoader``): at every step each candidate row joins
    the batch independently with probability ``rate``, so batch sizes vary (mean
    ``rate * len(rows)``); ``steps_per_epoch`` steps make an epoch.

    The whole schedule of ``epochs`` epochs is drawn up front from ``rng`` (a step's size from
    Binomial(n, rate), then that many distinct rows uniformly, which is the same distribution),
    so the number of steps each row is used in (:meth:`uses`) is known before training. An
    empty draw stays in the schedule as a step of no rows: the accountant composes every draw,
    and a DP-SGD party takes its noise-only step there as on any draw without its records
    (:func:`~secure_vfl.methods.base.train_epochs`). :meth:`epoch` ignores the generator it is
    handed: the sample must come from the one given here (for DP, a secure one).
    """

    def __init__(
        self,
        rows: np.ndarray,
        *,
        rate: float,
        steps_per_epoch: int,
        epochs: int,
        rng: np.random.Generator,
        n: int | None = None,
    ) -> None:
        if not 0 < rate <= 1:
            raise ConfigError(f"`rate` must be in (0, 1]. Found {rate}.")
        if steps_per_epoch < 1 or epochs < 1:
            raise ConfigError(
                f"`steps_per_epoch` and `epochs` must be >= 1. Found {steps_per_epoch}, {epochs}."
            )
        self.rows = np.asarray(rows, dtype=np.int64)
        draws = steps_per_epoch * epochs
        expected = self.rows.size * rate * draws  # row indices drawn
        size = 8 * expected + DRAW_BYTES * draws
        if size > MAX_SCHEDULE_BYTES:
            raise ConfigError(
                f"a Poisson sample of {epochs} epochs x {steps_per_epoch} steps at rate "
                f"{rate:.4g} over {self.rows.size} rows holds about {expected:.3g} row indices "
                f"in {draws} draws ({size / 2**30:.3g} GiB), all drawn before the first step; "
                f"expected at most {MAX_SCHEDULE_BYTES // 2**30} GiB: fewer epochs (or a larger "
                "--batch-size)."
            )
        self.n = int(n) if n is not None else int(self.rows.max(initial=-1)) + 1
        """The size of the index space the rows live in (the training set)."""
        self.rate = float(rate)
        self.steps_per_epoch = steps_per_epoch
        self.draws = steps_per_epoch * epochs
        """Poisson draws in all (empty ones included): the steps an accountant composes."""
        self.epochs: list[list[np.ndarray]] = []
        for _ in range(epochs):
            batches = []
            for _ in range(steps_per_epoch):
                size = int(rng.binomial(self.rows.size, self.rate))
                if size:
                    picked = np.sort(rng.choice(self.rows.size, size=size, replace=False))
                    batches.append(self.rows[picked])
                else:
                    batches.append(np.zeros(0, dtype=np.int64))
            self.epochs.append(batches)
        self._next = 0

    @property
    def schedule(self) -> list[np.ndarray]:
        """Every batch in the order training uses them: step t is ``schedule[t]``."""
        return [batch for epoch in self.epochs for batch in epoch]

    def uses(self) -> np.ndarray:
        """(n,) how many steps of the schedule use each row."""
        counts = np.zeros(self.n, dtype=np.int64)
        for batch in self.schedule:
            counts[batch] += 1
        return counts

    @property
    def next_epoch(self) -> int:
        """How many epochs of the schedule :meth:`epoch` has handed out."""
        return self._next

    def restore(self, epochs: list[list[np.ndarray]], *, next_epoch: int) -> None:
        """Take back a schedule drawn before (a resumed run's, from its checkpoint), of as many
        epochs as this one, each of as many draws, ``next_epoch`` of them handed out already;
        each draw a 1-D integer array of distinct candidate rows in their order (as drawn)."""
        if len(epochs) != len(self.epochs) or not 0 <= next_epoch <= len(epochs):
            raise DataError(
                f"a schedule of {len(self.epochs)} epochs, at most that many handed out, "
                f"expected; found {len(epochs)} epochs, {next_epoch} handed out."
            )
        short = [k for k, epoch in enumerate(epochs) if len(epoch) != self.steps_per_epoch]
        if short:
            raise DataError(
                f"a schedule of {self.steps_per_epoch} draws per epoch, empty ones included, "
                f"expected; found epoch {short[0] + 1} with {len(epochs[short[0]])} (a "
                "checkpoint of an earlier release, which left empty draws out: its run cannot "
                "be resumed by this one)."
            )
        position = np.full(self.n, -1, dtype=np.int64)
        position[self.rows] = np.arange(self.rows.size)
        for k, epoch in enumerate(epochs):
            for t, batch in enumerate(epoch):
                what = f"draw {t + 1} of epoch {k + 1} of the Poisson schedule"
                _check_indices(batch, self.n, what)
                picked = position[batch]
                stray, back = np.flatnonzero(picked < 0), np.flatnonzero(np.diff(picked) <= 0)
                if stray.size or back.size:
                    found = (
                        f"row {batch[stray[0]]}, not a candidate"
                        if stray.size
                        else f"row {batch[back[0] + 1]} after row {batch[back[0]]}"
                    )
                    raise DataError(
                        f"{what}: distinct candidate rows in their order expected; found {found}."
                    )
        self.epochs = [[np.asarray(batch, dtype=np.int64) for batch in e] for e in epochs]
        self._next = next_epoch

    def __len__(self) -> int:
        return self.steps_per_epoch

    def check_order(self, order: Sequence[Any]) -> None:
        """The draws of the schedule's epoch handed out last, as drawn."""
        drawn = self.epochs[self._next - 1] if self._next else []
        for k, batch in enumerate(order):
            _check_indices(batch, self.n, f"batch {k + 1} of the epoch's order")
        if not self._next or len(order) != len(drawn) or not all(map(np.array_equal, order, drawn)):
            raise DataError(
                f"the draws of epoch {self._next} of the Poisson schedule as the epoch's batch "
                "order expected; found other batches."
            )

    def epoch(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        """Yield the next epoch's drawn batches (``rng`` is not used; see the class)."""
        if self._next >= len(self.epochs):
            raise ConfigError(f"the Poisson schedule holds {len(self.epochs)} epochs; all used.")
        self._next += 1
        yield from self.epochs[self._next - 1]


def loss_normaliser(
    sampler: BatchSampler, drawn: int, *, counted: Callable[[], np.ndarray] | None = None
) -> float:
    """What a batch's summed loss is divided by: the ``drawn`` rows it counts, except under
    Poisson sampling, where it is the number of them a draw holds on average (rate x the
    candidate rows, those that ``counted()`` (N,) sets where a loss counts only some; asked
    only then), as
    Opacus' ``expected_batch_size``. A fixed normaliser keeps each row's gradient independent
    of which other rows were drawn: adding a record to the training set then moves a DP-SGD
    step's sum of clipped per-sample gradients by at most the clip norm, as its add/remove
    guarantee assumes; dividing by the rows drawn would rescale every other row's gradient,
    which moves the sum by up to twice the clip norm."""
    if not isinstance(sampler, PoissonSampler):
        return float(drawn)
    candidates = sampler.rows.size if counted is None else int(counted()[sampler.rows].sum())
    return sampler.rate * candidates


def poisson_like(
    sampler: BatchSampler, *, n: int, epochs: int, rng: np.random.Generator
) -> PoissonSampler:
    """The :class:`PoissonSampler` over the rows ``sampler`` draws from (of a training set of
    ``n`` rows), at rate ``batch_size / rows`` (capped at 1), with as many steps per epoch
    (:func:`poisson_terms`)."""
    candidates, rate, steps_per_epoch = poisson_terms(sampler)
    return PoissonSampler(
        candidates, rate=rate, steps_per_epoch=steps_per_epoch, epochs=epochs, rng=rng, n=n
    )


def poisson_terms(sampler: BatchSampler) -> tuple[np.ndarray, float, int]:
    """The candidate rows, rate and steps per epoch of the Poisson sampler that replaces
    ``sampler`` (the rows it draws from; ``batch_size / rows``, capped at 1; its steps).

    ConfigError for grouped batching: its batches must share one observed set, which a
    Poisson sample does not; differentially private runs use ``batching="mixed"``.
    """
    inner, rows = (
        (sampler.inner, sampler.rows)
        if isinstance(sampler, SubsetSampler)
        else (
            sampler,
            None,
        )
    )
    if isinstance(inner, GroupedSampler):
        raise ConfigError(
            "differentially private training samples its batches by Poisson sampling, which "
            "grouped batches (one observed set each) cannot follow; expected --batching mixed. "
            "Found --batching grouped."
        )
    if not isinstance(inner, MixedSampler):
        raise ConfigError(
            "a Poisson sampler replaces the grouped or mixed samplers; "
            f"found {type(inner).__name__}."
        )
    candidates = np.arange(inner.n, dtype=np.int64) if rows is None else np.asarray(rows)
    if candidates.size == 0:
        raise ConfigError("Poisson sampling needs at least one training row; found none.")
    return candidates, min(1.0, inner.batch_size / candidates.size), len(inner)
