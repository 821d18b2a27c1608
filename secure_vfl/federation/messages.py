"""Typed messages: everything that crosses a party boundary is one of these dataclasses.

Each message carries an explicit schema version and a header (sender, receiver, round, batch id)
that the receiver checks against what it expects (:func:`check_header`), and its tensor content is
validated on receipt (:meth:`Message.validate`: dtype, shape, finite values). A message carries
content or an error, never both: :class:`ErrorMessage` is the only one that carries an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from secure_vfl.errors import IntegrityError, ProtocolError

SCHEMA_VERSION = 1
PHASES = ("train", "predict")

PartyId = str
AGGREGATOR: PartyId = "aggregator"


def party_name(index: int) -> PartyId:
    """The conventional id of the data party holding feature block ``index``."""
    return f"party-{index}"


@dataclass(frozen=True, kw_only=True)
class Message:
    """Header shared by every message: who sends it to whom, in which session (one protocol run:
    a training run, a PSI exchange), for which round (a training step) and batch (a chunk of a
    stream)."""

    sender: PartyId
    receiver: PartyId
    round: int
    batch_id: int
    session: str = ""
    schema_version: int = SCHEMA_VERSION

    kind: ClassVar[str] = "message"

    def validate(self) -> None:
        """Check the message is well formed on its own; raise ProtocolError or IntegrityError."""
        if self.schema_version != SCHEMA_VERSION:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: schema version {SCHEMA_VERSION} expected, "
                f"found {self.schema_version}."
            )
        if self.round < 0 or self.batch_id < 0:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: round and batch id must be >= 0, "
                f"found round={self.round}, batch_id={self.batch_id}."
            )


def message_bytes(message: Message) -> int:
    """The payload size of ``message`` on the wire: the bytes of its tensors (headers aside)."""
    return sum(
        int(value.numel() * value.element_size())
        for value in vars(message).values()
        if isinstance(value, Tensor)
    )


def check_header(
    message: Message, *, sender: PartyId | None = None, receiver: PartyId, round: int, batch_id: int
) -> None:
    """Refuse a message that is not the one the receiver is waiting for (e.g. a replay)."""
    message.validate()
    expected = {"receiver": receiver, "round": round, "batch_id": batch_id}
    if sender is not None:
        expected["sender"] = sender
    for field, value in expected.items():
        found = getattr(message, field)
        if found != value:
            raise ProtocolError(
                f"{message.kind} from {message.sender}: "
                f"{field} {value!r} expected, found {found!r}."
            )


def _check_tensor(
    message: Message, name: str, tensor: Tensor, *, dims: int, dtype: torch.dtype
) -> None:
    if not isinstance(tensor, Tensor):
        raise ProtocolError(
            f"{message.kind} from {message.sender}: {name} must be a tensor, "
            f"found {type(tensor).__name__}."
        )
    if tensor.dtype != dtype or tensor.dim() != dims:
        raise ProtocolError(
            f"{message.kind} from {message.sender}: {name} must be a {dims}-d {dtype} tensor, "
            f"found {tensor.dim()}-d {tensor.dtype} of shape {tuple(tensor.shape)}."
        )
    if tensor.requires_grad:
        raise ProtocolError(
            f"{message.kind} from {message.sender}: {name} still carries an autograd graph; "
            "tensors are detached at every party boundary."
        )
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise IntegrityError(f"{message.kind} from {message.sender}: {name} has non-finite values.")


@dataclass(frozen=True, kw_only=True)
class RowsMessage(Message):
    """A message about some rows of the current batch, at ``positions`` within it.

    ``phase`` says whether the rows are training records (``"train"``) or rows being predicted
    (``"predict"``), so privacy accounting can price only releases of training records.
    """

    positions: Tensor
    tag: str = ""
    phase: str = "train"

    def _check_rows(self, name: str, tensor: Tensor) -> None:
        if self.phase not in PHASES:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: phase must be one of {PHASES}, "
                f"found {self.phase!r}."
            )
        _check_tensor(self, "positions", self.positions, dims=1, dtype=torch.int64)
        if tensor.shape[0] != self.positions.shape[0]:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: {self.positions.shape[0]} rows announced, "
                f"found {tensor.shape[0]} in {name}."
            )
        if self.positions.numel() and bool((self.positions[1:] <= self.positions[:-1]).any()):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: positions must be strictly increasing."
            )


@dataclass(frozen=True, kw_only=True)
class RepresentationMessage(RowsMessage):
    """A data party's representations of its observed rows of the batch (forward pass)."""

    representation: Tensor
    kind: ClassVar[str] = "representation"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "representation", self.representation, dims=2, dtype=torch.float32)
        self._check_rows("representation", self.representation)


@dataclass(frozen=True, kw_only=True)
class GradientMessage(RowsMessage):
    """The gradient of a head's loss with respect to a party's representations (backward pass)."""

    gradient: Tensor
    kind: ClassVar[str] = "gradient"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "gradient", self.gradient, dims=2, dtype=torch.float32)
        self._check_rows("gradient", self.gradient)


@dataclass(frozen=True, kw_only=True)
class SumMessage(Message):
    """Per-task sums of representations, delivered to the head that asked for them.

    ``sums[t, b]`` is the sum of the representations of the parties selected for task ``t`` at
    batch row ``b``; ``counts[t, b]`` how many there were (public: the receiver chose them).
    """

    sums: Tensor
    counts: Tensor
    kind: ClassVar[str] = "sum"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "sums", self.sums, dims=3, dtype=torch.float32)
        _check_tensor(self, "counts", self.counts, dims=2, dtype=torch.int64)
        if tuple(self.counts.shape) != tuple(self.sums.shape[:2]):
            raise ProtocolError(
                f"sum from {self.sender}: counts of shape {tuple(self.sums.shape[:2])} expected, "
                f"found {tuple(self.counts.shape)}."
            )


@dataclass(frozen=True, kw_only=True)
class PredictionMessage(RowsMessage):
    """A party's predicted classes for some rows (Ensemble voting)."""

    predictions: Tensor
    kind: ClassVar[str] = "prediction"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "predictions", self.predictions, dims=1, dtype=torch.int64)
        self._check_rows("predictions", self.predictions)


@dataclass(frozen=True, kw_only=True)
class ErrorMessage(Message):
    """A party's refusal: carries the reason and no content."""

    error: str
    kind: ClassVar[str] = "error"


@dataclass(frozen=True, kw_only=True)
class LatentMessage(RowsMessage):
    """Latent samples ``h`` drawn by the label party for some rows of the batch (FALSE-VFL).

    ``samples[i, j]`` is the j-th importance sample of the latent of row ``positions[i]``;
    the receiving party scores its block (or, in FALSE-VFL-II, its missingness) under them.
    """

    samples: Tensor
    kind: ClassVar[str] = "latent"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "samples", self.samples, dims=3, dtype=torch.float32)
        self._check_rows("samples", self.samples)


@dataclass(frozen=True, kw_only=True)
class LikelihoodMessage(RowsMessage):
    """A party's log-likelihood of its rows under each latent sample it received (FALSE-VFL).

    ``log_likelihood[i, j]`` is one scalar per row and importance sample: the only thing a party
    returns about its block in the forward pass.
    """

    log_likelihood: Tensor
    kind: ClassVar[str] = "likelihood"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "log_likelihood", self.log_likelihood, dims=2, dtype=torch.float32)
        self._check_rows("log_likelihood", self.log_likelihood)


@dataclass(frozen=True, kw_only=True)
class LatentGradientMessage(RowsMessage):
    """The gradient of a party's returned log-likelihoods with respect to the latent samples it
    received, already weighted by the loss gradient it was sent (FALSE-VFL backward pass)."""

    gradient: Tensor
    kind: ClassVar[str] = "latent-gradient"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "gradient", self.gradient, dims=3, dtype=torch.float32)
        self._check_rows("gradient", self.gradient)
