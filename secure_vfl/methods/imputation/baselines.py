"""The baselines of paper Table II behind the :class:`Imputer` interface.

Per client (``mean``, ``knn``, ``mice``, ``dae``): each client fits on its own training rows and
its own available columns. Federated (``fed-mean``, ``fed-dae``): global means from the federated
statistics, and the denoising autoencoder trained by the FedAvg loop of FedHF-Impute.

kNN and MICE are scikit-learn's ``KNNImputer`` and ``IterativeImputer`` on the client's
standardised available columns, and their output is what fills the missing entries (the public
reference code's versions silently returned column means). A feature that is available at a
client but never observed in its training rows has nothing to learn from locally: the mean, kNN
and MICE baselines fill it with the federated global mean (0 in standardised space).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import TypeAlias

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from sklearn.experimental import enable_iterative_imputer  # noqa: F401  (registers the class)
from sklearn.impute import IterativeImputer, KNNImputer
from torch import Tensor, nn

from secure_vfl import checks
from secure_vfl.data.imputation import ClientData, ImputationTask
from secure_vfl.errors import DataError
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.methods.imputation import parts
from secure_vfl.methods.imputation.base import (
    IMPUTERS,
    ImputeConfig,
    RoundCallback,
    check_client,
    derived_seed,
    imputation_rule,
)
from secure_vfl.methods.imputation.clients import ModelFactory
from secure_vfl.methods.imputation.federation import federated_statistics
from secure_vfl.methods.imputation.fedhf import (
    RECONSTRUCTIONS,
    Reconstruction,
    ReconstructionImputer,
    reconstruction_imputer,
)
from secure_vfl.methods.imputation.statistics import Standardisation, StatisticsPrivacyFactory

KNN_NEIGHBOURS = 5
MICE_ITERATIONS = 10

SklearnImputer: TypeAlias = KNNImputer | IterativeImputer


class ColumnMeanImputer:
    """Fills every missing-but-available entry with a per-client vector of column means."""

    def __init__(self, name: str, task: ImputationTask, means: Sequence[np.ndarray]) -> None:
        self.name = name
        self.task = task
        self.means = [np.asarray(m, dtype=np.float32) for m in means]

    def fit(self, *, on_round: RoundCallback | None = None) -> list[float]:
        """Nothing to train: the means are known at construction."""
        return []

    def impute(self, client_index: int, client: ClientData) -> np.ndarray:
        check_client(self.task, client_index, client)
        filled = np.broadcast_to(self.means[client_index], client.values.shape)
        return imputation_rule(client, filled)

    def save_part(self, client: str, directory: Path) -> dict[str, str]:
        """Client ``client``'s means (its own, or the federation's that it was sent) and schema
        into ``directory``; the SHA-256 of each file, for the imputer's manifest."""
        names = [train.name for train in self.task.train]
        if client not in names:
            raise DataError(f"{self.name}: no client {client!r}; expected one of {names}.")
        index = names.index(client)
        return parts.write_part(
            directory,
            client=client,
            kind=parts.MEANS,
            tensors=parts.means_tensors(self.task.train[index].available, self.means[index]),
        )


def client_means(client: ClientData, fallback: np.ndarray) -> np.ndarray:
    """Column means of the client's observed training values; ``fallback`` where never observed."""
    observed = client.observed
    count = observed.sum(axis=0)
    total = np.where(observed, client.values.astype(np.float64), 0.0).sum(axis=0)
    return np.where(count > 0, total / np.maximum(count, 1), fallback)


class PerClientSklearnImputer:
    """A scikit-learn imputer per client, fitted on its standardised training columns.

    Only the columns available at the client and observed at least once in its training rows
    enter the estimator; other available columns get the federated mean.
    """

    def __init__(
        self,
        name: str,
        task: ImputationTask,
        standardisation: Standardisation,
        make_estimator: Callable[[int, np.ndarray], SklearnImputer],
    ) -> None:
        self.name = name
        self.task = task
        self.standardisation = standardisation
        self.make_estimator = make_estimator
        self.columns = [c.available & c.observed.any(axis=0) for c in task.train]
        self.estimators: list[SklearnImputer | None] = [None] * len(task.train)

    def fit(self, *, on_round: RoundCallback | None = None) -> list[float]:
        """Fit each client's estimator on its own training rows; no rounds, so no curve."""
        for k, client in enumerate(self.task.train):
            columns = self.columns[k]
            if not columns.any():
                continue
            z = self.standardisation.standardise(client.values)[:, columns].astype(np.float64)
            estimator = self.make_estimator(k, z)
            with warnings.catch_warnings():
                # IterativeImputer warns when max_iter (fixed at 10; the paper gives no
                # count) is reached.
                warnings.simplefilter("ignore", ConvergenceWarning)
                estimator.fit(z)
            self.estimators[k] = estimator
        return []

    def impute(self, client_index: int, client: ClientData) -> np.ndarray:
        check_client(self.task, client_index, client)
        columns = self.columns[client_index]
        z = np.where(client.observed, self.standardisation.standardise(client.values), np.nan)
        z = z.astype(np.float64)
        filled = np.zeros_like(z)
        estimator = self.estimators[client_index]
        if columns.any():
            if estimator is None:
                raise DataError(f"{self.name} must be fitted before it imputes; call fit() first.")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ConvergenceWarning)
                out = estimator.transform(z[:, columns]) if client.n else z[:, columns]
            if out.shape != (client.n, int(columns.sum())):
                raise DataError(
                    f"{self.name} returned shape {out.shape}; "
                    f"expected {(client.n, int(columns.sum()))}."
                )
            filled[:, columns] = out
        return imputation_rule(client, self.standardisation.destandardise(filled))


class DenoisingAutoencoder(nn.Module):
    """DAE on the global F-dim vector: [x || m] (2F) -> hidden -> hidden -> F."""

    def __init__(self, features: int, *, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2 * features, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, features),
        )

    def forward(self, x: Tensor, observed: Tensor, available: Tensor) -> Tensor:
        return self.net(torch.cat([x, observed.to(x.dtype)], dim=-1))


def make_mean(
    task: ImputationTask,
    config: ImputeConfig,
    *,
    seed: int,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
) -> ColumnMeanImputer:
    """Per-client column means of its training rows (federated mean where never observed)."""
    checks.integer("seed", seed, low=0)  # it draws nothing, but a run's seed is checked alike
    statistics = federated_statistics(
        task.train, aggregator=aggregator, channel=channel, privacy=privacy, roles=roles
    )
    fallback = statistics.standardisation.mean
    return ColumnMeanImputer("mean", task, [client_means(c, fallback) for c in task.train])


def make_fed_mean(
    task: ImputationTask,
    config: ImputeConfig,
    *,
    seed: int,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
) -> ColumnMeanImputer:
    """Fed-Mean: every client fills with the global means of the federated statistics."""
    checks.integer("seed", seed, low=0)  # it draws nothing, but a run's seed is checked alike
    statistics = federated_statistics(
        task.train, aggregator=aggregator, channel=channel, privacy=privacy, roles=roles
    )
    mean = statistics.standardisation.mean
    return ColumnMeanImputer("fed-mean", task, [mean] * len(task.train))


def make_knn(
    task: ImputationTask,
    config: ImputeConfig,
    *,
    seed: int,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
) -> PerClientSklearnImputer:
    """kNN per client: ``KNNImputer(n_neighbors=5)``, donors = the client's training rows."""
    checks.integer("seed", seed, low=0)  # it draws nothing, but a run's seed is checked alike
    statistics = federated_statistics(
        task.train, aggregator=aggregator, channel=channel, privacy=privacy, roles=roles
    )
    return PerClientSklearnImputer(
        "knn",
        task,
        statistics.standardisation,
        lambda k, z: KNNImputer(n_neighbors=KNN_NEIGHBOURS),
    )


def make_mice(
    task: ImputationTask,
    config: ImputeConfig,
    *,
    seed: int,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
) -> PerClientSklearnImputer:
    """MICE per client: ``IterativeImputer`` (BayesianRidge chains), seeded, 10 iterations.

    Imputations are clipped to each column's observed training range: on wide, collinear data
    (chorizon, 99 features) the unclipped chained regressions diverge to infinity.
    """
    states = [derived_seed(seed, 4, k) % 2**32 for k in range(len(task.train))]
    statistics = federated_statistics(
        task.train, aggregator=aggregator, channel=channel, privacy=privacy, roles=roles
    )
    return PerClientSklearnImputer(
        "mice",
        task,
        statistics.standardisation,
        lambda k, z: IterativeImputer(
            max_iter=MICE_ITERATIONS,
            random_state=states[k],
            min_value=np.nanmin(z, axis=0),
            # scikit-learn wants min < max; a constant column gets a 1e-6 wide range
            max_value=np.maximum(np.nanmax(z, axis=0), np.nanmin(z, axis=0) + 1e-6),
        ),
    )


def _make_dae(
    name: str,
    task: ImputationTask,
    config: ImputeConfig,
    *,
    seed: int,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
) -> ReconstructionImputer:
    """A DAE block-masked like FedHF: one per client trained alone (``dae``), or one trained by
    FedHF-Impute's FedAvg loop (``fed-dae``). It reads no graph, so none is published."""
    return reconstruction_imputer(
        name,
        task,
        config,
        seed=seed,
        aggregator=aggregator,
        channel=channel,
        privacy=privacy,
        roles=roles,
    )


def _dae_models(config: ImputeConfig, features: int) -> ModelFactory:
    return lambda graph: DenoisingAutoencoder(features, hidden=config.hidden)


IMPUTERS.register("mean", make_mean)
IMPUTERS.register("knn", make_knn)
IMPUTERS.register("mice", make_mice)
RECONSTRUCTIONS.register(
    "dae", Reconstruction(models=_dae_models, uses_graph=False, federated=False)
)
RECONSTRUCTIONS.register(
    "fed-dae", Reconstruction(models=_dae_models, uses_graph=False, federated=True)
)
IMPUTERS.register("dae", partial(_make_dae, "dae"))
IMPUTERS.register("fed-mean", make_fed_mean)
IMPUTERS.register("fed-dae", partial(_make_dae, "fed-dae"))
