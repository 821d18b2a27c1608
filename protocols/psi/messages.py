"""The messages of DH-PSI: what crosses the boundary between requester A and responder B.

Every one carries the header's ``session`` (one protocol run: no replays from another) and the
``mode``; peer points are checked on receipt (:func:`~protocols.psi_kernel.decode_points`).
Fields are plain str, int, bytes, numpy arrays and a Literal of str, as the wire codec expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from protocols.psi_kernel import decode_points
from secure_vfl.errors import ProtocolError
from secure_vfl.federation.messages import Message
from secure_vfl.federation.wire import register_message

PsiMode = Literal["intersection", "cardinality"]
MODES: tuple[PsiMode, ...] = ("intersection", "cardinality")


@dataclass(frozen=True, kw_only=True)
class PsiMessage(Message):
    """Header of every PSI message: a non-empty ``session`` ties it to one protocol run (no
    replays) and ``mode`` to its kind of result. ``batch_id`` numbers the chunks of a stream
    (0, 1, ...)."""

    mode: PsiMode
    kind: ClassVar[str] = "psi"

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.session, str) or not self.session:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a session id expected, found {self.session!r}."
            )
        if self.mode not in MODES:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: mode in {MODES} expected, found {self.mode!r}."
            )

    def _check_total(self, name: str, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: {name} must be an integer >= 0, found {value!r}."
            )


@register_message
@dataclass(frozen=True, kw_only=True)
class PsiRequest(PsiMessage):
    """Step 1, A -> B, one chunk: A's singly masked ids ``a·H(x)``, the next ``len(points) / 32``
    of ``total`` in A's secret shuffled order."""

    points: bytes
    total: int
    kind: ClassVar[str] = "psi-request"

    def validate(self) -> None:
        super().validate()
        self._check_total("total", self.total)
        decode_points(self.points, f"{self.kind} from {self.sender}")


@register_message
@dataclass(frozen=True, kw_only=True)
class PsiResponse(PsiMessage):
    """Step 2, B -> A, the answer to one message of A (a :class:`PsiRequest` or a
    :class:`PsiNext`): one chunk of each of two streams, either possibly empty: ``peer_points``,
    ``b·(a·H(x))`` for all the points of A's next unanswered request chunk (in that chunk's order,
    unless cardinality mode, where they are shuffled over all of A's points), and ``own_points``,
    the next of B's ``own_total`` masked ids ``b·H(y)`` in B's secret shuffled order."""

    peer_points: bytes
    own_points: bytes
    own_total: int
    kind: ClassVar[str] = "psi-response"

    def validate(self) -> None:
        super().validate()
        self._check_total("own_total", self.own_total)
        decode_points(self.peer_points, f"{self.kind} from {self.sender} (A's points)")
        decode_points(self.own_points, f"{self.kind} from {self.sender} (its own points)")


@register_message
@dataclass(frozen=True, kw_only=True)
class PsiNext(PsiMessage):
    """Step 2, A -> B, once A's request chunks are all sent: "send response chunk
    ``batch_id``". B answers each of A's messages with exactly one response and sends nothing
    unasked, so at most one response is in flight, whatever the transport."""

    kind: ClassVar[str] = "psi-next"


@register_message
@dataclass(frozen=True, kw_only=True)
class PsiMatchMessage(PsiMessage):
    """Step 4 (alignment only), A -> B: aligned sample ``sample_positions[j]`` (of ``samples``)
    is B's shuffled point ``peer_positions[j]``; B maps that back to its own row."""

    samples: int
    sample_positions: np.ndarray
    peer_positions: np.ndarray
    kind: ClassVar[str] = "psi-matches"

    def validate(self) -> None:
        super().validate()
        self._check_total("samples", self.samples)
        for name in ("sample_positions", "peer_positions"):
            array = getattr(self, name)
            if not isinstance(array, np.ndarray) or array.dtype != np.int64 or array.ndim != 1:
                raise ProtocolError(
                    f"{self.kind} from {self.sender}: {name} must be a 1-d int64 array, found "
                    f"{getattr(array, 'dtype', type(array).__name__)} "
                    f"{getattr(array, 'shape', '')}."
                )
        if self.sample_positions.shape != self.peer_positions.shape:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: as many sample as peer positions expected, "
                f"found {self.sample_positions.shape[0]} and {self.peer_positions.shape[0]}."
            )
        positions = self.sample_positions
        if positions.size and (positions.min() < 0 or positions.max() >= self.samples):
            raise ProtocolError(
                f"{self.kind} from {self.sender}: sample positions in [0, {self.samples}) "
                f"expected, found [{positions.min()}, {positions.max()}]."
            )
