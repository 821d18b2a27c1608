"""The two roles of DH-PSI as state machines: :class:`RequesterSession` (A, who learns the
result) and :class:`ResponderSession` (B). Each turns one message of its peer into its answer,
checking the message before its state changes; the parties that hold them and carry their
messages are in :mod:`.parties`.

Flow control: B answers each message of A with exactly one response (possibly empty) and sends
nothing unasked: A sends its request chunks, then, once they are all sent, one :class:`PsiNext`
per further response it is owed. So at most one response is in flight (waiting in A's inbox),
over an in-process channel that delivers at once as over a network, and neither side buffers the
other's stream.

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
  are shuffled and sent back (32·N_A): 20·N_A + 4·N_B bytes, 52·N_A + 4·N_B in cardinality mode.
- everything else is per chunk: a small multiple of 32·``chunk_size`` bytes.

At 10^6 ids per side that is about 44 MB (requester) and 24 MB (responder); a process holding
both roles grew by 61 MB (intersection) and 90 MB (cardinality mode) at 10^6 ids per side
(``benchmarks/psi_costs.py``). A :class:`~secure_vfl.federation.channel.RecordingLayer` on the
channel keeps every message (64·N_A + 32·N_B bytes).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from protocols.noise import secure_generator
from protocols.psi.messages import (
    MODES,
    PsiMatchMessage,
    PsiMessage,
    PsiMode,
    PsiNext,
    PsiRequest,
    PsiResponse,
)
from protocols.psi_kernel import (
    CHUNK,
    POINT_BYTES,
    DigestIndex,
    Ids,
    ScalarPool,
    decode_points,
    digests,
    fresh_key,
    position_dtype,
)
from secure_vfl.errors import ConfigError, DataError, ProtocolError
from secure_vfl.federation.messages import check_header

LOOKUP_BLOCK = 1 << 16
"""Digests looked up at a time when intersecting (bounds the temporaries)."""

ROUND_REQUEST, ROUND_RESPONSE, ROUND_MATCHES = 0, 1, 2
"""Header rounds: A's request chunks; B's responses (and A's :class:`PsiNext` asking for one,
under the batch id of the response it asks for); A's matches."""

_NO_POINTS = np.empty(0, dtype=f"S{POINT_BYTES}")


def default_rng() -> np.random.Generator:
    """A party's own secret shuffles: AES-128-CTR keyed from :mod:`secrets`
    (:func:`protocols.noise.secure_generator`). Not numpy's PCG64, even seeded from ``secrets``:
    its state can be recovered from its outputs (Bouillaguet et al., CRYPTO 2020), and a peer
    sees outputs of the shuffles (the order of the points it receives)."""
    return secure_generator()


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


def check_chunk_size(chunk_size: int) -> int:
    """``chunk_size`` if it is an integer >= 1, else ConfigError."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ConfigError(f"`chunk_size` must be an integer >= 1. Found {chunk_size!r}.")
    return chunk_size


def check_ids(ids: Ids, who: str) -> Ids:
    """``ids`` if they are a sequence (or 1-d array) of distinct ids, at least one: ConfigError
    for text or bytes (each character would be an id), DataError for none or a repeated one
    (PSI matches sets; a peer's repeats are refused as tampering, one's own are a mistake)."""
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence | np.ndarray):
        raise ConfigError(
            f"{who}: a list (or array) of ids expected. Found {type(ids).__name__}"
            + (": each character would be an id." if isinstance(ids, str | bytes) else ".")
        )
    if len(ids) == 0:
        raise DataError(f"{who}: at least one id expected. Found none.")
    try:
        distinct = len(set(ids.tolist() if isinstance(ids, np.ndarray) else ids))
    except TypeError as error:  # e.g. a list among the ids
        raise ConfigError(f"{who}: ids of text or numbers expected ({error}).") from None
    if distinct != len(ids):
        raise DataError(
            f"{who}: distinct ids expected (PSI matches sets). Found {len(ids) - distinct} repeats."
        )
    return ids


class _Session:
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
        progress: Callable[[int], object] | None = None,
    ) -> None:
        self.ids = check_ids(ids, f"{name}'s ids")
        self.name = name
        self.peer = peer
        self.session_id = session_id
        self.mode = _check_mode(mode)
        self.chunk_size = check_chunk_size(chunk_size)
        self._key = _check_key(key if key is not None else fresh_key())
        self._rng = rng if rng is not None else default_rng()
        self._owns_pool = not isinstance(workers, ScalarPool)
        self._pool = (
            workers if isinstance(workers, ScalarPool) else ScalarPool(workers, progress=progress)
        )

    def _shuffle(self) -> np.ndarray:
        """A secret random order of this party's ids (4 bytes per id below 2^31 ids)."""
        return self._rng.permutation(len(self.ids)).astype(position_dtype(len(self.ids)))

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
        expected = (
            ("session id", self.session_id, message.session),
            ("mode", self.mode, message.mode),
        )
        for field, value, found in expected:
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
            "session": self.session_id,
            "mode": self.mode,
        }


class RequesterSession(_Session):
    """A's side of one session: streams its masked ids (:meth:`requests`), takes B's response
    to each of its messages (:meth:`receive`), asks for the rest of B's stream
    (:meth:`next_request`) and learns the intersection (or its size) from the last response.

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
        progress: Callable[[int], object] | None = None,
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
            progress=progress,
        )
        self.chunks = max(1, math.ceil(len(ids) / self.chunk_size))
        """Request chunks this party sends (one, empty, for no ids)."""
        self._order: np.ndarray | None = None
        self._sent = 0
        self._answered = 0
        self._peer_received = 0
        self._responses = 0
        self._own_total: int | None = None
        self._own_received = 0
        self._mine = DigestIndex(len(ids))
        self._theirs = DigestIndex(0)
        self.result: PsiResult | None = None
        self._peer_positions: np.ndarray | None = None

    @property
    def responses(self) -> int:
        """Responses received so far: the batch id of the next one."""
        return self._responses

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

    def next_request(self) -> PsiNext:
        """Step 2, after the last request chunk and before the result: ask B for its next
        response."""
        if self._sent < self.chunks or self.result is not None:
            raise ProtocolError(
                f"{self.name}: a {PsiNext.kind} only between the last request chunk and the "
                f"result; {self._sent} of {self.chunks} chunks sent, result "
                f"{'in' if self.result is not None else 'not in'}."
            )
        return PsiNext(**self._header(ROUND_RESPONSE, self._responses))  # type: ignore[arg-type]

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
        theirs_index = self._theirs if self._own_total is not None else DigestIndex(own_total)
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
        self._mine = self._theirs = DigestIndex(0)
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


class ResponderSession(_Session):
    """B's side of one session: answers each of A's messages with exactly one response, its
    doubly masked points and, interleaved, its own masked ids (:meth:`respond` to a request
    chunk, :meth:`answer` to a :class:`PsiNext`); learns its aligned rows from A's matches
    (:meth:`receive_matches`).

    ``chunk_size``: own points per response message. ``workers``: as for
    :class:`RequesterSession` (an own pool is stopped after the last response).
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
        progress: Callable[[int], object] | None = None,
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
            progress=progress,
        )
        self._own_order: np.ndarray | None = None
        self._own_chunks = math.ceil(len(ids) / self.chunk_size)
        self._own_sent = 0
        self._peer_total: int | None = None
        self._peer_received = 0
        self._peer_chunks: list[int] = []
        self._requests_done = False
        self._seen = DigestIndex(0)
        # Cardinality mode: A's doubly masked points, kept until they are all shuffled and sent
        # back, and how many of A's chunks' worth went back so far.
        self._doubled: np.ndarray | None = None
        self._doubled_sent = 0
        self._doubled_offset = 0
        self._responses = 0
        self.rows: np.ndarray | None = None
        """What B learns from A's matches: its row of each aligned sample, -1 where absent."""

    def respond(self, request: PsiRequest) -> PsiResponse:
        """Step 2, one request chunk: ``b·(a·H(x))`` for its points (in cardinality mode none
        until A's last chunk, then the first chunk's worth of all of them, shuffled) and the next
        chunk of own ``b·H(y)``.

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
        seen = self._seen if self._peer_total is not None else DigestIndex(total)
        values = digests(points)
        seen.refuse_repeats(values, where)
        doubled = self._pool.mask(self._key, points, what=where, offset=self._peer_received)
        buffer = self._doubled
        if self.mode == "cardinality" and buffer is None:
            try:  # kept whole until A's last chunk is in: the answer is shuffled over all
                buffer = np.empty(total, dtype=f"S{POINT_BYTES}")
            except (MemoryError, ValueError):  # numpy: ValueError when beyond any array
                raise ProtocolError(
                    f"{where}: a total of points this party can hold expected (cardinality mode "
                    f"keeps {POINT_BYTES} bytes of each), found {total}."
                ) from None

        last = received == total
        if self._own_order is None:
            self._own_order = self._shuffle()
        seen.add(values, self._peer_received)
        self._seen = seen if not last else DigestIndex(0)
        self._peer_total = total
        self._peer_chunks.append(points.shape[0])
        self._requests_done = last
        answer = doubled
        if buffer is not None:  # cardinality mode: answer only after a shuffle over all points
            buffer[self._peer_received : received] = doubled
            self._doubled = buffer
            if last:
                self._rng.shuffle(buffer)
            answer = self._shuffled_chunk() if last else _NO_POINTS
        self._peer_received = received
        return self._response(answer)

    def answer(self, message: PsiNext) -> PsiResponse:
        """Step 2, after A's last request chunk: the next response A asks for (the next chunk's
        worth of shuffled ``b·(a·H(x))`` in cardinality mode, and the next own chunk).

        Refused with ProtocolError, keeping this party's state, unless it is the response due
        and one is left.
        """
        self._check(message, PsiNext, ROUND_RESPONSE, self._responses)
        where = f"{message.kind} from {message.sender}"
        if not self._requests_done:
            raise ProtocolError(
                f"{where}: response {message.batch_id} asked for before A's last request chunk; "
                f"request chunk {len(self._peer_chunks)} expected."
            )
        if not self._pending():
            raise ProtocolError(
                f"{where}: response {message.batch_id} asked for, but the whole response "
                f"({self._responses} chunks) was sent."
            )
        return self._response(self._shuffled_chunk() if self._doubled is not None else _NO_POINTS)

    def _pending(self) -> bool:
        """Whether responses are left to send once A's requests are all in."""
        return self._own_sent < self._own_chunks or self._doubled is not None

    def _shuffled_chunk(self) -> np.ndarray:
        """The next chunk's worth of A's shuffled doubly masked points (cardinality mode)."""
        assert self._doubled is not None
        size = self._peer_chunks[self._doubled_sent]
        chunk = self._doubled[self._doubled_offset : self._doubled_offset + size]
        self._doubled_sent += 1
        self._doubled_offset += size
        if self._doubled_sent == len(self._peer_chunks):
            self._doubled = None
        return chunk

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
        if self._requests_done and not self._pending():
            self._done()
        return response

    def receive_matches(self, message: PsiMatchMessage) -> np.ndarray:
        """Step 4: (samples,) int64, this party's row of each aligned sample, -1 where absent
        (also kept in :attr:`rows`). Refused, keeping its state, before the whole response was
        sent or after a first matches message."""
        if self._own_order is None or not self._requests_done or self._pending():
            raise ProtocolError(
                f"{self.name}: matches only after the whole response was sent; "
                f"{self._responses} response chunks sent so far."
            )
        if self.rows is not None:
            raise ProtocolError(f"{self.name}: one matches message per session; already had.")
        self._check(message, PsiMatchMessage, ROUND_MATCHES)
        if message.samples > (self._peer_total or 0):  # aligned samples are some of A's ids
            raise ProtocolError(
                f"{message.kind} from {message.sender}: at most {self._peer_total} aligned "
                f"samples expected (its ids), found {message.samples}."
            )
        peer = message.peer_positions
        if peer.size and (peer.min() < 0 or peer.max() >= self._own_order.shape[0]):
            raise ProtocolError(
                f"{message.kind} from {message.sender}: positions in "
                f"[0, {self._own_order.shape[0]}) expected, found [{peer.min()}, {peer.max()}]."
            )
        for name, positions in (("sample", message.sample_positions), ("peer", peer)):
            if np.unique(positions).size != positions.size:
                raise ProtocolError(
                    f"{message.kind} from {message.sender}: distinct {name} positions expected "
                    "(one aligned sample per matched id), found repeats."
                )
        rows = np.full(message.samples, -1, dtype=np.int64)
        rows[message.sample_positions] = self._own_order[peer]
        self.rows = rows
        return rows
