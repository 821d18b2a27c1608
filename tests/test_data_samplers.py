"""Batch samplers: grouped (one observed set per batch), mixed, and Poisson for DP runs."""

from __future__ import annotations

import numpy as np
import pytest

from secure_vfl.data.missingness import mcar
from secure_vfl.data.samplers import (
    GroupedSampler,
    MixedSampler,
    PoissonSampler,
    make_sampler,
    poisson_like,
)
from secure_vfl.errors import ConfigError, DataError


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


@pytest.mark.parametrize("kind", ["grouped", "mixed", "subset"])
def test_a_sampler_takes_back_only_an_epoch_it_could_have_drawn(mask, kind):
    """A resumed run's batch order (from its checkpoint) is checked by its sampler: every row
    once, in the batches it cuts (one observed set each, when grouped)."""
    rows = np.arange(0, mask.shape[0], 2) if kind == "subset" else None
    sampler = make_sampler("mixed" if kind == "mixed" else "grouped", mask, 16, rows=rows)
    order = list(sampler.epoch(np.random.default_rng(1)))
    sampler.check_order(order)
    other = [order[0][:8], order[0][8:], *order[1:]]  # the same rows, cut otherwise
    with pytest.raises(DataError, match="batch"):
        sampler.check_order(other)
    with pytest.raises(DataError, match="rows once expected; found row"):
        sampler.check_order([order[0][::-1].copy() if k == 1 else b for k, b in enumerate(order)])
    with pytest.raises(DataError, match="a 1-D array of row indices expected, found float64"):
        sampler.check_order([b.astype(np.float64) for b in order])
    if kind != "mixed":
        a, b = (next(x for x in order if mask[x[0], 0] == v) for v in (True, False))
        swapped = [
            np.r_[b[:1], x[1:]] if x is a else np.r_[a[:1], x[1:]] if x is b else x for x in order
        ]
        with pytest.raises(DataError, match="samples of one observed set of parties expected"):
            sampler.check_order(swapped)


def test_make_sampler_by_name(mask):
    assert isinstance(make_sampler("grouped", mask, 8), GroupedSampler)
    mixed = make_sampler("mixed", mask, 8)
    assert isinstance(mixed, MixedSampler) and mixed.n == mask.shape[0]
    with pytest.raises(ConfigError, match=r"'grouped' or 'mixed'. Found 'random'"):
        make_sampler("random", mask, 8)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"`batch_size` must be >= 1. Found 0"):
        make_sampler("grouped", mask, 0)


def test_poisson_sampling_takes_each_row_independently_at_the_rate() -> None:
    rows = np.arange(0, 2000, 2)  # a subset of a training set of 2000 rows
    sampler = PoissonSampler(
        rows, rate=0.05, steps_per_epoch=20, epochs=10, rng=np.random.default_rng(0), n=2000
    )
    schedule = sampler.schedule
    assert sampler.draws == 200 and len(schedule) == 200 and len(sampler) == 20
    sizes = np.array([batch.size for batch in schedule])
    assert sizes.std() > 2  # variable batch sizes, mean rate * rows = 50
    assert sizes.mean() == pytest.approx(50, rel=0.05)
    uses = sampler.uses()
    assert uses[1::2].sum() == 0  # only the sampler's rows are drawn
    # each row is used Binomial(200, 0.05) times: mean 10, variance 9.5
    assert uses[rows].mean() == pytest.approx(10, rel=0.03)
    assert uses[rows].var() == pytest.approx(9.5, rel=0.15)
    assert all(np.unique(batch).size == batch.size for batch in schedule)
    again = PoissonSampler(
        rows, rate=0.05, steps_per_epoch=20, epochs=10, rng=np.random.default_rng(0), n=2000
    )
    assert all(np.array_equal(a, b) for a, b in zip(schedule, again.schedule, strict=True))


def test_poisson_epochs_replay_the_drawn_schedule_whatever_generator_is_passed() -> None:
    sampler = PoissonSampler(
        np.arange(100), rate=0.1, steps_per_epoch=10, epochs=2, rng=np.random.default_rng(1)
    )
    used = [b for _ in range(2) for b in sampler.epoch(np.random.default_rng(99))]
    assert all(np.array_equal(a, b) for a, b in zip(used, sampler.schedule, strict=True))
    with pytest.raises(ConfigError, match="all used"):
        next(sampler.epoch(np.random.default_rng(0)))


def test_an_empty_poisson_draw_is_a_step_and_a_schedule_without_them_is_not_restored() -> None:
    """An empty draw stays in the schedule as a step of no rows (DP-SGD takes a noise-only
    step there); a checkpoint's schedule that left them out (an earlier release) would resume
    with fewer steps than the accountant prices, and is refused."""
    sampler = PoissonSampler(
        np.arange(20), rate=0.05, steps_per_epoch=30, epochs=2, rng=np.random.default_rng(0)
    )
    assert [len(epoch) for epoch in sampler.epochs] == [30, 30]
    empty = sum(batch.size == 0 for batch in sampler.schedule)
    assert empty > 5  # (1 - 0.05)^20 = 0.36 of 60 draws
    again = PoissonSampler(
        np.arange(20), rate=0.05, steps_per_epoch=30, epochs=2, rng=np.random.default_rng(1)
    )
    again.restore(sampler.epochs, next_epoch=1)
    assert all(np.array_equal(a, b) for a, b in zip(again.schedule, sampler.schedule, strict=True))
    dropped = [[batch for batch in epoch if batch.size] for epoch in sampler.epochs]
    with pytest.raises(DataError, match="30 draws per epoch, empty ones included, expected"):
        again.restore(dropped, next_epoch=1)


def test_poisson_like_keeps_the_rows_rate_and_steps_and_refuses_grouped_batches(mask):
    labelled = np.arange(0, 1003, 3)
    poisson = poisson_like(
        make_sampler("mixed", mask, 32, rows=labelled),
        n=1003,
        epochs=2,
        rng=np.random.default_rng(0),
    )
    assert poisson.rate == pytest.approx(32 / labelled.size)
    assert len(poisson) == -(-labelled.size // 32) and poisson.n == 1003
    assert set(np.concatenate(poisson.schedule)) <= set(labelled)
    with pytest.raises(ConfigError, match="expected --batching mixed"):
        poisson_like(GroupedSampler(mask, 16), n=1003, epochs=1, rng=np.random.default_rng(0))
    with pytest.raises(ConfigError, match="rate"):
        PoissonSampler(
            np.arange(4), rate=0.0, steps_per_epoch=1, epochs=1, rng=np.random.default_rng(0)
        )


def test_a_poisson_schedule_too_large_to_hold_is_refused_before_a_draw() -> None:
    """The whole schedule is drawn up front: 5000 DP-SGD epochs of fashion-mnist's 60000
    training rows would hold 3e8 row indices (2.4 GB); at batch size 1, 100000 epochs of
    breast-cancer's 455 rows hold only 4.6e7 indices, but in as many arrays (about 8 GB,
    which a bound on the indices alone let through). Both are refused by their size."""
    rng = np.random.default_rng(0)
    drawn = rng.bit_generator.state
    PoissonSampler(np.arange(100), rate=0.5, steps_per_epoch=2, epochs=10, rng=rng)
    assert rng.bit_generator.state != drawn  # a schedule within the bound is drawn
    for rows, rate, steps, epochs, said in [
        (60000, 128 / 60000, 469, 5000, r"holds about 3e\+08 row indices in 2345000 draws"),
        (455, 1 / 455, 455, 100000, r"holds about 4\.55e\+07 row indices in 45500000 draws"),
    ]:
        drawn = rng.bit_generator.state
        with pytest.raises(ConfigError, match=rf"{said} \(.* GiB\).*at most 1 GiB"):
            PoissonSampler(
                np.arange(rows), rate=rate, steps_per_epoch=steps, epochs=epochs, rng=rng
            )
        assert rng.bit_generator.state == drawn  # refused before anything was drawn
