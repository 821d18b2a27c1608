"""Vertical partitioners: column blocks and image patches, remainders dropped."""

from __future__ import annotations

import re

import numpy as np
import pytest

from secure_vfl.data.partition import (
    column_blocks,
    image_grid,
    image_patches,
    left_out_columns,
    partition,
)
from secure_vfl.errors import ConfigError, DataError


def test_column_blocks_have_equal_width_and_drop_the_remainder():
    x = np.arange(5 * 10, dtype=np.float32).reshape(5, 10)
    blocks = column_blocks(x, 3)
    assert [b.shape for b in blocks] == [(5, 3)] * 3
    for k, block in enumerate(blocks):
        np.testing.assert_array_equal(block, x[:, 3 * k : 3 * k + 3])
    assert 9 not in np.concatenate(blocks, axis=1)[0]  # column 9 dropped


def test_left_out_columns_are_those_no_column_block_holds():
    assert left_out_columns(10, 3) == range(9, 10)
    assert left_out_columns(30, 4) == range(28, 30)  # breast-cancer over the default 4
    assert list(left_out_columns(4, 4)) == [] and list(left_out_columns(12, 3)) == []
    with pytest.raises(ConfigError, match="at most the number of features, 4"):
        left_out_columns(4, 5)


def test_column_blocks_one_party_and_one_column_each():
    x = np.ones((2, 4), np.float32)
    assert column_blocks(x, 1)[0].shape == (2, 4)
    assert [b.shape for b in column_blocks(x, 4)] == [(2, 1)] * 4


@pytest.mark.parametrize(
    ("parties", "expected"),
    [(0, "at least 1"), (5, "at most the number of features, 4 (a column each)")],
)
def test_column_blocks_refuse_party_counts_outside_one_to_d(parties, expected):
    # it said "in [1, 4]" where the CLI's own range starts at 2
    with pytest.raises(
        ConfigError, match=rf"`parties` must be {re.escape(expected)}.*Found {parties}"
    ):
        column_blocks(np.ones((2, 4), np.float32), parties)


def test_column_blocks_refuse_images():
    with pytest.raises(DataError, match=r"shape \(N, D\)"):
        column_blocks(np.ones((2, 1, 4, 4), np.float32), 2)


@pytest.mark.parametrize(
    ("parties", "grid"),
    [
        (2, (1, 2)),
        (3, (1, 3)),
        (4, (2, 2)),
        (5, (1, 5)),
        (6, (2, 3)),
        (7, (1, 7)),
        (8, (2, 4)),
        (9, (3, 3)),
        (10, (2, 5)),
    ],
)
def test_image_grid_table(parties, grid):
    assert image_grid(parties) == grid


@pytest.mark.parametrize("parties", [0, 1, 11])
def test_image_grid_refuses_other_party_counts(parties):
    with pytest.raises(ConfigError, match=rf"2\.\.10\. Found {parties}"):
        image_grid(parties)


def test_four_patches_are_quadrants():
    x = np.random.default_rng(0).random((3, 2, 8, 8)).astype(np.float32)
    top_left, top_right, bottom_left, bottom_right = image_patches(x, 4)
    np.testing.assert_array_equal(top_left, x[:, :, :4, :4])
    np.testing.assert_array_equal(top_right, x[:, :, :4, 4:])
    np.testing.assert_array_equal(bottom_left, x[:, :, 4:, :4])
    np.testing.assert_array_equal(bottom_right, x[:, :, 4:, 4:])


def test_eight_patches_of_fashion_mnist_are_14_by_7_row_major():
    x = np.arange(2 * 28 * 28, dtype=np.float32).reshape(2, 1, 28, 28)
    patches = image_patches(x, 8)
    assert [p.shape for p in patches] == [(2, 1, 14, 7)] * 8
    np.testing.assert_array_equal(patches[1], x[:, :, :14, 7:14])
    np.testing.assert_array_equal(patches[3], x[:, :, :14, 21:28])
    np.testing.assert_array_equal(patches[4], x[:, :, 14:, :7])
    together = np.concatenate([np.concatenate(patches[:4], 3), np.concatenate(patches[4:], 3)], 2)
    np.testing.assert_array_equal(together, x)


def test_image_patches_drop_remainder_pixels():
    x = np.ones((1, 1, 28, 28), np.float32)
    patches = image_patches(x, 9)  # 3x3 grid: 28 // 3 = 9, one row and column dropped
    assert [p.shape for p in patches] == [(1, 1, 9, 9)] * 9


def test_partition_dispatches_on_kind():
    assert len(partition(np.ones((2, 6), np.float32), "tabular", 3)) == 3
    assert partition(np.ones((2, 1, 4, 4), np.float32), "image", 4)[0].shape == (2, 1, 2, 2)
    with pytest.raises(ConfigError, match="`kind` must be"):
        partition(np.ones((2, 6), np.float32), "text", 3)  # type: ignore[arg-type]
