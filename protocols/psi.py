"""Diffie-Hellman private set intersection (PSI) over X25519, and a PSI-backed :class:`Aligner`.

Protocol (two parties, semi-honest). Each id ``x`` is hashed to a Curve25519 u-coordinate
``H(x)`` (BLAKE2b-256 with a domain-separation tag, top bit cleared as RFC 7748 decoding does).
Party A (the *requester*, who learns the result) holds secret scalar ``a``, party B (the
*responder*) holds ``b``; masking is the X25519 function ``a·P`` (clamped scalar multiplication
of the u-coordinate ``P``), and double masking commutes: ``a·(b·H(x)) == b·(a·H(x))``.

1. A -> B (:class:`PsiRequest`, one message per chunk of ``chunk_size`` points): ``a·H(x)`` for
   all of A's ids, in a random order A remembers.
2. B -> A (:class:`PsiResponse`, a stream of chunks): ``b·(a·H(x))`` for A's values (chunk by
   chunk in the same order in ``intersection`` mode; after A's last chunk, shuffled over all of
   them in ``cardinality`` mode) and, interleaved, ``b·H(y)`` for B's ids in a random order.
3. A computes ``a·(b·H(y))`` and intersects the doubly masked sets. In ``intersection`` mode A
   learns which of its ids B holds; in ``cardinality`` mode only how many.

Security argument (sketch). Under the decisional Diffie-Hellman assumption on Curve25519 and its
quadratic twist (hashed ids may land on either; X25519 is twist-secure and its clamped scalars
clear both cofactors), with ``H`` modelled as a random oracle, ``b·H(y)`` for an id ``y`` A does
not hold is indistinguishable from a random point to A, and ``a·H(x)`` hides A's ids from B.
What each side learns: A learns |B| and the intersection (or only its size); B learns |A| only.
Chunking reveals nothing more: chunk sizes follow from |A|, |B| and ``chunk_size``, and both
sides shuffle over their whole set before chunking. Used by :class:`PsiAligner`, B additionally
learns which of its ids are aligned (step 4, :class:`PsiMatchMessage`), which aligned VFL
training needs anyway. Not protected: a malicious party may choose its ids (inputs) freely; every
party learns the set sizes.

Refused from a peer, with no state change: points that are not 32 bytes, non-canonical encodings
(which an honest party never sends), low-order points (the shared secret is all zero), duplicate
masked values (across chunks too), chunks that do not fit the announced totals, and messages from
another session, round, sender, chunk or mode (replays).

Memory (N_A, N_B: the set sizes; ids themselves are the caller's). Points are streamed: a message
holds one chunk (32 bytes per point), and what a role keeps between chunks is fixed-size numpy
arrays, no Python object per id. Doubly masked points are compared through 16-byte digests (their
first 16 bytes: uniform, so a false match or repeat has probability about N_A·N_B / 2^128).

- requester: its shuffle (4 bytes per id, 8 above 2^31 ids), a digest and a stream position of
  each of its doubly masked points (20 bytes) and of B's (20 bytes): 24·N_A + 20·N_B bytes, plus
  one transient merge of the digest runs (about 25 bytes per digest merged) and, when done, the
  result (8 bytes per intersecting id, twice in intersection mode).
- responder: its shuffle (4·N_B), a digest and position of each requested point (20·N_A) to
  refuse repeats across chunks, and in ``cardinality`` mode A's doubly masked points until they
  are shuffled (32·N_A): 20·N_A + 4·N_B bytes, 52·N_A + 4·N_B in cardinality mode.
- everything else is per chunk: a small multiple of 32·``chunk_size`` bytes.

At 10^6 ids per side that is about 44 MB (requester) and 24 MB (responder); a process holding
both roles grew by 61 MB (intersection) and 90 MB (cardinality mode) at 10^6 ids per side
(``benchmarks/psi_costs.py``). A ``transcript`` keeps every message (64·N_A + 32·N_B bytes).

Parallelism: the X25519 multiplications (2·(N_A + N_B) in all, ~22 us each; hashing is ~1 us) run in
a :class:`ScalarPool` of worker processes (``workers``; default ``os.cpu_count()``; ``workers=1``
keeps everything in this process). A chunk is split over the workers; hashing happens there too.
The private scalar is sent to those worker processes with each task, over the pipes
:mod:`concurrent.futures` sets up between this process and its own children (same machine, same
user); it never leaves this party's processes and nothing but the protocol messages goes to
the peer.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import secrets
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from types import TracebackType
from typing import ClassVar, Literal

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError
from secure_vfl.federation.alignment import ALIGNERS, Alignment, checked_ids
from secure_vfl.federation.messages import Message, check_header

PsiMode = Literal["intersection", "cardinality"]
MODES: tuple[PsiMode, ...] = ("intersection", "cardinality")
POINT_BYTES = 32
DIGEST_BYTES = 16
HASH_TAG = b"secure-vfl/psi/x25519/v1"
CHUNK = 8192
"""Default points per message (``chunk_size``): 256 KiB of points, ~0.2 s of work per role."""
TASK_POINTS = 1024
"""Points per task handed to a worker process: ~25 ms of work, far above the hand-off, and small
enough to balance the workers when the machine is shared. A call on fewer than
``2 * TASK_POINTS`` points runs in this process unless the workers are already started."""
LOOKUP_BLOCK = 1 << 16
"""Digests looked up at a time when intersecting (bounds the temporaries)."""

ROUND_REQUEST, ROUND_RESPONSE, ROUND_MATCHES = 0, 1, 2

_P_LOW = 0xED  # p = 2^255 - 19, little-endian: ed ff .. ff 7f

Ids = Sequence[object] | np.ndarray


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


def _multiply(key: bytes, points: Iterable[bytes]) -> tuple[bytes, int]:
    """``key·P`` for each 32-byte point ``P``, concatenated, and the index of the first low-order
    point (its product is the all-zero point, which ``cryptography`` refuses), or -1 if none."""
    exchange = X25519PrivateKey.from_private_bytes(key).exchange
    load = X25519PublicKey.from_public_bytes
    out: list[bytes] = []
    append = out.append  # the loop runs ~10^6 times per party: no attribute look-ups in it
    for i, point in enumerate(points):
        try:
            append(exchange(load(point)))
        except ValueError:
            return b"", i
    return b"".join(out), -1


def _mask_task(key: bytes, points: bytes) -> tuple[bytes, int]:
    """Worker task: multiply the concatenated 32-byte ``points`` by ``key`` (plain bytes in and
    out, so that it pickles cheaply)."""
    views = (points[i : i + POINT_BYTES] for i in range(0, len(points), POINT_BYTES))
    return _multiply(key, views)


def _hash_mask_task(key: bytes, ids: Sequence[object] | np.ndarray) -> tuple[bytes, int]:
    """Worker task: hash each id to a point and multiply it by ``key``."""
    return _multiply(key, map(hash_to_point, ids))


class ScalarPool:
    """Worker processes for the X25519 scalar multiplications, started on first use.

    ``workers``: processes to use (default ``os.cpu_count()``); 1 keeps everything in this
    process, as do calls on few points (see :data:`TASK_POINTS`). One pool can serve both roles
    of an in-process run and several sessions (:func:`run_psi`, :class:`PsiAligner`); close it
    (or use it as a context manager) to stop the processes. Private scalars reach the workers as
    task arguments over this process's own pipes to its children.
    """

    def __init__(self, workers: int | None = None) -> None:
        count = workers if workers is not None else (os.cpu_count() or 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"`workers` must be an integer >= 1. Found {workers!r}.")
        self.workers = count
        self._executor: ProcessPoolExecutor | None = None
        self._finalizer: weakref.finalize | None = None

    def __enter__(self) -> ScalarPool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def running(self) -> bool:
        """Whether worker processes have been started (and not closed)."""
        return self._executor is not None

    def close(self) -> None:
        """Stop the worker processes (a later call starts new ones)."""
        if self._finalizer is not None:
            self._finalizer()
        self._executor = None
        self._finalizer = None

    def mask(self, key: bytes, points: np.ndarray, *, what: str, offset: int = 0) -> np.ndarray:
        """(n,) S32 array ``key·P`` for each point of ``points`` (n,) S32, in order.

        Raises IntegrityError naming the first low-order point by its index plus ``offset``.
        """
        n = points.shape[0]
        parallel = self._parallel(n)
        tasks = (
            (_mask_task, points[start:stop].tobytes(), stop - start)
            for start, stop in self._spans(n, parallel)
        )
        return self._run(key, tasks, n, parallel, what, offset)

    def hash_and_mask(self, key: bytes, ids: Ids, *, what: str, offset: int = 0) -> np.ndarray:
        """(n,) S32 array ``key·H(x)`` for each id of ``ids`` (hashing runs in the workers)."""
        n = len(ids)
        parallel = self._parallel(n)
        tasks = (
            (_hash_mask_task, ids[start:stop], stop - start)
            for start, stop in self._spans(n, parallel)
        )
        return self._run(key, tasks, n, parallel, what, offset)

    def _parallel(self, n: int) -> bool:
        """Worth the workers: enough points to start them, or, once started, enough to share
        (so that a session's last, short chunk does not leave them idle)."""
        least = 2 * TASK_POINTS if self._executor is None else TASK_POINTS // 4
        return self.workers > 1 and n >= least

    def _spans(self, n: int, parallel: bool) -> Iterator[tuple[int, int]]:
        size = min(TASK_POINTS, -(-n // self.workers)) if parallel else max(min(n, CHUNK), 1)
        for start in range(0, n, size):
            yield start, min(start + size, n)

    def _run(
        self,
        key: bytes,
        tasks: Iterator[tuple[Callable[..., tuple[bytes, int]], object, int]],
        n: int,
        parallel: bool,
        what: str,
        offset: int,
    ) -> np.ndarray:
        out = np.empty(n, dtype=f"S{POINT_BYTES}")
        buffer = out.view(np.uint8)
        results = self._submit(key, tasks) if parallel else self._inline(key, tasks)
        start = 0
        for (masked, bad), count in results:
            if bad >= 0:
                raise IntegrityError(
                    f"{what}: point {offset + start + bad} is of low order (its masked value "
                    "is the all-zero point); a valid point of large order expected."
                )
            buffer[start * POINT_BYTES : (start + count) * POINT_BYTES] = np.frombuffer(
                masked, dtype=np.uint8
            )
            start += count
        return out

    @staticmethod
    def _inline(
        key: bytes, tasks: Iterator[tuple[Callable[..., tuple[bytes, int]], object, int]]
    ) -> Iterator[tuple[tuple[bytes, int], int]]:
        for task, argument, count in tasks:
            yield task(key, argument), count

    def _submit(
        self, key: bytes, tasks: Iterator[tuple[Callable[..., tuple[bytes, int]], object, int]]
    ) -> Iterator[tuple[tuple[bytes, int], int]]:
        """Results in task order, with at most ``2 * workers`` tasks in flight at a time."""
        if self._executor is None:
            self._executor = ProcessPoolExecutor(self.workers, mp_context=_worker_context())
            self._finalizer = weakref.finalize(self, self._executor.shutdown)
        pending: deque[tuple[Future[tuple[bytes, int]], int]] = deque()
        try:
            for task, argument, count in tasks:
                if len(pending) >= 2 * self.workers:
                    future, done = pending.popleft()
                    yield future.result(), done
                pending.append((self._executor.submit(task, key, argument), count))
            while pending:
                future, done = pending.popleft()
                yield future.result(), done
        finally:
            for future, _ in pending:
                future.cancel()


def _worker_context() -> BaseContext | None:
    """Fork on Linux: workers start in milliseconds with this process's modules already
    imported (this module imports torch through ``secure_vfl``, which a spawned worker would
    import again, ~1.5 s each), even where the caller itself was spawned. Elsewhere the
    platform's default (spawn on macOS and Windows, where fork is unsafe or missing)."""
    return multiprocessing.get_context("fork") if sys.platform == "linux" else None


def mask_points(
    key: bytes, points: np.ndarray, *, workers: int | None = None, what: str = "points"
) -> np.ndarray:
    """(n,) S32 array ``key·P`` for each point ``P`` of ``points`` (n,) S32, in the same order,
    over ``workers`` processes (see :class:`ScalarPool`). Raises IntegrityError naming the index
    of the first low-order point (one whose product is the all-zero point)."""
    with ScalarPool(workers) as pool:
        return pool.mask(key, points, what=what)


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


def digests(points: np.ndarray) -> np.ndarray:
    """(n,) S16 array: the first 16 bytes of each point of ``points`` (n,) S32, what the roles
    keep of masked points (masked points are uniform, so 16 bytes tell them apart)."""
    raw = points.view(np.uint8).reshape(-1, POINT_BYTES)[:, :DIGEST_BYTES]
    return np.ascontiguousarray(raw).view(f"S{DIGEST_BYTES}").reshape(-1)


def _position_dtype(count: int) -> type[np.signedinteger]:
    return np.int32 if count < 2**31 else np.int64


class _DigestIndex:
    """Distinct digests, each with its position in a stream, kept as a few sorted runs whose
    sizes at least double (as in a log-structured merge): refusing a chunk's repeats costs
    O(chunk · log^2 N), keeping N digests 16 bytes plus a position each, and a merge of two runs
    needs about 25 bytes per merged digest on top."""

    def __init__(self, count: int) -> None:
        self._dtype = _position_dtype(count)
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []

    def lookup(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For each of ``values``: whether it is kept, and its position where it is."""
        kept = np.zeros(values.shape[0], dtype=bool)
        positions = np.zeros(values.shape[0], dtype=self._dtype)
        for run, run_positions in self._runs:
            at = np.minimum(np.searchsorted(run, values), run.shape[0] - 1)
            found = run[at] == values
            kept |= found
            positions[found] = run_positions[at[found]]
        return kept, positions

    def refuse_repeats(self, values: np.ndarray, what: str) -> None:
        """Raise IntegrityError if ``values`` repeat among themselves or with those kept."""
        if np.unique(values).shape[0] != values.shape[0] or self.lookup(values)[0].any():
            raise IntegrityError(
                f"{what}: distinct masked values expected (ids are unique). Found repeats."
            )

    def add(self, values: np.ndarray, first_position: int) -> None:
        """Keep ``values`` (checked with :meth:`refuse_repeats`) at positions from
        ``first_position`` on."""
        if not values.size:
            return
        order = np.argsort(values)
        self._runs.append((values[order], (first_position + order).astype(self._dtype)))
        while len(self._runs) > 1 and self._runs[-2][0].shape[0] <= 2 * self._runs[-1][0].shape[0]:
            self._merge_last_two()

    def merge(self) -> None:
        """Merge all runs into one, so that :meth:`lookup` searches a single array."""
        while len(self._runs) > 1:
            self._merge_last_two()

    def blocks(self, size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """The digests kept and their positions, ``size`` at a time (sorted within runs)."""
        for run, run_positions in self._runs:
            for start in range(0, run.shape[0], size):
                yield run[start : start + size], run_positions[start : start + size]

    def _merge_last_two(self) -> None:
        low, low_positions = self._runs.pop()
        high, high_positions = self._runs.pop()
        where = np.searchsorted(high, low) + np.arange(low.shape[0])  # digests are distinct
        from_high = np.ones(high.shape[0] + low.shape[0], dtype=bool)
        from_high[where] = False
        merged = np.empty(from_high.shape[0], dtype=high.dtype)
        merged[where], merged[from_high] = low, high
        positions = np.empty(from_high.shape[0], dtype=self._dtype)
        positions[where], positions[from_high] = low_positions, high_positions
        self._runs.append((merged, positions))


@dataclass(frozen=True, kw_only=True)
class PsiMessage(Message):
    """Header of every PSI message: the session id ties it to one protocol run (no replays).
    ``batch_id`` numbers the chunks of a stream (0, 1, ...)."""

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

    def _check_total(self, name: str, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ProtocolError(
                f"{self.kind} from {self.sender}: {name} must be an integer >= 0, found {value!r}."
            )


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


@dataclass(frozen=True, kw_only=True)
class PsiResponse(PsiMessage):
    """Step 2, B -> A, one chunk of each of two streams, either possibly empty: ``peer_points``,
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
    """What both roles share: ids, key, session, chunking and the scalar-multiplication pool."""

    def __init__(
        self,
        ids: Ids,
        *,
        name: str,
        peer: str,
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
        rng: np.random.Generator | None = None,
        workers: int | ScalarPool | None = None,
        chunk_size: int = CHUNK,
    ) -> None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ConfigError(f"`chunk_size` must be an integer >= 1. Found {chunk_size!r}.")
        self.ids = ids
        self.name = name
        self.peer = peer
        self.session_id = session_id
        self.mode = _check_mode(mode)
        self.chunk_size = chunk_size
        self._key = _check_key(key if key is not None else fresh_key())
        self._rng = rng if rng is not None else _default_rng()
        self._owns_pool = not isinstance(workers, ScalarPool)
        self._pool = workers if isinstance(workers, ScalarPool) else ScalarPool(workers)

    def _shuffle(self) -> np.ndarray:
        """A secret random order of this party's ids (4 bytes per id below 2^31 ids)."""
        return self._rng.permutation(len(self.ids)).astype(_position_dtype(len(self.ids)))

    def _masked_chunk(self, order: np.ndarray, index: int) -> np.ndarray:
        """``key·H(x)`` for the ids of chunk ``index`` of ``order``."""
        positions = order[index * self.chunk_size : (index + 1) * self.chunk_size]
        if isinstance(self.ids, np.ndarray):
            chunk: Ids = self.ids[positions]
        else:
            chunk = [self.ids[i] for i in positions.tolist()]
        what = f"{self.name}'s ids"
        return self._pool.hash_and_mask(self._key, chunk, what=what, offset=index * self.chunk_size)

    def _done(self) -> None:
        if self._owns_pool:
            self._pool.close()

    def _check(
        self, message: PsiMessage, kind: type[PsiMessage], round: int, batch_id: int = 0
    ) -> None:
        if not isinstance(message, kind):
            raise ProtocolError(
                f"{self.name}: a {kind.kind} message expected, found {type(message).__name__}."
            )
        check_header(message, sender=self.peer, receiver=self.name, round=round, batch_id=batch_id)
        for field, value in (("session id", self.session_id), ("mode", self.mode)):
            found = message.session_id if field == "session id" else message.mode
            if found != value:
                raise ProtocolError(
                    f"{message.kind} from {message.sender}: {field} {value!r} expected, "
                    f"found {found!r} (a message from another session or a replay)."
                )

    def _header(self, round: int, batch_id: int = 0) -> dict[str, object]:
        return {
            "sender": self.name,
            "receiver": self.peer,
            "round": round,
            "batch_id": batch_id,
            "session_id": self.session_id,
            "mode": self.mode,
        }


class PsiRequester(_PsiRole):
    """Party A: streams its masked ids (:meth:`requests`), takes B's response chunks
    (:meth:`receive`) and learns the intersection (or its size) from the last one.

    ``chunk_size``: points per request message. ``workers``: processes for the scalar
    multiplications (default all cores, 1 for none; stopped when the result is in) or a
    :class:`ScalarPool` to share, which the caller closes.
    """

    def __init__(
        self,
        ids: Ids,
        *,
        name: str = "requester",
        peer: str = "responder",
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
        rng: np.random.Generator | None = None,
        workers: int | ScalarPool | None = None,
        chunk_size: int = CHUNK,
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
            chunk_size=chunk_size,
        )
        self.chunks = max(1, math.ceil(len(ids) / chunk_size))
        """Request chunks this party sends (one, empty, for no ids)."""
        self._order: np.ndarray | None = None
        self._sent = 0
        self._answered = 0
        self._peer_received = 0
        self._responses = 0
        self._own_total: int | None = None
        self._own_received = 0
        self._mine = _DigestIndex(len(ids))
        self._theirs = _DigestIndex(0)
        self.result: PsiResult | None = None
        self._peer_positions: np.ndarray | None = None

    def requests(self) -> Iterator[PsiRequest]:
        """Step 1: ``a·H(x)`` for each own id, in a secret random order remembered for step 3,
        one :class:`PsiRequest` per chunk (each computed when the iterator reaches it)."""
        if self._order is not None:
            raise ProtocolError(f"{self.name}: one request stream per session expected.")
        self._order = self._shuffle()
        return self._request_chunks(self._order)

    def _request_chunks(self, order: np.ndarray) -> Iterator[PsiRequest]:
        for index in range(self.chunks):
            masked = self._masked_chunk(order, index)
            self._sent = index + 1
            yield PsiRequest(
                points=masked.tobytes(),
                total=len(self.ids),
                **self._header(ROUND_REQUEST, index),  # type: ignore[arg-type]
            )

    def receive(self, response: PsiResponse) -> PsiResult | None:
        """Step 3, one response chunk: check it, keep digests of ``b·(a·H(x))`` and of
        ``a·(b·H(y))``; after the last chunk intersect them and return the result (also in
        :attr:`result`), else None.

        Raises ProtocolError/IntegrityError (and keeps its state) on a malformed chunk.
        """
        if self._order is None:
            raise ProtocolError(f"{self.name}: requests() must come before receive().")
        if self.result is not None:
            raise ProtocolError(f"{self.name}: the whole response was already received.")
        self._check(response, PsiResponse, ROUND_RESPONSE, self._responses)
        where = f"{response.kind} from {response.sender}"
        doubled = decode_points(response.peer_points, f"{where} (A's points)")
        theirs = decode_points(response.own_points, f"{where} (its own points)")
        if doubled.shape[0]:
            if self._answered >= self._sent:
                raise ProtocolError(
                    f"{where}: no request chunk is waiting for an answer, found "
                    f"{doubled.shape[0]} doubly masked points."
                )
            expected = min(self.chunk_size, len(self.ids) - self._answered * self.chunk_size)
            if doubled.shape[0] != expected:
                raise ProtocolError(
                    f"{where}: {expected} doubly masked points expected (one per id of request "
                    f"chunk {self._answered}) or none, found {doubled.shape[0]}."
                )
        own_total = response.own_total
        if self._own_total is not None and own_total != self._own_total:
            raise ProtocolError(
                f"{where}: {self._own_total} own points announced before, found {own_total}."
            )
        own_received = self._own_received + theirs.shape[0]
        if own_received > own_total:
            raise ProtocolError(
                f"{where}: {own_total} own points announced, found {own_received} so far."
            )
        mine_digests = digests(doubled)
        self._mine.refuse_repeats(mine_digests, f"{where} (A's points)")
        masked = self._pool.mask(
            self._key, theirs, what=f"{where} (its own points)", offset=self._own_received
        )
        theirs_index = self._theirs if self._own_total is not None else _DigestIndex(own_total)
        theirs_digests = digests(masked)
        theirs_index.refuse_repeats(theirs_digests, f"{where} (its own points)")

        self._mine.add(mine_digests, self._peer_received)
        theirs_index.add(theirs_digests, self._own_received)
        self._theirs = theirs_index
        self._own_total = own_total
        self._own_received = own_received
        self._peer_received += doubled.shape[0]
        self._answered += 1 if doubled.shape[0] else 0
        self._responses += 1
        complete = self._sent == self.chunks and self._peer_received == len(self.ids)
        return self._intersect(own_total) if complete and own_received == own_total else None

    def _intersect(self, peer_size: int) -> PsiResult:
        """Look each of A's doubly masked digests up among B's, a block at a time."""
        assert self._order is not None
        self._theirs.merge()
        ours: list[np.ndarray] = []
        theirs: list[np.ndarray] = []
        for block, positions in self._mine.blocks(LOOKUP_BLOCK):
            found, their_positions = self._theirs.lookup(block)
            ours.append(self._order[positions[found]])
            theirs.append(their_positions[found])
        self._mine = self._theirs = _DigestIndex(0)
        matched_ours = np.concatenate(ours) if ours else np.zeros(0, dtype=np.int64)
        indices: np.ndarray | None = None
        if self.mode == "intersection":
            by_id = np.argsort(matched_ours)
            indices = matched_ours[by_id].astype(np.int64)
            self._peer_positions = np.concatenate(theirs)[by_id].astype(np.int64)
        self.result = PsiResult(
            mode=self.mode, size=int(matched_ours.shape[0]), peer_size=peer_size, indices=indices
        )
        self._done()
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
    """Party B: answers each of A's request chunks (:meth:`respond`) with its doubly masked
    points and, interleaved, its own masked ids.

    ``chunk_size``: own points per response message. ``workers``: as for :class:`PsiRequester`
    (an own pool is stopped after the last response).
    """

    def __init__(
        self,
        ids: Ids,
        *,
        name: str = "responder",
        peer: str = "requester",
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
        rng: np.random.Generator | None = None,
        workers: int | ScalarPool | None = None,
        chunk_size: int = CHUNK,
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
            chunk_size=chunk_size,
        )
        self._own_order: np.ndarray | None = None
        self._own_chunks = math.ceil(len(ids) / chunk_size)
        self._own_sent = 0
        self._peer_total: int | None = None
        self._peer_received = 0
        self._peer_chunks: list[int] = []
        self._requests_done = False
        self._seen = _DigestIndex(0)
        self._doubled: np.ndarray | None = None
        self._responses = 0

    def respond(self, request: PsiRequest) -> Iterator[PsiResponse]:
        """Step 2, one request chunk: ``b·(a·H(x))`` for its points and the next chunk of own
        ``b·H(y)`` (computed as the iterator reaches them); after A's last chunk, the rest.

        The request is checked (and refused with ProtocolError/IntegrityError, keeping this
        party's state) and masked before this returns.
        """
        if self._requests_done:
            raise ProtocolError(f"{self.name}: one request per session expected; already had.")
        self._check(request, PsiRequest, ROUND_REQUEST, len(self._peer_chunks))
        where = f"{request.kind} from {request.sender}"
        points = decode_points(request.points, where)
        total = request.total
        if self._peer_total is not None and total != self._peer_total:
            raise ProtocolError(
                f"{where}: {self._peer_total} points announced before, found {total}."
            )
        received = self._peer_received + points.shape[0]
        if received > total or (total and not points.shape[0]):
            raise ProtocolError(
                f"{where}: chunks of at least one point, {total} in all, expected; "
                f"found {points.shape[0]} in this one ({received} so far)."
            )
        seen = self._seen if self._peer_total is not None else _DigestIndex(total)
        values = digests(points)
        seen.refuse_repeats(values, where)
        doubled = self._pool.mask(self._key, points, what=where, offset=self._peer_received)
        buffer = self._doubled
        if self.mode == "cardinality" and buffer is None:
            buffer = np.empty(total, dtype=f"S{POINT_BYTES}")

        last = received == total
        if self._own_order is None:
            self._own_order = self._shuffle()
        seen.add(values, self._peer_received)
        self._seen = seen if not last else _DigestIndex(0)
        self._peer_total = total
        self._peer_chunks.append(points.shape[0])
        self._requests_done = last
        answers: Iterable[np.ndarray] = (doubled,)
        if buffer is not None:  # cardinality mode: answer only after a shuffle over all points
            buffer[self._peer_received : received] = doubled
            self._doubled = buffer if not last else None
            answers = self._shuffled(buffer) if last else ()
        self._peer_received = received
        return self._responses_to(answers, last)

    def _shuffled(self, buffer: np.ndarray) -> Iterator[np.ndarray]:
        self._rng.shuffle(buffer)
        start = 0
        for size in self._peer_chunks:
            yield buffer[start : start + size]
            start += size

    def _responses_to(self, answers: Iterable[np.ndarray], last: bool) -> Iterator[PsiResponse]:
        answered = False
        for doubled in answers:
            answered = True
            yield self._response(doubled)
        if not answered and self._own_sent < self._own_chunks:
            yield self._response(np.empty(0, dtype=f"S{POINT_BYTES}"))
        while last and self._own_sent < self._own_chunks:
            yield self._response(np.empty(0, dtype=f"S{POINT_BYTES}"))
        if last:
            self._done()

    def _response(self, doubled: np.ndarray) -> PsiResponse:
        """One response: ``doubled`` and the next chunk of own masked ids, if any is left."""
        assert self._own_order is not None
        own = b""
        if self._own_sent < self._own_chunks:
            own = self._masked_chunk(self._own_order, self._own_sent).tobytes()
            self._own_sent += 1
        response = PsiResponse(
            peer_points=doubled.tobytes(),
            own_points=own,
            own_total=len(self.ids),
            **self._header(ROUND_RESPONSE, self._responses),  # type: ignore[arg-type]
        )
        self._responses += 1
        return response

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


def exchange(
    requester: PsiRequester,
    responder: PsiResponder,
    transcript: list[PsiMessage] | None = None,
) -> PsiResult:
    """Run steps 1-3 between two in-process roles, chunk by chunk; messages exchanged are
    appended to ``transcript`` if given (which then keeps them all)."""
    result: PsiResult | None = None
    for request in requester.requests():
        if transcript is not None:
            transcript.append(request)
        for response in responder.respond(request):
            if transcript is not None:
                transcript.append(response)
            result = requester.receive(response)
    if result is None:
        raise ProtocolError(f"{requester.name}: the response stream ended before it was complete.")
    return result


def run_psi(
    mine: Ids,
    theirs: Ids,
    *,
    mode: str = "intersection",
    key_mine: bytes | None = None,
    key_theirs: bytes | None = None,
    rng: np.random.Generator | None = None,
    session_id: str | None = None,
    workers: int | None = None,
    chunk_size: int = CHUNK,
    transcript: list[PsiMessage] | None = None,
) -> PsiResult:
    """Run both roles in-process: ``mine`` is the requester (who learns the result).

    ``rng`` drives both parties' shuffles (tests; by default each has its own secret-seeded
    generator). ``workers`` processes (default ``os.cpu_count()``) serve both roles. Messages
    exchanged are appended to ``transcript`` if given.
    """
    session = session_id if session_id is not None else fresh_session_id()
    with ScalarPool(workers) as pool:
        requester = PsiRequester(
            mine,
            session_id=session,
            mode=mode,
            key=key_mine,
            rng=rng,
            workers=pool,
            chunk_size=chunk_size,
        )
        responder = PsiResponder(
            theirs,
            session_id=session,
            mode=mode,
            key=key_theirs,
            rng=rng,
            workers=pool,
            chunk_size=chunk_size,
        )
        return exchange(requester, responder, transcript)


class PsiAligner:
    """An :class:`Aligner` that replaces the plain join with DH-PSI between the label party and
    each data party separately, so data parties never see each other's ids.

    The label party (requester) learns which of its ids each data party holds, hence the
    availability mask; each data party learns which of its ids are aligned and their sample
    positions (needed to feed its rows in sample order), and so the number N of aligned samples.
    Returns exactly what :class:`~secure_vfl.federation.alignment.JoinAligner` returns. One
    :class:`ScalarPool` of ``workers`` processes serves every session.
    """

    def __init__(
        self,
        *,
        rng: np.random.Generator | None = None,
        key_factory: Callable[[], bytes] = fresh_key,
        workers: int | None = None,
        chunk_size: int = CHUNK,
        transcript: list[PsiMessage] | None = None,
    ) -> None:
        self.rng = rng
        self.key_factory = key_factory
        self.workers = workers
        self.chunk_size = chunk_size
        self.transcript = transcript

    def align(self, party_ids: Sequence[np.ndarray], label_ids: np.ndarray) -> Alignment:
        """PSI of the label ids with each party's ids, then the aligned rows (label ids sorted)."""
        party_ids, label_ids = checked_ids(party_ids, label_ids)
        sessions: list[tuple[PsiRequester, PsiResponder]] = []
        with ScalarPool(self.workers) as pool:
            for k, ids in enumerate(party_ids):
                session = fresh_session_id()
                requester = PsiRequester(
                    label_ids,
                    name="label-party",
                    peer=f"party-{k}",
                    session_id=session,
                    key=self.key_factory(),
                    rng=self.rng,
                    workers=pool,
                    chunk_size=self.chunk_size,
                )
                responder = PsiResponder(
                    ids,
                    name=f"party-{k}",
                    peer="label-party",
                    session_id=session,
                    key=self.key_factory(),
                    rng=self.rng,
                    workers=pool,
                    chunk_size=self.chunk_size,
                )
                exchange(requester, responder, self.transcript)
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
            if self.transcript is not None:
                self.transcript.append(message)
            rows[:, k] = responder.receive_matches(message)
        return Alignment(
            sample_ids=label_ids[label_rows],
            rows=rows,
            label_rows=label_order[kept].astype(np.int64),
            dropped=int((~kept).sum()),
        )


ALIGNERS.register("psi", PsiAligner)
