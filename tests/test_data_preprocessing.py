"""Standardisation with training rows only, and stratified splits."""

from __future__ import annotations

import numpy as np
import pytest

from secure_vfl.data.preprocessing import Standardizer, stratified_split
from secure_vfl.errors import ConfigError, DataError


def test_standardizer_uses_only_training_rows():
    generator = np.random.default_rng(0)
    train = generator.normal(5.0, 2.0, size=(5000, 3)).astype(np.float32)
    test = generator.normal(-3.0, 1.0, size=(5000, 3)).astype(np.float32)
    scaler = Standardizer().fit(train)
    scaled_train, scaled_test = scaler.transform(train), scaler.transform(test)
    assert scaled_train.dtype == np.float32
    np.testing.assert_allclose(scaled_train.mean(axis=0), 0.0, atol=1e-4)
    np.testing.assert_allclose(scaled_train.std(axis=0), 1.0, atol=1e-4)
    np.testing.assert_allclose(scaled_test.mean(axis=0), -4.0, atol=0.1)  # (-3 - 5) / 2
    np.testing.assert_allclose(scaled_test.std(axis=0), 0.5, atol=0.05)


def test_standardizer_row_mask_ignores_unobserved_rows():
    x = np.array([[1.0], [3.0], [1000.0]], dtype=np.float32)
    scaler = Standardizer().fit(x, np.array([True, True, False]))
    assert scaler.mean.tolist() == [2.0]
    assert scaler.std.tolist() == [1.0]


def test_standardizer_floors_constant_features():
    x = np.full((10, 2), 7.0, dtype=np.float32)
    scaled = Standardizer().fit_transform(x)
    assert np.isfinite(scaled).all() and (scaled == 0).all()


def test_standardizer_keeps_trailing_image_shape():
    x = np.random.default_rng(1).random((20, 1, 4, 3)).astype(np.float32)
    scaler = Standardizer().fit(x)
    assert scaler.mean.shape == (1, 4, 3)
    with pytest.raises(DataError, match=r"feature shape \(1, 4, 3\).*Found \(1, 3, 4\)"):
        scaler.transform(np.zeros((2, 1, 3, 4), np.float32))


def test_standardizer_refuses_unfitted_use_and_empty_rows():
    with pytest.raises(DataError, match="not fitted"):
        Standardizer().transform(np.zeros((2, 2), np.float32))
    with pytest.raises(DataError, match="zero rows"):
        Standardizer().fit(np.zeros((2, 2), np.float32), np.array([False, False]))


def test_stratified_split_keeps_class_proportions_and_covers_rows_once():
    labels = np.repeat([0, 1, 2], [500, 300, 200])
    train, test = stratified_split(labels, 0.2, rng=np.random.default_rng(0))
    assert np.bincount(labels[test]).tolist() == [100, 60, 40]
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(1000))
    again, _ = stratified_split(labels, 0.2, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(train, again)
    other, _ = stratified_split(labels, 0.2, rng=np.random.default_rng(1))
    assert not np.array_equal(train, other)


@pytest.mark.parametrize("fraction", [0.0, 1.0, 1.5])
def test_stratified_split_refuses_fractions_outside_open_interval(fraction):
    with pytest.raises(ConfigError, match=rf"\(0, 1\)\. Found {fraction}"):
        stratified_split(np.zeros(10), fraction, rng=np.random.default_rng(0))
