"""Vertical partitioners: cut each sample's features into one block per party.

Tabular data is cut into contiguous column blocks of equal width (LASER-VFL); images into a grid
of equal patches (FALSE-VFL's 8 patches of Fashion-MNIST). Remainders are dropped so every block
of a kind has the same shape, as in both papers.
"""

from __future__ import annotations

import numpy as np

from secure_vfl.data.datasets import Kind
from secure_vfl.errors import ConfigError, DataError

_IMAGE_GRIDS: dict[int, tuple[int, int]] = {
    2: (1, 2),
    3: (1, 3),
    4: (2, 2),
    5: (1, 5),
    6: (2, 3),
    7: (1, 7),
    8: (2, 4),
    9: (3, 3),
    10: (2, 5),
}


def _check_parties(parties: int, width: int) -> None:
    """ConfigError unless each of ``parties`` can get at least one of ``width`` columns."""
    if parties < 1:
        raise ConfigError(f"`parties` must be at least 1. Found {parties}.")
    if parties > width:
        raise ConfigError(
            f"`parties` must be at most the number of features, {width} (a column each). "
            f"Found {parties}."
        )


def column_blocks(x: np.ndarray, parties: int) -> list[np.ndarray]:
    """Split ``(N, D)`` into ``parties`` contiguous blocks of ``D // parties`` columns each;
    the last ``D % parties`` columns are dropped."""
    if x.ndim != 2:
        raise DataError(f"tabular features must have shape (N, D). Found shape {x.shape}.")
    width = x.shape[1]
    _check_parties(parties, width)
    block = width // parties
    return [np.ascontiguousarray(x[:, k * block : (k + 1) * block]) for k in range(parties)]


def column_ranges(width: int, parties: int) -> list[range]:
    """The column indices each party gets from :func:`column_blocks` on ``width`` columns."""
    _check_parties(parties, width)
    block = width // parties
    return [range(k * block, (k + 1) * block) for k in range(parties)]


def left_out_columns(width: int, parties: int) -> range:
    """The last ``width % parties`` column indices, which no block of :func:`column_blocks`
    holds (empty when ``parties`` divides ``width``)."""
    _check_parties(parties, width)
    return range(width // parties * parties, width)


def image_grid(parties: int) -> tuple[int, int]:
    """(rows, cols) of the patch grid for ``parties`` in 2..10, as close to square as K allows."""
    try:
        return _IMAGE_GRIDS[parties]
    except KeyError:
        raise ConfigError(
            f"image partitions support `parties` in 2..10. Found {parties}."
        ) from None


def image_patches(x: np.ndarray, parties: int) -> list[np.ndarray]:
    """Cut ``(N, C, H, W)`` images into the :func:`image_grid` patches in row-major order.

    Patches are ``H // rows`` by ``W // cols``; remainder pixels at the bottom/right are dropped.
    """
    if x.ndim != 4:
        raise DataError(f"images must have shape (N, C, H, W). Found shape {x.shape}.")
    rows, cols = image_grid(parties)
    height, width = x.shape[2] // rows, x.shape[3] // cols
    if height == 0 or width == 0:
        raise ConfigError(
            f"images of {x.shape[2]}x{x.shape[3]} pixels cannot be cut into a {rows}x{cols} grid."
        )
    return [
        np.ascontiguousarray(x[:, :, r * height : (r + 1) * height, c * width : (c + 1) * width])
        for r in range(rows)
        for c in range(cols)
    ]


def partition(split_x: np.ndarray, kind: Kind, parties: int) -> list[np.ndarray]:
    """Column blocks for tabular data, image patches for images."""
    if kind == "tabular":
        return column_blocks(split_x, parties)
    if kind == "image":
        return image_patches(split_x, parties)
    raise ConfigError(f"`kind` must be 'tabular' or 'image'. Found {kind!r}.")
