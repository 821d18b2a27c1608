"""The network transport: each party in its own process, messages over gRPC with mutual TLS.

A :class:`PartyEndpoint` is one party's presence on the network: a gRPC server bound to its
address that receives encoded messages, and a client channel to each peer. The message format
is the wire codec's (:func:`~secure_vfl.federation.wire.encode`, ``decode``): gRPC carries raw
bytes (no generated code, no protobuf schema, never pickle). Two methods, service
``securevfl.Transport``: ``Deliver`` (unary, one encoded message) and ``DeliverStream`` (client
streaming, a message larger than :data:`STREAM_THRESHOLD` in chunks of :data:`CHUNK_BYTES`,
reassembled up to the codec's size limit). A delivery may carry several messages of one sender
to one receiver, acted on in their order (``send_all``: a step's closing gradient and the next
request to the same party): the metadata ``svfl-count`` announces them, and the bytes are their
encodings, each after its 4-byte big-endian length (the capture file's records), within the
same size limit.

**Identity.** Mutual TLS by default, with the federation's certificates (:mod:`protocols.tls`,
``secure-vfl certs init``): a party's name is its certificate's common name, also its first DNS
name. The server takes the caller's name from the caller's certificate (``x509_pem_cert`` of
``context.auth_context()``, parsed once per certificate), its common name, and refuses, with
``PERMISSION_DENIED``, any message whose header names another sender; the client checks that the
server's certificate holds the DNS name of the party it means to reach
(``grpc.ssl_target_name_override``). Both ends must see one name, so the server also refuses
(``UNAUTHENTICATED``) a caller certificate whose DNS names lack its common name or name another
member (the rule a party's start-up applies to its own,
:func:`~secure_vfl.federation.certificates.name_mismatches`): a CA that issued the common name
``a`` with the DNS name ``b`` would otherwise have made a certificate that calls as ``a`` and
serves as ``b``. That closes the calling half only: a client checks no more than that the server's
certificate holds the DNS name it dials, so such a certificate still serves as ``b``. A party's
start-up and ``certs check`` refuse it as a party's own; one the CA issued elsewhere is revoked
(below). (The auth context's ``x509_subject_alternative_name`` is no substitute: it lists DNS
names, IP addresses, URIs and e-mail addresses alike.) A certificate from another CA fails the TLS
handshake. Plaintext only with ``insecure=True``, which logs a warning on every endpoint. A
deployed party checks its own certificate against its federation's CA before it listens or connects
(:func:`identity_problems`, the checks of ``secure-vfl certs check`` a handshake depends on). A
server binds its port alone (``grpc.so_reuseport`` off): a second party at a port in use cannot
listen, rather than share its connections. One caller (a certificate's name; without TLS, which
tells no name, a connection's address, ``context.peer()``) has at most :data:`CALLS_PER_CALLER`
calls served at once; more are refused at once (``RESOURCE_EXHAUSTED``, logged and kept in
:attr:`PartyEndpoint.refused` as every refusal), so that no holder of a certificate of the CA holds
all the threads of a server with calls it never finishes, and at most :data:`UNACTED_PER_CALLER`
of its deliveries wait for the party to act on them (a call that ends first leaves its delivery
queued); a server that knows its federation's
members has threads for all their calls at once and as many more
(:attr:`PartyEndpoint.server_threads`), so members holding theirs together cannot keep another
out either (one that does not, :data:`SERVER_THREADS`). ``Deliver`` is served
as a client stream of one message (a unary call on the wire), so that its call is counted from its
start, as a stream's is: gRPC reads a unary call's message before the server's code sees the call.

**Revocation.** gRPC's Python API takes no certificate revocation list, so the server applies
the CA's (``secure-vfl certs revoke``, :attr:`TlsIdentity.crl`) itself, read again when its
file (:attr:`TlsIdentity.crl_path`) changes, within :data:`CRL_RECHECK_SECONDS`, if the new list
keeps every revocation of the one in force (:class:`_Revocations`): a caller whose
certificate's serial number the list holds is refused (``PERMISSION_DENIED``, naming the caller
and when its certificate was revoked); a deployed party with a revoked certificate of its own
does not start. The client side cannot do the same: gRPC's Python API shows a client nothing of
the server's certificate (it checks only the chain and the name), so whoever holds a revoked
certificate and its key can still answer as that party, and receive what is sent to it, wherever
it can take the party's address. Moving the party to a new address in the federation file helps
where the key is known to sit at the old one only (a lost or seized machine); where it may be
used anywhere on the network path, make a new CA and certificates for every party (``certs
init`` in a new directory).

**Delivery is synchronous, as in one process.** ``send`` returns once the receiving party has
*acted on* the message: its handler returned (``on_<kind>``), or the message waits in its inbox.
The receiving server thread hands the decoded message to the receiving party's own thread and
waits for it; meanwhile the sending party, blocked in ``send``, acts on whatever arrives for it
(the replies its message caused), on its own thread. So a chain of deliveries
(label party -> data party -> aggregator -> label party) runs as the in-process call stack does
(:meth:`~secure_vfl.federation.channel.Channel.post` calls the receiver before returning): one
handler at a time in the whole federation, in the same order, every party's code on its own
thread (gRPC's threads only decode, check and hand over). A receiver that refuses a message
(its handler raises) makes the sender's ``send`` raise :class:`~secure_vfl.errors.ProtocolError`
quoting the reason, as the exception would propagate in one process.

One exception to the nesting: a message a party sends with :meth:`Party.send_after
<secure_vfl.federation.parties.Party.send_after>` (the aggregator's sum to the party that asked
for it) goes once that party has answered the delivery it is acting on (:attr:`PartyEndpoint.
after`), so the contributor whose representation completed the sum goes on while the label
party trains on it, and a step does not end with a chain of answers unwinding through three
processes. Its receiver waits for it where it needs it (:meth:`Party.take
<secure_vfl.federation.parties.Party.take>` acts on arrivals until it is there); it travels
marked ``svfl-detached``, and a refusal of it is raised in its receiver's own wait, since no
sender relays it.

How the label party's driving maps onto this (what :class:`NetworkChannel` does and what the
``party serve`` and federation-file layer still has to do):

- The label party's program is unchanged: it ``send`` s a plan, and when ``send`` returns every
  consequence has been handled but a reply sent after an answer, which :meth:`Party.take` waits
  for; it finds the answer in its inbox or knows it never came, as in process. Handlers,
  drivers and each party's message order are unchanged, so a seed gives the same model over
  the network as in process.
- In each process a :class:`NetworkChannel` replaces the in-process
  :class:`~secure_vfl.federation.channel.Channel`: its one local party is attached (the endpoint
  hands it every arriving message, ``party.receive``), and posting to any other name goes
  through the channel's layers and then :meth:`PartyEndpoint.send`. Other parties are addresses,
  not objects: what a composition root reads today from ``channel.parties`` (accountants, hook
  seconds, ``after_training``) has to become messages or stay local to each party.
- A data party or aggregator process runs ``endpoint.act_on_next(deadline)`` in a loop until
  the label party ends the run (a message to add) or the label party is silent for longer than
  the deadline (it died: exit non-zero).
- A dead or unreachable peer surfaces as :class:`~secure_vfl.errors.TransportError` from ``send``
  (after bounded retries on ``UNAVAILABLE``) or when a deadline passes: the place where the
  fault handling of LASER and FALSE-VFL (a dropped party becomes a missing block) hooks in.

**Deadlines and retries.** Every call carries a deadline (``deadline`` seconds, which covers the
nested chain of deliveries it causes). Only ``UNAVAILABLE`` (could not connect, connection lost)
is retried, a bounded number of times with exponential backoff, and not when the TLS handshake
failed on the peer's certificate (another CA's, or not naming the peer: no retry changes that;
:meth:`PartyEndpoint.await_peers` stops waiting for such a peer too); every delivery carries a
per-sender stream token and sequence number, so a retry of a message that did arrive is not
acted on twice (the receiver answers it with the first attempt's outcome), and a reused or old
sequence number is refused as a replay. That makes retries safe; it is not what stops replays:
TLS keeps a network attacker from replaying anything, and a party that replays its own messages
on a new stream meets the protocols' own checks (sessions, rounds, batches), as in one process.
A call's messages (a delivery, or a streamed message's chunks) have the receiving party's
``deadline`` from the call's start to arrive; a call still short of them then is broken off
(``DEADLINE_EXCEEDED``, what arrived dropped, logged and kept in :attr:`PartyEndpoint.refused`).
gRPC waits for a call's next message as long as the caller's own deadline allows, and that is the
caller's to choose (a set-up message's is 600 s; a caller may set none): where it ends first (a
peer's delivery: its deadline is its sender's) gRPC ends the call then, on the server too; any
other call's messages are read by a thread of its own, which the server stops waiting for at its
deadline. Waiting for the party to act on a delivery is not part of that time: it lasts the
caller's deadline (the endpoint's where it set none).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import logging
import os
import queue
import re
import secrets
import socket
import stat
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, NoReturn

# gRPC's core prints a failed TLS handshake as an INFO line of its own ("Handshake failed with
# error SSL_ERROR_SSL ...") on the operator's terminal, beside this module's error that says
# which party failed and what to check. Its errors still print; a GRPC_VERBOSITY the user set
# wins. Read when gRPC is first imported: this module is the only one that imports it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

import grpc

from secure_vfl.errors import (
    ConfigError,
    NotSetUpError,
    ProtocolError,
    SecureVFLError,
    TransportError,
)
from secure_vfl.federation import wire
from secure_vfl.federation.certificates import (
    UNREADABLE_PEM,
    TlsIdentity,
    check_party_name,
    common_names,
    crl_replacement_problems,
    name_mismatches,
    parse_certificate,
    read_certificate,
    read_crl,
    revoked_serials,
    unreadable,
)
from secure_vfl.federation.channel import CAPTURE_LENGTH, Channel, ChannelLayer, append_record
from secure_vfl.federation.messages import AGGREGATOR, Message
from secure_vfl.io import decimal, file_kind

if TYPE_CHECKING:
    from secure_vfl.federation.parties import Party

logger = logging.getLogger(__name__)

SERVICE = "securevfl.Transport"
DELIVER = f"/{SERVICE}/Deliver"
DELIVER_STREAM = f"/{SERVICE}/DeliverStream"
STREAM_THRESHOLD = 4 * 1024 * 1024
"""A message larger than this (gRPC's default message limit) is streamed in chunks."""
CHUNK_BYTES = 1024 * 1024
FRAME_LIMIT = STREAM_THRESHOLD + 64 * 1024
"""The largest gRPC message either end accepts: one unstreamed message, with room to spare."""
DEFAULT_DEADLINE = 60.0
PROBE_SECONDS = 5.0
"""How long a driver waits for a peer to accept a connection before it takes the peer for lost
(sooner if the peer's address refuses the connection: nothing listens there)."""
REJOIN_PROBE_SECONDS = 2.0
"""How long a probe of lost peers (:meth:`NetworkChannel.returned`) waits at most for one to
accept a connection again (a restarted one accepts in milliseconds). A quick probe (the label
party's at an epoch boundary, an imputation coordinator's before a round) does not wait for an
address that refuses: a peer that stays dead costs it milliseconds."""
SERVER_THREADS = 16
"""The threads of a party's gRPC server, at least: one per call served at once. An endpoint
that knows its federation's members has more where they need them
(:attr:`PartyEndpoint.server_threads`)."""
CALLS_PER_CALLER = 4
"""At most this many calls of one caller are served at once (more are refused at once,
``RESOURCE_EXHAUSTED``): well under :data:`SERVER_THREADS`, so that one certificate of the CA
cannot hold every server thread. A peer has one or two in flight here: ``send_all`` has one
delivery to a peer on its way at a time (the next to it goes once the peer acted on the last),
and while it waits its party acts on what arrives, which may send to the same peer again (a
nested ``send_all``, or a detached reply once it answered, :attr:`PartyEndpoint.after`): the
label party's gradient to a data party while its head task to it is in flight, the most any
server met in the deployment tests (tests/test_deploy.py). A retry after a lost connection may
find its first attempt still waiting here for the party: three. Four leaves one to spare."""
UNACTED_PER_CALLER = 4 * CALLS_PER_CALLER
"""At most this many of one caller's deliveries wait here for the party to act on them; a new
one beyond is refused at once (``RESOURCE_EXHAUSTED``). An honest caller has no more waiting
than calls in flight (each call waits until the party acts, and a retry finds its first
attempt's delivery), but a call that ends first (its caller cancelled it, or its deadline
passed) leaves its delivery queued: without a bound, a caller that ends its calls at once could
queue deliveries, each up to the codec's size limit, until the party's memory ran out."""
SENDER_THREADS = 64
"""At most this many outgoing calls of a party at once (one per peer a ``send_all`` reaches;
started as needed, then kept for the endpoint's life). Each call blocks in one of them: a gRPC
future would start a thread of its own whenever no call of its channel is in flight, which is
every call of a party that sends one message at a time (it doubled a deployed step's CPU)."""
REPLAY_WINDOW = 1024
"""Deliveries remembered per sender stream (for retries); older sequence numbers are replays."""
STREAMS_KEPT = 4
"""Sender streams (endpoint lifetimes) remembered per peer."""
REFUSALS_KEPT = 64
"""The latest deliveries' refusals an endpoint keeps (:attr:`PartyEndpoint.refused`)."""
REFUSALS_LOGGED = 20
"""At most this many refusals of one caller's deliveries are logged in
:data:`REFUSAL_LOG_SECONDS` (the rest are counted, and said at the caller's first refusal
after the span, or when the endpoint closes):
refused calls cost a caller little, and without a bound one could fill the party's log, and
bury what else it says, as fast as it can call."""
REFUSAL_LOG_SECONDS = 60.0
REFUSAL_LOG_CALLERS = 256
"""The callers whose refusals an endpoint counts for :data:`REFUSALS_LOGGED` (the oldest
forgotten first)."""
CALLER_CERTIFICATES_KEPT = 64
"""Caller certificates whose verdict (the caller's name, or why it is refused) an endpoint
keeps, so that a certificate is parsed once, not on every call; the oldest goes first."""
CRL_RECHECK_SECONDS = 2.0
"""How often, at most, a server looks whether the file of its revocation list changed (when a
call comes): a revocation reaches a running party within this long of its list's arrival."""
CRL_MAX_BYTES = 16 * 1024 * 1024
"""The largest file a running server reads as its revocation list (a list of about 200,000
revocations): a larger one, or one that is not a plain file, is not read (the list in force
stays). The read happens on a call's thread: a named pipe would block it for good, holding the
look (no later list applied), and /dev/zero would be read until memory ran out."""

_NOT_DELIVERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_STREAM, _SEQUENCE, _SIZE, _COUNT = "svfl-stream", "svfl-sequence", "svfl-size", "svfl-count"
_DETACHED = "svfl-detached"
"""Metadata of a delivery whose sender relays no refusal of it (sent after the sender answered
what it acted on): the receiver's own wait for it raises its refusal
(:meth:`PartyEndpoint.await_reply`)."""
MAX_BUNDLE = 64
"""The most messages one delivery carries."""
_DEADLINE_ROUNDING = 1.0
"""How much later than its sender's a call's deadline may be here: gRPC sends a deadline
rounded up (to 10 ms below 10 s, 100 ms below 100 s, a second below 18 hours), so a peer with
this party's deadline reads as one with a slightly later one."""
_CALL_END_POLL = 0.1
"""How often a server thread waiting for its party to act on a delivery looks whether the
call has ended meanwhile (its caller went away), in seconds."""
_DIAGNOSIS = f"/{SERVICE}/Diagnose"
"""A method no endpoint serves: called on a channel whose connection failed, to learn why (the
call fails at once with the connection's last error, or, connected after all, is answered
UNIMPLEMENTED without reaching the party)."""
_CERTIFICATE_REFUSED = re.compile(
    r"handshake failed|verification check failed|CERTIFICATE_VERIFY_FAILED", re.IGNORECASE
)
"""What gRPC's UNAVAILABLE details say when the TLS handshake failed on this side: it refused
the peer's certificate (another CA's: ``Tls handshake failed ... CERTIFICATE_VERIFY_FAILED``; one
not naming the party called: ``Custom verification check failed ... Hostname Verification Check
failed``), or what answered is no TLS server: no retry can change that. A peer that refuses
this party's certificate only closes the connection (``Socket closed``), which says nothing
certain, and is retried."""


def free_loopback_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that the OS has just handed out (and that are
    closed again, for parties to bind): for a federation on one machine, tests and examples."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a delivery is retried on ``UNAVAILABLE`` (only): at most
    ``attempts`` tries, waiting ``first_backoff`` seconds after the first failure, doubling up to
    ``max_backoff``, and never past the delivery's deadline."""

    attempts: int = 5
    first_backoff: float = 0.1
    max_backoff: float = 2.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_backoff < 0 or self.max_backoff < self.first_backoff:
            raise ConfigError(
                "attempts >= 1 and 0 <= first_backoff <= max_backoff expected. Found "
                f"{self.attempts}, {self.first_backoff}, {self.max_backoff}."
            )

    def backoffs(self) -> Iterator[float]:
        """The wait after each failed attempt but the last."""
        wait = self.first_backoff
        for _ in range(self.attempts - 1):
            yield wait
            wait = min(2 * wait, self.max_backoff)


@dataclasses.dataclass
class _Arrival:
    """A delivery's decoded messages (``sizes``: their encoded sizes) handed from a server
    thread to the party's thread, which acts on them in order, up to the first it refuses,
    and sets ``done`` (with ``refusal``: why it refused it), letting go of the messages: what
    stays of it, for a retry to be answered with, is its outcome and checksum."""

    messages: tuple[Message, ...]
    sizes: tuple[int, ...]
    size: int  # of the delivery's bytes
    checksum: int  # CRC-32 of the bytes: tells a retry (the same bytes) from a reuse
    caller: str  # whose deliveries it counts among (UNACTED_PER_CALLER)
    source: str  # whose refusals its refusal counts among (REFUSALS_LOGGED, _refusal_source)
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    refusal: str | None = None
    failed: bool = False  # the handler raised something other than a ProtocolError
    not_set_up: bool = False  # the party was never set up for the message's run
    detached: bool = False  # its sender relays no refusal (:data:`_DETACHED`)


class _Recent:
    """The deliveries remembered of one sender stream, by sequence number, down to
    :data:`REPLAY_WINDOW` below the highest seen. A sender numbers its messages in order, so
    they are kept in arrival order and forgetting the old ones looks at the front only."""

    def __init__(self) -> None:
        self.arrivals: dict[int, _Arrival] = {}
        self.highest = -1
        self._order: collections.deque[int] = collections.deque()

    def keep(self, number: int, arrival: _Arrival) -> None:
        self.arrivals[number] = arrival
        self._order.append(number)
        self.highest = max(self.highest, number)
        oldest = self.highest - REPLAY_WINDOW
        while self._order and self._order[0] <= oldest:
            del self.arrivals[self._order.popleft()]


_WAKE = object()  # an outgoing call finished: the waiting party thread looks again
_Item = _Arrival | object


@dataclasses.dataclass
class _Delivery:
    """Messages on their way to one peer, in one call: each one's encoding, the call's bytes,
    its numbered metadata and its attempt."""

    messages: tuple[Message, ...]
    encoded: tuple[bytes, ...]
    data: bytes
    channel: grpc.Channel
    metadata: tuple[tuple[str, str], ...]
    start: float
    timeout: float
    future: futures.Future[Any] | None = None
    attempts: int = 1


class _Refusal(Exception):
    """Raised inside a server thread to refuse a delivery with a status code."""

    def __init__(self, code: grpc.StatusCode, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


_GONE = "gone"  # what _Revocations last read of a file that is not there (not a content)


class _Revocations:
    """The CA's revocation list a server applies, read again from its file
    (:attr:`TlsIdentity.crl_path`) when the file changes, looked at when a call comes, at most
    every :data:`CRL_RECHECK_SECONDS`. A new list is applied only if the CA signed it, it is not
    older than the list in force and it keeps every revocation of that list
    (:func:`~secure_vfl.federation.certificates.crl_replacement_problems`); otherwise, and when
    the file is gone, unreadable, not a plain file or larger than :data:`CRL_MAX_BYTES`, the list
    in force stays and the party's log says why, once for each content of the file.
    ``generation`` counts the lists applied."""

    def __init__(self, name: str, identity: TlsIdentity | None) -> None:
        self.name = name
        self.path = identity.crl_path if identity is not None else None
        self.pem = identity.crl if identity is not None else None
        self.crl = read_crl(self.pem, f"{name}'s certificate revocation list") if self.pem else None
        self.serials = revoked_serials(self.crl) if self.crl is not None else {}
        """The serial numbers the list in force revokes, with when and why."""
        self.generation = 0
        self._ca = read_certificate(identity.ca, f"{name}'s CA") if identity is not None else None
        self._own = parse_certificate(identity.certificate) if identity is not None else None
        self._read: bytes | str | None = self.pem
        """The file's content last judged, or why it could not be read: its bytes are
        compared, not its time stamps (a file replaced within a clock tick by one of its size
        looks the same)."""
        self._next = time.monotonic() + CRL_RECHECK_SECONDS
        self._lock = threading.Lock()

    def refresh(self) -> bool:
        """Look whether the file changed, if it is time to, and apply the new list if it
        may be: whether the list in force changed. Never raises (a call is being served)."""
        if self.path is None or time.monotonic() < self._next:
            return False
        if not self._lock.acquire(blocking=False):  # another call is looking
            return False
        try:
            self._next = time.monotonic() + CRL_RECHECK_SECONDS
            return self._look(self.path)
        finally:
            self._lock.release()

    def _look(self, path: Path) -> bool:
        try:
            pem = _list_file(path)
        except FileNotFoundError:
            if self.pem is not None and self._read != _GONE:
                logger.warning(
                    "%s: its certificate revocation list %s is gone; it keeps applying the "
                    "one it read (%d revoked).",
                    self.name,
                    path,
                    len(self.serials),
                )
            self._read = _GONE
            return False
        except OSError as error:
            return self._keep(path, f"it cannot be read ({error.strerror or error})")
        if isinstance(pem, str):
            return self._keep(path, f"it is {pem}")
        if pem == self._read:
            return False
        if pem == self.pem:  # back as it was
            self._read = pem
            return False
        try:
            crl = read_crl(pem, str(path))
        except ConfigError as error:  # it names the file, which _keep names too
            return self._keep(path, str(error).removeprefix(f"{path}: "), pem)
        assert self._ca is not None
        problems = crl_replacement_problems(path, crl, self.crl, self._ca)
        if problems:
            return self._keep(path, " ".join(problem.what for problem in problems), pem)
        before = len(self.serials)
        self.pem, self.crl, self.serials, self._read = pem, crl, revoked_serials(crl), pem
        self.generation += 1
        assert self._own is not None
        own = self.serials.get(self._own.serial_number)
        logger.warning(
            "%s: applies the new certificate revocation list %s: %d revoked (%d before)%s.",
            self.name,
            path,
            len(self.serials),
            before,
            f"; it revokes this party's own certificate ({own}): every peer that has it "
            "refuses this party's calls"
            if own is not None
            else "",
        )
        return True

    def _keep(self, path: Path, why: str, pem: bytes | None = None) -> bool:
        """Keep the list in force, saying ``why`` not the file's (``pem``: what it holds, not
        judged again; None: unread, read again at the next look and said again only if the
        reason changed)."""
        if why != self._read:
            logger.warning(
                "%s: keeps applying the certificate revocation list it has (%d revoked), not "
                "the one now at %s: %s",
                self.name,
                len(self.serials),
                path,
                why,
            )
        self._read = pem if pem is not None else why
        return False


def _list_file(path: Path) -> bytes | str:
    """The bytes of the revocation list's file at ``path``, or why they are not read: it is not
    a plain file (opened without blocking, so a named pipe is seen, not waited on), or it holds
    more than :data:`CRL_MAX_BYTES`. OSError where it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return f"not a plain file ({file_kind(path)})"
        chunks: list[bytes] = []
        size = 0
        while size <= CRL_MAX_BYTES:
            chunk = os.read(fd, min(1 << 16, CRL_MAX_BYTES + 1 - size))
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
        return f"larger than {CRL_MAX_BYTES} bytes"
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """What a server concluded of one caller certificate: the caller's party name, or the
    status and reason it refuses the certificate with."""

    caller: str
    refusal: tuple[grpc.StatusCode, str] | None = None


def _refusal_source(context: grpc.ServicerContext) -> str:
    """Whose refused delivery this is, for :data:`REFUSALS_LOGGED`: the caller certificate's
    common name (the handshake verified it; unread if the certificate names several), else the
    caller's address without its port (every connection of a host, without TLS)."""
    names = context.auth_context().get("x509_common_name", [])
    if len(names) == 1:
        return bytes(names[0]).decode("utf-8", "replace")
    return context.peer().rpartition(":")[0] or context.peer()


def _metadata(context: grpc.ServicerContext) -> dict[str, str]:
    return {key: str(value) for key, value in context.invocation_metadata()}


def _time_left(context: grpc.ServicerContext) -> float | None:
    """The seconds left of the caller's own deadline; None where it set none (gRPC says about
    2^63 seconds then, more than a thread can wait for)."""
    left = context.time_remaining()
    return left if left is not None and left < threading.TIMEOUT_MAX else None


def _elapsed(start: float) -> str:
    return f"{time.monotonic() - start:.1f} s"


def _bind_refusal(listen: str) -> str | None:
    """Why this machine would refuse a server socket at ``listen`` (``host:port``), or None:
    asked before gRPC binds, whose own failure says only that it failed (the reason goes to its
    log). The probe binds as gRPC does (SO_REUSEADDR: a port whose last connections linger
    is free) and closes at once; a port 0 (any free port) is not probed."""
    host, _, port_text = listen.rpartition(":")
    host = host.strip("[]")
    try:
        port = int(port_text)
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError, UnicodeError) as error:
        return f"{host!r} is not an address of this machine ({error})."
    if port == 0:
        return None
    family, kind, protocol, _, address = infos[0]
    with socket.socket(family, kind, protocol) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as error:
            reason = error.strerror or str(error)
            if error.errno == errno.EADDRINUSE:
                return (
                    f"{reason}: another process listens there (this party served twice, or "
                    "another program); expected a free port."
                )
            if error.errno == errno.EADDRNOTAVAIL:
                return (
                    f"{reason}: {host} is not an address of this machine; expected the "
                    "federation file to give this party one of its own."
                )
            return f"{reason}."
    return None


class PartyEndpoint:
    """One party's endpoint: a gRPC server at ``listen`` and clients to its ``peers``
    (name -> ``host:port``), under mutual TLS with ``identity`` (or plaintext with
    ``insecure=True`` and no identity).

    Messages that arrive are handed to ``handler`` (``party.receive`` under a
    :class:`NetworkChannel`) or, without one, kept for :meth:`receive`, always on the party's
    own thread: inside :meth:`send` (while it waits), :meth:`receive` or :meth:`act_on_next`.
    ``bytes`` counts the encoded bytes sent, by (sender, receiver, phase), as the in-process
    transport does; ``received`` those that arrived. With ``capture`` every message this party
    sends (when it is counted: it crossed) and every new delivery it accepts (a retry's second
    arrival is not) is appended to that file as the in-process transport records one
    (``[4-byte big-endian length][encoded message]``, :func:`~secure_vfl.federation.channel.
    read_capture`): this party's own view of the run.
    """

    def __init__(
        self,
        name: str,
        *,
        listen: str = "127.0.0.1:0",
        peers: Mapping[str, str] | None = None,
        identity: TlsIdentity | None = None,
        insecure: bool = False,
        deadline: float = DEFAULT_DEADLINE,
        retry: RetryPolicy | None = None,
        max_message_bytes: int = wire.MAX_MESSAGE_BYTES,
        capture: BinaryIO | None = None,
        members: Collection[str] | None = None,
    ) -> None:
        self.name = check_party_name(name)
        if insecure == (identity is not None):
            raise ConfigError(
                f"{name}: a TLS identity (certificate, key and the federation CA) or "
                "insecure=True expected, not both and not neither."
            )
        if identity is not None and identity.name != name:
            raise ConfigError(
                f"{name}: its certificate names {identity.name!r}; a party's certificate must "
                "name the party."
            )
        if deadline <= 0:
            raise ConfigError(f"a deadline > 0 seconds expected. Found {deadline}.")
        self.identity = identity
        self.insecure = insecure
        self.deadline = deadline
        self.retry = retry if retry is not None else RetryPolicy()
        self.max_message_bytes = max_message_bytes
        self.capture = capture
        self.members = frozenset(members) if members is not None else None
        self.server_threads = (
            SERVER_THREADS
            if self.members is None
            else max(SERVER_THREADS, CALLS_PER_CALLER * (len(self.members) + 1))
        )
        """Calls this endpoint's server serves at once, each on a thread of its own: with the
        federation's members, enough for every member's :data:`CALLS_PER_CALLER` and as many
        more (refusals of callers that are no member take a thread while they are refused), so
        that members holding their calls together cannot keep another member out."""
        """The parties whose certificates may call this one (a federation's members); None:
        any the CA certified. A CA outlives its federations (one CA for several is the
        documented way), so a certificate it issued to an organisation that left, or to one
        of another federation, would otherwise reach this party."""
        self._revocations = _Revocations(name, identity)
        """The CA's revocation list (``identity.crl``, read again from ``identity.crl_path``
        when it changes): callers whose certificates it lists are refused."""
        self._capture_lock = threading.Lock()  # the party's thread sends, gRPC's receive
        self.handler: Callable[[Message], None] | None = None
        self.after: Callable[[], None] | None = None
        """Called on the party's thread once it has acted on a delivery and answered it
        (``party.flush_after`` under a :class:`NetworkChannel`): sends what the party held
        back to go once its answer is on its way (:meth:`Party.send_after`)."""
        self.redact: Callable[[str], str] = _as_it_is
        """What a refusal of this party's handler says to the sender, from what it says in this
        party's own log (e.g. the party's own directories left out)."""
        self.bytes: Counter[tuple[str, str, str]] = Counter()
        self.received: Counter[tuple[str, str, str]] = Counter()
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._kept: collections.deque[Message] = collections.deque()
        self.refused: collections.deque[str] = collections.deque(maxlen=REFUSALS_KEPT)
        """Why the server refused the latest deliveries before the party saw them (the codec
        refused the bytes, an impostor, a replay, ...): logged, kept here, and answered to
        their sender with the status. The party goes on: a peer cannot stop it with a bad
        frame, and an honest sender learns from the status why its message did not count."""
        self._detached_refusals: collections.deque[str] = collections.deque(maxlen=REFUSALS_KEPT)
        self._peers: dict[str, str] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._calls: dict[grpc.Channel, tuple[Any, Any]] = {}  # Deliver, DeliverStream
        self._sequence: Counter[str] = Counter()
        self.restarted: set[str] = set()
        """Peers that refused a message as never set up for its run (:class:`~secure_vfl.errors.
        NotSetUpError`): a new process at their address, whatever the run gave the old one is
        gone. :meth:`NetworkChannel.unreachable` reports them lost."""
        self._token = secrets.token_hex(16)  # this endpoint's sender stream
        self._lock = threading.Lock()
        self._deliveries: dict[tuple[str, str], _Recent] = {}
        self._verdicts: dict[bytes, _Verdict] = {}  # by caller certificate (PEM), oldest first
        self._verdicts_lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()  # calls being served, by caller (_slot)
        # By the source of refused deliveries: when the span began and how many were refused.
        self._refusal_windows: dict[str, tuple[float, int]] = {}
        self._unacted: Counter[str] = Counter()  # deliveries the party has not acted on, by caller
        self._closing: list[threading.Thread] = []  # closing the channels reconnect replaced
        if insecure:
            logger.warning(
                "%s: gRPC WITHOUT TLS (insecure=True): messages cross the network in the clear "
                "and no peer's identity is checked; use certificates (secure-vfl certs init).",
                name,
            )
        self._senders = futures.ThreadPoolExecutor(SENDER_THREADS, f"{self.name}-send")
        self._server, self.port = self._start_server(listen)
        for peer, address in (peers or {}).items():
            self.add_peer(peer, address)

    # -- life cycle --------------------------------------------------------------------------

    def _start_server(self, listen: str) -> tuple[grpc.Server, int]:
        handlers = grpc.method_handlers_generic_handler(
            SERVICE,
            {
                # A unary call on the wire, served as a stream of one message (_serve_message).
                "Deliver": grpc.stream_unary_rpc_method_handler(self._serve_message),
                "DeliverStream": grpc.stream_unary_rpc_method_handler(self._serve_stream),
            },
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.server_threads),
            handlers=(handlers,),
            options=[
                ("grpc.max_receive_message_length", FRAME_LIMIT),
                ("grpc.max_send_message_length", FRAME_LIMIT),
                # gRPC sets SO_REUSEPORT by default: a second party at a port in use would
                # bind too, and the two would share its connections.
                ("grpc.so_reuseport", 0),
            ],
            maximum_concurrent_rpcs=self.server_threads,
        )
        refusal = _bind_refusal(listen)
        if refusal is not None:
            raise TransportError(f"{self.name}: cannot listen on {listen}: {refusal}")
        try:
            if self.identity is None:
                port = server.add_insecure_port(listen)
            else:
                credentials = grpc.ssl_server_credentials(
                    [(self.identity.key, self.identity.certificate)],
                    root_certificates=self.identity.ca,
                    require_client_auth=True,
                )
                port = server.add_secure_port(listen, credentials)
        except RuntimeError as error:
            raise TransportError(f"{self.name}: cannot listen on {listen}: {error}") from error
        if port == 0:
            raise TransportError(f"{self.name}: cannot listen on {listen} (address in use?).")
        server.start()
        return server, port

    def add_peer(self, name: str, address: str) -> None:
        """Make party ``name`` reachable at ``address`` (``host:port``)."""
        check_party_name(name)
        if name in self._peers:
            raise ConfigError(f"{self.name}: peer {name!r} is already at {self._peers[name]}.")
        self._connect(name, address)
        self._peers[name] = address

    def reconnect(self, name: str) -> None:
        """A new client connection to peer ``name`` at its address (a restarted process): the
        old one may be waiting out gRPC's reconnection backoff after the peer died."""
        old = self._channels[name]
        self._connect(name, self._peers[name])
        self._calls.pop(old, None)
        # Closing a channel a probe watched waits for gRPC's connectivity poll (about 0.2 s):
        # not on the probing party's time (close() waits for it).
        closing = threading.Thread(target=old.close, name=f"{self.name}-close", daemon=True)
        closing.start()
        self._closing = [*(t for t in self._closing if t.is_alive()), closing]

    def _connect(self, name: str, address: str) -> None:
        """A client channel to peer ``name`` and its two calls, made once for every message
        (making one costs about as much as encoding a small message)."""
        channel = self._channels[name] = self._client(name, address)
        self._calls[channel] = (channel.unary_unary(DELIVER), channel.stream_unary(DELIVER_STREAM))

    def _client(self, name: str, address: str) -> grpc.Channel:
        options: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", FRAME_LIMIT),
            ("grpc.max_send_message_length", FRAME_LIMIT),
        ]
        if self.identity is None:
            return grpc.insecure_channel(address, options=options)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.identity.ca,
            private_key=self.identity.key,
            certificate_chain=self.identity.certificate,
        )
        # The server must prove it is the party called: its certificate must hold the
        # party's name (as a DNS name), whatever host it is reached at.
        options += [("grpc.ssl_target_name_override", name), ("grpc.default_authority", name)]
        return grpc.secure_channel(address, credentials, options=options)

    @property
    def address(self) -> str:
        """Where peers on this machine reach this endpoint."""
        return f"127.0.0.1:{self.port}"

    def close(self, grace: float = 0.5) -> None:
        """Stop serving and close every client channel; deliveries not yet acted on are
        answered as refused (their senders learn that this party stopped)."""
        stopped = self._server.stop(grace)
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Arrival):
                item.refusal = f"{self.name} stopped before acting on {item.messages[0].kind}."
                item.done.set()
        stopped.wait(grace + 1.0)
        with self._lock:  # what no later refusal will say now
            unlogged = {
                source: count - REFUSALS_LOGGED
                for source, (_, count) in self._refusal_windows.items()
                if count > REFUSALS_LOGGED
            }
            self._refusal_windows.clear()
        for source, count in unlogged.items():
            self._say_unlogged(source, count)
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
        self._calls.clear()
        for closing in self._closing:
            closing.join(grace + 1.0)
        self._closing.clear()
        self._senders.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PartyEndpoint:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # -- the server side: gRPC threads decode, check identity and hand over ------------------

    def _serve_message(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """``Deliver``: a unary call, served as a client stream of one message, so that the call
        is counted (:meth:`_slot`) and its message timed (:meth:`_within`) from its start.
        Served as unary, gRPC reads the message on a server thread before this code sees the
        call, as long as the caller's own deadline allows (for ever, without one)."""
        with self._slot(context) as caller:
            try:
                data = self._one_message(requests, context, caller)
            except _Refusal as refusal:
                self._refuse(context, refusal)
            return self._accept(data, context)

    def _serve_stream(self, chunks: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        with self._slot(context) as caller:  # refused before it streams, if it is
            try:
                declared = self._declared_size(_metadata(context))
                data = self._reassemble(chunks, context, caller, declared)
            except _Refusal as refusal:
                self._refuse(context, refusal)
            return self._accept(data, context)

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext) -> Iterator[str]:
        """Serve a call as one of its caller's at most :data:`CALLS_PER_CALLER` at once, or
        refuse it at once (``RESOURCE_EXHAUSTED``); its place is given back however the call
        ends. The caller (yielded) is its certificate's name; without TLS, its connection's
        address (``context.peer()``), all a plaintext caller has. A caller that may not call
        at all is refused here too (:meth:`_caller`)."""
        try:
            caller = self._caller(context) or f"the plaintext peer at {context.peer()}"
            with self._lock:
                admitted = self._in_flight[caller] < CALLS_PER_CALLER
                if admitted:
                    self._in_flight[caller] += 1
            if not admitted:
                raise _Refusal(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.name}: {caller} already has {CALLS_PER_CALLER} calls in flight "
                    "here, the most one caller may have at once; refused.",
                )
        except _Refusal as refusal:
            self._refuse(context, refusal)
        try:
            yield caller
        finally:
            with self._lock:
                self._in_flight[caller] -= 1
                if not self._in_flight[caller]:
                    del self._in_flight[caller]

    def _one_message(
        self, requests: Iterator[bytes], context: grpc.ServicerContext, caller: str
    ) -> bytes:
        """The one message of ``caller``'s ``Deliver`` call (:meth:`_within`), refused
        (``INVALID_ARGUMENT``) without one, or at a second."""
        data: bytes | None = None
        for request in self._within(requests, context, caller, "a delivery"):
            if data is not None:
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{self.name}: a delivery of one gRPC message expected from {caller}, "
                    "found more.",
                )
            data = request
        if data is None:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.name}: a delivery of one gRPC message expected from {caller}, found none.",
            )
        return data

    def _reassemble(
        self, chunks: Iterator[bytes], context: grpc.ServicerContext, caller: str, declared: int
    ) -> bytes:
        """The ``declared`` bytes of ``caller``'s streamed message from its ``chunks``
        (:meth:`_within`); what arrived of a stream refused or broken off is let go at once."""
        buffer = bytearray()
        what = f"a streamed message of {declared} bytes"
        try:
            for chunk in self._within(chunks, context, caller, what):
                if len(buffer) + len(chunk) > declared:
                    raise _Refusal(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{self.name}: a streamed message longer than the {declared} bytes "
                        "announced.",
                    )
                buffer += chunk
        except BaseException:
            buffer.clear()
            raise
        if len(buffer) != declared:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.name}: a streamed message of {declared} bytes announced, "
                f"{len(buffer)} arrived.",
            )
        return bytes(buffer)

    def _within(
        self, requests: Iterator[bytes], context: grpc.ServicerContext, caller: str, what: str
    ) -> Iterator[bytes]:
        """The gRPC messages of a call (``requests``: ``what`` ``caller`` sends) as they
        arrive, all within the endpoint's :attr:`deadline` from now, else ``DEADLINE_EXCEEDED``.
        gRPC's iterator waits for the next one as long as the caller's own deadline (which
        gRPC keeps) allows: read here where that comes first (a peer's deliveries), else by a
        thread of the call's own, which ends with the call (a caller with a later deadline, a
        set-up message's, or none)."""
        left = _time_left(context)
        if left is not None and left <= self.deadline + _DEADLINE_ROUNDING:
            yield from requests
            return
        end = time.monotonic() + self.deadline
        handed: queue.SimpleQueue[bytes | BaseException | None] = queue.SimpleQueue()

        def read() -> None:
            try:
                for request in requests:
                    handed.put(request)
            except BaseException as error:  # grpc.RpcError: the call was cancelled
                handed.put(error)
            else:
                handed.put(None)

        threading.Thread(target=read, name=f"{self.name}-read", daemon=True).start()
        arrived = 0
        while True:
            try:
                item = handed.get(timeout=max(end - time.monotonic(), 0.0))
            except queue.Empty:
                raise _Refusal(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.name}: {what} from {caller} did not arrive within the deadline "
                    f"({self.deadline:g} s; {arrived} bytes did); broken off.",
                ) from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            arrived += len(item)
            yield item

    def _declared_size(self, metadata: Mapping[str, str]) -> int:
        text = metadata.get(_SIZE, "")
        size = decimal(text)
        if size is None or size > self.max_message_bytes:
            raise _Refusal(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.name}: a streamed message of at most {self.max_message_bytes} bytes "
                f"expected, {wire.shown(text) if text else 'no size'} announced.",
            )
        return size

    def _refuse(self, context: grpc.ServicerContext, refusal: _Refusal) -> NoReturn:
        """Refuse a delivery: the sender gets the status, this party's log and :attr:`refused`
        the reason; nothing reaches the party, but for a reply sent after its sender answered
        (:data:`_DETACHED`, the aggregator's sum), whose refusal no sender relays: that one is
        raised in the wait of the party that awaits it (:meth:`await_reply`), woken for it."""
        self._log_refusal(_refusal_source(context), refusal.reason)
        self.refused.append(refusal.reason)
        if self._unrelayed(context):
            self._detached_refusals.append(refusal.reason)
            self._queue.put(_WAKE)
        context.abort(refusal.code, refusal.reason)
        raise AssertionError("context.abort returns only by raising")  # pragma: no cover

    def _log_refusal(self, source: str, reason: str) -> None:
        """Log the refusal ``reason`` of a delivery from ``source`` (:func:`_refusal_source`),
        unless :data:`REFUSALS_LOGGED` of its refusals were logged in the last
        :data:`REFUSAL_LOG_SECONDS`: then say once that the next ones are not, and how many
        were not when the next span begins."""
        now = time.monotonic()
        with self._lock:
            window = self._refusal_windows.pop(source, None)  # back in last: the latest
            unlogged = 0
            if window is None or now - window[0] >= REFUSAL_LOG_SECONDS:
                if window is not None:
                    unlogged = max(window[1] - REFUSALS_LOGGED, 0)
                window = (now, 0)
            window = (window[0], window[1] + 1)
            self._refusal_windows[source] = window
            while len(self._refusal_windows) > REFUSAL_LOG_CALLERS:
                del self._refusal_windows[next(iter(self._refusal_windows))]
        if unlogged:
            self._say_unlogged(source, unlogged)
        if window[1] <= REFUSALS_LOGGED:
            logger.warning("%s", reason)
        elif window[1] == REFUSALS_LOGGED + 1:
            logger.warning(
                "%s: %d refusals of deliveries from %s within %g s; the next ones are not logged "
                "until %g s have passed (the latest %d its server refused are kept in its refused "
                "list).",
                self.name,
                REFUSALS_LOGGED,
                source,
                REFUSAL_LOG_SECONDS,
                REFUSAL_LOG_SECONDS,
                REFUSALS_KEPT,
            )

    def _say_unlogged(self, source: str, count: int) -> None:
        logger.warning(
            "%s: %d more refusals of deliveries from %s were not logged.", self.name, count, source
        )

    def _unrelayed(self, context: grpc.ServicerContext) -> bool:
        """Whether a refused delivery was a reply whose refusal no sender relays: marked
        detached, by the one party that sends such replies (the aggregator's sum), as its
        certificate says (any caller without TLS, which tells no one's name). Anyone else's
        mark is ignored: a certificate of the CA is not a licence to fail the awaiting
        party's wait."""
        if _metadata(context).get(_DETACHED) != "1":
            return False
        try:
            caller = self._caller(context)
        except _Refusal:
            return False
        return caller is None or caller == AGGREGATOR

    @property
    def revoked_count(self) -> int:
        """How many certificates the revocation list this endpoint applies revokes."""
        return len(self._revocations.serials)

    def _caller(self, context: grpc.ServicerContext) -> str | None:
        """The caller's party name, from its certificate (None without TLS), refused unless
        the certificate names that party alone (:meth:`_judge`). Judged once per certificate:
        the verdict is kept, for the latest :data:`CALLER_CERTIFICATES_KEPT` certificates."""
        if self.identity is None:
            return None
        certificates = context.auth_context().get("x509_pem_cert", [])
        if len(certificates) != 1:
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{self.name}: one caller certificate expected, found {len(certificates)}.",
            )
        pem = bytes(certificates[0])
        if self._revocations.refresh():
            with self._verdicts_lock:  # judged against the list no longer in force
                self._verdicts.clear()
        with self._verdicts_lock:
            verdict = self._verdicts.get(pem)
            generation = self._revocations.generation
        if verdict is None:
            try:
                verdict = _Verdict(self._judge(pem))
            except _Refusal as refusal:
                verdict = _Verdict("", (refusal.code, refusal.reason))
            with self._verdicts_lock:
                # Kept only if judged against the list still in force.
                if generation == self._revocations.generation:
                    self._verdicts[pem] = verdict
                while len(self._verdicts) > CALLER_CERTIFICATES_KEPT:
                    del self._verdicts[next(iter(self._verdicts))]
        if verdict.refusal is not None:
            raise _Refusal(*verdict.refusal)
        return verdict.caller

    def _judge(self, pem: bytes) -> str:
        """The party the caller certificate ``pem`` (the handshake verified it against the
        federation CA) names, its common name; refused unless it is one of :attr:`members`,
        the CA has not revoked the certificate (``identity.crl``) and it names the party
        alone, as a party's start-up requires of its own (:func:`~secure_vfl.federation.
        certificates.name_mismatches`): its common name also among its DNS names, no other
        member there. A client checks the server's DNS names, so a certificate with the
        common name ``a`` and the DNS name ``b`` would otherwise pass for ``a`` when it calls
        and for ``b`` when it serves."""
        try:
            certificate = parse_certificate(pem)
        except UNREADABLE_PEM as error:
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{self.name}: a caller certificate it can read expected; found "
                f"{unreadable(pem, error)}.",
            ) from error
        names = common_names(certificate)
        if len(names) != 1 or not isinstance(names[0], str):
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{self.name}: a caller certificate with one common name expected, found "
                f"{len(names)}.",
            )
        caller = names[0]
        if self.members is not None and caller not in self.members:
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.name}: a caller whose certificate names {wire.shown(caller)}, not a "
                f"member of the federation ({', '.join(sorted(self.members))}).",
            )
        revoked = self._revocations.serials.get(certificate.serial_number)
        if revoked is not None:
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.name}: a caller certificate the CA has not revoked expected; "
                f"{wire.shown(caller)}'s (serial {certificate.serial_number:x}) was {revoked} "
                "(the federation's certificate revocation list).",
            )
        # Without a federation's members (the library's endpoints), its peers are the parties.
        parties = self.members if self.members is not None else {*self._peers, self.name}
        mismatches = name_mismatches(certificate, caller, parties)
        if mismatches:
            raise _Refusal(
                grpc.StatusCode.UNAUTHENTICATED,
                f"{self.name}: a caller certificate that names one party (its common name "
                f"among its DNS names, no other member there) expected; found common name "
                f"{wire.shown(caller)}: {'; '.join(m.rstrip('.') for m in mismatches)}.",
            )
        return caller

    def _accept(self, data: bytes, context: grpc.ServicerContext) -> bytes:
        """Decode and check a delivery, hand it to the party's thread, wait until it has acted
        on it and answer with the outcome."""
        try:
            caller = self._caller(context)
            metadata = _metadata(context)
            parts = _split_delivery(self.name, data, metadata.get(_COUNT))
            messages = tuple(self._check(part, caller) for part in parts)
            sender = caller or messages[0].sender
            if any(message.sender != sender for message in messages):
                raise _Refusal(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"{self.name}: one delivery with messages of several senders "
                    f"{sorted({message.sender for message in messages})}; a delivery is one "
                    "sender's.",
                )
            arrival, new = self._register(
                sender, metadata, messages, parts, data, _refusal_source(context)
            )
        except _Refusal as refusal:
            self._refuse(context, refusal)
        message = messages[0]
        if new:
            try:
                for part in parts:
                    self._record(part)
            except BaseException as error:  # the capture file refused it: never queued
                arrival.refusal = self.redact(
                    f"{self.name} could not record {message.kind} from {message.sender}: {error}"
                )
                arrival.failed = True
                arrival.messages = ()
                arrival.done.set()  # a retry is answered so, not left waiting
                self._acted(arrival)
                raise
            self._queue.put(arrival)
        left = _time_left(context)
        if not self._await_acted(arrival, context, left if left is not None else self.deadline):
            if context.is_active():
                context.abort(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self.name} did not act on {message.kind} from {message.sender} in time.",
                )
            return b""  # the caller went away: no one reads an answer
        if arrival.refusal is not None:
            code = grpc.StatusCode.ABORTED
            if arrival.failed:
                code = grpc.StatusCode.INTERNAL
            elif arrival.not_set_up:
                code = grpc.StatusCode.FAILED_PRECONDITION
            context.abort(code, arrival.refusal)
        return b""

    def _await_acted(
        self, arrival: _Arrival, context: grpc.ServicerContext, seconds: float
    ) -> bool:
        """Wait until the party has acted on ``arrival``, at most ``seconds``, or until the
        call ends first (its caller gave up, or its connection dropped): whether it acted. A
        call whose caller went away gives its place (:meth:`_slot`) back then, not once the
        party acts: the caller's retry of the delivery, answered from the same arrival, takes
        a place of its own, and retries during one long action of the party (a set-up) would
        otherwise use up its :data:`CALLS_PER_CALLER` and be refused for good."""
        ended = threading.Event()
        if not context.add_callback(ended.set):
            return arrival.done.is_set()  # the call has ended already
        end = time.monotonic() + seconds
        while not arrival.done.wait(timeout=min(_CALL_END_POLL, max(end - time.monotonic(), 0))):
            if ended.is_set() or time.monotonic() >= end:
                return arrival.done.is_set()  # it may have acted since the wait timed out
        return True

    def _check(self, data: bytes, caller: str | None) -> Message:
        """The message ``data`` encodes, refused unless the codec accepts it, it comes in the
        caller's name (its certificate's) and it is addressed to this party."""
        try:
            message = wire.decode(data, max_bytes=self.max_message_bytes)
        except ProtocolError as error:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.name}: a message from {caller or 'a plaintext peer'} that the codec "
                f"refuses: {error}",
            ) from error
        if caller is not None and message.sender != caller:
            raise _Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{self.name}: a {message.kind} claiming to come from {message.sender!r} over "
                f"a connection whose certificate is {caller!r}'s; a party sends only in its "
                "own name.",
            )
        if message.receiver != self.name:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.name}: a {message.kind} from {message.sender} addressed to "
                f"{message.receiver!r}.",
            )
        return message

    def _register(
        self,
        sender: str,
        metadata: Mapping[str, str],
        messages: tuple[Message, ...],
        parts: Sequence[bytes],
        data: bytes,
        source: str,
    ) -> tuple[_Arrival, bool]:
        """The arrival of this delivery, and whether it is new: a retry (same stream and
        sequence number, same bytes) gets the first attempt's; an old sequence number, or a
        reused one with other bytes, is refused as a replay. ``source``: the caller's, whose
        refusals the party's refusal of it counts among (:func:`_refusal_source`)."""
        message = messages[0]
        stream, sequence = metadata.get(_STREAM, ""), metadata.get(_SEQUENCE, "")
        number = decimal(sequence)
        if not stream or number is None:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.name}: a delivery from {sender} without its stream and sequence number "
                "(at most 18 decimal digits).",
            )
        # A checksum, not a cryptographic digest, is enough: the stream and its numbers are the
        # authenticated sender's own, so bytes made to collide could only make the sender's own
        # second message count as a retry of its first (not acted on), which it could as well
        # not have sent.
        checksum = zlib.crc32(data)
        with self._lock:
            recent = self._deliveries.get((sender, stream))
            if recent is None:
                # A sender's new stream (a restarted process): forget its oldest beyond a few.
                streams = [key for key in self._deliveries if key[0] == sender]
                for forgotten in streams[: max(len(streams) - STREAMS_KEPT + 1, 0)]:
                    del self._deliveries[forgotten]
                recent = self._deliveries[(sender, stream)] = _Recent()
            known = recent.arrivals.get(number)
            if known is not None and known.checksum == checksum and known.size == len(data):
                return known, False
            if known is not None or number <= recent.highest - REPLAY_WINDOW:
                raise _Refusal(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"{self.name}: {message.kind} from {sender} replays delivery {number} of its "
                    "stream; refused.",
                )
            if self._unacted[sender] >= UNACTED_PER_CALLER:
                raise _Refusal(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.name}: {sender} already has {UNACTED_PER_CALLER} deliveries here that "
                    "the party has not acted on, the most one caller may have; refused.",
                )
            arrival = _Arrival(
                messages,
                tuple(len(part) for part in parts),
                len(data),
                checksum,
                sender,
                source,
                detached=metadata.get(_DETACHED) == "1",
            )
            recent.keep(number, arrival)
            self._unacted[sender] += 1
            return arrival, True

    # -- the party's thread: acting on what arrived ------------------------------------------

    def _act_on(self, item: _Item) -> None:
        if isinstance(item, _Arrival):
            try:
                for message in item.messages:
                    if not self._act_on_message(item, message):
                        break
            finally:
                for message, size in zip(item.messages, item.sizes, strict=True):
                    self.received[(message.sender, message.receiver, _phase(message))] += size
                # What a retry of it is answered with stays in the replay window; its messages
                # (a step's tensors) do not.
                item.messages = ()
                item.done.set()
                self._acted(item)
            if item.refusal is not None and item.detached:
                self._detached_refusals.append(item.refusal)
            if self.after is not None:
                try:
                    self.after()
                except ProtocolError as error:  # the receiver refused it: its own wait says so
                    logger.warning("%s: %s", self.name, error)

    def _acted(self, arrival: _Arrival) -> None:
        """Count ``arrival``, registered by :meth:`_register`, off its caller's deliveries
        waiting for the party (:data:`UNACTED_PER_CALLER`): the party acted on it, or it never
        reached the party's queue."""
        with self._lock:
            self._unacted[arrival.caller] -= 1
            if not self._unacted[arrival.caller]:
                del self._unacted[arrival.caller]

    def _act_on_message(self, item: _Arrival, message: Message) -> bool:
        """Hand one message of ``item`` to the handler (or keep it); whether it was accepted
        (else ``item`` says why not)."""
        refusal: str | None = None  # what this party says of it in its own log
        try:
            if self.handler is None:
                self._kept.append(message)
            else:
                self.handler(message)
        except ProtocolError as error:
            refusal = f"{self.name} refused {message.kind} from {message.sender}: {error}"
            # Only its own: one it met further down a chain of deliveries is the sender's.
            item.not_set_up = isinstance(error, NotSetUpError) and error.party == self.name
        except SecureVFLError as error:  # its own data or files refused what was asked
            refusal = f"{self.name} could not act on {message.kind} from {message.sender}: {error}"
            item.failed = True
        except Exception as error:  # the sender learns it failed; this party goes on
            refusal = (
                f"{self.name} failed acting on {message.kind} from {message.sender}: "
                f"{type(error).__name__}: {error}"
            )
            item.failed = True
        if refusal is None:
            return True
        item.refusal = self.redact(refusal)
        if item.failed:  # the party's own failure (its code, data or files): always said
            logger.warning("%s", refusal)
        else:
            # Not item.caller: without TLS, that is the name the message claims, which a caller
            # could change with each delivery to have every refusal logged.
            self._log_refusal(item.source, refusal)
        return False

    def act_on_next(
        self,
        deadline: float | None = None,
        *,
        awaiting: str = "message",
    ) -> None:
        """Act on the next thing that arrives (hand a message to the handler, or keep it);
        TransportError if nothing arrives within ``deadline`` seconds (default: the
        endpoint's)."""
        timeout = self.deadline if deadline is None else deadline
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise TransportError(
                f"{self.name}: no {awaiting} arrived within {timeout:g} s; is the peer running "
                "and can it reach this party?"
            ) from None
        self._act_on(item)

    def await_reply(self, awaiting: str) -> None:
        """Act on the next thing that arrives, for a party waiting for ``awaiting`` (a reply
        sent after its sender answered, :data:`_DETACHED`): ProtocolError for such a reply this
        party refused, now or since its last wait (nobody else tells it);
        TransportError if nothing arrives within the endpoint's deadline."""
        if not self._detached_refusals:
            self.act_on_next(awaiting=awaiting)
        if self._detached_refusals:
            raise ProtocolError(self._detached_refusals.popleft())

    def forget_detached_refusals(self) -> list[str]:
        """Why this party refused replies sent after their answers, until now, each forgotten
        (:meth:`await_reply` would raise them): the attempt they belonged to was abandoned."""
        forgotten = list(self._detached_refusals)
        self._detached_refusals.clear()
        return forgotten

    def receive(
        self,
        deadline: float | None = None,
        *,
        sender: str | None = None,
        kind: str | None = None,
    ) -> Message:
        """The next kept message (from ``sender``, of ``kind``, if given), waiting for it up to
        ``deadline`` seconds (default: the endpoint's). TransportError naming what was awaited
        if it does not come."""
        timeout = self.deadline if deadline is None else deadline
        end = time.monotonic() + timeout
        while True:
            for message in self._kept:
                if sender in (None, message.sender) and kind in (None, message.kind):
                    self._kept.remove(message)
                    return message
            try:
                item = self._queue.get(timeout=max(end - time.monotonic(), 0.0))
            except queue.Empty:
                where = f" at {self._peers[sender]}" if sender in self._peers else ""
                raise TransportError(
                    f"{self.name}: no {kind or 'message'} from {sender or 'any peer'} arrived "
                    f"within {timeout:g} s; is {sender or 'the peer'}{where} running, and can it "
                    "reach this party?"
                ) from None
            self._act_on(item)

    # -- the client side ---------------------------------------------------------------------

    def await_peers(
        self, names: Sequence[str], seconds: float, *, refused_is_lost: bool = False
    ) -> list[str]:
        """Wait, at most ``seconds`` in all, until each of ``names`` accepts a connection (with
        mutual TLS: the handshake succeeds), so that a party started a little later is not
        taken for a dead one. Returns those still not reachable; the first message to one of
        them then fails with the reason (refused certificate, nothing listening). With
        ``refused_is_lost`` (a probe of a peer that was up: is its process gone?) a peer is not
        reachable as soon as a connection to it fails (gRPC's TRANSIENT_FAILURE: refused, or the
        handshake failed): a live process's server accepts within milliseconds, however busy
        the party is, and a dead one's address refuses at once. Without it, a peer whose
        certificate this party refused in the handshake (another CA's, or one not naming the
        peer) is not reachable at once too: no wait would change that."""
        end = time.monotonic() + seconds
        # Every connection is tried at once, so one peer that never answers does not use up
        # the time of those after it.
        wake = threading.Event()
        probes = [_Probe(name, self._channels[name], refused_is_lost, wake) for name in names]
        try:
            while (remaining := end - time.monotonic()) > 0:
                wake.clear()  # before looking: a change from now on wakes the wait below
                pending = [probe for probe in probes if not probe.done.is_set()]
                if not pending:
                    break
                for probe in pending:
                    if probe.failures > probe.diagnosed:
                        probe.diagnosed = probe.failures
                        if self._refused_certificate(probe.name, remaining):
                            probe.done.set()
                            wake.set()  # look again at once: it may have been the last
                wake.wait(max(end - time.monotonic(), 0.001))
        finally:
            for probe in probes:
                probe.close()
        return [probe.name for probe in probes if not probe.ready]

    def await_peers_or_warn(self, names: Sequence[str], seconds: float) -> list[str]:
        """:meth:`await_peers`, and a warning naming those not reachable and how long was
        waited (a driver goes on: the first message to one of them fails with its reason)."""
        start = time.monotonic()
        late = self.await_peers(names, seconds)
        if late:
            logger.warning(
                "%s: not reachable after %.1f s (wait %.0f s; a refused certificate is given up "
                "at once): %s",
                self.name,
                time.monotonic() - start,
                seconds,
                ", ".join(late),
            )
        return late

    def _refused_certificate(self, name: str, seconds: float) -> bool:
        """Whether the last connection to peer ``name`` failed because this party refused its
        certificate (:data:`_CERTIFICATE_REFUSED`), asked by a call no endpoint serves
        (:data:`_DIAGNOSIS`) that fails with the connection's last error."""
        diagnose = self._channels[name].unary_unary(_DIAGNOSIS)
        try:
            diagnose(b"", timeout=min(seconds, 1.0), wait_for_ready=False)
        except grpc.RpcError as error:
            return _certificate_refused(error)
        return False

    def send(self, message: Message, *, deadline: float | None = None) -> int:
        """Deliver ``message`` to the peer it names and return its encoded size once that peer
        has acted on it; meanwhile act on what arrives for this party. ProtocolError if the peer
        refuses it (the peer's reason is quoted) or it does not come from this party;
        TransportError if the peer is not reached (after retries on UNAVAILABLE) or does not
        answer within ``deadline`` seconds (default: the endpoint's)."""
        return self.send_all([message], deadline=deadline)[0]

    def send_all(
        self,
        messages: Sequence[Message],
        *,
        deadline: float | None = None,
        detached: bool = False,
        failed: dict[str, ProtocolError] | None = None,
    ) -> list[int]:
        """Deliver ``messages`` as :meth:`send` does, but to their peers at once: every peer
        acts on its own while the others do, and this returns (their encoded sizes) once each
        has acted. The messages to one peer keep their order, in one delivery (acted on up to
        the first the peer refuses), or in several one after another where together they would
        pass the size limit (a peer's next one goes once it acted on the one before; each has
        its own ``deadline``).
        After a failure the others are still waited for, then the first failure
        is raised. ``detached``: nobody waits on this party for their outcome (it answered
        the delivery that caused them), so a peer that refuses one also raises the refusal in
        its own next wait. ``failed``, if given, gets each failure by the peer it came from."""
        encoded = [self._encode(message) for message in messages]
        groups: dict[str, list[int]] = {}
        for i, message in enumerate(messages):
            groups.setdefault(message.receiver, []).append(i)
        # Each peer's messages in as few deliveries as the size limit allows, one after
        # another; every peer's at once, each going on as soon as its last one was acted on.
        queues = [self._bundles(indices, encoded) for indices in groups.values()]

        def start(bundle: list[int]) -> _Delivery:
            sent = [messages[i] for i in bundle]
            return self._start(sent, [encoded[i] for i in bundle], deadline, detached)

        def follow(peer: int) -> _Delivery | None:
            return start(queues[peer].pop(0)) if queues[peer] else None

        outcomes = self._complete_all([start(bundles.pop(0)) for bundles in queues], follow)
        failures = []
        for error, indices in zip(outcomes, groups.values(), strict=True):
            if error is not None:  # TransportError included; its peer's next ones not sent
                failures.append(error)
                if failed is not None:
                    failed[messages[indices[0]].receiver] = error
        if failures:
            raise failures[0]
        return [len(data) for data in encoded]

    def _bundles(self, indices: Sequence[int], encoded: Sequence[bytes]) -> list[list[int]]:
        """``indices`` (one peer's messages, ``encoded``) cut in order into deliveries of at most
        MAX_BUNDLE messages and ``max_message_bytes`` bytes (a message over it goes alone)."""
        bundles: list[list[int]] = [[]]
        size = 0
        for i in indices:
            part = len(encoded[i]) + CAPTURE_LENGTH.size
            if bundles[-1] and (
                len(bundles[-1]) == MAX_BUNDLE or size + part > self.max_message_bytes
            ):
                bundles.append([])
                size = 0
            bundles[-1].append(i)
            size += part
        return bundles

    def _encode(self, message: Message) -> bytes:
        """``message``'s bytes, if it is this party's to send to a known peer."""
        if message.sender != self.name:
            raise ProtocolError(
                f"{self.name}: a {message.kind} naming sender {message.sender!r}; a party sends "
                "only in its own name."
            )
        if message.receiver not in self._channels:
            raise ProtocolError(
                f"{self.name}: no address for {message.receiver!r} (peers: "
                f"{', '.join(sorted(self._peers)) or 'none'})."
            )
        return wire.encode(message)

    def _start(
        self,
        messages: Sequence[Message],
        encoded: Sequence[bytes],
        deadline: float | None,
        detached: bool = False,
    ) -> _Delivery:
        """Number one peer's ``messages`` (``encoded``) on its stream, as one delivery, and
        put its first attempt on the wire."""
        receiver = messages[0].receiver
        channel = self._channels[receiver]
        self._sequence[receiver] += 1
        metadata: tuple[tuple[str, str], ...] = (
            (_STREAM, self._token),
            (_SEQUENCE, str(self._sequence[receiver])),
        )
        if len(messages) == 1:
            data = encoded[0]
        else:
            data = b"".join(CAPTURE_LENGTH.pack(len(part)) + part for part in encoded)
            metadata += ((_COUNT, str(len(messages))),)
        if detached:
            metadata += ((_DETACHED, "1"),)
        timeout = self.deadline if deadline is None else deadline
        delivery = _Delivery(
            tuple(messages), tuple(encoded), data, channel, metadata, time.monotonic(), timeout
        )
        delivery.future = self._call(channel, data, metadata, timeout)
        return delivery

    def _complete_all(
        self,
        deliveries: Sequence[_Delivery],
        follow: Callable[[int], _Delivery | None] | None = None,
    ) -> list[ProtocolError | None]:
        """Wait for every one of ``deliveries`` (acting on what arrives), each retried on
        UNAVAILABLE within its own deadline, until its peer has acted on it or it failed; all
        at once, so that peers not reached cost the time of their retries once, not once each.
        ``follow(i)``, once the i-th was delivered, may start the next delivery in its place
        (None: that one was the last). Returns each place's failure (None: all delivered). An
        error that is not the transport's (a channel closed under it) is raised as it is."""
        deliveries = list(deliveries)
        outcomes: dict[int, ProtocolError | None] = {}
        backoffs = [self.retry.backoffs() for _ in deliveries]
        retries: dict[int, float] = {}  # delivery -> when its next attempt goes
        for delivery in deliveries:
            self._wake_when_done(delivery)
        while True:
            for i, delivery in enumerate(deliveries):
                future = delivery.future
                if i in outcomes or i in retries or future is None or not future.done():
                    continue
                try:
                    backoff = self._settle(delivery, backoffs[i])
                except ProtocolError as error:
                    outcomes[i] = error
                    continue
                if backoff is not None:
                    retries[i] = time.monotonic() + backoff
                    continue
                after = follow(i) if follow is not None else None
                if after is None:
                    outcomes[i] = None
                else:
                    deliveries[i], backoffs[i] = after, self.retry.backoffs()
                    self._wake_when_done(after)
            if len(outcomes) == len(deliveries):
                return [outcomes[i] for i in range(len(deliveries))]
            now = time.monotonic()
            for i, when in list(retries.items()):
                if when <= now:
                    del retries[i]
                    delivery = deliveries[i]
                    delivery.attempts += 1
                    remaining = delivery.start + delivery.timeout - now
                    delivery.future = self._call(
                        delivery.channel, delivery.data, delivery.metadata, max(remaining, 0.001)
                    )
                    self._wake_when_done(delivery)
            # Until an outgoing call ends (its callback wakes this) or the next retry is due.
            wait = min(retries.values(), default=now + 1.0) - time.monotonic()
            try:
                item = self._queue.get(timeout=max(wait, 0.0))
            except queue.Empty:
                continue
            self._act_on(item)

    def _wake_when_done(self, delivery: _Delivery) -> None:
        future = delivery.future
        assert future is not None
        future.add_done_callback(lambda _: self._queue.put(_WAKE))

    def _settle(self, delivery: _Delivery, backoffs: Iterator[float]) -> float | None:
        """What the ended attempt of ``delivery`` comes to: None if the peer acted on it (its
        bytes counted, as in one process), else the wait before the next attempt; raises its
        failure where no retry is left or would help (not UNAVAILABLE, a refused certificate,
        past its deadline)."""
        future = delivery.future
        assert future is not None
        error = future.exception()
        if error is not None and not isinstance(error, grpc.RpcError):
            raise error  # not the transport's (a channel closed under it): as it is
        if error is None or error.code() not in _NOT_DELIVERED:
            # It crossed (answered, or refused by the peer): count it, as in one process.
            for sent, part in zip(delivery.messages, delivery.encoded, strict=True):
                self.bytes[(sent.sender, sent.receiver, _phase(sent))] += len(part)
                self._record(part)
        if error is None:
            return None
        backoff = next(backoffs, None)
        late = time.monotonic() + (backoff or 0.0) >= delivery.start + delivery.timeout
        hopeless = error.code() != grpc.StatusCode.UNAVAILABLE or _certificate_refused(error)
        if hopeless or backoff is None or late:
            raise self._failure(delivery.messages[0], error, delivery.attempts, delivery.start)
        return backoff

    def _record(self, data: bytes) -> None:
        """Append ``data`` to the capture file (if any) as one record."""
        if self.capture is not None:
            with self._capture_lock:
                append_record(self.capture, data)

    def _call(
        self,
        channel: grpc.Channel,
        data: bytes,
        metadata: tuple[tuple[str, str], ...],
        timeout: float,
    ) -> futures.Future[Any]:
        """The call, blocking in one of the endpoint's sender threads (:data:`SENDER_THREADS`);
        its future fails with the call's ``grpc.RpcError``."""
        calls = self._calls.get(channel)
        if calls is None:  # a retry on a channel that reconnect has replaced (and closed)
            calls = (channel.unary_unary(DELIVER), channel.stream_unary(DELIVER_STREAM))
        call, streamed = calls
        if len(data) <= STREAM_THRESHOLD:
            return self._senders.submit(call, data, timeout=timeout, metadata=metadata)
        chunks = (data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES))
        return self._senders.submit(
            streamed, chunks, timeout=timeout, metadata=(*metadata, (_SIZE, str(len(data))))
        )

    def _failure(
        self, message: Message, error: grpc.RpcError, attempts: int, start: float
    ) -> ProtocolError:
        code, details = error.code(), error.details() or ""
        what = f"{message.kind} from {self.name} to {message.receiver}"
        if _certificate_refused(error):
            return TransportError(
                f"{what}: the TLS handshake with {message.receiver} at "
                f"{self._peers[message.receiver]} failed, which no retry changes: "
                f"{_handshake_reason(details, message.receiver)} (gRPC: {details})"
            )
        if code == grpc.StatusCode.UNAVAILABLE:
            # Nothing listens there: certificates are not in question (a peer that refuses this
            # party's certificate closes the connection instead, which says nothing certain).
            lowered = details.lower()
            if "connection refused" in lowered:
                question = "Is it running?"
            elif "dns resolution failed" in lowered or "domain name not found" in lowered:
                question = "Its host name does not resolve: is the federation file's address right?"
            else:
                question = "Is it running, and do both certificates come from this federation's CA?"
            return TransportError(
                f"{what}: {message.receiver} at {self._peers[message.receiver]} could not be "
                f"reached ({attempts} attempts over {_elapsed(start)}): {details}. {question}",
                message.receiver,
            )
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return TransportError(
                f"{what}: no answer within the deadline ({_elapsed(start)}): {details or code.name}"
            )
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            self.restarted.add(message.receiver)
            return NotSetUpError(
                message.receiver,
                f"{what}: {message.receiver} was never set up for this run (its process was "
                f"restarted?): {details}",
            )
        if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL):  # the party says why
            return ProtocolError(f"{what} refused: {details}")
        return ProtocolError(f"{what} refused ({code.name}): {details}")


def _split_delivery(name: str, data: bytes, count: str | None) -> list[bytes]:
    """The encoded messages of one delivery: ``data`` itself, or with ``count`` (the metadata
    ``svfl-count``) that many records ``[4-byte big-endian length][message]`` and nothing
    after them. A malformed delivery is refused (INVALID_ARGUMENT) saying what was expected."""
    if count is None:
        return [data]
    number = decimal(count)
    if number is None or not 2 <= number <= MAX_BUNDLE:
        raise _Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name}: a delivery of 2 to {MAX_BUNDLE} messages expected, found {wire.shown(count)} "
            "announced.",
        )
    parts, offset, size = [], 0, len(data)
    for index in range(number):
        head = offset + CAPTURE_LENGTH.size
        length = CAPTURE_LENGTH.unpack_from(data, offset)[0] if head <= size else None
        if length is None or head + length > size:
            raise _Refusal(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{name}: a delivery of {count} messages whose message {index + 1} is cut short "
                f"at byte {size}.",
            )
        parts.append(data[head : head + length])
        offset = head + length
    if offset != size:
        raise _Refusal(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{name}: a delivery of {count} messages that ends after {offset} bytes, found "
            f"{size - offset} more.",
        )
    return parts


def _handshake_reason(details: str, peer: str) -> str:
    """What a failed TLS handshake's ``details`` (gRPC's, OpenSSL's words) mean to an operator."""
    if "WRONG_VERSION_NUMBER" in details:
        return (
            f"what answers there does not speak TLS: is {peer} served with --insecure, or is "
            "another program at that port?"
        )
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return (
            f"{peer}'s certificate is not signed by this federation's CA (the ca.pem here): "
            "does it serve another federation's certificates?"
        )
    if "Hostname Verification" in details:
        return (
            f"the certificate served there does not name {peer}: does the process there serve "
            f"{peer}'s certificate?"
        )
    return (
        f"does the process there serve {peer}'s certificate, from this federation's CA (the "
        "same ca.pem at both parties)?"
    )


def _certificate_refused(error: grpc.RpcError) -> bool:
    """Whether ``error`` says this party refused the peer's certificate in the TLS handshake
    (:data:`_CERTIFICATE_REFUSED`): a connection no retry can make."""
    details = error.details() or ""
    return error.code() == grpc.StatusCode.UNAVAILABLE and bool(
        _CERTIFICATE_REFUSED.search(details)
    )


def _as_it_is(text: str) -> str:
    return text


def _phase(message: Message) -> str:
    return str(getattr(message, "phase", "train"))


class _Probe:
    """Watches one peer's connection for :meth:`PartyEndpoint.await_peers`: ``done`` is set
    once it is up (``ready``), once the channel is closed, and with ``refused_is_lost`` once a
    connection attempt fails; ``failures`` counts the failed attempts. Every change sets
    ``wake``, which the waiting party shares between its probes."""

    def __init__(
        self, name: str, channel: grpc.Channel, refused_is_lost: bool, wake: threading.Event
    ) -> None:
        self.name = name
        self.ready = False
        self.done = threading.Event()
        self.failures = 0
        self.diagnosed = 0  # failures the waiting party has looked into
        self._wake = wake
        self._channel = channel
        self._ends = {grpc.ChannelConnectivity.SHUTDOWN}
        if refused_is_lost:
            self._ends.add(grpc.ChannelConnectivity.TRANSIENT_FAILURE)
        channel.subscribe(self._changed, try_to_connect=True)

    def _changed(self, state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.READY:
            self.ready = True
            self.done.set()
        elif state in self._ends:
            self.done.set()
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            self.failures += 1
        self._wake.set()

    def close(self) -> None:
        self._channel.unsubscribe(self._changed)


class NetworkChannel(Channel):
    """The channel of one party's process: the party attached here is reached directly (a
    message to itself), every other party through ``endpoint``; every message passes the
    channel's ``layers`` first, in the sending process, as in one process.

    The endpoint hands the attached party every message that arrives (``party.receive``), on
    the party's own thread; ``transport`` is the endpoint (``transport.bytes``: what this party
    sent).
    """

    def __init__(self, endpoint: PartyEndpoint, layers: Sequence[ChannelLayer] = ()) -> None:
        super().__init__(layers)
        self.endpoint = endpoint
        self.transport: Any = endpoint

    def hosts(self, name: str) -> bool:
        """Only this process's party lives here; every other is reached over the network."""
        return name == self.endpoint.name

    def unreachable(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` that are lost: each that refused a message since as never set up
        for the run (a process restarted in place of the one the run set up, whatever that
        one held died with it), and each whose process accepts no connection within the probe
        time (:data:`PROBE_SECONDS`, at most the endpoint's deadline): a live peer's
        connection is up, or comes up within milliseconds; a killed one's never does, and its
        address refuses at once."""
        restarted = self.endpoint.restarted.intersection(names)
        self.endpoint.restarted.difference_update(restarted)
        probed = [name for name in names if name not in restarted]
        late = self.endpoint.await_peers(
            probed, min(PROBE_SECONDS, self.endpoint.deadline), refused_is_lost=True
        )
        return [name for name in names if name in restarted or name in late]

    def returned(self, names: Sequence[str], *, quick: bool = False) -> list[str]:
        """Those of the lost ``names`` whose process accepts a connection again (a fresh one,
        with mutual TLS: a process at the address whose certificate does not name the party,
        or comes from another CA, fails the handshake and stays lost) within
        :data:`REJOIN_PROBE_SECONDS` (at most the endpoint's deadline), all probed at once;
        ``quick``: one whose first connection attempt fails (its address refuses: no process
        there yet) is not back, at once."""
        for name in names:
            self.endpoint.reconnect(name)
        self.endpoint.restarted.difference_update(names)
        late = self.endpoint.await_peers(
            names, min(REJOIN_PROBE_SECONDS, self.endpoint.deadline), refused_is_lost=quick
        )
        return [name for name in names if name not in late]

    def attach(self, party: Party) -> None:
        """Attach this process's party: the one the endpoint's certificate names."""
        if party.name != self.endpoint.name or self.endpoint.handler is not None:
            raise ProtocolError(
                f"a channel over {self.endpoint.name!r}'s endpoint carries that party only; "
                f"found {party.name!r}."
            )
        super().attach(party)
        self.endpoint.handler = party.receive
        self.endpoint.after = party.flush_after

    def post(self, message: Message, *, sender: Party) -> None:
        """Send ``message`` from the attached party to the peer it names, over the network."""
        self.check_sender(message, sender)
        self.endpoint.send(self.through_layers(message))

    def post_all(
        self, messages: Sequence[Message], *, sender: Party, detached: bool = False
    ) -> None:
        """Send ``messages`` from the attached party to their peers at once
        (:meth:`PartyEndpoint.send_all`): the peers act concurrently."""
        for message in messages:
            self.check_sender(message, sender)
        layered = [self.through_layers(message) for message in messages]
        self.endpoint.send_all(layered, detached=detached)

    def forget_refusals(self) -> list[str]:
        """:meth:`PartyEndpoint.forget_detached_refusals`: the driver abandoned an attempt."""
        return self.endpoint.forget_detached_refusals()

    def wait(self, awaiting: str) -> bool:
        """Act on the next message that arrives for the attached party
        (:meth:`PartyEndpoint.await_reply`): what a party that drives waits with for a reply
        that comes after the sends it made returned (:meth:`Party.send_after`)."""
        self.endpoint.await_reply(awaiting)
        return True
