"""What every learning method shares: its configuration, its interface and the training loop."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from secure_vfl.data.samplers import BatchSampler
from secure_vfl.data.vertical import VerticalData, VerticalSplit, labeled_subset
from secure_vfl.errors import ConfigError
from secure_vfl.federation.aggregator import Aggregator, PlainAggregator
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    AGGREGATOR,
    GradientMessage,
    RepresentationMessage,
    party_name,
)
from secure_vfl.federation.parties import DataParty, HeadParty
from secure_vfl.models.networks import make_bottom
from secure_vfl.models.simsiam import pretrain_simsiam
from secure_vfl.registry import Registry

Heads = Literal["all", "active"]
Batching = Literal["grouped", "mixed"]
StepCallback = Callable[[int, float], None]


@dataclass(frozen=True, kw_only=True)
class MethodConfig:
    """Hyper-parameters shared by the split-network methods (defaults: LASER reference, tabular).

    ``heads="all"`` gives every party labels and a head (the LASER paper); ``"active"`` keeps one
    label party (party 0) with a single head (the threat model's setting). ``batching="grouped"``
    forms batches of one observed set (the paper); ``"mixed"`` samples subsets per sample.
    ``pretrain_epochs > 0`` pretrains every party's bottom model with SimSiam on its own
    training rows, labelled or not, before training (local: nothing is sent).
    ``secure_sums=True`` says the aggregator is a secure backend that releases only sums over
    0 or >= 2 parties besides the receiver: methods plan only such sums, or refuse to run.
    ``labeled`` keeps that many training labels (a seeded random subset, see
    :func:`~secure_vfl.data.vertical.labeled_subset`) and treats the other rows as unlabelled;
    ``None`` labels every training row.
    """

    heads: Heads = "all"
    batching: Batching = "mixed"
    epochs: int = 20
    batch_size: int = 128
    lr: float = 0.03
    momentum: float = 0.8
    weight_decay: float = 0.0
    representation_dim: int = 128
    standard_incomplete: Literal["random", "zero"] = "random"
    plug_dropout: float = 0.5
    vectorised: bool = True
    secure_sums: bool = False
    pretrain_epochs: int = 0
    labeled: int | None = None

    def __post_init__(self) -> None:
        _choice("heads", self.heads, ("all", "active"))
        _choice("batching", self.batching, ("grouped", "mixed"))
        _choice("standard_incomplete", self.standard_incomplete, ("random", "zero"))
        _positive_int("epochs", self.epochs)
        _positive_int("batch_size", self.batch_size)
        _positive_int("representation_dim", self.representation_dim)
        if isinstance(self.pretrain_epochs, bool) or not isinstance(self.pretrain_epochs, int):
            raise ConfigError(
                f"`pretrain_epochs` must be an integer >= 0. Found {self.pretrain_epochs!r}."
            )
        if self.pretrain_epochs < 0:
            raise ConfigError(f"`pretrain_epochs` must be >= 0. Found {self.pretrain_epochs}.")
        if self.labeled is not None:
            _positive_int("labeled", self.labeled)
        if not (self.lr > 0 and np.isfinite(self.lr)):
            raise ConfigError(f"`lr` must be a positive number. Found {self.lr}.")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"`momentum` must be in [0, 1). Found {self.momentum}.")
        if not self.weight_decay >= 0:
            raise ConfigError(f"`weight_decay` must be >= 0. Found {self.weight_decay}.")
        if not 0 <= self.plug_dropout < 1:
            raise ConfigError(f"`plug_dropout` must be in [0, 1). Found {self.plug_dropout}.")


def labeled_rows(data: VerticalData, config: MethodConfig, seed: int) -> np.ndarray:
    """The training rows whose labels a method may use: all, or ``config.labeled`` of them
    drawn with the run's seed (the same rows for every method of a run)."""
    return labeled_subset(data.train.n, config.labeled, rng=np.random.default_rng(seed))


def refuse_secure_sums(config: MethodConfig, method: str, reason: str) -> None:
    """Raise ConfigError when ``config`` asks for secure sums that ``method`` cannot use."""
    if config.secure_sums:
        raise ConfigError(
            f"{method} cannot run under secure aggregation: {reason} Secure sums serve "
            "laser with heads='active'."
        )


def require_hiding_crowd(config: MethodConfig, parties: int, method: str) -> None:
    """Refuse secure sums with fewer than 3 parties: with the label party and one other, no
    sum can hide the other party's term, so it would never contribute."""
    if config.secure_sums and parties < 3:
        raise ConfigError(
            f"{method} under secure aggregation needs at least 3 parties (the label party and "
            f"two others whose terms hide each other). Found {parties}."
        )


def _choice(name: str, value: object, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ConfigError(f"`{name}` must be one of {', '.join(allowed)}. Found {value!r}.")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"`{name}` must be a positive integer. Found {value!r}.")


class Method(Protocol):
    """A trainable VFL method: fit on the training split, predict on any test split."""

    name: str
    sampler: BatchSampler

    def train_step(self, rows: np.ndarray, round: int, batch_id: int) -> float:
        """One training step on the training rows ``rows``; returns its loss."""
        ...

    @property
    def total_steps(self) -> int:
        """How many training steps :meth:`fit` runs (for progress reporting)."""
        ...

    def fit(self, *, on_step: StepCallback | None = None) -> list[float]:
        """Train; return the mean training loss of every epoch."""
        ...

    def predict(self, split_name: str) -> np.ndarray:
        """Predicted class of every (sample, party): (N, K) int64, -1 where the party is absent."""
        ...


class MethodFactory(Protocol):
    """Builds a method for the given data; each method's module registers one."""

    def __call__(
        self,
        data: VerticalData,
        config: MethodConfig,
        *,
        seed: int,
        channel: Channel | None = None,
        aggregator: Aggregator | None = None,
    ) -> Method: ...


METHODS: Registry[MethodFactory] = Registry("method")


@dataclass
class Federation:
    """The parties of one run, the channel they talk through and the aggregator they use."""

    data: VerticalData
    parties: list[DataParty]
    channel: Channel
    aggregator: Aggregator
    generator: torch.Generator
    rng: np.random.Generator

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.parties]

    def send_representations(
        self,
        split: str,
        rows: Tensor,
        present: Tensor,
        *,
        receiver: str,
        round: int,
        batch_id: int,
        train: bool,
        senders: Sequence[DataParty] | None = None,
        tag: str = "",
    ) -> list[RepresentationMessage]:
        """Each sender's representations of its present rows of the batch, as delivered.

        ``present`` is (B, len(senders)); senders default to the federation's data parties.
        """
        senders = self.parties if senders is None else senders
        messages = []
        for k, party in enumerate(senders):
            positions = torch.nonzero(present[:, k]).flatten()
            if positions.numel() == 0:
                continue
            message = party.represent(
                split,
                rows[positions],
                positions,
                receiver=receiver,
                round=round,
                batch_id=batch_id,
                train=train,
                tag=tag,
            )
            messages.append(
                self.channel.receive(
                    message, sender=party.name, receiver=receiver, round=round, batch_id=batch_id
                )
            )
        return messages

    def means(
        self,
        representations: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        receiver: str,
        round: int,
        batch_id: int,
        tag: str,
    ) -> tuple[Tensor, Tensor]:
        """Per-task means (T, B, d) of the selected representations, summed by the aggregator
        and delivered to ``receiver``, with their counts (T, B, 1) (at least 1).

        ``tag`` tells this call apart from others with the same round and batch (training vs
        prediction, one task chunk vs another) so secure backends never reuse a mask context.
        """
        message = self.aggregator.combine(
            representations,
            selection,
            parties=self.names,
            receiver=receiver,
            round=round,
            batch_id=batch_id,
            tag=tag,
        )
        message = self.channel.receive(
            message, sender=AGGREGATOR, receiver=receiver, round=round, batch_id=batch_id
        )
        counts = message.counts.clamp(min=1).unsqueeze(-1).to(message.sums.dtype)
        return message.sums / counts, counts

    def deliver_gradients(
        self, messages: Sequence[GradientMessage], *, round: int, batch_id: int
    ) -> dict[str, list[GradientMessage]]:
        """Send gradient messages through the channel; what each receiver got, by name."""
        received: dict[str, list[GradientMessage]] = defaultdict(list)
        for message in messages:
            received[message.receiver].append(
                self.channel.receive(
                    message,
                    sender=message.sender,
                    receiver=message.receiver,
                    round=round,
                    batch_id=batch_id,
                )
            )
        return received

    def apply_gradients(self, received: dict[str, list[GradientMessage]], *, round: int) -> None:
        """Every party backpropagates what it received (or forgets its forward) and steps."""
        for party in self.parties:
            if party.name in received:
                party.backward(received[party.name], round=round)
            else:
                party.discard_pending()
            party.step()


def split_tensors(data: VerticalData) -> dict[str, VerticalSplit]:
    """Every split of ``data`` by name: ``"train"`` and each test mechanism's label."""
    return {"train": data.train, **data.tests}


def build_federation(
    data: VerticalData,
    config: MethodConfig,
    *,
    seed: int,
    channel: Channel | None,
    aggregator: Aggregator | None,
    bottoms: Sequence[nn.Module] | None = None,
) -> Federation:
    """One data party per block, each with a fresh bottom model and its own SGD optimiser."""
    splits = split_tensors(data)
    parties = []
    for k in range(data.train.parties):
        shape = data.train.blocks[k].shape[1:]
        if bottoms is not None:
            model = bottoms[k]
        else:
            with isolated_seed(seed + k):
                model = make_bottom(shape, out=config.representation_dim)
            if config.pretrain_epochs > 0:
                own_rows = data.train.blocks[k][data.train.mask[:, k]]
                with isolated_seed(seed + 500 + k):
                    pretrain_simsiam(
                        model,
                        torch.from_numpy(own_rows),
                        width=config.representation_dim,
                        epochs=config.pretrain_epochs,
                        batch_size=config.batch_size,
                        lr=config.lr,
                        generator=torch.Generator().manual_seed(seed + 500 + k),
                    )
        blocks = {name: torch.from_numpy(split.blocks[k]) for name, split in splits.items()}
        parties.append(DataParty(party_name(k), blocks, model, sgd(model, config)))
    return Federation(
        data=data,
        parties=parties,
        channel=channel if channel is not None else Channel(),
        aggregator=aggregator if aggregator is not None else PlainAggregator(),
        generator=torch.Generator().manual_seed(seed),
        rng=np.random.default_rng(seed),
    )


def head_party(name: str, data: VerticalData, head: nn.Module, config: MethodConfig) -> HeadParty:
    """A party holding the labels of every split and ``head``."""
    labels = {n: torch.from_numpy(s.labels) for n, s in split_tensors(data).items()}
    return HeadParty(name, labels, head, sgd(head, config))


def sgd(module: nn.Module, config: MethodConfig) -> torch.optim.Optimizer:
    """The optimiser of the LASER reference: SGD with momentum."""
    return torch.optim.SGD(
        module.parameters(),
        lr=config.lr,
        momentum=config.momentum,
        weight_decay=config.weight_decay,
    )


@contextmanager
def isolated_seed(seed: int) -> Iterator[None]:
    """Seed torch's global RNG (used by parameter initialisation) inside this block only."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def random_predictions(mask: np.ndarray, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """A uniformly random class for every observed (sample, party): (N, K), -1 where absent."""
    out = rng.integers(0, num_classes, size=mask.shape).astype(np.int64)
    out[~mask] = -1
    return out


def broadcast_prediction(prediction: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Every observed party reports the one joint ``prediction`` (N,): (N, K), -1 where absent."""
    out = np.repeat(prediction.astype(np.int64)[:, None], mask.shape[1], axis=1)
    out[~mask] = -1
    return out


def batches(n: int, size: int) -> list[Tensor]:
    """Consecutive index batches over ``n`` rows (evaluation order)."""
    return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]


def train_epochs(
    step: Callable[[np.ndarray, int, int], float],
    sampler: BatchSampler,
    *,
    epochs: int,
    rng: np.random.Generator,
    on_step: StepCallback | None,
) -> list[float]:
    """Run ``step(rows, round, batch_id)`` over every batch of every epoch; mean loss per epoch."""
    losses = []
    round = 0
    for _ in range(epochs):
        total, count = 0.0, 0
        for batch_id, rows in enumerate(sampler.epoch(rng)):
            loss = step(rows, round, batch_id)
            total += loss * len(rows)
            count += len(rows)
            round += 1
            if on_step is not None:
                on_step(round, loss)
        losses.append(total / count if count else float("nan"))
    return losses
