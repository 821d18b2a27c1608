"""One DH-PSI session run in-process: both roles in this process, messages passed directly."""

from __future__ import annotations

import secrets

import numpy as np

from protocols.psi.messages import PsiMessage
from protocols.psi.roles import PsiRequester, PsiResponder, PsiResult
from protocols.psi_kernel import CHUNK, Ids, ScalarPool
from secure_vfl.errors import ProtocolError


def fresh_session_id() -> str:
    """A new random session id (128 bits, hex) that ties a protocol run's messages together."""
    return secrets.token_hex(16)


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
