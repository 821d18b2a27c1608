"""One evaluation protocol for every imputation method (paper section IV d, DESIGN section 5).

For each client, a fixed-seed random 20 % of its observed-and-available test entries is hidden;
the method imputes the corrupted rows; the score is the RMSE on exactly the hidden entries in
standardised space (errors divided by the global federated std). The hidden entries depend only
on the task and the seed, so every method is scored on the same ones. Each client's are drawn by
its own generator (:func:`score_seed`), so a client that scores itself, its test rows never
leaving it (:class:`SelfScoring`), hides exactly the entries the evaluator would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, TypedDict, runtime_checkable

import numpy as np

from secure_vfl.data.imputation import ClientData, ImputationTask, hide_entries
from secure_vfl.errors import DataError
from secure_vfl.methods.imputation.base import Imputer, derived_seed
from secure_vfl.methods.imputation.statistics import Standardisation

TEST_FRACTION = 0.2


class ImputationScores(TypedDict):
    """RMSEs in standardised space; per-client entries keyed by client name (JSON-ready)."""

    rmse: float  # over all hidden entries of all clients
    rmse_client_mean: float  # mean of the per-client RMSEs
    rmse_client_std: float  # their (population) std across clients
    rmse_per_client: dict[str, float]
    hidden_per_client: dict[str, int]


SCORE_STREAM = 5
"""The key of the test draws' seeds under the run's seed (:func:`~secure_vfl.methods.imputation.
base.derived_seed`; 0 to 4 are the clients' training streams and MICE's)."""


def score_seed(seed: int, client_index: int) -> int:
    """The seed of client ``client_index``'s hidden test entries in a run seeded ``seed``: each
    client draws its own, so a client that scores itself (in its own process) draws the same
    entries as the in-process evaluator."""
    return derived_seed(seed, SCORE_STREAM, client_index)


def hide_test_entries(
    client: ClientData, seed: int, fraction: float = TEST_FRACTION
) -> tuple[ClientData, np.ndarray]:
    """``client``'s test rows with ``fraction`` of their observed-and-available entries hidden,
    drawn by a generator seeded ``seed`` (:func:`score_seed`), and the mask of those entries."""
    return hide_entries(client, fraction, rng=np.random.default_rng(seed))


def hidden_test_entries(
    task: ImputationTask, *, seed: int, fraction: float = TEST_FRACTION
) -> list[tuple[ClientData, np.ndarray]]:
    """Each test client with ``fraction`` of its observed-and-available entries hidden, each
    drawn by the client's own generator (:func:`score_seed`)."""
    return [
        hide_test_entries(client, score_seed(seed, k), fraction)
        for k, client in enumerate(task.test)
    ]


def squared_errors(
    imputed: np.ndarray, truth: ClientData, hidden: np.ndarray, std: np.ndarray, *, by: str
) -> tuple[float, int]:
    """The sum of squared errors of ``imputed`` (``by``'s answer) against ``truth`` over the
    ``hidden`` entries, in units of ``std``, and how many entries there are. DataError for an
    answer of another shape or without a finite value at a hidden entry."""
    if imputed.shape != truth.values.shape:
        raise DataError(
            f"{by} returned shape {imputed.shape} for {truth.name}; expected {truth.values.shape}."
        )
    errors = ((imputed - truth.values) / std.astype(np.float32))[hidden]
    if not np.all(np.isfinite(errors)):
        raise DataError(
            f"{by} left {int((~np.isfinite(errors)).sum())} hidden entries of "
            f"{truth.name} without a finite value."
        )
    return float((errors.astype(np.float64) ** 2).sum()), int(errors.size)


def check_scorable(task: ImputationTask, fraction: float = TEST_FRACTION) -> None:
    """DataError, before any work, when the evaluation would hide no test entry of any client
    (its score an RMSE of nothing): each client hides ``round(fraction * observed)`` of them,
    whatever the seed."""
    if not any(round(fraction * int(client.observed.sum())) for client in task.test):
        raise _nothing_to_score(len(task.test))


def _nothing_to_score(clients: int) -> DataError:
    return DataError(
        f"no client had a test entry to hide and score ({clients} clients, 0 hidden entries: "
        "their test rows are too few); expected more rows per client (a registered dataset: "
        "fewer --clients)."
    )


def scores_of(errors: Mapping[str, tuple[float, int]]) -> ImputationScores:
    """The scores of per-client (sum of squared errors, count) pairs, in client order."""
    per_client = {
        name: float(np.sqrt(sse / count)) if count else float("nan")
        for name, (sse, count) in errors.items()
    }
    squared = sum(sse for sse, _ in errors.values())
    total = sum(count for _, count in errors.values())
    if not total:  # an RMSE of nothing: it printed nan, and exited 0
        raise _nothing_to_score(len(errors))
    scored = np.array([r for r in per_client.values() if np.isfinite(r)])
    return ImputationScores(
        rmse=float(np.sqrt(squared / total)) if total else float("nan"),
        rmse_client_mean=float(scored.mean()) if scored.size else float("nan"),
        rmse_client_std=float(scored.std()) if scored.size else float("nan"),
        rmse_per_client=per_client,
        hidden_per_client={name: count for name, (_, count) in errors.items()},
    )


@runtime_checkable
class SelfScoring(Protocol):
    """An imputer whose clients score themselves (:class:`~secure_vfl.federation.messages.
    ScoreRequest`): their test rows never leave them."""

    def score(
        self, standardisation: Standardisation, *, seed: int, fraction: float
    ) -> dict[str, tuple[float, int]]:
        """Each client's (sum of squared errors, count) on its hidden test entries."""
        ...


def evaluate(
    imputer: Imputer,
    task: ImputationTask,
    *,
    standardisation: Standardisation,
    seed: int,
    fraction: float = TEST_FRACTION,
) -> ImputationScores:
    """Score ``imputer`` on the hidden test entries; a fitted imputer is expected. One whose
    clients score themselves is asked to (by messages); any other imputes each client's
    corrupted test rows here. Both see the same entries and give the same scores."""
    if isinstance(imputer, SelfScoring):
        return scores_of(imputer.score(standardisation, seed=seed, fraction=fraction))
    errors: dict[str, tuple[float, int]] = {}
    for k, (corrupted, hidden) in enumerate(
        hidden_test_entries(task, seed=seed, fraction=fraction)
    ):
        truth = task.test[k]
        errors[truth.name] = squared_errors(
            imputer.impute(k, corrupted), truth, hidden, standardisation.std, by=imputer.name
        )
    return scores_of(errors)
