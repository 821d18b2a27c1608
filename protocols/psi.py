"""Diffie-Hellman private set intersection (PSI) over X25519, and a PSI-backed :class:`Aligner`.

Protocol (two parties, semi-honest). Each id ``x`` is hashed to a Curve25519 u-coordinate
``H(x)`` (BLAKE2b-256 with a domain-separation tag, top bit cleared as RFC 7748 decoding does).
Party A (the *requester*, who learns the result) holds secret scalar ``a``, party B (the
*responder*) holds ``b``; masking is the X25519 function ``a·P`` (clamped scalar multiplication
of the u-coordinate ``P``), and double masking commutes: ``a·(b·H(x)) == b·(a·H(x))``.

1. A -> B (:class:`PsiRequest`): ``a·H(x)`` for all of A's ids, in a random order A remembers.
2. B -> A (:class:`PsiResponse`): ``b·(a·H(x))`` for A's values (same order in ``intersection``
   mode, shuffled in ``cardinality`` mode) and ``b·H(y)`` for B's ids, shuffled.
3. A computes ``a·(b·H(y))`` and intersects the doubly masked sets. In ``intersection`` mode A
   learns which of its ids B holds; in ``cardinality`` mode only how many.

Security argument (sketch). Under the decisional Diffie-Hellman assumption on Curve25519 and its
quadratic twist (hashed ids may land on either; X25519 is twist-secure and its clamped scalars
clear both cofactors), with ``H`` modelled as a random oracle, ``b·H(y)`` for an id ``y`` A does
not hold is indistinguishable from a random point to A, and ``a·H(x)`` hides A's ids from B.
What each side learns: A learns |B| and the intersection (or only its size); B learns |A| only.
Used by :class:`PsiAligner`, B additionally learns which of its ids are aligned (step 4,
:class:`PsiMatchMessage`), which aligned VFL training needs anyway. Not protected: a malicious
party may choose its ids (inputs) freely; every party learns the set sizes.

Refused from a peer, with no state change: points that are not 32 bytes, non-canonical encodings
(which an honest party never sends), low-order points (the shared secret is all zero), duplicate
masked values, and messages from another session, round, sender or mode (replays).
"""

from __future__ import annotations

import hashlib
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError
from secure_vfl.federation.alignment import ALIGNERS, Alignment, check_unique_ids, id_kind
from secure_vfl.federation.messages import Message, check_header

PsiMode = Literal["intersection", "cardinality"]
MODES: tuple[PsiMode, ...] = ("intersection", "cardinality")
POINT_BYTES = 32
HASH_TAG = b"secure-vfl/psi/x25519/v1"
CHUNK = 4096
"""Points per batch handed to one scalar-multiplication task (bounds per-task memory)."""
PARALLEL_THRESHOLD = 20_000
"""Below this many points the process-pool start-up costs more than it saves."""

ROUND_REQUEST, ROUND_RESPONSE, ROUND_MATCHES = 0, 1, 2

_P_LOW = 0xED  # p = 2^255 - 19, little-endian: ed ff .. ff 7f


def fresh_key() -> bytes:
    """A new random X25519 private scalar (32 bytes, from :mod:`secrets`)."""
    return secrets.token_bytes(POINT_BYTES)


def fresh_session_id() -> str:
    """A new random session id (128 bits, hex) that ties a protocol run's messages together."""
    return secrets.token_hex(16)


def _default_rng() -> np.random.Generator:
    return np.random.default_rng(secrets.randbits(128))


def _id_bytes(value: object) -> bytes:
    """Canonical bytes of one id, so that equal ids (as JoinAligner compares them) hash equally."""
    if isinstance(value, bytes | np.bytes_):
        return bytes(value)
    if isinstance(value, str | np.str_):
        return str(value).encode("utf-8")
    if isinstance(value, bool | np.bool_):
        raise DataError(f"ids must be text or numbers. Found a boolean {value!r}.")
    if isinstance(value, int | np.integer):
        return b"#" + str(int(value)).encode("ascii")
    if isinstance(value, float | np.floating):
        number = float(value)
        if number.is_integer():
            return b"#" + str(int(number)).encode("ascii")
        return b"#" + repr(number).encode("ascii")
    raise DataError(f"ids must be text or numbers. Found {type(value).__name__} {value!r}.")


def hash_to_point(value: object) -> bytes:
    """Hash one id to a 32-byte X25519 u-coordinate: BLAKE2b-256(tag, id), top bit cleared."""
    digest = bytearray(
        hashlib.blake2b(_id_bytes(value), digest_size=POINT_BYTES, key=HASH_TAG).digest()
    )
    digest[31] &= 0x7F
    return bytes(digest)


def hash_ids(ids: Iterable[object], count: int) -> np.ndarray:
    """(count,) S32 array of :func:`hash_to_point` of each id; no per-id object is kept."""
    points = np.empty(count, dtype=f"S{POINT_BYTES}")
    buffer = points.view(np.uint8).reshape(count, POINT_BYTES)
    filled = 0
    for i, value in enumerate(ids):
        if i >= count:
            raise DataError(f"expected {count} ids. Found more.")
        buffer[i] = np.frombuffer(hash_to_point(value), dtype=np.uint8)
        filled = i + 1
    if filled != count:
        raise DataError(f"expected {count} ids. Found {filled}.")
    return points


def _mask_chunk(key: bytes, points: bytes) -> tuple[bytes, int]:
    """Multiply each 32-byte point of ``points`` by the clamped scalar ``key``.

    Runs in worker processes, so it takes and returns plain bytes. Returns the masked points and
    the index (within the chunk) of the first low-order point, or -1 if there was none.
    """
    private_key = X25519PrivateKey.from_private_bytes(key)
    out = bytearray(len(points))
    for i in range(0, len(points), POINT_BYTES):
        try:
            shared = private_key.exchange(
                X25519PublicKey.from_public_bytes(points[i : i + POINT_BYTES])
            )
        except ValueError:
            return b"", i // POINT_BYTES
        out[i : i + POINT_BYTES] = shared
    return bytes(out), -1


def _chunks(points: np.ndarray) -> Iterator[bytes]:
    for start in range(0, points.shape[0], CHUNK):
        yield points[start : start + CHUNK].tobytes()


def mask_points(
    key: bytes, points: np.ndarray, *, workers: int | None = None, what: str = "points"
) -> np.ndarray:
    """(n,) S32 array ``key·P`` for each point ``P`` of ``points`` (n,) S32, in the same order.

    Works in chunks of :data:`CHUNK` points, over ``workers`` processes (default: 2 above
    :data:`PARALLEL_THRESHOLD` points, else 1). Raises IntegrityError naming the index of the
    first low-order point (one whose product is the all-zero point).
    """
    n = points.shape[0]
    if workers is None:
        workers = 2 if n > PARALLEL_THRESHOLD else 1
    if workers < 1:
        raise ConfigError(f"`workers` must be >= 1. Found {workers}.")
    out = np.empty(n, dtype=f"S{POINT_BYTES}")
    buffer = out.view(np.uint8)
    if workers == 1 or n <= CHUNK:
        results: Iterable[tuple[bytes, int]] = map(_mask_chunk, _repeat(key), _chunks(points))
        _collect(results, buffer, what)
    else:
        with ProcessPoolExecutor(workers) as pool:
            _collect(_bounded_map(pool, key, points, 4 * workers), buffer, what)
    return out


def _repeat(key: bytes) -> Iterator[bytes]:
    while True:
        yield key


def _bounded_map(
    pool: ProcessPoolExecutor, key: bytes, points: np.ndarray, in_flight: int
) -> Iterator[tuple[bytes, int]]:
    """Like ``pool.map`` over the chunks, in order, but with at most ``in_flight`` chunks
    submitted at a time, so that the copies sent to workers stay bounded for 10^6 ids."""
    pending: deque[Future[tuple[bytes, int]]] = deque()
    for chunk in _chunks(points):
        if len(pending) >= in_flight:
            yield pending.popleft().result()
        pending.append(pool.submit(_mask_chunk, key, chunk))
    while pending:
        yield pending.popleft().result()


def _collect(results: Iterable[tuple[bytes, int]], buffer: np.ndarray, what: str) -> None:
    for chunk_index, (masked, bad) in enumerate(results):
        if bad >= 0:
            raise IntegrityError(
                f"{what}: point {chunk_index * CHUNK + bad} is of low order (its masked value "
                "is the all-zero point); a valid point of large order expected."
            )
        start = chunk_index * CHUNK * POINT_BYTES
        buffer[start : start + len(masked)] = np.frombuffer(masked, dtype=np.uint8)


def decode_points(payload: bytes, what: str) -> np.ndarray:
    """Peer bytes -> (n,) S32 array, refusing a length that is not a multiple of 32 bytes and
    non-canonical encodings (top bit set, or u >= 2^255 - 19), which X25519 never outputs."""
    if not isinstance(payload, bytes):
        raise ProtocolError(f"{what}: bytes expected. Found {type(payload).__name__}.")
    if len(payload) % POINT_BYTES:
        raise ProtocolError(
            f"{what}: a whole number of {POINT_BYTES}-byte points expected. "
            f"Found {len(payload)} bytes ({len(payload) % POINT_BYTES} left over)."
        )
    points = np.frombuffer(payload, dtype=f"S{POINT_BYTES}")
    raw = points.view(np.uint8).reshape(-1, POINT_BYTES)
    too_large = (raw[:, 31] >= 0x80) | (
        (raw[:, 31] == 0x7F) & (raw[:, 1:31] == 0xFF).all(axis=1) & (raw[:, 0] >= _P_LOW)
    )
    if too_large.any():
        index = int(np.flatnonzero(too_large)[0])
        raise IntegrityError(
            f"{what}: point {index} is not a canonical u-coordinate (< 2^255 - 19 expected, "
            f"found {raw[index].tobytes()[::-1].hex()} big-endian)."
        )
    return points


def _refuse_duplicates(points: np.ndarray, what: str) -> None:
    if np.unique(points).shape[0] != points.shape[0]:
        raise IntegrityError(
            f"{what}: distinct masked values expected (ids are unique). Found repeats."
        )


@dataclass(frozen=True, kw_only=True)
class PsiMessage(Message):
    """Header of every PSI message: the session id ties it to one protocol run (no replays)."""

    session_id: str
    mode: PsiMode
    kind: ClassVar[str] = "psi"

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.session_id, str) or not self.session_id:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: a session id expected, found {self.session_id!r}."
            )
        if self.mode not in MODES:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: mode in {MODES} expected, found {self.mode!r}."
            )


@dataclass(frozen=True, kw_only=True)
class PsiRequest(PsiMessage):
    """Step 1, A -> B: A's singly masked ids ``a·H(x)`` in A's secret shuffled order."""

    points: bytes
    kind: ClassVar[str] = "psi-request"

    def validate(self) -> None:
        super().validate()
        decode_points(self.points, f"{self.kind} from {self.sender}")


@dataclass(frozen=True, kw_only=True)
class PsiResponse(PsiMessage):
    """Step 2, B -> A: ``b·(a·H(x))`` for A's points (same order unless cardinality mode) and
    B's own ``b·H(y)``, shuffled."""

    peer_points: bytes
    own_points: bytes
    kind: ClassVar[str] = "psi-response"

    def validate(self) -> None:
        super().validate()
        decode_points(self.peer_points, f"{self.kind} from {self.sender} (A's points)")
        decode_points(self.own_points, f"{self.kind} from {self.sender} (its own points)")


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


@dataclass(frozen=True)
class PsiResult:
    """What the requester A learns.

    ``size``: the intersection size. ``indices``: sorted indices into A's ids of the ids B holds
    (``intersection`` mode; None in ``cardinality`` mode). ``peer_size``: |B|.
    """

    mode: PsiMode
    size: int
    peer_size: int
    indices: np.ndarray | None


def _check_mode(mode: str) -> PsiMode:
    if mode not in MODES:
        raise ConfigError(f"`mode` must be one of {MODES}. Found {mode!r}.")
    return mode


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, bytes) or len(key) != POINT_BYTES:
        raise ConfigError(
            f"`key` must be {POINT_BYTES} bytes. Found {type(key).__name__} of length "
            f"{len(key) if isinstance(key, bytes) else '?'}."
        )
    return key


class _PsiRole:
    """What both roles share: ids, key, session, and the worker count."""

    def __init__(
        self,
        ids: Sequence[object] | np.ndarray,
        *,
        name: str,
        peer: str,
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
        rng: np.random.Generator | None = None,
        workers: int | None = None,
    ) -> None:
        self.ids = ids
        self.name = name
        self.peer = peer
        self.session_id = session_id
        self.mode = _check_mode(mode)
        self._key = _check_key(key if key is not None else fresh_key())
        self._rng = rng if rng is not None else _default_rng()
        self.workers = workers

    def _masked_own(self) -> np.ndarray:
        """This party's ids hashed and masked once, in id order."""
        points = hash_ids(iter(self.ids), len(self.ids))
        return mask_points(self._key, points, workers=self.workers, what=f"{self.name}'s ids")

    def _check(self, message: PsiMessage, kind: type[PsiMessage], round: int) -> None:
        if not isinstance(message, kind):
            raise ProtocolError(
                f"{self.name}: a {kind.kind} message expected, found {type(message).__name__}."
            )
        check_header(message, sender=self.peer, receiver=self.name, round=round, batch_id=0)
        for field, value in (("session id", self.session_id), ("mode", self.mode)):
            found = message.session_id if field == "session id" else message.mode
            if found != value:
                raise ProtocolError(
                    f"{message.kind} from {message.sender}: {field} {value!r} expected, "
                    f"found {found!r} (a message from another session or a replay)."
                )

    def _header(self, round: int) -> dict[str, object]:
        return {
            "sender": self.name,
            "receiver": self.peer,
            "round": round,
            "batch_id": 0,
            "session_id": self.session_id,
            "mode": self.mode,
        }


class PsiRequester(_PsiRole):
    """Party A: sends its masked ids, receives B's response, learns the intersection (or size)."""

    def __init__(
        self,
        ids: Sequence[object] | np.ndarray,
        *,
        name: str = "requester",
        peer: str = "responder",
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
        rng: np.random.Generator | None = None,
        workers: int | None = None,
    ) -> None:
        super().__init__(
            ids,
            name=name,
            peer=peer,
            session_id=session_id,
            mode=mode,
            key=key,
            rng=rng,
            workers=workers,
        )
        self._order: np.ndarray | None = None
        self.result: PsiResult | None = None
        self._peer_positions: np.ndarray | None = None

    def request(self) -> PsiRequest:
        """Step 1: ``a·H(x)`` for each own id, in a secret random order remembered for step 3."""
        if self._order is not None:
            raise ProtocolError(f"{self.name}: one request per session expected; already sent.")
        masked = self._masked_own()
        order = self._rng.permutation(masked.shape[0])
        self._order = order
        header = self._header(ROUND_REQUEST)
        return PsiRequest(points=masked[order].tobytes(), **header)  # type: ignore[arg-type]

    def finish(self, response: PsiResponse) -> PsiResult:
        """Step 3: check B's response, compute ``a·(b·H(y))`` and intersect.

        Raises ProtocolError/IntegrityError (and keeps its state) on a malformed response.
        """
        if self._order is None:
            raise ProtocolError(f"{self.name}: request() must come before finish().")
        if self.result is not None:
            raise ProtocolError(f"{self.name}: one response per session expected; already had.")
        self._check(response, PsiResponse, ROUND_RESPONSE)
        where = f"{response.kind} from {response.sender}"
        doubled_mine = decode_points(response.peer_points, f"{where} (A's points)")
        theirs = decode_points(response.own_points, f"{where} (its own points)")
        if doubled_mine.shape[0] != self._order.shape[0]:
            raise ProtocolError(
                f"{where}: {self._order.shape[0]} doubly masked points expected (one per "
                f"requested id), found {doubled_mine.shape[0]}."
            )
        _refuse_duplicates(doubled_mine, f"{where} (A's points)")
        _refuse_duplicates(theirs, f"{where} (its own points)")
        doubled_theirs = mask_points(
            self._key, theirs, workers=self.workers, what=f"{where} (its own points)"
        )
        _refuse_duplicates(doubled_theirs, f"{where} (its own points, masked)")
        found = np.isin(doubled_mine, doubled_theirs)
        size = int(found.sum())
        indices: np.ndarray | None = None
        peer_positions: np.ndarray | None = None
        if self.mode == "intersection":
            ours = self._order[found]
            sort_theirs = np.argsort(doubled_theirs, kind="stable")
            at = np.searchsorted(doubled_theirs[sort_theirs], doubled_mine[found])
            by_id = np.argsort(ours, kind="stable")
            indices = ours[by_id].astype(np.int64)
            peer_positions = sort_theirs[at][by_id].astype(np.int64)
        self._peer_positions = peer_positions
        self.result = PsiResult(
            mode=self.mode, size=size, peer_size=int(theirs.shape[0]), indices=indices
        )
        return self.result

    def matches(self, sample_of: np.ndarray, samples: int) -> PsiMatchMessage:
        """Step 4 (alignment): tell B where its matched ids sit among ``samples`` aligned samples.

        ``sample_of`` (n_A,) int64: the aligned sample position of each of A's ids, -1 if none.
        """
        if self.result is None or self.result.indices is None or self._peer_positions is None:
            raise ProtocolError(
                f"{self.name}: a finished intersection-mode session expected before matches()."
            )
        positions = sample_of[self.result.indices]
        kept = positions >= 0
        return PsiMatchMessage(
            samples=samples,
            sample_positions=positions[kept].astype(np.int64),
            peer_positions=self._peer_positions[kept],
            **self._header(ROUND_MATCHES),  # type: ignore[arg-type]
        )


class PsiResponder(_PsiRole):
    """Party B: answers A's request with its doubly masked points and its own masked ids."""

    def __init__(
        self,
        ids: Sequence[object] | np.ndarray,
        *,
        name: str = "responder",
        peer: str = "requester",
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
        rng: np.random.Generator | None = None,
        workers: int | None = None,
    ) -> None:
        super().__init__(
            ids,
            name=name,
            peer=peer,
            session_id=session_id,
            mode=mode,
            key=key,
            rng=rng,
            workers=workers,
        )
        self._own_order: np.ndarray | None = None

    def respond(self, request: PsiRequest) -> PsiResponse:
        """Step 2: ``b·(a·H(x))`` for A's points and ``b·H(y)`` for own ids, shuffled.

        Raises ProtocolError/IntegrityError (and keeps its state) on a malformed request.
        """
        if self._own_order is not None:
            raise ProtocolError(f"{self.name}: one request per session expected; already had.")
        self._check(request, PsiRequest, ROUND_REQUEST)
        where = f"{request.kind} from {request.sender}"
        points = decode_points(request.points, where)
        _refuse_duplicates(points, where)
        doubled = mask_points(self._key, points, workers=self.workers, what=where)
        if self.mode == "cardinality":
            doubled = doubled[self._rng.permutation(doubled.shape[0])]
        own = self._masked_own()
        own_order = self._rng.permutation(own.shape[0])
        self._own_order = own_order
        return PsiResponse(
            peer_points=doubled.tobytes(),
            own_points=own[own_order].tobytes(),
            **self._header(ROUND_RESPONSE),  # type: ignore[arg-type]
        )

    def receive_matches(self, message: PsiMatchMessage) -> np.ndarray:
        """Step 4: (samples,) int64, this party's row of each aligned sample, -1 where absent."""
        if self._own_order is None:
            raise ProtocolError(f"{self.name}: respond() must come before receive_matches().")
        self._check(message, PsiMatchMessage, ROUND_MATCHES)
        peer = message.peer_positions
        if peer.size and (peer.min() < 0 or peer.max() >= self._own_order.shape[0]):
            raise ProtocolError(
                f"{message.kind} from {message.sender}: positions in "
                f"[0, {self._own_order.shape[0]}) expected, found [{peer.min()}, {peer.max()}]."
            )
        rows = np.full(message.samples, -1, dtype=np.int64)
        rows[message.sample_positions] = self._own_order[peer]
        return rows


def run_psi(
    mine: Sequence[object] | np.ndarray,
    theirs: Sequence[object] | np.ndarray,
    *,
    mode: str = "intersection",
    key_mine: bytes | None = None,
    key_theirs: bytes | None = None,
    rng: np.random.Generator | None = None,
    session_id: str | None = None,
    workers: int | None = None,
    transcript: list[PsiMessage] | None = None,
) -> PsiResult:
    """Run both roles in-process: ``mine`` is the requester (who learns the result).

    ``rng`` drives both parties' shuffles (tests; by default each has its own secret-seeded
    generator). Messages exchanged are appended to ``transcript`` if given.
    """
    session = session_id if session_id is not None else fresh_session_id()
    requester = PsiRequester(
        mine, session_id=session, mode=mode, key=key_mine, rng=rng, workers=workers
    )
    responder = PsiResponder(
        theirs, session_id=session, mode=mode, key=key_theirs, rng=rng, workers=workers
    )
    request = requester.request()
    response = responder.respond(request)
    if transcript is not None:
        transcript.extend([request, response])
    return requester.finish(response)


class PsiAligner:
    """An :class:`Aligner` that replaces the plain join with DH-PSI between the label party and
    each data party separately, so data parties never see each other's ids.

    The label party (requester) learns which of its ids each data party holds, hence the
    availability mask; each data party learns which of its ids are aligned and their sample
    positions (needed to feed its rows in sample order), and so the number N of aligned samples.
    Returns exactly what :class:`~secure_vfl.federation.alignment.JoinAligner` returns.
    """

    def __init__(
        self,
        *,
        rng: np.random.Generator | None = None,
        key_factory: Callable[[], bytes] = fresh_key,
        workers: int | None = None,
        transcript: list[PsiMessage] | None = None,
    ) -> None:
        self.rng = rng
        self.key_factory = key_factory
        self.workers = workers
        self.transcript = transcript

    def align(self, party_ids: Sequence[np.ndarray], label_ids: np.ndarray) -> Alignment:
        """PSI of the label ids with each party's ids, then the aligned rows (label ids sorted)."""
        if len(party_ids) == 0:
            raise DataError("expected the ids of at least one party. Found none.")
        label_ids = np.asarray(label_ids)
        check_unique_ids(label_ids, "label party")
        sessions: list[tuple[PsiRequester, PsiResponder]] = []
        for k, ids in enumerate(party_ids):
            ids = np.asarray(ids)
            check_unique_ids(ids, f"party {k}")
            if id_kind(ids) != id_kind(label_ids):
                raise DataError(
                    f"party {k} ids must be of the same kind as the label ids "
                    f"({id_kind(label_ids)}). Found {id_kind(ids)}."
                )
            session = fresh_session_id()
            requester = PsiRequester(
                label_ids,
                name="label-party",
                peer=f"party-{k}",
                session_id=session,
                key=self.key_factory(),
                rng=self.rng,
                workers=self.workers,
            )
            responder = PsiResponder(
                ids,
                name=f"party-{k}",
                peer="label-party",
                session_id=session,
                key=self.key_factory(),
                rng=self.rng,
                workers=self.workers,
            )
            request = requester.request()
            response = responder.respond(request)
            requester.finish(response)
            self._record(request, response)
            sessions.append((requester, responder))
        held = np.zeros((label_ids.size, len(party_ids)), dtype=bool)
        for k, (requester, _) in enumerate(sessions):
            assert requester.result is not None and requester.result.indices is not None
            held[requester.result.indices, k] = True
        label_order = np.argsort(label_ids, kind="stable")
        kept = held[label_order].any(axis=1)
        label_rows = label_order[kept].astype(np.int64)
        sample_of = np.full(label_ids.size, -1, dtype=np.int64)
        sample_of[label_rows] = np.arange(label_rows.size, dtype=np.int64)
        rows = np.full((label_rows.size, len(party_ids)), -1, dtype=np.int64)
        for k, (requester, responder) in enumerate(sessions):
            message = requester.matches(sample_of, int(label_rows.size))
            self._record(message)
            rows[:, k] = responder.receive_matches(message)
        return Alignment(
            sample_ids=label_ids[label_rows],
            rows=rows,
            label_rows=label_rows,
            dropped=int((~kept).sum()),
        )

    def _record(self, *messages: PsiMessage) -> None:
        if self.transcript is not None:
            self.transcript.extend(messages)


ALIGNERS.register("psi", PsiAligner)
