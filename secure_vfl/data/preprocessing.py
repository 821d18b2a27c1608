"""Standardisation with training statistics only, and seeded stratified train/test splits.

Test rows never contribute to the statistics a model is trained with: each party standardises its
own block with the mean and standard deviation of the training rows it actually observes.
"""

from __future__ import annotations

import numpy as np

from secure_vfl.errors import ConfigError, DataError

STD_FLOOR = 1e-6
"""Smallest standard deviation used to divide by, so constant features map to 0, not to NaN."""


class Standardizer:
    """Per-feature ``(x - mean) / std`` fitted on training rows, for any trailing feature shape.

    Statistics are taken over axis 0 only, so an image block ``(N, C, H, W)`` gets one mean and
    one std per pixel and channel, as a tabular block ``(N, D)`` gets one per column.
    """

    def __init__(self) -> None:
        self._mean: np.ndarray | None = None
        self._std: np.ndarray | None = None

    @property
    def mean(self) -> np.ndarray:
        """Per-feature training mean, shape = the block's trailing shape."""
        if self._mean is None:
            raise DataError("this Standardizer is not fitted yet; call `fit` first.")
        return self._mean

    @property
    def std(self) -> np.ndarray:
        """Per-feature training standard deviation, floored at ``STD_FLOOR``."""
        if self._std is None:
            raise DataError("this Standardizer is not fitted yet; call `fit` first.")
        return self._std

    def fit(self, x: np.ndarray, row_mask: np.ndarray | None = None) -> Standardizer:
        """Fit on the rows of ``x`` (the training rows); with ``row_mask`` only on rows where it
        is True (the rows this party observes). Returns ``self``."""
        if x.ndim < 2:
            raise DataError(f"`x` must have shape (N, ...features). Found shape {x.shape}.")
        rows = x
        if row_mask is not None:
            row_mask = np.asarray(row_mask)
            if row_mask.dtype != np.bool_ or row_mask.shape != (x.shape[0],):
                raise DataError(
                    f"`row_mask` must be a bool array of shape ({x.shape[0]},). "
                    f"Found {row_mask.dtype} of shape {row_mask.shape}."
                )
            rows = x[row_mask]
        if rows.shape[0] == 0:
            raise DataError("cannot fit a Standardizer on zero rows; no training row is observed.")
        values = rows.astype(np.float64, copy=False)
        self._mean = values.mean(axis=0)
        self._std = np.maximum(values.std(axis=0), STD_FLOOR)
        return self

    def transform(self, x: np.ndarray) -> np.ndarray:
        """Return ``(x - mean) / std`` as float32; ``x`` must have the fitted trailing shape."""
        mean, std = self.mean, self.std
        if x.shape[1:] != mean.shape:
            raise DataError(
                f"`x` must have feature shape {mean.shape} (as fitted). Found {x.shape[1:]}."
            )
        return ((x.astype(np.float64, copy=False) - mean) / std).astype(np.float32)

    def fit_transform(self, x: np.ndarray, row_mask: np.ndarray | None = None) -> np.ndarray:
        """Fit on ``x`` (restricted to ``row_mask`` if given) and transform all of ``x``."""
        return self.fit(x, row_mask).transform(x)


def stratified_split(
    labels: np.ndarray, test_fraction: float, *, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices into sorted (train, test) index arrays, keeping class proportions.

    Each class contributes ``round(test_fraction * count)`` rows to the test split, so a class
    with a single sample stays in training.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"`test_fraction` must be in (0, 1). Found {test_fraction}.")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise DataError(f"`labels` must be 1-D. Found shape {labels.shape}.")
    test_parts: list[np.ndarray] = []
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        n_test = round(test_fraction * members.size)
        test_parts.append(rng.permutation(members)[:n_test])
    test = np.sort(np.concatenate(test_parts)) if test_parts else np.empty(0, np.int64)
    in_test = np.zeros(labels.shape[0], dtype=bool)
    in_test[test] = True
    return np.flatnonzero(~in_test).astype(np.int64), test.astype(np.int64)
