"""FedHF-Impute (Algorithms 1-2): block-masked self-supervised training, FedAvg through the seam.

The same loop trains any reconstruction model ``f(x, m, a) -> x_hat`` in standardised space: the
GNN of :mod:`secure_vfl.models.feature_graph` (``fedhf``) and the denoising autoencoder of the
baselines, federated (``fed-dae``) or per client (``dae``). Model updates are averaged only
through :func:`federated_average`, i.e. one :func:`sum_vectors` of ``[w_k * theta_k, w_k]`` per
round with w_k = n_k / N the client's share of the N training rows (N from one secure count at
the start), so a secure aggregator or a DP channel layer can take the plain sum's place. Every
value sent is then at most max |theta| in magnitude, whatever the clients' sizes, which keeps
model updates inside the secure backends' fixed-point ranges (GNN parameters are O(1)); the
validation reports and the row count travel as :func:`wide_sum` digits.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.data.imputation import ClientData, ImputationTask, hide_entries
from secure_vfl.errors import ProtocolError
from secure_vfl.federation.aggregator import Aggregator, PlainAggregator, sum_vectors
from secure_vfl.federation.channel import Channel
from secure_vfl.methods.base import isolated_seed
from secure_vfl.methods.imputation.base import (
    IMPUTERS,
    ImputeConfig,
    RoundCallback,
    check_client,
    imputation_rule,
)
from secure_vfl.methods.imputation.statistics import (
    SERVER,
    FederatedStatistics,
    Standardisation,
    StatisticsPrivacy,
    federated_statistics,
    wide_sum,
)
from secure_vfl.models.feature_graph import FeatureGraphImputer

ModelFactory = Callable[[], nn.Module]

_PREDICT_ROWS = 256


def derived_seed(seed: int, *keys: int) -> int:
    """An independent 63-bit seed for the stream named by ``keys`` under the run's ``seed``."""
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


def block_mask(
    observed: Tensor, available: Tensor, fraction: float, generator: torch.Generator
) -> Tensor:
    """The corruption set Omega of one batch (eqs. 5-6, block masking).

    Draws round(fraction * |F_avail|) (at least 1) of the available features uniformly at random
    and returns (B, F) bool: every observed entry of those features in the batch.
    """
    candidates = torch.nonzero(available).flatten()
    blocked = torch.zeros_like(available)
    if candidates.numel():
        count = max(1, int(fraction * candidates.numel() + 0.5))
        order = torch.randperm(candidates.numel(), generator=generator)
        blocked[candidates[order[:count]]] = True
    return observed & blocked.unsqueeze(0)


def masked_mse(prediction: Tensor, target: Tensor, omega: Tensor) -> Tensor:
    """Eq. 6: the mean squared error over the corrupted entries Omega only."""
    return ((prediction - target)[omega] ** 2).mean()


def flat_parameters(module: nn.Module) -> Tensor:
    """The module's parameters as one detached flat float32 vector (theta of eq. 8)."""
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()]).to(torch.float32)


def load_parameters(module: nn.Module, vector: Tensor) -> None:
    """Copy a flat vector into the module's parameters (no storage shared with ``vector``)."""
    expected = sum(p.numel() for p in module.parameters())
    if vector.shape != (expected,):
        raise ProtocolError(
            f"a parameter vector of length {expected} expected, found shape {tuple(vector.shape)}."
        )
    offset = 0
    with torch.no_grad():
        for parameter in module.parameters():
            size = parameter.numel()
            parameter.copy_(vector[offset : offset + size].view_as(parameter))
            offset += size


def federated_average(
    aggregator: Aggregator,
    channel: Channel,
    updates: Mapping[str, tuple[int, Tensor]],
    *,
    receiver: str,
    round: int,
    total_rows: int | None = None,
) -> Tensor | None:
    """Eq. 8: sum_k n_k theta_k / sum_k n_k, formed by one secure-sum-able vector sum.

    Each client contributes ``[w_k * theta_k, w_k]`` with its share w_k = n_k / ``total_rows``
    (public: the federation's row count, by default the total of ``updates``), so no sent value
    exceeds max |theta_k|; the receiver divides by the summed shares (the cohort's share when
    clients are sampled). Returns None when the participating clients hold no training rows
    (nothing to average).
    """
    if total_rows is None:
        total_rows = max(1, sum(n for n, _ in updates.values()))
    if isinstance(total_rows, bool) or not isinstance(total_rows, int) or total_rows < 1:
        raise ProtocolError(f"`total_rows` must be a positive integer. Found {total_rows!r}.")
    contributions = {}
    for name, (n, theta) in updates.items():
        share = float(n) / total_rows
        contributions[name] = torch.cat(
            [share * theta.to(torch.float32), torch.tensor([share], dtype=torch.float32)]
        )
    total = sum_vectors(
        aggregator, channel, contributions, receiver=receiver, round=round, tag="fedavg"
    )
    weight = float(total[-1])
    return total[:-1] / weight if weight > 0 else None


@dataclass(frozen=True)
class ClientShard:
    """One client's standardised training tensors, with Omega_val held out of them.

    ``values`` (n, F) float32, 0 where not observed for training; ``observed`` (n, F) and
    ``available`` (F,) bool; ``validation`` (n, F) bool marks Omega_val, whose true standardised
    values are in ``targets``.
    """

    name: str
    values: Tensor
    observed: Tensor
    available: Tensor
    validation: Tensor
    targets: Tensor

    @property
    def n(self) -> int:
        return int(self.values.shape[0])


def model_inputs(client: ClientData, standardisation: Standardisation) -> tuple[Tensor, Tensor]:
    """(x, m): standardised values with 0 where not observed, and the observed mask."""
    observed = client.observed
    z = np.where(observed, standardisation.standardise(client.values), 0.0).astype(np.float32)
    return torch.from_numpy(z), torch.from_numpy(observed)


def make_shard(
    client: ClientData,
    standardisation: Standardisation,
    fraction: float,
    rng: np.random.Generator,
) -> ClientShard:
    """Hide a fixed ``fraction`` of the client's observed-and-available entries as Omega_val."""
    training, hidden = hide_entries(client, fraction, rng=rng)
    values, observed = model_inputs(training, standardisation)
    truth = np.where(hidden, standardisation.standardise(client.values), 0.0).astype(np.float32)
    return ClientShard(
        name=client.name,
        values=values,
        observed=observed,
        available=torch.from_numpy(client.available.copy()),
        validation=torch.from_numpy(hidden),
        targets=torch.from_numpy(truth),
    )


class ReconstructionClient:
    """A client of Algorithm 2: its shard, its copy of the model and its own Adam state."""

    def __init__(
        self, shard: ClientShard, model: nn.Module, config: ImputeConfig, generator: torch.Generator
    ) -> None:
        self.shard = shard
        self.model = model
        self.config = config
        self.generator = generator
        self.optimiser = torch.optim.Adam(model.parameters(), lr=config.lr)

    def train(self, epochs: int) -> float:
        """``epochs`` passes over the shard in shuffled batches (the last one may be short).

        Returns the mean block-masked loss over the steps taken.
        """
        shard = self.shard
        self.model.train()
        total, steps = 0.0, 0
        for _ in range(epochs):
            order = torch.randperm(shard.n, generator=self.generator)
            for start in range(0, shard.n, self.config.batch_size):
                rows = order[start : start + self.config.batch_size]
                x, observed = shard.values[rows], shard.observed[rows]
                omega = block_mask(
                    observed, shard.available, self.config.block_fraction, self.generator
                )
                if not bool(omega.any()):
                    continue
                corrupted = x.masked_fill(omega, 0.0)
                prediction = self.model(corrupted, observed & ~omega, shard.available)
                loss = masked_mse(prediction, x, omega)
                self.optimiser.zero_grad()
                loss.backward()
                self.optimiser.step()
                total += float(loss.detach())
                steps += 1
        return total / steps if steps else float("nan")

    def validation_error(self) -> tuple[float, int]:
        """Sum of squared errors and count over Omega_val (Algorithm 2, line 14)."""
        shard = self.shard
        if not bool(shard.validation.any()):
            return 0.0, 0
        prediction = predict(self.model, shard.values, shard.observed, shard.available)
        errors = (prediction - shard.targets)[shard.validation]
        return float((errors.double() ** 2).sum()), int(errors.numel())


def predict(model: nn.Module, values: Tensor, observed: Tensor, available: Tensor) -> Tensor:
    """The model's standardised predictions for every row, in chunks, without gradients."""
    model.eval()
    with torch.no_grad():
        chunks = [
            model(values[i : i + _PREDICT_ROWS], observed[i : i + _PREDICT_ROWS], available)
            for i in range(0, values.shape[0], _PREDICT_ROWS)
        ]
    return torch.cat(chunks) if chunks else torch.zeros_like(values)


class ReconstructionImputer:
    """A block-masked reconstruction model per client (``federated=False``) or one shared by
    FedAvg (``federated=True``, Algorithm 1). ``impute`` uses the best-validation checkpoint
    (paper section IV e: model selection on validation RMSE only)."""

    def __init__(
        self,
        name: str,
        task: ImputationTask,
        config: ImputeConfig,
        *,
        seed: int,
        make_model: ModelFactory,
        federated: bool,
        statistics: FederatedStatistics,
        aggregator: Aggregator | None = None,
        channel: Channel | None = None,
    ) -> None:
        self.name = name
        self.task = task
        self.config = config
        self.federated = federated
        self.standardisation = statistics.standardisation
        self.aggregator = aggregator if aggregator is not None else PlainAggregator()
        self.channel = channel if channel is not None else Channel()
        self.rng = np.random.default_rng(derived_seed(seed, 1))
        self.clients: list[ReconstructionClient] = []
        for k, client in enumerate(task.train):
            shard = make_shard(
                client,
                self.standardisation,
                config.validation_fraction,
                np.random.default_rng(derived_seed(seed, 2, k)),
            )
            with isolated_seed(derived_seed(seed, 0) if federated else derived_seed(seed, 0, k)):
                model = make_model()
            generator = torch.Generator().manual_seed(derived_seed(seed, 3, k))
            self.clients.append(ReconstructionClient(shard, model, config, generator))
        self.global_model: nn.Module | None = (
            copy.deepcopy(self.clients[0].model) if federated else None
        )
        self.best: list[Tensor | None] = [None] * len(self.clients)
        self.best_round = 0
        self.total_rows = self._count_rows() if federated else 0

    def _count_rows(self) -> int:
        """N = sum_k n_k by one secure sum (public from here on: it scales the FedAvg shares)."""
        counts = {c.shard.name: np.array([float(c.shard.n)]) for c in self.clients}
        total = wide_sum(
            counts,
            aggregator=self.aggregator,
            channel=self.channel,
            receiver=SERVER,
            round=0,
            tag="rows",
        )
        return int(np.rint(total[0]))

    def _sample_clients(self) -> list[int]:
        """The cohort S_t: a uniformly random share ``client_fraction`` of the clients."""
        count = max(1, int(self.config.client_fraction * len(self.clients) + 0.5))
        chosen = self.rng.choice(len(self.clients), size=count, replace=False)
        return sorted(int(k) for k in chosen)

    def _federated_round(self, round: int) -> None:
        assert self.global_model is not None
        theta = flat_parameters(self.global_model)
        updates: dict[str, tuple[int, Tensor]] = {}
        for k in self._sample_clients():
            client = self.clients[k]
            load_parameters(client.model, theta)
            client.train(self.config.local_epochs)
            updates[client.shard.name] = (client.shard.n, flat_parameters(client.model))
        averaged = federated_average(
            self.aggregator,
            self.channel,
            updates,
            total_rows=max(self.total_rows, 1),
            receiver=SERVER,
            round=round,
        )
        if averaged is not None:
            load_parameters(self.global_model, averaged)
        theta = flat_parameters(self.global_model)
        for client in self.clients:
            load_parameters(client.model, theta)

    def _validation(self, round: int) -> tuple[float, list[float]]:
        """The round's RMSE over every client's Omega_val, and each client's own SSE / count."""
        errors = [client.validation_error() for client in self.clients]
        if self.federated:
            reports = {
                client.shard.name: np.array([sse, float(count)])
                for client, (sse, count) in zip(self.clients, errors, strict=True)
            }
            total = wide_sum(
                reports,
                aggregator=self.aggregator,
                channel=self.channel,
                receiver=SERVER,
                round=round,
                tag="validation",
            )
            sse, count = float(total[0]), float(total[1])
        else:
            sse = sum(e[0] for e in errors)
            count = float(sum(e[1] for e in errors))
        per_client = [s / c if c else float("inf") for s, c in errors]
        return (float(np.sqrt(sse / count)) if count else float("nan")), per_client

    def fit(self, *, on_round: RoundCallback | None = None) -> list[float]:
        """R rounds of local training (+ FedAvg when federated); validation RMSE per round."""
        curve: list[float] = []
        best_rmse = float("inf")
        best_client = [float("inf")] * len(self.clients)
        for round in range(self.config.rounds):
            if self.federated:
                self._federated_round(round)
            else:
                for client in self.clients:
                    client.train(self.config.local_epochs)
            rmse, per_client = self._validation(round)
            curve.append(rmse)
            if self.federated:
                if rmse < best_rmse:
                    best_rmse, self.best_round = rmse, round + 1
                    assert self.global_model is not None
                    self.best = [flat_parameters(self.global_model)] * len(self.clients)
            else:
                for k, client in enumerate(self.clients):
                    if per_client[k] < best_client[k]:
                        best_client[k] = per_client[k]
                        self.best[k] = flat_parameters(client.model)
                if rmse < best_rmse:
                    best_rmse, self.best_round = rmse, round + 1
            if on_round is not None:
                on_round(round + 1, rmse)
        return curve

    def impute(self, client_index: int, client: ClientData) -> np.ndarray:
        """Eq. 7 with the (best-validation) model's de-standardised predictions."""
        check_client(self.task, client_index, client)
        model = copy.deepcopy(self.clients[client_index].model)
        best = self.best[client_index]
        if best is not None:
            load_parameters(model, best)
        values, observed = model_inputs(client, self.standardisation)
        available = torch.from_numpy(client.available.copy())
        z = predict(model, values, observed, available).numpy()
        return imputation_rule(client, self.standardisation.destandardise(z))


def make_fedhf(
    task: ImputationTask,
    config: ImputeConfig,
    *,
    seed: int,
    aggregator: Aggregator | None = None,
    channel: Channel | None = None,
    privacy: StatisticsPrivacy | None = None,
) -> ReconstructionImputer:
    """FedHF-Impute: the feature graph from federated statistics, the GNN trained by FedAvg."""
    statistics = federated_statistics(
        task.train, aggregator=aggregator, channel=channel, privacy=privacy
    )
    graph = statistics.graph(top_k=config.top_k)
    return ReconstructionImputer(
        "fedhf",
        task,
        config,
        seed=seed,
        make_model=lambda: FeatureGraphImputer(graph, hidden=config.hidden, layers=config.layers),
        federated=True,
        statistics=statistics,
        aggregator=aggregator,
        channel=channel,
    )


IMPUTERS.register("fedhf", make_fedhf)
