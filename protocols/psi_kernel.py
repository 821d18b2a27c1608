"""The arithmetic of DH-PSI (:mod:`protocols.psi`): ids hashed to X25519 points, scalar
multiplication over worker processes, checks of a peer's points, and the digest index.

Each id ``x`` is hashed to a Curve25519 u-coordinate ``H(x)`` (BLAKE2b-256 with a
domain-separation tag, top bit cleared as RFC 7748 decoding does); masking is the X25519 function
``a·P`` (clamped scalar multiplication of the u-coordinate ``P``).

Parallelism: the X25519 multiplications (2·(N_A + N_B) in all, ~22 us each; hashing is ~1 us) run in
a :class:`ScalarPool` of worker processes (``workers``; default ``os.cpu_count()``; ``workers=1``
keeps everything in this process). A chunk is split over the workers; hashing happens there too.
The private scalar is sent to those worker processes with each task, over the pipes
:mod:`concurrent.futures` sets up between this process and its own children (same machine, same
user); it never leaves this party's processes and nothing but the protocol messages goes to
the peer.

This module imports neither torch nor the message classes (which do, through
:mod:`secure_vfl.federation.messages`), and it sits outside the ``protocols.psi`` package, whose
``__init__`` imports them: a worker started by spawn or forkserver imports only this module, numpy
and ``cryptography`` to run its tasks (``tests/test_psi.py`` checks it stays so).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import secrets
import sys
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing.context import BaseContext
from types import TracebackType

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

from secure_vfl.errors import ConfigError, DataError, IntegrityError, ProtocolError

POINT_BYTES = 32
DIGEST_BYTES = 16
HASH_TAG = b"secure-vfl/psi/x25519/v1"
CHUNK = 8192
"""Default points per message (``chunk_size``): 256 KiB of points, ~0.2 s of work per role."""
TASK_POINTS = 1024
"""Points per task handed to a worker process: ~25 ms of work, far above the hand-off, and small
enough to balance the workers when the machine is shared. A call on fewer than
``2 * TASK_POINTS`` points runs in this process unless the workers are already started."""

_P_LOW = 0xED  # p = 2^255 - 19, little-endian: ed ff .. ff 7f

Ids = Sequence[object] | np.ndarray


def fresh_key() -> bytes:
    """A new random X25519 private scalar (32 bytes, from :mod:`secrets`)."""
    return secrets.token_bytes(POINT_BYTES)


_NUMBER = b"\xff#"
"""Prefix of a number's bytes: 0xFF occurs in no UTF-8 text, so the number 7 is not the text
``#7`` (whose bytes are ``b"#7"``)."""


def _id_bytes(value: object) -> bytes:
    """Canonical bytes of one id, so that equal ids (as JoinAligner compares them) hash equally
    and a text id never hashes as a number: text as UTF-8, bytes as they are, numbers after
    :data:`_NUMBER`."""
    if isinstance(value, bytes | np.bytes_):
        return bytes(value)
    if isinstance(value, str | np.str_):
        return str(value).encode("utf-8")
    if isinstance(value, bool | np.bool_):
        raise DataError(f"ids must be text or numbers. Found a boolean {value!r}.")
    if isinstance(value, int | np.integer):
        return _NUMBER + str(int(value)).encode("ascii")
    if isinstance(value, float | np.floating):
        number = float(value)
        if number.is_integer():
            return _NUMBER + str(int(number)).encode("ascii")
        return _NUMBER + repr(number).encode("ascii")
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
    of an in-process run and several sessions (:func:`~protocols.psi.run_psi`,
    :class:`~protocols.psi.PsiAligner`); close it (or use it as a context manager) to stop the
    processes. Private scalars reach the workers as task arguments over this process's own pipes
    to its children.

    ``progress``, if given, is called with the number of points of each task as it completes
    (both roles' multiplications, 2·(N_A + N_B) in a run): what drives a progress bar.
    """

    def __init__(
        self, workers: int | None = None, *, progress: Callable[[int], object] | None = None
    ) -> None:
        count = workers if workers is not None else (os.cpu_count() or 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"`workers` must be an integer >= 1. Found {workers!r}.")
        self.workers = count
        self.progress = progress
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
            if self.progress is not None:
                self.progress(count)
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
    """Fork on Linux: a worker starts in ~30 ms with this process's modules already imported,
    even where the caller itself was spawned; a spawned one imports only this module (no torch)
    but still takes ~0.2 s. Spawn where gRPC is loaded (a deployed party): forking a process
    whose gRPC threads run crashes the children (gRPC's fork handlers are off by default), as
    every deployed PSI of 2048 ids or more did. Elsewhere the platform's default (spawn on
    macOS and Windows, where fork is unsafe or missing)."""
    if sys.platform != "linux":
        return None
    return multiprocessing.get_context("spawn" if "grpc" in sys.modules else "fork")


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


def position_dtype(count: int) -> type[np.signedinteger]:
    """The integer type of positions in a stream of ``count`` items (4 bytes below 2^31)."""
    return np.int32 if count < 2**31 else np.int64


class DigestIndex:
    """Distinct digests, each with its position in a stream, kept as a few sorted runs whose
    sizes at least double (as in a log-structured merge): refusing a chunk's repeats costs
    O(chunk · log^2 N), keeping N digests 16 bytes plus a position each, and a merge of two runs
    needs about 25 bytes per merged digest on top."""

    def __init__(self, count: int) -> None:
        self._dtype = position_dtype(count)
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
