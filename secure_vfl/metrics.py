"""Metrics of the LASER-VFL paper (appendix C): every observed party should predict well.

Predictions come as an (N, K) array: the class that party k reports for sample n, -1 where
party k does not observe sample n. Accuracy averages, per sample, the correctness of the observed
parties' predictions; F1 is computed per party on the samples it observes, then averaged.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import f1_score

from secure_vfl.errors import DataError


def _check(predictions: np.ndarray, labels: np.ndarray) -> np.ndarray:
    if predictions.ndim != 2 or predictions.shape[0] != labels.shape[0]:
        raise DataError(
            f"predictions must be (N, K) with N = {labels.shape[0]} labels; "
            f"found shape {predictions.shape}."
        )
    observed = predictions >= 0
    if not observed.any(axis=1).all():
        raise DataError("every sample needs at least one observed party's prediction.")
    return observed


def accuracy(predictions: np.ndarray, labels: np.ndarray) -> float:
    """100 x mean over samples of the share of observed parties that predict the label."""
    observed = _check(predictions, labels)
    correct = (predictions == labels[:, None]) & observed
    return float(100.0 * np.mean(correct.sum(axis=1) / observed.sum(axis=1)))


def f1(predictions: np.ndarray, labels: np.ndarray, num_classes: int) -> float:
    """100 x F1 per party on the samples it observes (binary: positive class 1; else macro)."""
    observed = _check(predictions, labels)
    average = "binary" if num_classes == 2 else "macro"
    scores = []
    for k in range(predictions.shape[1]):
        rows = observed[:, k]
        if rows.any():
            scores.append(
                f1_score(
                    labels[rows],
                    predictions[rows, k],
                    average=average,
                    labels=list(range(num_classes)) if average == "macro" else None,
                    zero_division=0,
                )
            )
    return float(100.0 * np.mean(scores))
