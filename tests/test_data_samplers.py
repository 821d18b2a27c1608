"""Batch samplers: grouped (one observed set per batch) and mixed."""

from __future__ import annotations

import numpy as np
import pytest

from secure_vfl.data.missingness import mcar
from secure_vfl.data.samplers import GroupedSampler, MixedSampler, make_sampler
from secure_vfl.errors import ConfigError


@pytest.fixture
def mask() -> np.ndarray:
    return mcar(1003, 3, 0.4, rng=np.random.default_rng(0))


def test_grouped_batches_share_one_mask_row(mask):
    sampler = GroupedSampler(mask, 16)
    for batch in sampler.epoch(np.random.default_rng(1)):
        assert (mask[batch] == mask[batch[0]]).all()


def test_grouped_epoch_covers_every_sample_once(mask):
    sampler = GroupedSampler(mask, 16)
    batches = list(sampler.epoch(np.random.default_rng(1)))
    assert len(batches) == len(sampler)
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(mask.shape[0]))
    assert all(batch.dtype == np.int64 for batch in batches)


def test_grouped_keeps_last_partial_batch_of_each_bucket(mask):
    sampler = GroupedSampler(mask, 16)
    sizes = sorted(len(b) for b in sampler.epoch(np.random.default_rng(2)))
    partial = sorted(b.size % 16 for b in sampler.buckets if b.size % 16)
    assert sizes[: len(partial)] == partial
    assert len(sampler.patterns) == len(sampler.buckets) == 8


def test_grouped_order_changes_between_epochs(mask):
    sampler = GroupedSampler(mask, 16)
    generator = np.random.default_rng(3)
    first = np.concatenate(list(sampler.epoch(generator)))
    second = np.concatenate(list(sampler.epoch(generator)))
    assert not np.array_equal(first, second)
    first_buckets = [tuple(mask[b[0]]) for b in sampler.epoch(np.random.default_rng(4))]
    second_buckets = [tuple(mask[b[0]]) for b in sampler.epoch(np.random.default_rng(5))]
    assert first_buckets != second_buckets  # batch order is shuffled across buckets


def test_mixed_epoch_covers_all_once_and_reshuffles():
    sampler = MixedSampler(1003, 32)
    generator = np.random.default_rng(0)
    batches = list(sampler.epoch(generator))
    assert len(batches) == len(sampler) == 32 and len(batches[-1]) == 1003 - 31 * 32
    np.testing.assert_array_equal(np.sort(np.concatenate(batches)), np.arange(1003))
    assert not np.array_equal(
        np.concatenate(batches), np.concatenate(list(sampler.epoch(generator)))
    )


def test_make_sampler_by_name(mask):
    assert isinstance(make_sampler("grouped", mask, 8), GroupedSampler)
    mixed = make_sampler("mixed", mask, 8)
    assert isinstance(mixed, MixedSampler) and mixed.n == mask.shape[0]
    with pytest.raises(ConfigError, match=r"'grouped' or 'mixed'. Found 'random'"):
        make_sampler("random", mask, 8)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"`batch_size` must be >= 1. Found 0"):
        make_sampler("grouped", mask, 0)
