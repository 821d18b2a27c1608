"""What every imputation method shares: its configuration, its interface and the rule of eq. 7."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from secure_vfl import checks
from secure_vfl.data.imputation import ClientData, ImputationTask
from secure_vfl.errors import ConfigError, DataError
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.channel import Channel
from secure_vfl.methods.imputation.statistics import StatisticsPrivacyFactory
from secure_vfl.registry import Registry

RoundCallback = Callable[[int, float], None]


def derived_seed(seed: int, *keys: int) -> int:
    """An independent 63-bit seed for the stream named by ``keys`` under the run's ``seed``;
    ConfigError for a ``seed`` that is not an integer >= 0."""
    seed = checks.integer("seed", seed, low=0)
    state = np.random.SeedSequence([seed, *keys]).generate_state(2, dtype=np.uint32)
    return int((int(state[0]) << 31) ^ int(state[1]))


MAX_WIDTH = {"hidden": 65536, "layers": 64, "top_k": 4096}
"""The widest and deepest imputation network a config may ask for, and the most neighbours per
feature (a larger one was refused only by torch, mid-run, or ignored; neighbours beyond a
federation's features only pad the graph, each slot in every batch's memory)."""


@dataclass(frozen=True, kw_only=True)
class ImputeConfig:
    """Hyper-parameters of FedHF-Impute and its neural baselines (defaults: DESIGN section 5).

    ``batch_size=16`` rather than the reference's 64: clients of ~60 training rows would
    otherwise train on one or two batches per epoch (REFERENCE.md). ``validation_fraction`` of
    each client's observed-and-available training entries is held out from training as the
    fixed validation mask Omega_val (Algorithm 2, line 14). ``hidden`` is the GNN's d and the
    DAE's width; ``layers`` and ``top_k`` concern FedHF only; the non-neural baselines use none.
    """

    rounds: int = 30
    local_epochs: int = 2
    batch_size: int = 16
    lr: float = 1e-3
    hidden: int = 128
    layers: int = 3
    top_k: int = 8
    block_fraction: float = 0.25
    client_fraction: float = 1.0
    validation_fraction: float = 0.2

    def __post_init__(self) -> None:
        counts = ("rounds", "local_epochs", "batch_size", "hidden", "layers", "top_k")
        values: dict[str, object] = {
            name: checks.integer(name, getattr(self, name), low=1) for name in counts
        }
        values["lr"] = checks.real("lr", self.lr, low=0, low_open=True, high=checks.FLOAT32_MAX)
        for name in ("hidden", "layers", "top_k"):  # a network's width, depth and fan-in
            if values[name] > MAX_WIDTH[name]:  # type: ignore[operator]
                raise ConfigError(
                    f"`{name}` must be at most {MAX_WIDTH[name]}. Found {values[name]}."
                )
        for name in ("block_fraction", "client_fraction", "validation_fraction"):
            closed = name != "validation_fraction"
            value = getattr(self, name)
            values[name] = checks.real(
                name, value, low=0, high=1, low_open=True, high_open=not closed
            )
        checks.store(self, values)


TRAINING_FIELDS = ("rounds", "client_fraction", "local_epochs", "batch_size", "lr")
"""The settings of :class:`ImputeConfig` that only the methods that train a model use."""


def changed_training_fields(config: ImputeConfig) -> list[str]:
    """Those of :data:`TRAINING_FIELDS` that ``config`` sets to other than the defaults."""
    default = ImputeConfig()
    return [name for name in TRAINING_FIELDS if getattr(config, name) != getattr(default, name)]


class Imputer(Protocol):
    """A fitted-on-training-rows imputer that fills one client's rows by the rule of eq. 7."""

    name: str

    def fit(self, *, on_round: RoundCallback | None = None) -> list[float]:
        """Train; return the validation RMSE of every round ([] for non-iterative methods)."""
        ...

    def impute(self, client_index: int, client: ClientData) -> np.ndarray:
        """Client ``client_index``'s rows filled: float32 (n, F), raw scale, NaN if unavailable."""
        ...


class ImputerFactory(Protocol):
    """Builds an imputer for a task; each method's module registers one."""

    def __call__(
        self,
        task: ImputationTask,
        config: ImputeConfig,
        *,
        seed: int,
        aggregator: SumBackend | None = None,
        channel: Channel | None = None,
        privacy: StatisticsPrivacyFactory | None = None,
        roles: Mapping[str, str] | None = None,
    ) -> Imputer:
        """``privacy`` (optional) makes each client's own mechanism, which clips and noises the
        federated statistics that client sends; ``roles`` replaces clients (or the aggregation
        server) by roles registered by name (see
        :func:`~secure_vfl.methods.imputation.federation.build_imputation_federation`)."""
        ...


IMPUTERS: Registry[ImputerFactory] = Registry("imputer")


def check_client(task: ImputationTask, client_index: int, client: ClientData) -> None:
    """Refuse rows that do not belong to training client ``client_index``'s schema."""
    clients = len(task.train)
    if not 0 <= client_index < clients:
        raise DataError(f"`client_index` must be in [0, {clients}). Found {client_index}.")
    reference = task.train[client_index]
    if client.values.ndim != 2 or client.values.shape[1] != len(task.features):
        raise DataError(
            f"rows of {client.name} must have {len(task.features)} columns. "
            f"Found shape {client.values.shape}."
        )
    if not np.array_equal(client.available, reference.available):
        raise DataError(
            f"rows of {client.name} must have the availability mask of {reference.name} "
            f"(the schema the imputer was fitted on); found a different mask."
        )


def imputation_rule(client: ClientData, predicted: np.ndarray) -> np.ndarray:
    """Eq. 7: observed values kept exactly, missing-but-available entries from ``predicted``,
    schema-unavailable features left NaN."""
    observed = client.observed
    fill = ~observed & client.available[None, :]
    if not np.all(np.isfinite(predicted[fill])):
        raise DataError(
            f"the imputer must predict finite values for the missing-but-available entries of "
            f"{client.name}; found {int((~np.isfinite(predicted[fill])).sum())} non-finite."
        )
    out = np.where(observed, client.values, predicted).astype(np.float32)
    out[:, ~client.available] = np.nan
    return out
