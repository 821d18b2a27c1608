"""FedHF-Impute (Algorithms 1-2): block-masked self-supervised training, FedAvg by messages.

The same loop trains any reconstruction model ``f(x, m, a) -> x_hat`` in standardised space: the
GNN of :mod:`secure_vfl.models.feature_graph` (``fedhf``) and the denoising autoencoder of the
baselines, federated (``fed-dae``) or per client (``dae``). The coordinator (the FedAvg server)
drives the clients only by messages (:mod:`secure_vfl.methods.imputation.federation`): it asks
for the statistics, publishes the global standardisation (and the graph), downloads the global
parameters to every client, asks the round's cohort to train and contribute
``[w_k * theta_k, w_k]`` with w_k = n_k / N the client's share of the N training rows (N from one
secure count at the start), and learns only the sum of those contributions, which it divides by
the summed shares (eq. 8). Every value sent is then at most max |theta| in magnitude, whatever
the clients' sizes, which keeps model updates inside the secure backends' fixed-point ranges
(GNN parameters are O(1)); the validation reports and the row count travel as wide digits.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.data.imputation import ClientData, ImputationTask
from secure_vfl.errors import ConfigError, ProtocolError, RunWarning
from secure_vfl.federation.aggregator import SealingScheme, SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.methods.base import isolated_seed
from secure_vfl.methods.imputation.base import (
    IMPUTERS,
    ImputeConfig,
    RoundCallback,
    check_client,
    derived_seed,
)
from secure_vfl.methods.imputation.clients import (
    RESTART_TAG,
    ImputationClient,
    ModelFactory,
    TrainingPlan,
    flat_parameters,
)
from secure_vfl.methods.imputation.evaluation import ScoredErrors, checked_fraction, score_seed
from secure_vfl.methods.imputation.federation import (
    ImputationFederation,
    build_imputation_federation,
    in_process_clients,
)
from secure_vfl.methods.imputation.statistics import (
    STATISTICS_ROUNDS,
    Standardisation,
    StatisticsPrivacyFactory,
    collect_statistics,
    from_wide_digits,
    wide_width,
)
from secure_vfl.models.feature_graph import FeatureGraph, FeatureGraphImputer
from secure_vfl.registry import Registry

_NO_ARGUMENTS = np.zeros(0)


def cohort_size(client_fraction: float, clients: int) -> int:
    """How many of ``clients`` a FedAvg round samples: ``client_fraction`` of them, rounded half
    up, at least 1."""
    return max(1, int(client_fraction * clients + 0.5))


def _check_cohort(client_fraction: float, clients: int, scheme: str) -> None:
    """ConfigError when a round would sample one client of several under a secure sum, which
    refuses a sum of one (it is that client's update in the clear)."""
    if scheme and clients >= 2 and cohort_size(client_fraction, clients) < 2:
        least = math.ceil(1.5 / clients * 1e4) / 1e4  # samples 2, even shown to 4 decimals
        raise ConfigError(
            f"`client_fraction` {client_fraction:g} of {clients} clients samples 1 a round; a "
            f"secure sum ({scheme}) needs at least 2 (the sum of one is its update in the clear): "
            f"expected a client_fraction of at least {least:g}."
        )


def _message_round(round: int) -> int:
    """The message round of FedAvg round ``round`` (0-based; -1: the set-up's row count and
    initial download; ``rounds``: the best model's download): after the statistics' rounds."""
    return STATISTICS_ROUNDS + 1 + round


@dataclass(frozen=True)
class Reconstruction:
    """How a reconstruction method is built: its model's factory for a configuration and a
    number of features, whether the model reads the feature graph, and whether its clients
    train one model by FedAvg (else each trains its own alone)."""

    models: Callable[[ImputeConfig, int], ModelFactory]
    uses_graph: bool
    federated: bool


RECONSTRUCTIONS: Registry[Reconstruction] = Registry("reconstruction method")
"""The reconstruction methods by name (``fedhf`` here, ``dae`` and ``fed-dae`` in
:mod:`~secure_vfl.methods.imputation.baselines`): what the in-process factories build, and what
a deployed client builds its own part from."""


class ReconstructionImputer:
    """A block-masked reconstruction model per client (``federated=False``) or one shared by
    FedAvg (``federated=True``, Algorithm 1), on a federation of client actors.

    It builds the federation (or, given ``federation``, drives one built elsewhere: clients in
    their own processes), runs the statistics and publishes them; then, federated, it is the
    coordinator's program (every step a message); per client, each client trains and selects
    its model alone (local steps, no message). ``impute`` uses the best-validation model (paper
    section IV e: model selection on validation RMSE only), which each client holds at the end.
    """

    def __init__(
        self,
        name: str,
        task: ImputationTask | None,
        config: ImputeConfig,
        *,
        seed: int,
        make_model: ModelFactory,
        uses_graph: bool,
        federated: bool,
        aggregator: SumBackend | None = None,
        channel: Channel | None = None,
        privacy: StatisticsPrivacyFactory | None = None,
        roles: Mapping[str, str] | None = None,
        federation: ImputationFederation | None = None,
    ) -> None:
        self.name = name
        self.task = task
        self.config = config
        self.federated = federated
        self.rng = np.random.default_rng(derived_seed(seed, 1))  # the cohorts' draws
        if federated:
            if federation is not None:
                _check_cohort(config.client_fraction, len(federation.names), federation.scheme)
            elif isinstance(aggregator, SealingScheme):
                _check_cohort(config.client_fraction, len(_task(task).train), aggregator.scheme)
        if federation is None:
            federation = build_imputation_federation(
                _task(task).train,
                seed=seed,
                aggregator=aggregator,
                channel=channel,
                privacy=privacy,
                roles=roles,
                training=TrainingPlan(config=config, make_model=make_model, shared_init=federated),
                tests=_task(task).test,
            )
        elif not federated:
            raise ConfigError(
                f"{name}: clients that train alone are driven in one process; a federation "
                "built elsewhere runs FedAvg methods only."
            )
        self.federation = federation
        self._scorings = 0
        statistics = collect_statistics(self.federation)
        graph = statistics.graph(top_k=config.top_k) if uses_graph else None
        self.federation.publish(statistics.standardisation, graph)
        self.standardisation = statistics.standardisation
        """The global standardisation it published (exact without DP)."""
        self.counts = np.diag(statistics.counts).copy()
        """How many observed training entries of each feature the statistics counted (exact
        without DP)."""
        self.graph = graph
        """The feature graph it published (None: not a graph model)."""
        self.best: Tensor | None = None
        self.best_round = 0
        self._fitted = False  # an imputer trains once (fit)
        self._warned_cohort = False
        self.theta: Tensor | None = None
        self.total_rows = 0
        if federated:
            # The global model starts where every client's does (the same seed); the download
            # makes it the clients' starting point whatever they built.
            with isolated_seed(derived_seed(seed, 0)):
                self.theta = flat_parameters(make_model(graph))
            self.total_rows = self._count_rows()
            self.federation.download(self.theta, round=_message_round(-1), tag="initial")

    def _count_rows(self) -> int:
        """N = sum_k n_k by one secure sum (public from here on: it scales the FedAvg shares)."""
        summed = self.federation.sum(
            "rows", _NO_ARGUMENTS, width=wide_width(1), round=_message_round(-1), tag="rows"
        )
        return int(np.rint(from_wide_digits(summed)[0]))

    def _clients(self) -> list[ImputationClient]:
        """The in-process clients, for their local steps (never the coordinator's program)."""
        return in_process_clients(self.federation.channel)

    def _sample_clients(self) -> list[str]:
        """The cohort S_t: a uniformly random share ``client_fraction`` of the clients; under a
        secure sum at least 2 (lost clients may leave the share at 1 of the rest, whose sum the
        aggregator would refuse as one client's update in the clear; recovery stops the run
        before only one is left)."""
        names = self.federation.names
        count = cohort_size(self.config.client_fraction, len(names))
        if self.federation.scheme and count < 2 <= len(names):
            if not self._warned_cohort:
                warnings.warn(
                    f"{self.name}: `client_fraction` {self.config.client_fraction:g} of the "
                    f"{len(names)} clients left samples 1 a round, and a secure sum "
                    f"({self.federation.scheme}) needs 2: each round samples 2 from now on.",
                    RunWarning,
                    stacklevel=2,
                )
                self._warned_cohort = True
            count = 2
        chosen = self.rng.choice(len(names), size=count, replace=False)
        return [names[k] for k in sorted(int(k) for k in chosen)]

    def _recovering_round(self, round: int) -> float:
        """:meth:`_federated_round`; should a client be lost in it (a deployment: its process
        died), drop it, abandon the round and run it again over the others from the round's
        global model, downloaded to them anew (their local steps of the abandoned attempt are
        undone, their optimisers' moments and batch generators put back). Each retry drops a
        client or re-raises
        (:meth:`~secure_vfl.methods.imputation.federation.ImputationFederation.recover`)."""
        start = self.theta
        retry = False
        while True:
            try:
                if retry:
                    assert start is not None
                    self.federation.download(start, round=_message_round(round), tag=RESTART_TAG)
                return self._federated_round(round)
            except ProtocolError as error:
                self.theta = start
                self.federation.recover(error, round=_message_round(round), fedavg_round=round + 1)
                retry = True

    def _rejoin(self, round: int) -> None:
        """Before a round: readmit the lost clients that answer again (a deployment: their
        operators restarted them), each sent the statistics and the global model
        (:meth:`~secure_vfl.methods.imputation.federation.ImputationFederation.rejoin`)."""
        assert self.theta is not None
        self.federation.rejoin(
            round=_message_round(round),
            fedavg_round=round + 1,
            statistics=(self.standardisation, self.graph),
            parameters=self.theta,
        )

    def _federated_round(self, round: int) -> float:
        """Eq. 8 over the round's cohort, the download of the average to every client, and the
        round's validation RMSE from the clients' summed errors."""
        assert self.theta is not None
        total = torch.from_numpy(
            self.federation.sum(
                "train",
                np.array([float(max(self.total_rows, 1))]),
                width=self.theta.numel() + 1,
                round=_message_round(round),
                tag="fedavg",
                cohort=self._sample_clients(),
            )
        )
        weight = float(total[-1])
        if weight > 0:  # else the cohort holds no training rows: nothing to average
            self.theta = total[:-1] / weight
        self.federation.download(self.theta, round=_message_round(round), tag="global")
        summed = self.federation.sum(
            "validation",
            _NO_ARGUMENTS,
            width=wide_width(2),
            round=_message_round(round),
            tag="validation",
        )
        sse, count = (float(v) for v in from_wide_digits(summed))
        return float(np.sqrt(sse / count)) if count else float("nan")

    def _local_round(self) -> float:
        """Every client trains alone and keeps its best model by its own validation error; the
        round's RMSE over every client's Omega_val (the experiment's readout)."""
        sse, count = 0.0, 0
        for client in self._clients():
            client.train(self.config.local_epochs)
            own_sse, own_count = client.validation_error()
            client.keep_if_best(own_sse / own_count if own_count else float("inf"))
            sse, count = sse + own_sse, count + own_count
        return float(np.sqrt(sse / count)) if count else float("nan")

    def fit(self, *, on_round: RoundCallback | None = None) -> list[float]:
        """R rounds of local training (+ FedAvg when federated); validation RMSE per round.

        Federated, the coordinator downloads the best-validation parameters at the end; per
        client, each client restores its own best. ConfigError on a second call: the clients'
        rounds have moved on (federated, a second fit was refused as a replay of round 1) and
        per client it trained R more rounds from the best of the first."""
        if self._fitted:
            raise ConfigError(
                f"{self.name}: fit() was called on this imputer already; an imputer trains once: "
                "build another (a new run) to train again."
            )
        self._fitted = True
        curve: list[float] = []
        best_rmse = float("inf")
        for round in range(self.config.rounds):
            if self.federated and round > 0:
                self._rejoin(round)
            rmse = self._recovering_round(round) if self.federated else self._local_round()
            curve.append(rmse)
            if rmse < best_rmse:
                best_rmse, self.best_round = rmse, round + 1
                self.best = self.theta  # that round's global model (None per client)
            if on_round is not None:
                on_round(round + 1, rmse)
        if not self.federated:
            for client in self._clients():
                client.restore_best()
        elif self.best is not None:
            self._download_best(self.best)
        return curve

    def _download_best(self, best: Tensor) -> None:
        """The best-validation model's download to every client; one lost meanwhile is dropped
        and the others are sent it again, as a fresh batch."""
        round = _message_round(self.config.rounds)
        while True:
            try:
                return self.federation.download(best, round=round, tag="best")
            except ProtocolError as error:
                self.federation.recover(error, round=round, fedavg_round=self.config.rounds)

    def score(
        self, standardisation: Standardisation, *, seed: int, fraction: float
    ) -> ScoredErrors:
        """Each client scores its (best-validation) model on its own test rows, its hidden
        entries drawn by its own generator (:func:`~secure_vfl.methods.imputation.evaluation.
        score_seed`): its squared error and count, by messages, and per feature their sum over
        the clients (see :class:`~secure_vfl.methods.imputation.evaluation.SelfScoring`).
        ConfigError, before any message, for a ``fraction`` outside (0, 1)."""
        fraction = checked_fraction(fraction)
        self._scorings += 1
        return self.federation.score(
            standardisation.std,
            lambda k: score_seed(seed, k),
            fraction=fraction,
            round=_message_round(self.config.rounds + self._scorings),
            fedavg_round=self.config.rounds,
        )

    def impute(self, client_index: int, client: ClientData) -> np.ndarray:
        """Eq. 7 with the client's (best-validation) model: the client imputes its own rows."""
        if self.task is None:
            raise ConfigError(
                f"{self.name}: its clients are elsewhere; each imputes its own rows there."
            )
        check_client(self.task, client_index, client)
        return self._clients()[client_index].impute(client)

    def save_part(self, client: str, directory: Path) -> dict[str, str]:
        """The in-process client ``client`` writes its own part into ``directory``; the
        SHA-256 of each file, for the imputer's manifest."""
        for party in self._clients():
            if party.name == client:
                return party.save_part(directory)
        raise ConfigError(f"{self.name}: no client {client!r} in this process.")


def _graph_model(config: ImputeConfig, graph: FeatureGraph | None) -> nn.Module:
    """FedHF's GNN on the published feature graph."""
    if graph is None:
        raise ProtocolError("FedHF's model reads the feature graph; found none published.")
    return FeatureGraphImputer(graph, hidden=config.hidden, layers=config.layers)


def make_fedhf(
    task: ImputationTask,
    config: ImputeConfig,
    *,
    seed: int,
    aggregator: SumBackend | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacyFactory | None = None,
    roles: Mapping[str, str] | None = None,
) -> ReconstructionImputer:
    """FedHF-Impute: the feature graph from federated statistics, the GNN trained by FedAvg."""
    return reconstruction_imputer(
        "fedhf",
        task,
        config,
        seed=seed,
        aggregator=aggregator,
        channel=channel,
        privacy=privacy,
        roles=roles,
    )


def reconstruction_imputer(
    name: str,
    task: ImputationTask | None,
    config: ImputeConfig,
    *,
    seed: int,
    federation: ImputationFederation | None = None,
    **options: Any,
) -> ReconstructionImputer:
    """The :class:`ReconstructionImputer` of the reconstruction method ``name``
    (:data:`RECONSTRUCTIONS`) on ``task``, or driving ``federation`` (of ``federation.features``
    features); ``options`` are its aggregator, channel, privacy and roles."""
    recipe = RECONSTRUCTIONS.get(name)
    features = federation.features if federation is not None else len(_task(task).features)
    return ReconstructionImputer(
        name,
        task,
        config,
        seed=seed,
        make_model=recipe.models(config, features),
        uses_graph=recipe.uses_graph,
        federated=recipe.federated,
        federation=federation,
        **options,
    )


def _task(task: ImputationTask | None) -> ImputationTask:
    if task is None:
        raise ConfigError("a task or a federation to drive expected, found neither.")
    return task


def _graph_models(config: ImputeConfig, features: int) -> ModelFactory:
    return lambda graph: _graph_model(config, graph)


RECONSTRUCTIONS.register(
    "fedhf", Reconstruction(models=_graph_models, uses_graph=True, federated=True)
)
IMPUTERS.register("fedhf", make_fedhf)
