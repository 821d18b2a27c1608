"""Batch samplers: each epoch is an iterator of index arrays into the training set.

``grouped`` is LASER-VFL's batching, where every batch shares one observed set of parties;
``mixed`` is plain shuffling, leaving per-sample subsets of parties to the method (DESIGN §5).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, Protocol

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


class SubsetSampler:
    """A sampler over some training rows (``rows``), yielding indices into the full set."""

    def __init__(self, inner: BatchSampler, rows: np.ndarray) -> None:
        self._inner = inner
        self.rows = rows

    def __len__(self) -> int:
        return len(self._inner)

    def epoch(self, rng: np.random.Generator) -> Iterator[np.ndarray]:
        for batch in self._inner.epoch(rng):
            yield self.rows[batch]


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
