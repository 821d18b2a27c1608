"""Metrics as the LASER paper's appendix C defines them."""

from __future__ import annotations

import numpy as np
import pytest

from secure_vfl.errors import DataError
from secure_vfl.metrics import accuracy, f1


def test_accuracy_averages_over_the_observed_parties_of_each_sample() -> None:
    predictions = np.array([[1, 1, -1], [0, 1, 1], [-1, -1, 2]])
    labels = np.array([1, 1, 0])
    # sample 0: 2/2 right; sample 1: 2/3 right; sample 2: 0/1 right
    assert accuracy(predictions, labels) == pytest.approx(100 * (1 + 2 / 3 + 0) / 3)


def test_f1_is_computed_per_party_on_the_samples_it_observes() -> None:
    labels = np.array([1, 0, 1, 0])
    predictions = np.array([[1, 1], [0, 1], [1, -1], [1, -1]])
    # party 0: tp=2 fp=1 fn=0 -> F1 = 0.8; party 1 (rows 0, 1): tp=1 fp=1 fn=0 -> F1 = 2/3
    assert f1(predictions, labels, 2) == pytest.approx(100 * (0.8 + 2 / 3) / 2)


def test_metrics_refuse_samples_nobody_predicts() -> None:
    with pytest.raises(DataError, match="at least one observed"):
        accuracy(np.array([[-1, -1]]), np.array([0]))
    with pytest.raises(DataError, match=r"\(N, K\)"):
        accuracy(np.array([1, 0]), np.array([1, 0]))
