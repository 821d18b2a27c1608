"""One evaluation protocol for every imputation method (paper section IV d, DESIGN section 5).

For each client, a fixed-seed random 20 % of its observed-and-available test entries is hidden;
the method imputes the corrupted rows; the score is the RMSE on exactly the hidden entries in
standardised space (errors divided by the global federated std), overall, per client and per
feature, and per feature also in the data's own units (times that std). The hidden entries
depend only on the task and the seed, so every method is scored on the same ones. Each
client's are drawn by its own generator (:func:`score_seed`), so a client that scores itself,
its test rows never leaving it (:class:`SelfScoring`), hides exactly the entries the evaluator
would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypedDict, runtime_checkable

import numpy as np

from secure_vfl import checks
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
    rmse_per_feature: dict[str, float]  # over every client's hidden entries of the feature
    rmse_per_feature_in_units: dict[str, float]  # the same times the feature's std: its units
    hidden_per_feature: dict[str, int]


@dataclass(frozen=True)
class HiddenErrors:
    """The squared errors of one client's imputation at its hidden test entries, in the
    yardstick's units: their sum and count, and the same per feature (float64 and int64 (F,))."""

    sse: float
    count: int
    feature_sse: np.ndarray
    feature_count: np.ndarray


@dataclass(frozen=True)
class ScoredErrors:
    """A scoring's errors: each client's (sum of squared errors, count) over its hidden test
    entries, and per feature their sums over every client scored (float64 and int64 (F,))."""

    per_client: dict[str, tuple[float, int]]
    feature_sse: np.ndarray
    feature_count: np.ndarray

    @classmethod
    def of(cls, errors: Mapping[str, HiddenErrors], features: int) -> ScoredErrors:
        """The errors of clients each scored apart (in one process: the evaluator's)."""
        return cls(
            per_client={name: (e.sse, e.count) for name, e in errors.items()},
            feature_sse=np.sum([e.feature_sse for e in errors.values()], axis=0)
            if errors
            else np.zeros(features),
            feature_count=np.sum([e.feature_count for e in errors.values()], axis=0)
            if errors
            else np.zeros(features, dtype=np.int64),
        )


SCORE_STREAM = 5
"""The key of the test draws' seeds under the run's seed (:func:`~secure_vfl.methods.imputation.
base.derived_seed`; 0 to 4 are the clients' training streams and MICE's)."""


def checked_fraction(fraction: object) -> float:
    """``fraction``, if it is a share of the test entries that can be hidden and scored: in
    (0, 1), for every method alike (a self-scoring client refuses any other); else ConfigError."""
    return checks.real("fraction", fraction, low=0, high=1, low_open=True, high_open=True)


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
) -> HiddenErrors:
    """The squared errors of ``imputed`` (``by``'s answer) against ``truth`` at the ``hidden``
    entries, in units of ``std``: their sum and count, overall and per feature. DataError for
    an answer of another shape or without a finite value at a hidden entry."""
    if imputed.shape != truth.values.shape:
        raise DataError(
            f"{by} returned shape {imputed.shape} for {truth.name}; expected {truth.values.shape}."
        )
    errors = (imputed - truth.values) / std.astype(np.float32)
    unscored = hidden & ~np.isfinite(errors)
    if unscored.any():
        raise DataError(
            f"{by} left {int(unscored.sum())} hidden entries of {truth.name} without a finite "
            "value."
        )
    squared = np.where(hidden, errors, 0.0).astype(np.float64) ** 2
    return HiddenErrors(
        sse=float((errors[hidden].astype(np.float64) ** 2).sum()),
        count=int(hidden.sum()),
        feature_sse=squared.sum(axis=0),
        feature_count=hidden.sum(axis=0).astype(np.int64),
    )


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


def scores_of(
    errors: ScoredErrors, *, features: Sequence[str], std: np.ndarray
) -> ImputationScores:
    """The scores of a scoring's ``errors``, of the ``features`` whose yardstick is ``std`` (a
    feature's RMSE in its own units is its RMSE in units of ``std`` times its std)."""
    per_client = {name: _rmse(sse, count) for name, (sse, count) in errors.per_client.items()}
    squared = sum(sse for sse, _ in errors.per_client.values())
    total = sum(count for _, count in errors.per_client.values())
    if not total:  # an RMSE of nothing: it printed nan, and exited 0
        raise _nothing_to_score(len(errors.per_client))
    per_feature = [
        _rmse(float(sse), int(count))
        for sse, count in zip(errors.feature_sse, errors.feature_count, strict=True)
    ]
    scored = np.array([r for r in per_client.values() if np.isfinite(r)])
    return ImputationScores(
        rmse=_rmse(squared, total),
        rmse_client_mean=float(scored.mean()) if scored.size else float("nan"),
        rmse_client_std=float(scored.std()) if scored.size else float("nan"),
        rmse_per_client=per_client,
        hidden_per_client={name: count for name, (_, count) in errors.per_client.items()},
        rmse_per_feature=dict(zip(features, per_feature, strict=True)),
        rmse_per_feature_in_units={
            feature: rmse * float(scale)
            for feature, rmse, scale in zip(features, per_feature, std, strict=True)
        },
        hidden_per_feature={
            feature: int(count)
            for feature, count in zip(features, errors.feature_count, strict=True)
        },
    )


def _rmse(squared: float, count: int) -> float:
    """The root of the mean of ``count`` squared errors summing to ``squared`` (NaN of none)."""
    return float(np.sqrt(squared / count)) if count else float("nan")


@runtime_checkable
class SelfScoring(Protocol):
    """An imputer whose clients score themselves (:class:`~secure_vfl.federation.messages.
    ScoreRequest`): their test rows never leave them."""

    def score(
        self, standardisation: Standardisation, *, seed: int, fraction: float
    ) -> ScoredErrors:
        """Each client's errors on its hidden test entries, and per feature their sums over
        the clients."""
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
    corrupted test rows here. Both see the same entries and give the same scores. ConfigError,
    before anything is asked, for a ``fraction`` outside (0, 1)."""
    fraction = checked_fraction(fraction)
    std = standardisation.std
    if isinstance(imputer, SelfScoring):
        scored = imputer.score(standardisation, seed=seed, fraction=fraction)
        return scores_of(scored, features=task.features, std=std)
    errors: dict[str, HiddenErrors] = {}
    for k, (corrupted, hidden) in enumerate(
        hidden_test_entries(task, seed=seed, fraction=fraction)
    ):
        truth = task.test[k]
        errors[truth.name] = squared_errors(
            imputer.impute(k, corrupted), truth, hidden, std, by=imputer.name
        )
    return scores_of(ScoredErrors.of(errors, len(task.features)), features=task.features, std=std)
