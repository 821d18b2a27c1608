"""An imputation client as an actor: its own rows, model, optimiser, generator and releases.

:class:`ImputationClient` holds one client's training rows and, once the coordinator has
published the global statistics (:class:`~secure_vfl.federation.messages.GlobalStatisticsMessage`),
its shard (with Omega_val held out), its copy of the model, its own Adam state and batch
generator. It acts only on the coordinator's messages: a
:class:`~secure_vfl.federation.messages.ComputeRequest` runs one local computation (a statistics
exchange, its row count, ``local_epochs`` of block-masked training, its validation error) whose
vector is its contribution to a secure sum; a
:class:`~secure_vfl.federation.messages.ParametersMessage` loads the global model (FedAvg's
download); a :class:`~secure_vfl.federation.messages.ScoreRequest` has it score its model on
its own test rows (it answers with its squared error and count, never the rows). Block masking
and the masked loss (eqs. 5-6) are the client's side of Algorithm 2.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.data.imputation import ClientData, hide_entries
from secure_vfl.errors import DivergenceError, OutOfRangeError, ProtocolError
from secure_vfl.federation.messages import (
    AGGREGATOR,
    ComputeRequest,
    GlobalStatisticsMessage,
    Message,
    ParametersMessage,
    RepresentationMessage,
    ScoreMessage,
    ScoreRequest,
    SealRequest,
)
from secure_vfl.federation.parties import ROLES, SecureSumParty
from secure_vfl.federation.parts import unwrapped
from secure_vfl.methods.base import isolated_seed
from secure_vfl.methods.imputation import parts
from secure_vfl.methods.imputation.base import ImputeConfig, derived_seed, imputation_rule
from secure_vfl.methods.imputation.evaluation import hide_test_entries, squared_errors
from secure_vfl.methods.imputation.statistics import (
    EXCHANGES,
    SERVER,
    WIDE_CAPACITY,
    Standardisation,
    StatisticsPrivacy,
    exchange_contribution,
    wide_digits,
)
from secure_vfl.models.feature_graph import FeatureGraph

ModelFactory = Callable[[FeatureGraph | None], nn.Module]
"""Builds a client's reconstruction model from the published feature graph (None for a model
that reads none)."""

_PREDICT_ROWS = 256


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
    """Copy a flat vector into the module's parameters (no storage shared with ``vector``);
    ProtocolError, before anything is copied, for a vector of the wrong length."""
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


def train_locally(
    model: nn.Module,
    optimiser: torch.optim.Optimizer,
    shard: ClientShard,
    config: ImputeConfig,
    generator: torch.Generator,
    *,
    epochs: int,
) -> float:
    """Algorithm 2's local step: ``epochs`` passes over the shard in shuffled batches (the last
    one may be short), each batch block-masked. Returns the mean masked loss over the steps."""
    model.train()
    total, steps = 0.0, 0
    for _ in range(epochs):
        order = torch.randperm(shard.n, generator=generator)
        for start in range(0, shard.n, config.batch_size):
            rows = order[start : start + config.batch_size]
            x, observed = shard.values[rows], shard.observed[rows]
            omega = block_mask(observed, shard.available, config.block_fraction, generator)
            if not bool(omega.any()):
                continue
            corrupted = x.masked_fill(omega, 0.0)
            prediction = model(corrupted, observed & ~omega, shard.available)
            loss = masked_mse(prediction, x, omega)
            optimiser.zero_grad()
            loss.backward()
            optimiser.step()
            total += float(loss.detach())
            steps += 1
    return total / steps if steps else float("nan")


def predict(model: nn.Module, values: Tensor, observed: Tensor, available: Tensor) -> Tensor:
    """The model's standardised predictions for every row, in chunks, without gradients."""
    model.eval()
    with torch.no_grad():
        chunks = [
            model(values[i : i + _PREDICT_ROWS], observed[i : i + _PREDICT_ROWS], available)
            for i in range(0, values.shape[0], _PREDICT_ROWS)
        ]
    return torch.cat(chunks) if chunks else torch.zeros_like(values)


def reconstruct(model: nn.Module, standardisation: Standardisation, rows: ClientData) -> np.ndarray:
    """Eq. 7 on ``rows`` with ``model``'s de-standardised predictions."""
    values, observed = model_inputs(rows, standardisation)
    available = torch.from_numpy(rows.available.copy())
    z = predict(model, values, observed, available).numpy()
    return imputation_rule(rows, standardisation.destandardise(z))


@dataclass(frozen=True)
class ClientTraining:
    """What one client trains with: the hyper-parameters, the model's factory and its own seeds
    (of its initial parameters, of its validation mask Omega_val, of its batch generator)."""

    config: ImputeConfig
    make_model: ModelFactory
    init_seed: int
    shard_seed: int
    generator_seed: int


@dataclass(frozen=True)
class TrainingPlan:
    """How every client of a run trains: the hyper-parameters, the model's factory, and whether
    all start from one initialisation (FedAvg: the coordinator's) or each from its own."""

    config: ImputeConfig
    make_model: ModelFactory
    shared_init: bool

    def for_client(self, index: int, seed: int) -> ClientTraining:
        """Client ``index``'s plan, its seeds derived from the run's ``seed``."""
        return ClientTraining(
            config=self.config,
            make_model=self.make_model,
            init_seed=derived_seed(seed, 0) if self.shared_init else derived_seed(seed, 0, index),
            shard_seed=derived_seed(seed, 2, index),
            generator_seed=derived_seed(seed, 3, index),
        )


RESTART_TAG = "restart"
"""The tag of the download that starts a FedAvg round again after a client was lost in it."""


class ImputationClient(SecureSumParty):
    """One client of federated imputation: its training rows (and, to be scored, its test
    rows), its own statistics mechanism (if any) and, once the global statistics are published,
    its shard, model copy, Adam optimiser and batch generator.

    It acts only on the coordinator's messages (anything else is refused, as is a message it
    has acted on before) and on its peers' public keys; what it computes for a sum is its
    contribution, sent to the aggregator in the clear under a plain sum or kept and sealed on
    request under a secure one. Its local steps (:meth:`train`, :meth:`validation_error`,
    :meth:`impute`) are its own program's: a local baseline calls them, and `impute` writes its
    imputed table with the last (`--save-imputed`); its score it computes on request.
    """

    REQUESTS = frozenset(
        {
            "compute-request",
            "parameters",
            "global-statistics",
            "key-request",
            "seal-request",
            "score-request",
            "abort",
        }
    )

    def __init__(
        self,
        data: ClientData,
        *,
        test: ClientData | None = None,
        privacy: StatisticsPrivacy | None = None,
        training: ClientTraining | None = None,
        coordinator: str = SERVER,
    ) -> None:
        super().__init__(data.name)
        self._data = data
        self._test = test
        self.coordinator = coordinator
        """The party whose requests it acts on (:data:`SERVER` in one process; deployed, the
        label party that coordinates)."""
        self.privacy = privacy
        self.training = training
        self.standardisation: Standardisation | None = None
        self.graph: FeatureGraph | None = None
        self.shard: ClientShard | None = None
        self.model: nn.Module | None = None
        self.optimiser: torch.optim.Optimizer | None = None
        self.generator = (
            torch.Generator().manual_seed(training.generator_seed) if training else None
        )
        # Its optimiser's state and its generator's before its last round of local training
        # (that round's message round): a retried round starts from them again.
        self._round_start: tuple[int, dict[str, Any], Tensor | None] | None = None
        self._best: Tensor | None = None
        self._best_error = math.inf
        # Its last score's squared errors and counts per feature, and whether the errors were
        # too large to send (2F + 1 values), which it contributes to the feature-errors sum.
        self._feature_errors: np.ndarray | None = None

    @property
    def n(self) -> int:
        """How many training rows it holds."""
        return int(self._data.values.shape[0])

    def receive(self, message: Message) -> None:
        """Refuse what its role never receives: requests from anyone but the coordinator, and
        any kind it has no use for; public keys come from its peers."""
        if message.kind != "public-key" and (
            message.kind not in self.REQUESTS or message.sender != self.coordinator
        ):
            raise ProtocolError(
                f"{self.name}: the coordinator's requests ({', '.join(sorted(self.REQUESTS))}) "
                f"and public keys expected, found a {message.kind} from {message.sender}."
            )
        super().receive(message)

    def diverged(self, request: SealRequest, error: OutOfRangeError) -> DivergenceError:
        """What it was about to seal (its model update or statistics) is past what the sums
        encode: the imputation diverged, said in its own flags."""
        return DivergenceError(
            f"the imputation diverged: {self.name}'s contribution to the {self.scheme} sums of "
            f"{request.deliver_to} has {error.found}, beyond what they encode, {error.limit}; "
            "try a lower --lr or fewer --local-epochs."
        )

    def _ready(self) -> tuple[ClientTraining, ClientShard, nn.Module, torch.optim.Optimizer]:
        if (
            self.training is None
            or self.shard is None
            or self.model is None
            or self.optimiser is None
        ):
            raise ProtocolError(
                f"{self.name}: a model to train expected, found none: the coordinator's global "
                "statistics must come first (and the client must have been built to train)."
            )
        return self.training, self.shard, self.model, self.optimiser

    # -- the coordinator's messages ----------------------------------------------------------

    def on_global_statistics(self, message: GlobalStatisticsMessage) -> None:
        """Standardise its rows, hold Omega_val out and build its model from the graph."""
        if self.training is None or self.shard is not None:
            raise ProtocolError(
                f"{self.name}: global statistics to set up its training expected once, by a "
                f"client that trains; found {'a second' if self.shard else 'one unused'}."
            )
        features = self._data.values.shape[1]
        if message.mean.shape[0] != features:
            raise ProtocolError(
                f"{self.name}: a standardisation of its {features} features expected, found "
                f"{message.mean.shape[0]}."
            )
        standardisation = Standardisation(
            mean=message.mean.numpy(),
            std=message.std.numpy(),
            constant=None if message.constant is None else message.constant.numpy(),
        )
        graph = None
        if message.neighbours is not None:
            assert message.weights is not None and message.mask is not None  # validated
            graph = FeatureGraph(
                neighbours=message.neighbours.numpy(),
                weights=message.weights.numpy(),
                mask=message.mask.numpy(),
            )
        training = self.training
        shard = make_shard(
            self._data,
            standardisation,
            training.config.validation_fraction,
            np.random.default_rng(training.shard_seed),
        )
        with isolated_seed(training.init_seed):
            model = training.make_model(graph)
        optimiser = torch.optim.Adam(model.parameters(), lr=training.config.lr)
        self.standardisation, self.shard, self.graph = standardisation, shard, graph
        self.model, self.optimiser = model, optimiser

    def on_parameters(self, message: ParametersMessage) -> None:
        """FedAvg's download: load the global parameters into its model. A ``restart`` (the
        round is run again after a client was lost in it) also puts back its optimiser's
        moments and its batch generator as they were before it trained in the abandoned
        attempt, so that attempt leaves nothing behind."""
        _, _, model, optimiser = self._ready()
        load_parameters(model, message.parameters)
        start = self._round_start
        if message.tag == RESTART_TAG and start is not None and start[0] == message.round:
            _, state, generator = start
            optimiser.load_state_dict(copy.deepcopy(state))
            if self.generator is not None and generator is not None:
                self.generator.set_state(generator)

    def on_compute_request(self, request: ComputeRequest) -> None:
        """Run the named local computation and contribute its vector to the sum ``tag``."""
        vector = self._compute(request.computation, request.arguments.numpy(), request.round)
        self.contribute(
            RepresentationMessage(
                **self.reply_header(request, AGGREGATOR),
                positions=torch.zeros(1, dtype=torch.int64),
                tag=request.tag,
                representation=torch.from_numpy(vector.astype(np.float32)).reshape(1, -1),
                ticket=request.ticket,
            )
        )

    def on_score_request(self, request: ScoreRequest) -> None:
        """Score its model on its own test rows: hide the entries the request's seed draws,
        impute them, and answer with the squared errors in the request's units and their
        count (nothing else of the rows leaves it). The same per feature it keeps for the
        ``feature-errors`` sum, which reports them summed over the clients only."""
        if self._test is None:
            raise ProtocolError(f"{self.name}: test rows to score on expected, found none.")
        features = self._test.values.shape[1]
        if request.std.shape[0] != features:
            raise ProtocolError(
                f"{self.name}: a std for each of its {features} features expected, found "
                f"{request.std.shape[0]}."
            )
        corrupted, hidden = hide_test_entries(self._test, request.seed, request.fraction)
        errors = squared_errors(
            self.impute(corrupted), self._test, hidden, request.std.numpy(), by=self.name
        )
        # Errors too large for a wide value (a diverged model: over ~1e7 std units) are not
        # sent; the last value says so, and the sum then reports no per-feature error.
        overflow = bool(errors.feature_sse.max(initial=0.0) >= WIDE_CAPACITY / 2)
        self._feature_errors = np.concatenate(
            [
                np.zeros_like(errors.feature_sse) if overflow else errors.feature_sse,
                errors.feature_count.astype(np.float64),
                [float(overflow)],
            ]
        )
        self.send(ScoreMessage(**self.reply_header(request), sse=errors.sse, count=errors.count))

    def _compute(self, computation: str, arguments: np.ndarray, round: int) -> np.ndarray:
        if computation in EXCHANGES:
            return exchange_contribution(self._data, computation, arguments, self.privacy)
        if computation == "train":
            return self._federated_update(arguments, round).numpy()
        if arguments.size:
            raise ProtocolError(
                f"{self.name}: no arguments for {computation!r} expected, found {arguments.size}."
            )
        if computation == "rows":
            return wide_digits(np.array([float(self.n)]))
        if computation == "validation":
            sse, count = self.validation_error()
            return wide_digits(np.array([sse, float(count)]))
        if computation == "feature-errors":
            if self._feature_errors is None:
                raise ProtocolError(
                    f"{self.name}: a score-request before its feature-errors expected, found none."
                )
            return wide_digits(self._feature_errors)
        raise ProtocolError(f"{self.name}: no local computation named {computation!r}.")

    def _federated_update(self, arguments: np.ndarray, round: int) -> Tensor:
        """Train ``local_epochs`` and return [w * theta, w], w = n / N its share of the
        federation's N rows (eq. 8's weights, so no value sent exceeds max |theta|). What it
        trains from (its optimiser's moments, its generator) is noted as ``round``'s start,
        which a restart of the round puts back; only once the request is found good."""
        training, shard, model, optimiser = self._ready()
        total_rows = float(arguments[0]) if arguments.shape == (1,) else math.nan
        if not (total_rows.is_integer() and total_rows >= max(1, shard.n)):
            raise ProtocolError(
                f"{self.name}: one argument, the federation's row count (an integer >= its own "
                f"{shard.n} rows and >= 1), expected; found {arguments.tolist()}."
            )
        self._round_start = (
            round,
            copy.deepcopy(optimiser.state_dict()),
            self.generator.get_state() if self.generator is not None else None,
        )
        self.train(training.config.local_epochs)
        share = float(shard.n) / int(total_rows)
        theta = flat_parameters(model)
        return torch.cat(
            [share * theta.to(torch.float32), torch.tensor([share], dtype=torch.float32)]
        )

    # -- its own local steps ------------------------------------------------------------------

    def train(self, epochs: int) -> float:
        """``epochs`` of block-masked training on its shard; the mean masked loss."""
        training, shard, model, optimiser = self._ready()
        assert self.generator is not None  # made with the training plan
        return train_locally(
            model, optimiser, shard, training.config, self.generator, epochs=epochs
        )

    def validation_error(self) -> tuple[float, int]:
        """Sum of squared errors and count over Omega_val (Algorithm 2, line 14)."""
        _, shard, model, _ = self._ready()
        if not bool(shard.validation.any()):
            return 0.0, 0
        prediction = predict(model, shard.values, shard.observed, shard.available)
        errors = (prediction - shard.targets)[shard.validation]
        return float((errors.double() ** 2).sum()), int(errors.numel())

    def keep_if_best(self, error: float) -> None:
        """Keep its current parameters when ``error`` (its own validation MSE) is its best yet
        (a client that trains alone selects its own model)."""
        _, _, model, _ = self._ready()
        if error < self._best_error:
            self._best_error, self._best = error, flat_parameters(model)

    def restore_best(self) -> None:
        """Load the parameters kept by :meth:`keep_if_best` (if any)."""
        _, _, model, _ = self._ready()
        if self._best is not None:
            load_parameters(model, self._best)

    def impute(self, rows: ClientData) -> np.ndarray:
        """Eq. 7 on ``rows`` of its schema with its model's de-standardised predictions (a
        local step: the client fills its own table)."""
        _, _, model, _ = self._ready()
        assert self.standardisation is not None  # set with the model
        return reconstruct(model, self.standardisation, rows)

    def save_part(self, directory: Path) -> dict[str, str]:
        """Write its own part (:mod:`~secure_vfl.methods.imputation.parts`: its schema, the
        standardisation and graph it was published, its model) into ``directory``, to fill
        new rows of its own later; the SHA-256 of each file, for the imputer's manifest."""
        _, _, model, _ = self._ready()
        assert self.standardisation is not None  # set with the model
        tensors = parts.reconstruction_tensors(
            self._data.available, self.standardisation, self.graph, unwrapped(model)
        )
        return parts.write_part(
            directory, client=self.name, kind=parts.RECONSTRUCTION, tensors=tensors
        )


ROLES.register("imputation-client", ImputationClient)
