"""One evaluation protocol for every imputation method (paper section IV d, DESIGN section 5).

For each client, a fixed-seed random 20 % of its observed-and-available test entries is hidden;
the method imputes the corrupted rows; the score is the RMSE on exactly the hidden entries in
standardised space (errors divided by the global federated std). The hidden entries depend only
on the task and the seed, so every method is scored on the same ones.
"""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from secure_vfl.data.imputation import ClientData, ImputationTask, hide_entries
from secure_vfl.errors import DataError
from secure_vfl.methods.imputation.base import Imputer
from secure_vfl.methods.imputation.statistics import Standardisation

TEST_FRACTION = 0.2


class ImputationScores(TypedDict):
    """RMSEs in standardised space; per-client entries keyed by client name (JSON-ready)."""

    rmse: float  # over all hidden entries of all clients
    rmse_client_mean: float  # mean of the per-client RMSEs
    rmse_client_std: float  # their (population) std across clients
    rmse_per_client: dict[str, float]
    hidden_per_client: dict[str, int]


def hidden_test_entries(
    task: ImputationTask, *, seed: int, fraction: float = TEST_FRACTION
) -> list[tuple[ClientData, np.ndarray]]:
    """Each test client with ``fraction`` of its observed-and-available entries hidden.

    One generator seeded with ``seed`` draws the clients' masks in client order.
    """
    rng = np.random.default_rng(seed)
    return [hide_entries(client, fraction, rng=rng) for client in task.test]


def evaluate(
    imputer: Imputer,
    task: ImputationTask,
    *,
    standardisation: Standardisation,
    seed: int,
    fraction: float = TEST_FRACTION,
) -> ImputationScores:
    """Score ``imputer`` on the hidden test entries; a fitted imputer is expected."""
    squared = 0.0
    total = 0
    per_client: dict[str, float] = {}
    hidden_counts: dict[str, int] = {}
    for k, (corrupted, hidden) in enumerate(
        hidden_test_entries(task, seed=seed, fraction=fraction)
    ):
        truth = task.test[k]
        imputed = imputer.impute(k, corrupted)
        if imputed.shape != truth.values.shape:
            raise DataError(
                f"{imputer.name} returned shape {imputed.shape} for {truth.name}; "
                f"expected {truth.values.shape}."
            )
        errors = ((imputed - truth.values) / standardisation.std.astype(np.float32))[hidden]
        if not np.all(np.isfinite(errors)):
            raise DataError(
                f"{imputer.name} left {int((~np.isfinite(errors)).sum())} hidden entries of "
                f"{truth.name} without a finite value."
            )
        client_squared = float((errors.astype(np.float64) ** 2).sum())
        per_client[truth.name] = (
            float(np.sqrt(client_squared / errors.size)) if errors.size else float("nan")
        )
        hidden_counts[truth.name] = int(errors.size)
        squared += client_squared
        total += int(errors.size)
    scored = np.array([r for r in per_client.values() if np.isfinite(r)])
    return ImputationScores(
        rmse=float(np.sqrt(squared / total)) if total else float("nan"),
        rmse_client_mean=float(scored.mean()) if scored.size else float("nan"),
        rmse_client_std=float(scored.std()) if scored.size else float("nan"),
        rmse_per_client=per_client,
        hidden_per_client=hidden_counts,
    )
