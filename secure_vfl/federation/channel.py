"""Point-to-point delivery: a stack of channel layers in front of a transport.

A layer sees every message on its way and may record it, account for it or transform it (DP noise
on gradients or embeddings, sparsification, an attack's tampering). Layers never reach into a
party; they only see what crosses the boundary.

The transport moves bytes: the in-process one encodes every message with the wire codec
(:mod:`secure_vfl.federation.wire`) and decodes it on the other side, so even in one process no
tensor or object is shared between parties, and it counts (and optionally captures) the bytes
that crossed. Over the network (:mod:`secure_vfl.federation.network`) each process has one
party and a :class:`~secure_vfl.federation.network.NetworkChannel`, whose ``post`` sends through
the same layers and then over gRPC, returning once the receiver has acted on the message, as
:meth:`Channel.post` does in one process.
"""

from __future__ import annotations

import fcntl
import io
import os
import struct
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, Protocol, TypeVar, cast, overload

from secure_vfl.errors import NonFiniteError, OutputError, ProtocolError, VersionError
from secure_vfl.federation import wire
from secure_vfl.federation.messages import Message, check_header

if TYPE_CHECKING:
    from secure_vfl.federation.parties import Party

M = TypeVar("M", bound=Message)

CAPTURE_LENGTH = struct.Struct(">I")

Readmission = Callable[[str], int]
"""Sets a lost data party that answers again up anew, as at the start of the run (its own
process builds its initial models by the seed rule, then, in a run with deployed checkpoints,
restores its checkpoint in the last commit that held it, if it still has it); returns the
training step of the checkpoint it restored (0: none). ProtocolError if it cannot. Made by the
composition root: over the network, the party's ``setup`` message (:mod:`secure_vfl.deployment`)."""


class ChannelLayer(Protocol):
    """One transformation of messages in transit."""

    def on_message(self, message: M) -> M:
        """Return the message to pass on (the same object, or a transformed copy)."""
        ...


class Transport(Protocol):
    """Moves a message to its receiver and returns it as the receiver decodes it.

    ``bytes`` counts the encoded bytes put on the wire, by (sender, receiver, phase).
    """

    bytes: Counter[tuple[str, str, str]]

    def deliver(self, message: M) -> M:
        """Deliver ``message``; what arrives is decoded and validated by the wire codec."""
        ...


class InProcessTransport:
    """All parties in one process, but every message crosses as bytes: encoded by the sender,
    decoded (and validated) on receipt. ``capture`` appends each message as a record
    ``[4-byte big-endian length][encoded message]`` (see :func:`read_capture`). A message is
    counted and captured once encoded, before the receiver decodes it: one the receiver's codec
    refuses (a diverged run's NaN) crossed all the same, as over the network.
    ``codec_seconds`` (and ``codec_seconds_by_kind``, by message kind) add up the time spent
    encoding and decoding."""

    def __init__(self, *, capture: BinaryIO | None = None) -> None:
        self.bytes: Counter[tuple[str, str, str]] = Counter()
        self.capture = capture
        self.codec_seconds = 0.0
        self.codec_seconds_by_kind: defaultdict[str, float] = defaultdict(float)

    def deliver(self, message: M) -> M:
        start = time.perf_counter()
        data = wire.encode(message)
        encoding = time.perf_counter() - start
        phase = getattr(message, "phase", "train")
        self.bytes[(message.sender, message.receiver, phase)] += len(data)
        if self.capture is not None:
            append_record(self.capture, data)
        start = time.perf_counter()
        try:
            return cast(M, wire.decode(data))
        finally:
            seconds = encoding + time.perf_counter() - start
            self.codec_seconds += seconds
            self.codec_seconds_by_kind[message.kind] += seconds


def append_record(capture: BinaryIO, data: bytes) -> None:
    """Append ``data`` to ``capture`` as one record in one write, flushed, under the capture's
    lock (:func:`capture_lock`): two commands that append to one file at once keep their records
    whole (a length written apart from its message let the other's record in between), and a
    refused write fails here, not when the file is closed. OutputError naming the file where
    the system refuses it (a full disk)."""
    try:
        with capture_lock(capture, follow=True):
            capture.write(CAPTURE_LENGTH.pack(len(data)) + data)
            capture.flush()
    except OSError as error:
        name = getattr(capture, "name", "the capture file")
        raise OutputError(
            f"--capture {name} cannot be written: {error.strerror or error}; the run stopped."
        ) from error


@contextmanager
def capture_lock(capture: BinaryIO, *, follow: bool = False) -> Iterator[None]:
    """Hold the lock every command takes to append a record to the capture file ``capture`` or
    to cut a torn record off its end (an exclusive ``flock``, dropped by the system when its
    holder dies): a command starting on the file while another is halfway through a record
    waits for it, instead of cutting the half record as a killed command's. A capture that is
    no file (an ``io.BytesIO``) has no other writer and no lock. OSError where the system
    refuses the lock.

    ``follow``: where the file ``capture`` holds was removed (the command that made it was
    refused before any message and removed it, empty, not knowing that this one held it too),
    ``capture`` is first pointed at the file at its name, made anew if none is there."""
    try:
        descriptor = capture.fileno()
    except (AttributeError, io.UnsupportedOperation):
        yield
        return
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    name = getattr(capture, "name", None)
    while follow and isinstance(name, str) and os.fstat(descriptor).st_nlink == 0:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        reopened = os.open(name, flags, 0o666)
        os.dup2(reopened, descriptor, inheritable=False)  # ``capture`` writes there now
        os.close(reopened)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(descriptor, fcntl.LOCK_UN)


def read_capture(path: Path | str) -> Iterator[Message]:
    """The messages of a capture file, in the order they crossed; ProtocolError on a truncated
    record or a message the codec refuses."""
    for _, message in capture_records(path):
        yield message


@dataclass(frozen=True)
class NonFiniteRecord:
    """A captured message the codec refuses for non-finite values, the first fault it finds in
    it (a run that diverged: what crossed, as it crossed): its header, read without its other
    fields, and the refusal."""

    header: wire.Header
    reason: str


@overload
def capture_records(
    path: Path | str, *, end: int | None = None, non_finite: Literal[False] = False
) -> Iterator[tuple[int, Message]]: ...


@overload
def capture_records(
    path: Path | str, *, end: int | None = None, non_finite: bool
) -> Iterator[tuple[int, Message | NonFiniteRecord]]: ...


def capture_records(
    path: Path | str, *, end: int | None = None, non_finite: bool = False
) -> Iterator[tuple[int, Message | NonFiniteRecord]]:
    """Each message of the capture file ``path`` with its encoded size in bytes (what crossed),
    in the order they crossed, up to byte ``end`` (None: the end of the file; a record's
    boundary, such as :func:`whole_records` finds). ProtocolError on a truncated record or a
    message the codec refuses, naming the file and the record (its number and first byte);
    with ``non_finite``, a message the codec refuses for non-finite values (the first fault it
    finds in it) is a :class:`NonFiniteRecord` instead (a capture of a run that diverged ends
    in one)."""
    path = Path(path)
    with path.open("rb") as handle:
        read = records = 0
        while (end is None or read < end) and (header := handle.read(CAPTURE_LENGTH.size)):
            records += 1
            where = f"{path}, record {records} (at byte {read})"  # read after the fact
            if len(header) < CAPTURE_LENGTH.size:
                raise ProtocolError(f"{where}: a truncated record length at the end of the file.")
            (length,) = CAPTURE_LENGTH.unpack(header)
            data = handle.read(length)
            if len(data) != length:
                raise ProtocolError(
                    f"{where}: a record of {length} bytes expected, found {len(data)}."
                )
            try:
                message: Message | NonFiniteRecord = wire.decode(data)
            except NonFiniteError as error:
                if not non_finite:
                    raise type(error)(f"{where}: {error}") from None
                message = NonFiniteRecord(wire.header_of(data), str(error))
            except ProtocolError as error:
                hint = (
                    " The file was captured by another release of secure-vfl; read it with that "
                    "release."
                    if isinstance(error, VersionError)
                    else ""
                )
                raise type(error)(f"{where}: {error}{hint}") from None
            read += CAPTURE_LENGTH.size + length
            yield length, message


def whole_records(path: Path) -> int:
    """The length of ``path``'s leading whole capture records (each a length, then a message
    that starts with the codec's magic bytes), read by their lengths alone: the file's size, or
    where a torn last record starts (a command stopped while writing it). ProtocolError where
    a record does not start as one: not a capture file (or one appended to after a torn
    record, which no cut mends)."""
    size = path.stat().st_size
    opening = CAPTURE_LENGTH.size + len(wire.MAGIC)
    with path.open("rb") as handle:
        end = 0
        while end < size:
            header = handle.read(opening)
            seen = max(len(header) - CAPTURE_LENGTH.size, 0)
            if header[CAPTURE_LENGTH.size :] != wire.MAGIC[:seen] or (seen == 0 and end == 0):
                where = "it starts" if end == 0 else f"its record at byte {end} starts"
                raise ProtocolError(
                    f"{path} is not a capture file ({where} with {header!r}; a record length "
                    f"and then {wire.MAGIC!r} expected)"
                )
            (length,) = CAPTURE_LENGTH.unpack(header[: CAPTURE_LENGTH.size].ljust(4, b"\0"))
            if len(header) < opening or end + CAPTURE_LENGTH.size + length > size:
                break  # the torn last record
            end += CAPTURE_LENGTH.size + length
            handle.seek(end)
        return end


class Channel:
    """The path every message between parties takes: layers in order, then the transport.

    Parties attached to the channel receive what is posted to them (:meth:`post`): the channel
    is the network, and the only thing that knows every party's address.
    """

    def __init__(
        self, layers: Sequence[ChannelLayer] = (), transport: Transport | None = None
    ) -> None:
        self.layers = list(layers)
        self.transport: Transport = transport if transport is not None else InProcessTransport()
        self.layer_seconds: defaultdict[str, float] = defaultdict(float)
        self.party_names: list[str] | None = None
        """The data parties' names in block order (None: ``party-0``, ``party-1``, ...)."""
        self.absent: frozenset[str] = frozenset()
        """Data parties known to be absent from the start (a deployed prediction's parties not
        served): a federation built on this channel never asks them for anything, its key
        set-up included."""
        self.lost_now: set[str] = set()
        """The data parties its driver counts lost now (dropped, not readmitted): a deployed
        run that stops early does not try to end the run at them."""
        self.readmit: Readmission | None = None
        """How a lost data party that answers again rejoins (None: a lost party never does;
        probing it then costs nothing). See :meth:`~secure_vfl.methods.base.Federation.rejoin`."""
        self._parties: dict[str, Party] = {}

    def hosts(self, name: str) -> bool:
        """Whether the party ``name`` lives on this channel's side (in one process: every
        party; over the network: the one party of this process)."""
        return True

    def unreachable(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` that can no longer be reached (a process that died); in one
        process every party is reachable. The driver asks after a failed step, to tell a lost
        party from an error in the protocol."""
        return []

    def returned(self, names: Sequence[str], *, quick: bool = False) -> list[str]:
        """Those of the lost parties ``names`` that can be reached again (probed once, all at
        once, with a short bounded wait; ``quick``: a party whose address refuses is not back,
        without waiting): the label party asks at an epoch boundary, an imputation's
        coordinator before every round."""
        lost = set(self.unreachable(names))
        return [name for name in names if name not in lost]

    def attach(self, party: Party) -> None:
        """Make ``party`` reachable by its name; a name is attached once."""
        if party.name in self._parties:
            raise ProtocolError(f"a party named {party.name!r} is already on this channel.")
        self._parties[party.name] = party

    def detach(self, name: str) -> None:
        """Make the party ``name`` unreachable by its name (a lost party whose place a party
        set up anew takes, in one process); ProtocolError if none is attached under it."""
        if self._parties.pop(name, None) is None:
            raise ProtocolError(f"no party named {name!r} is on this channel.")

    @property
    def parties(self) -> dict[str, Party]:
        """The attached parties by name (the network's address book)."""
        return dict(self._parties)

    def through_layers(self, message: M) -> M:
        """``message`` after every layer, in order; ``layer_seconds`` accumulates the time each
        layer class spends (e.g. DP noise)."""
        for layer in self.layers:
            start = time.perf_counter()
            message = layer.on_message(message)
            self.layer_seconds[type(layer).__name__] += time.perf_counter() - start
        return message

    def send(self, message: M) -> M:
        """Pass ``message`` through every layer and deliver it; return what the receiver gets."""
        return self.transport.deliver(self.through_layers(message))

    def receive(
        self, message: M, *, sender: str | None = None, receiver: str, round: int, batch_id: int
    ) -> M:
        """Send ``message`` and check on arrival that it is the one the receiver waits for."""
        delivered = self.send(message)
        check_header(delivered, sender=sender, receiver=receiver, round=round, batch_id=batch_id)
        return delivered

    def post(self, message: Message, *, sender: Party) -> None:
        """Send ``message`` from the attached party ``sender`` to the attached party it names.

        The channel vouches for the sender (a network transport does so by its certificate): a
        message whose header names another sender is refused before anything is sent.
        """
        self.check_sender(message, sender)
        receiver = self._parties.get(message.receiver)
        if receiver is None:
            raise ProtocolError(
                f"{message.kind} from {message.sender} to {message.receiver!r}: no such party "
                f"on this channel (found {', '.join(sorted(self._parties))})."
            )
        receiver.receive(self.send(message))
        receiver.flush_after()

    def post_all(
        self, messages: Sequence[Message], *, sender: Party, detached: bool = False
    ) -> None:
        """Send ``messages`` from ``sender``, each to the party it names, with no message
        depending on another's answer: a transport may deliver them at once (the network does,
        each receiver's messages in one delivery); in one process they go one after another, in
        order. As over the network, a failure stops only the messages to the same receiver that
        follow it: the others are delivered, then the first failure is raised. (``detached``,
        messages sent after the sender answered what it acted on, :meth:`Party.send_after`,
        changes nothing here: the failure still reaches whoever posted that.)"""
        failures: list[ProtocolError] = []
        failed: set[str] = set()
        for message in messages:
            if message.receiver in failed:
                continue
            try:
                self.post(message, sender=sender)
            except ProtocolError as error:
                failures.append(error)
                failed.add(message.receiver)
        if failures:
            raise failures[0]

    def wait(self, awaiting: str) -> bool:
        """Act on the next message that arrives for a party waiting for ``awaiting``; whether
        one can arrive at all. In one process none can: every message is delivered, and acted
        on, before the send that caused it returns."""
        return False

    def forget_refusals(self) -> list[str]:
        """Forget, and return, why the attached party refused replies that no send waited for
        (their senders had moved on), which its next :meth:`wait` would raise: the driver
        abandoned the attempt they belonged to (a lost party: one of its replies may have
        failed on the way to it). In one process there are none: a refusal reaches the sender
        that caused it."""
        return []

    def check_sender(self, message: Message, sender: Party) -> None:
        """ProtocolError unless ``sender`` is the attached party ``message`` names as sender."""
        if message.sender != sender.name or self._parties.get(sender.name) is not sender:
            raise ProtocolError(
                f"{message.kind} claims sender {message.sender!r} but was posted by "
                f"{sender.name!r}; a party sends only in its own name."
            )


class RecordingLayer:
    """Keeps every message that passes, in order (tests, byte accounting, curious observers)."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def on_message(self, message: M) -> M:
        self.messages.append(message)
        return message

    def kinds(self) -> list[str]:
        """The kinds of the recorded messages, in order."""
        return [m.kind for m in self.messages]
