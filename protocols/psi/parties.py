"""The two parties of DH-PSI as actors (:class:`~secure_vfl.federation.parties.Party`): each owns
its ids, its shuffle generator and, per session, its own secret scalar, and reaches its peer only
through the channel it is connected to.

- :class:`PsiRequester` (A; the label party in alignment): its program, :meth:`~PsiRequester.
  intersect`, sends its request chunks, takes B's response to each from its inbox, asks for the
  rest of B's stream (``psi-next``) and learns the result; :meth:`~PsiRequester.send_matches`
  then tells B where its matched ids sit.
- :class:`PsiResponder` (B; a data party): answers each ``psi-request`` and ``psi-next`` with
  one ``psi-response`` and learns its aligned rows from ``psi-matches``
  (:meth:`~PsiResponder.aligned_rows`).

A party runs one session per peer (:class:`~protocols.psi.roles.RequesterSession`,
:class:`~protocols.psi.roles.ResponderSession`, which check every message), so the label party
runs one with each data party, under a fresh key each.

Both are replaceable roles, registered on import in
:data:`~secure_vfl.federation.parties.ROLES` as ``psi-requester`` and ``psi-responder``: an
attacker is a subclass of the side it plays (``run_psi(..., roles={"responder": NAME})``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import numpy as np

from protocols.psi.messages import PsiMatchMessage, PsiMessage, PsiNext, PsiRequest, PsiResponse
from protocols.psi.roles import (
    ROUND_RESPONSE,
    PsiResult,
    RequesterSession,
    ResponderSession,
    check_chunk_size,
    default_rng,
)
from protocols.psi_kernel import CHUNK, Ids, ScalarPool
from secure_vfl.errors import ProtocolError
from secure_vfl.federation.parties import ROLES, Party


class _PsiParty(Party):
    """What both parties hold: ids, a shuffle generator, chunking and the scalar pool.

    ``workers``: processes for the scalar multiplications (default all cores, 1 for none;
    started and stopped per session) or a :class:`ScalarPool` to share (a machine's compute: it
    keeps no state of a session), which the caller closes. ``progress`` is told the points of
    each of its sessions' own pools' tasks as they complete (a shared pool has its own).
    """

    def __init__(
        self,
        ids: Ids,
        *,
        name: str,
        rng: np.random.Generator | None,
        workers: int | ScalarPool | None,
        chunk_size: int,
        progress: Callable[[int], object] | None,
    ) -> None:
        super().__init__(name)
        self.ids = ids  # checked by each session made from them, before any message
        self.chunk_size = check_chunk_size(chunk_size)
        self._rng = rng if rng is not None else default_rng()
        self._workers = workers
        self._progress = progress

    def _settings(
        self,
        sessions: Mapping[str, object],
        peer: str,
        session_id: str,
        mode: str,
        key: bytes | None,
    ) -> dict[str, Any]:
        """The keyword arguments of a new session with ``peer``; ProtocolError if ``sessions``
        (this party's) already hold one: one session per peer."""
        if peer in sessions:
            raise ProtocolError(f"{self.name}: one session with {peer} expected; found a second.")
        return {
            "name": self.name,
            "peer": peer,
            "session_id": session_id,
            "mode": mode,
            "key": key,
            "rng": self._rng,
            "workers": self._workers,
            "chunk_size": self.chunk_size,
            "progress": self._progress,
        }


class PsiRequester(_PsiParty):
    """Party A: learns which of its ids each peer holds (or how many), one session per peer."""

    def __init__(
        self,
        ids: Ids,
        *,
        name: str = "requester",
        rng: np.random.Generator | None = None,
        workers: int | ScalarPool | None = None,
        chunk_size: int = CHUNK,
        progress: Callable[[int], object] | None = None,
    ) -> None:
        super().__init__(
            ids, name=name, rng=rng, workers=workers, chunk_size=chunk_size, progress=progress
        )
        self._sessions: dict[str, RequesterSession] = {}

    def intersect(
        self,
        peer: str,
        *,
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
    ) -> PsiResult:
        """Run a session with ``peer``: send each request chunk and take the response to it from
        the inbox, then ask for the rest of the peer's stream one response at a time, so that
        no more than one response waits; return what this party learns.

        ``key``: this party's secret scalar for the session (default: a fresh one). Raises
        ProtocolError/IntegrityError on a message its session refuses.
        """
        settings = self._settings(self._sessions, peer, session_id, mode, key)
        session = RequesterSession(self.ids, **settings)
        self._sessions[peer] = session
        for request in session.requests():
            self._ask(session, request)
        while session.result is None:
            self._ask(session, session.next_request())
        return session.result

    def _ask(self, session: RequesterSession, request: PsiMessage) -> None:
        """Send ``request`` to the session's peer and take its response in."""
        self.expect(
            PsiResponse.kind,
            senders=[session.peer],
            round=ROUND_RESPONSE,
            batch_id=session.responses,
        )
        self.send(request)
        session.receive(self._response(session))

    def _response(self, session: RequesterSession) -> PsiResponse:
        """The peer's response to this party's last message, from the inbox (which keeps only
        the response each message asked for: :meth:`_ask`); ProtocolError if it is missing."""
        message = self.take(
            PsiResponse.kind, sender=session.peer, round=ROUND_RESPONSE, batch_id=session.responses
        )
        return cast(PsiResponse, message)  # the session checks its class

    def send_matches(self, peer: str, sample_of: np.ndarray, samples: int) -> None:
        """Step 4 (alignment): tell ``peer`` where its matched ids sit among ``samples`` aligned
        samples; ``sample_of`` (n_A,) int64 is the sample of each of this party's ids, -1 if
        none."""
        session = self._sessions.get(peer)
        if session is None:
            raise ProtocolError(
                f"{self.name}: matches for {peer}, but it ran no session with it (sessions with "
                f"{sorted(self._sessions) or 'none'})."
            )
        self.send(session.matches(sample_of, samples))


class PsiResponder(_PsiParty):
    """Party B: answers the sessions it accepted, one response per message of its peer."""

    def __init__(
        self,
        ids: Ids,
        *,
        name: str = "responder",
        rng: np.random.Generator | None = None,
        workers: int | ScalarPool | None = None,
        chunk_size: int = CHUNK,
        progress: Callable[[int], object] | None = None,
    ) -> None:
        super().__init__(
            ids, name=name, rng=rng, workers=workers, chunk_size=chunk_size, progress=progress
        )
        self._sessions: dict[str, ResponderSession] = {}

    def accept(
        self,
        peer: str,
        *,
        session_id: str,
        mode: str = "intersection",
        key: bytes | None = None,
    ) -> None:
        """Agree to a session with ``peer`` (its id and mode are agreed beforehand); then answer
        its messages as they come. ``key``: as for :meth:`PsiRequester.intersect`."""
        settings = self._settings(self._sessions, peer, session_id, mode, key)
        self._sessions[peer] = ResponderSession(self.ids, **settings)

    def on_psi_request(self, request: PsiRequest) -> None:
        self.send(self._session(request).respond(request))

    def on_psi_next(self, message: PsiNext) -> None:
        self.send(self._session(message).answer(message))

    def on_psi_matches(self, message: PsiMatchMessage) -> None:
        self._session(message).receive_matches(message)

    def aligned_rows(self, peer: str) -> np.ndarray:
        """What this party learnt from ``peer``'s matches: (samples,) int64, its row of each
        aligned sample, -1 where it holds none."""
        session = self._sessions.get(peer)
        if session is None or session.rows is None:
            raise ProtocolError(f"{self.name}: matches from {peer} expected, found none.")
        return session.rows

    def _session(self, message: PsiMessage) -> ResponderSession:
        session = self._sessions.get(message.sender)
        if session is None:
            raise ProtocolError(
                f"{self.name}: a {message.kind} from {message.sender}, but it accepted no "
                f"session with it (sessions with {sorted(self._sessions) or 'none'})."
            )
        return session


ROLES.register("psi-requester", PsiRequester)
ROLES.register("psi-responder", PsiResponder)
