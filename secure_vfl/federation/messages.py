"""Typed messages: everything that crosses a party boundary is one of these dataclasses.

Each message carries an explicit schema version and a header (sender, receiver, session, round,
batch id) that the receiver checks against what it expects (:func:`check_header`). Every message
that crosses a boundary is decoded by the wire codec (:mod:`secure_vfl.federation.wire`), which
refuses malformed bytes and non-finite floating-point values, then calls
:meth:`Message.validate` for the structure (dtypes, shapes, rows). A message carries content or an
error, never both: :class:`ErrorMessage` is the only one that carries an error.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor

from secure_vfl.errors import NonFiniteError, ProtocolError
from secure_vfl.federation.tickets import TICKET_KEY_BYTES
from secure_vfl.federation.wire import register_message

SCHEMA_VERSION = 10
"""The messages' layouts: 2 since sealed sums carry their members' selection, sum and seal
requests their DP-released rows, and the abort message exists; 3 since a gradient may close its
receiver's step (``GradientMessage.step``) and a head task may hold its gradients for the driver
(``HeadTask.hold``); 4 since the global statistics mark constant features
(``GlobalStatisticsMessage.constant``); 5 since a scored imputation client contributes its
per-feature errors to a sum (the ``feature-errors`` computation); 6 since a plain sum carries
its request's phase (``SumMessage.phase``); 7 since a representation request names the heads'
parties whose gradients its forward pass takes (``RepresentRequest.gradients_from``); 8 since
every request for a contribution to the aggregator, and the contribution, carries its ticket
(:mod:`~secure_vfl.federation.tickets`; the ``ticket-key`` message exists); 9 since a head
task's sums may come as the disjoint parts its tasks are unions of (``HeadTask.parts``); 10
since a closing gradient may step its receiver's head too (``GradientMessage.heads``). A party
of another version is refused on its first message, naming both."""
PHASES = ("train", "predict")

PartyId = str
AGGREGATOR: PartyId = "aggregator"
DRIVEN_KINDS = frozenset(
    {
        "abort",
        "compute-request",
        "global-statistics",
        "head-task",
        "key-request",
        "latent",
        "parameters",
        "predict-task",
        "represent-request",
        "score-request",
        "seal-request",
        "sum-request",
        "ticket-key",
        "update",
    }
)
"""The kinds only a run's driver sends (the label party; an imputation run's coordinator): its
requests and plans. A party that knows its driver (:attr:`~secure_vfl.federation.parties.
Party.driver`) refuses them from anyone else."""


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
        """Check the message is well formed on its own (ProtocolError); the finiteness of its
        floating-point content is the wire codec's to check on receipt."""
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


def _increasing(tensor: Tensor) -> bool:
    """Whether a 1-d tensor is strictly increasing (numpy: cheaper than torch on small rows;
    counting the steps that are not increases is cheaper than a reduction with ``all``)."""
    values = tensor.numpy()
    return not np.count_nonzero(values[1:] <= values[:-1])


def _nonnegative(tensor: Tensor) -> bool:
    return not np.count_nonzero(tensor.numpy() < 0)


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
        if not _increasing(self.positions):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: positions must be strictly increasing."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class RepresentationMessage(RowsMessage):
    """A data party's representations of its observed rows of the batch (forward pass); to the
    aggregator, with the ``ticket`` of the request that asked for it (:mod:`~secure_vfl.
    federation.tickets`)."""

    representation: Tensor
    ticket: bytes = b""
    kind: ClassVar[str] = "representation"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "representation", self.representation, dims=2, dtype=torch.float32)
        self._check_rows("representation", self.representation)


@register_message
@dataclass(frozen=True, kw_only=True)
class GradientMessage(RowsMessage):
    """The gradient of a head's loss with respect to a party's representations (backward pass).

    With ``step`` it is the last gradient the receiver's forward pass ``(round, tag)`` gets: the
    receiver acts on it as on the gradient and then the :class:`UpdateRequest` of that step (the
    driver sends no separate one), saving a message and a round trip per party and step; with
    ``heads`` too, that update steps the receiver's head ``tag`` as well (``UpdateRequest.heads``).
    """

    gradient: Tensor
    step: bool = False
    heads: bool = False
    kind: ClassVar[str] = "gradient"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "gradient", self.gradient, dims=2, dtype=torch.float32)
        self._check_rows("gradient", self.gradient)
        if self.heads and not self.step:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: heads set on a gradient that does not close "
                "its step; only a closing gradient (step) stands for an update of the heads."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class SumMessage(Message):
    """Per-task sums of representations, delivered to the head that asked for them.

    ``sums[t, b]`` is the sum of the representations of the parties selected for task ``t`` at
    batch row ``b``; ``counts[t, b]`` how many there were (public: the receiver chose them).
    """

    sums: Tensor
    counts: Tensor
    tag: str = ""
    phase: str = "train"  # its request's: what the transport counts its bytes under
    kind: ClassVar[str] = "sum"

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "phase", self.phase, PHASES)
        _check_tensor(self, "sums", self.sums, dims=3, dtype=torch.float32)
        _check_tensor(self, "counts", self.counts, dims=2, dtype=torch.int64)
        if tuple(self.counts.shape) != tuple(self.sums.shape[:2]):
            raise ProtocolError(
                f"sum from {self.sender}: counts of shape {tuple(self.sums.shape[:2])} expected, "
                f"found {tuple(self.counts.shape)}."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class PredictionMessage(RowsMessage):
    """A party's predicted classes for some rows (Ensemble voting) and, when the task asked
    for them, its class probabilities (rows, classes)."""

    predictions: Tensor
    probabilities: Tensor | None = None
    kind: ClassVar[str] = "prediction"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "predictions", self.predictions, dims=1, dtype=torch.int64)
        self._check_rows("predictions", self.predictions)
        if self.probabilities is not None:
            _check_tensor(self, "probabilities", self.probabilities, dims=2, dtype=torch.float32)
            self._check_rows("probabilities", self.probabilities)


@register_message
@dataclass(frozen=True, kw_only=True)
class ErrorMessage(Message):
    """A party's refusal: carries the reason and no content."""

    error: str
    kind: ClassVar[str] = "error"


@register_message
@dataclass(frozen=True, kw_only=True)
class LatentMessage(RowsMessage):
    """Latent samples ``h`` drawn by the label party for some rows of the batch (FALSE-VFL).

    ``samples[i, j]`` is the j-th importance sample of the latent of row ``positions[i]``, which
    is row ``rows[i]`` of the receiver's table of ``split``; the receiving party scores its block
    (or, in FALSE-VFL-II, its missingness) under them and answers with a
    :class:`LikelihoodMessage`. With ``backward`` it keeps the graph for the gradient that will
    come back (training stage 1).
    """

    samples: Tensor
    split: str
    rows: Tensor
    backward: bool = False
    kind: ClassVar[str] = "latent"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "samples", self.samples, dims=3, dtype=torch.float32)
        self._check_rows("samples", self.samples)
        _check_tensor(self, "rows", self.rows, dims=1, dtype=torch.int64)
        if self.rows.shape != self.positions.shape or not _nonnegative(self.rows):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: one row >= 0 per position expected, found "
                f"{self.rows.numel()} rows for {self.positions.numel()} positions."
            )


@register_message
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


@register_message
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


def _check_choice(message: Message, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ProtocolError(
            f"{message.kind} from {message.sender}: {name} must be one of {allowed}, "
            f"found {value!r}."
        )


@register_message
@dataclass(frozen=True, kw_only=True)
class RepresentRequest(Message):
    """The driver asks a data party for representations of some of its rows (no features, no
    labels): ``rows`` index the party's own table of ``split``, ``positions`` place them in the
    batch; the party sends a :class:`RepresentationMessage` to ``reply_to`` computed with its
    model ``model`` (``""``: its bottom model) and, in training with ``backward``, keeps the
    graph for the gradient that will come back under ``tag``, from the driver or from the
    parties ``gradients_from`` (the holders of the heads that train on it). (``phase`` prices
    the release; ``backward=False`` serves training rows to a step that sends no gradient
    back.) With ``reply_to`` the aggregator, under plain sums, it carries the ``ticket`` the
    representation carries there (:mod:`~secure_vfl.federation.tickets`; under a secure sum
    the representation is held for sealing and the seal request carries one)."""

    split: str
    rows: Tensor
    positions: Tensor
    reply_to: PartyId
    tag: str = ""
    model: str = ""
    phase: str = "train"
    backward: bool = True
    gradients_from: tuple[PartyId, ...] = ()
    ticket: bytes = b""
    kind: ClassVar[str] = "represent-request"

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "phase", self.phase, PHASES)
        _check_tensor(self, "rows", self.rows, dims=1, dtype=torch.int64)
        _check_tensor(self, "positions", self.positions, dims=1, dtype=torch.int64)
        if self.rows.shape != self.positions.shape:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: as many rows as positions expected, found "
                f"{self.rows.numel()} rows and {self.positions.numel()} positions."
            )
        if not (_nonnegative(self.rows) and _nonnegative(self.positions)):
            raise ProtocolError(f"{self.kind} from {self.sender}: rows and positions must be >= 0.")
        if not _increasing(self.positions):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: positions must be strictly increasing."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class SumRequest(Message):
    """The driver asks the aggregator for per-task sums of the representations it holds for
    ``(round, batch_id, phase, source_tag)``, delivered to ``deliver_to``: ``selection[t, b, k]``
    says whether party ``parties[k]``'s row ``b`` enters sum ``t``; ``tag`` names the sum so
    secure backends never reuse a mask context. ``dp_rows[b, k]`` (a ``release="dp"`` policy;
    None: no such row) flags the rows that enter a sum as its only contributor besides the
    receiver: ``parties[k]`` sends row ``b`` clipped and noised, as a DP release it prices."""

    selection: Tensor
    parties: tuple[str, ...]
    deliver_to: PartyId
    tag: str
    source_tag: str = ""
    phase: str = "train"
    dp_rows: Tensor | None = None
    kind: ClassVar[str] = "sum-request"

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "phase", self.phase, PHASES)
        _check_tensor(self, "selection", self.selection, dims=3, dtype=torch.bool)
        if self.selection.shape[2] != len(self.parties) or len(set(self.parties)) != len(
            self.parties
        ):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: one selection column per distinct party "
                f"expected, found {self.selection.shape[2]} columns for parties {self.parties}."
            )
        if self.dp_rows is not None:
            _check_tensor(self, "dp_rows", self.dp_rows, dims=2, dtype=torch.bool)
            if self.dp_rows.shape != self.selection.shape[1:]:
                raise ProtocolError(
                    f"{self.kind} from {self.sender}: dp_rows of shape "
                    f"{tuple(self.selection.shape[1:])} (rows, parties) expected, found "
                    f"{tuple(self.dp_rows.shape)}."
                )


@register_message
@dataclass(frozen=True, kw_only=True)
class UpdateRequest(Message):
    """The driver closes a training step: the party backpropagates the gradients it received
    for ``(round, tag)`` (if any), forgets a forward pass whose gradient did not come, and steps
    the optimiser of the model that served it (and of its heads when ``heads`` is set)."""

    tag: str = ""
    heads: bool = False
    kind: ClassVar[str] = "update"


@register_message
@dataclass(frozen=True, kw_only=True)
class AbortRequest(Message):
    """The driver abandons training step ``round`` (a party it needed was lost mid-step): the
    receiver discards what it holds for that step (forward passes, gradients and head tasks
    received, head gradients accumulated, shares kept or added), so that the step's retry
    without the lost party counts once."""

    kind: ClassVar[str] = "abort"


@register_message
@dataclass(frozen=True, kw_only=True)
class HeadTask(Message):
    """The driver tells a head-holding party what its head trains on this step: the batch rows
    (``rows``, indices into the training labels the party holds), each task's loss weight
    ``weights[t, b]`` and ``selection[t, b, k]`` (who contributed, so the party knows whom it owes
    gradients); the sums themselves come from the aggregator under ``tag``.

    With ``hold`` (only from the party itself: the label party's own head, when it trains one
    task of the step) the head sends no gradient to another party but keeps them for the driver,
    which sends them as the step's last (``GradientMessage.step``) once the step's loss is in.

    With ``parts`` (S, B, K) the sums come per part instead of per task: at each row the parts
    are disjoint and every task is a union of them (:meth:`composition`), so the head adds each
    task's sum from its parts' (under secure sums, each contributor then seals its term once a
    step, into its own part, however many tasks it enters).
    """

    rows: Tensor
    weights: Tensor
    normaliser: float
    selection: Tensor
    present: Tensor
    parties: tuple[str, ...]
    tag: str
    head: str = ""
    hold: bool = False
    parts: Tensor | None = None
    kind: ClassVar[str] = "head-task"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "rows", self.rows, dims=1, dtype=torch.int64)
        _check_tensor(self, "weights", self.weights, dims=2, dtype=torch.float32)
        _check_tensor(self, "selection", self.selection, dims=3, dtype=torch.bool)
        _check_tensor(self, "present", self.present, dims=2, dtype=torch.bool)
        tasks, batch = self.weights.shape
        if (
            tuple(self.selection.shape) != (tasks, batch, len(self.parties))
            or self.rows.numel() != batch
            or tuple(self.present.shape) != (batch, len(self.parties))
        ):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: rows (B,), weights (T, B), selection "
                f"(T, B, {len(self.parties)}) and present (B, {len(self.parties)}) expected, "
                f"found {tuple(self.rows.shape)}, {tuple(self.weights.shape)}, "
                f"{tuple(self.selection.shape)} and {tuple(self.present.shape)}."
            )
        if not (self.normaliser > 0 and math.isfinite(self.normaliser)):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a positive normaliser expected, "
                f"found {self.normaliser}."
            )
        if self.parts is not None:
            self._check_parts(self.parts, batch)

    def _check_parts(self, parts: Tensor, batch: int) -> None:
        _check_tensor(self, "parts", parts, dims=3, dtype=torch.bool)
        if tuple(parts.shape[1:]) != (batch, len(self.parties)):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: parts (S, {batch}, {len(self.parties)}) "
                f"expected, found {tuple(parts.shape)}."
            )
        if bool((parts.sum(dim=0) > 1).any()):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: disjoint parts expected, found a party in "
                "two parts of one row."
            )
        covered = torch.einsum("tsb,sbk->tbk", self.composition().float(), parts.float()) > 0
        if not torch.equal(covered, self.selection):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: each task a union of parts expected, found "
                "a task whose selection the parts it contains do not cover."
            )

    def composition(self) -> Tensor:
        """(T, S, B) bool: which parts' sums make up each task's at each row (the non-empty
        parts inside its selection); all False without ``parts``."""
        if self.parts is None:
            return torch.zeros(
                self.selection.shape[0], 0, self.selection.shape[1], dtype=torch.bool
            )
        inside = ~(self.parts.unsqueeze(0) & ~self.selection.unsqueeze(1)).any(dim=3)
        return inside & self.parts.any(dim=2).unsqueeze(0)


@register_message
@dataclass(frozen=True, kw_only=True)
class PredictTask(Message):
    """The driver asks a head-holding party to predict ``positions`` of the batch from the sum
    the aggregator delivers under ``tag``; it answers with a :class:`PredictionMessage`, with
    the class probabilities too when ``probabilities`` is set."""

    positions: Tensor
    tag: str
    head: str = ""
    probabilities: bool = False
    kind: ClassVar[str] = "predict-task"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "positions", self.positions, dims=1, dtype=torch.int64)


@register_message
@dataclass(frozen=True, kw_only=True)
class LossMessage(Message):
    """A head-holding party's weighted training loss of one step, reported to the driver."""

    loss: float
    tag: str = ""
    kind: ClassVar[str] = "loss"

    def validate(self) -> None:
        super().validate()
        if not math.isfinite(self.loss):
            raise NonFiniteError(
                f"{self.kind} from {self.sender} (round {self.round}): the loss is not finite.",
                step=self.round,
            )


# -- secure sums split at the party boundary (key set-up, sealed contributions, sealed sums) --


@register_message
@dataclass(frozen=True, kw_only=True)
class KeyRequest(Message):
    """The driver opens a secure-sum session: every contributor announces its public key (if
    its scheme has one) to the other ``contributors``, every ``receivers`` member its public
    key to the contributors and the aggregator, which gets a request too (it announces nothing).
    Only this request opens a session: a key of one not opened waits for it. Nothing secret is
    asked for or sent."""

    scheme: str
    contributors: tuple[str, ...]
    receivers: tuple[str, ...]
    kind: ClassVar[str] = "key-request"


@register_message
@dataclass(frozen=True, kw_only=True)
class TicketKeyMessage(Message):
    """The driver's key for the tickets of its ``session``, to the aggregation server, before the
    first request of the session that carries a ticket (:mod:`~secure_vfl.federation.tickets`).
    It protects no data: it tells the server which contributions the driver asked for."""

    key: bytes
    kind: ClassVar[str] = "ticket-key"

    def validate(self) -> None:
        super().validate()
        if len(self.key) != TICKET_KEY_BYTES:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a key of {TICKET_KEY_BYTES} bytes expected, "
                f"found {len(self.key)}."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class PublicKeyMessage(Message):
    """A party's public key for a secure-sum scheme: as a contributor (``role="sender"``,
    e.g. its X25519 key for pairwise masks) or as a receiver of sums (``role="receiver"``, e.g.
    its Paillier modulus or its CKKS public context), in the scheme's own serialisation."""

    scheme: str
    role: str
    key: bytes
    kind: ClassVar[str] = "public-key"

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "role", self.role, ("sender", "receiver"))


@register_message
@dataclass(frozen=True, kw_only=True)
class SealRequest(SumRequest):
    """The driver asks a contributor to seal (mask or encrypt) the representation it kept for
    ``(round, batch_id, phase, source_tag)`` into the sums ``selection`` (T, B, K) describes,
    for ``deliver_to``, and send it to the aggregator under ``tag`` (the fields of the
    :class:`SumRequest` for the same sums) with the ``ticket`` the share carries there
    (:mod:`~secure_vfl.federation.tickets`)."""

    ticket: bytes = b""
    kind: ClassVar[str] = "seal-request"


@register_message
@dataclass(frozen=True, kw_only=True)
class SealedMessage(Message):
    """A contributor's sealed share of the sums ``tag`` for ``deliver_to``: its values in the
    sums it enters, masked or encrypted by ``scheme`` (``payload`` in the scheme's own
    serialisation: ring elements, Paillier or CKKS ciphertexts); ``width`` values per row;
    ``ticket``: its seal request's (:mod:`~secure_vfl.federation.tickets`)."""

    scheme: str
    deliver_to: PartyId
    tag: str
    width: int
    payload: tuple[bytes, ...]
    phase: str = "train"
    ticket: bytes = b""
    kind: ClassVar[str] = "sealed"

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "phase", self.phase, PHASES)
        if self.width < 1:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a width >= 1 expected, found {self.width}."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class SealedSumMessage(Message):
    """The aggregator's sealed sums for ``receiver``: the contributors' payloads combined
    (pair masks cancelled, ciphertexts added), which only the receiver can open;
    ``selection[t, b, k]`` says that ``parties[k]``'s share entered sum ``(t, b)`` (the
    receiver removes the self-masks of exactly those; :attr:`counts` per sum)."""

    scheme: str
    tag: str
    width: int
    selection: Tensor
    parties: tuple[str, ...]
    payload: tuple[bytes, ...]
    phase: str = "train"
    kind: ClassVar[str] = "sealed-sum"

    @property
    def counts(self) -> Tensor:
        """(T, B) int64: how many contributors entered each sum."""
        return self.selection.sum(dim=-1)

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "phase", self.phase, PHASES)
        _check_tensor(self, "selection", self.selection, dims=3, dtype=torch.bool)
        if self.width < 1 or self.selection.shape[2] != len(self.parties):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a width >= 1 and a (T, B, "
                f"{len(self.parties)}) selection of the parties expected, found width "
                f"{self.width} and shape {tuple(self.selection.shape)}."
            )


# -- federated imputation: the coordinator's requests, publications and downloads ------------

COMPUTATIONS: tuple[str, ...] = (
    "moments",
    "deviations",
    "pairs",
    "rows",
    "train",
    "validation",
    "feature-errors",
)
"""The local computations an imputation client runs on request: the three statistics exchanges,
its row count, local training (its FedAvg update), its validation error, and the per-feature
errors of the score it last sent (:class:`ScoreMessage`), which only their sum over the clients
reports."""


@register_message
@dataclass(frozen=True, kw_only=True)
class ComputeRequest(Message):
    """The coordinator asks a client to run its local ``computation`` (one of
    :data:`COMPUTATIONS`) on ``arguments`` (public values only: a released mean, the
    federation's row count) and to contribute the resulting vector to the sum ``tag`` of this
    round: a one-row representation sent to the aggregator in the clear under a plain sum, kept
    until a :class:`SealRequest` under a secure one; ``ticket``: the one-row representation's
    under a plain sum (:mod:`~secure_vfl.federation.tickets`)."""

    computation: str
    arguments: Tensor
    tag: str
    ticket: bytes = b""
    kind: ClassVar[str] = "compute-request"

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "computation", self.computation, COMPUTATIONS)
        _check_tensor(self, "arguments", self.arguments, dims=1, dtype=torch.float64)


@register_message
@dataclass(frozen=True, kw_only=True)
class ParametersMessage(Message):
    """The coordinator's FedAvg download to one client: the global model's parameters as one
    flat float32 vector (theta of eq. 8); ``tag`` says which (``"initial"``, a round's
    ``"global"`` average, the ``"best"`` by validation)."""

    parameters: Tensor
    tag: str = ""
    kind: ClassVar[str] = "parameters"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "parameters", self.parameters, dims=1, dtype=torch.float32)


@register_message
@dataclass(frozen=True, kw_only=True)
class GlobalStatisticsMessage(Message):
    """What the coordinator publishes to each client once the statistics are summed: the
    global standardisation (per-feature ``mean`` and ``std`` > 0, float64, and which features
    are ``constant``, bool, if known) and, for a model that reads one, the feature graph
    (``neighbours`` (F, k) int64 in [0, F), ``weights`` float32 in [0, 1] and 0 where ``mask``
    (bool) is False; all three or none)."""

    mean: Tensor
    std: Tensor
    neighbours: Tensor | None = None
    weights: Tensor | None = None
    mask: Tensor | None = None
    constant: Tensor | None = None
    kind: ClassVar[str] = "global-statistics"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "mean", self.mean, dims=1, dtype=torch.float64)
        _check_tensor(self, "std", self.std, dims=1, dtype=torch.float64)
        features = self.mean.shape[0]
        if self.std.shape != self.mean.shape or not bool((self.std > 0).all()):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a std > 0 for each of the {features} "
                f"features expected, found shape {tuple(self.std.shape)}, minimum "
                f"{float(self.std.min()) if self.std.numel() else 'none'}."
            )
        if self.constant is not None:
            _check_tensor(self, "constant", self.constant, dims=1, dtype=torch.bool)
            if self.constant.shape != self.mean.shape:
                raise ProtocolError(
                    f"{self.kind} from {self.sender}: a constant flag for each of the "
                    f"{features} features expected, found {self.constant.shape[0]}."
                )
        graph = (self.neighbours, self.weights, self.mask)
        if all(part is None for part in graph):
            return
        if self.neighbours is None or self.weights is None or self.mask is None:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: the graph's neighbours, weights and mask "
                "expected together, found only some of them."
            )
        _check_tensor(self, "neighbours", self.neighbours, dims=2, dtype=torch.int64)
        _check_tensor(self, "weights", self.weights, dims=2, dtype=torch.float32)
        _check_tensor(self, "mask", self.mask, dims=2, dtype=torch.bool)
        shape = tuple(self.neighbours.shape)
        if shape[0] != features or {tuple(self.weights.shape), tuple(self.mask.shape)} != {shape}:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: neighbours, weights and mask of shape "
                f"({features}, k) expected, found {shape}, {tuple(self.weights.shape)} and "
                f"{tuple(self.mask.shape)}."
            )
        if self.neighbours.numel() and not (
            int(self.neighbours.min()) >= 0 and int(self.neighbours.max()) < features
        ):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: neighbours in [0, {features}) expected, found "
                f"[{int(self.neighbours.min())}, {int(self.neighbours.max())}]."
            )
        if bool(
            ((self.weights < 0) | (self.weights > 1) | (~self.mask & (self.weights != 0))).any()
        ):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: weights in [0, 1] expected, and 0 where the "
                "mask is False; found others."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class ScoreRequest(Message):
    """The evaluator asks an imputation client to score its model on its own test rows: the
    client hides ``fraction`` of their observed-and-available entries (drawn by a generator
    seeded ``seed``), imputes them and answers with a :class:`ScoreMessage`. ``std`` (F,
    float64 > 0) is the evaluator's yardstick: errors are measured in its units."""

    std: Tensor
    seed: int
    fraction: float
    kind: ClassVar[str] = "score-request"

    def validate(self) -> None:
        super().validate()
        _check_tensor(self, "std", self.std, dims=1, dtype=torch.float64)
        if not bool((self.std > 0).all()):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a std > 0 for every feature expected, found "
                f"a minimum of {float(self.std.min())}."
            )
        if self.seed < 0 or not 0.0 < self.fraction < 1.0:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a seed >= 0 and a fraction in (0, 1) "
                f"expected, found seed {self.seed} and fraction {self.fraction}."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class ScoreMessage(Message):
    """An imputation client's score: the sum of its squared errors (in the yardstick's units)
    over the ``count`` test entries it hid. Nothing of its rows crosses but these two numbers."""

    sse: float
    count: int
    kind: ClassVar[str] = "score"

    def validate(self) -> None:
        super().validate()
        if self.sse < 0 or self.count < 0 or (self.count == 0 and self.sse != 0):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a squared error >= 0 over a count >= 0 (0 "
                f"over none) expected, found {self.sse} over {self.count}."
            )


# -- deployment: how a run is set up and ended between processes (secure_vfl.deployment) -----

DEPLOYMENT_TOPICS = (
    "roster",
    "ids-request",
    "ids",
    "psi",
    "psi-ready",
    "fit",
    "fitted",
    "setup",
    "checkpoints",
    "checkpoints-ready",
    "checkpoint",
    "checkpointed",
    "save",
    "saved",
    "end",
    "report",
    "columns-request",
    "columns",
    "impute-setup",
    "impute-save",
    "impute-saved",
    "predict-setup",
)


@register_message
@dataclass(frozen=True, kw_only=True)
class DeploymentMessage(Message):
    """A control message of a deployed run (every party its own process): the label party
    first has every other process compare its federation file with the label party's
    (``roster``: the label party, each member's name and address, the CA's SHA-256), then
    asks a data party for its ids (``ids-request``) and hears them (``ids``), or, under
    ``--align psi``, asks it to take the responder's side of a PSI session (``psi``: the session
    id and mode) and hears its block width (``psi-ready``); it sets the run up
    (``setup``: the method, seed, the party's rows per split, the secure-sum scheme), tells it
    the run's checkpoints before training (``checkpoints``: the run id and, on resume, the step
    and the manifest SHA-256 to restore from; answered by ``checkpoints-ready``), has it write
    its own checkpoint of a step (``checkpoint``, answered by ``checkpointed`` with its
    manifest's SHA-256), has it save its own part of the trained model (``save``: the model's
    run id; answered by ``saved`` with its files' SHA-256) and ends the run (``end``, answered
    by a ``report``). An imputation run asks each client for its feature columns
    (``columns-request``, answered by ``columns``), sets it up (``impute-setup``) and may
    have it write its imputed table (``impute-save``, answered by ``impute-saved``) and save its
    own imputer (``save``, answered by ``saved``; :mod:`secure_vfl.deployed_imputation`).
    ``body`` is a JSON
    object whose schema the receiver checks per topic (:mod:`secure_vfl.deployment`); never
    pickle."""

    topic: str
    body: str
    kind: ClassVar[str] = "deployment"

    def validate(self) -> None:
        super().validate()
        _check_choice(self, "topic", self.topic, DEPLOYMENT_TOPICS)
