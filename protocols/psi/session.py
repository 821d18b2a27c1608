"""One DH-PSI session run in-process: both roles in this process, messages passed directly."""

from __future__ import annotations

import secrets

import numpy as np

from protocols.psi.roles import PsiRequester, PsiResponder, PsiResult
from protocols.psi_kernel import CHUNK, Ids, ScalarPool
from secure_vfl.errors import ProtocolError
from secure_vfl.federation.channel import Channel


def fresh_session_id() -> str:
    """A new random session id (128 bits, hex) that ties a protocol run's messages together."""
    return secrets.token_hex(16)


def exchange(
    requester: PsiRequester, responder: PsiResponder, channel: Channel | None = None
) -> PsiResult:
    """Run steps 1-3 between two in-process roles, chunk by chunk; every message crosses
    ``channel`` (encoded and decoded by its transport; a fresh in-process one by default)."""
    channel = channel if channel is not None else Channel()
    result: PsiResult | None = None
    for request in requester.requests():
        for response in responder.respond(channel.send(request)):
            result = requester.receive(channel.send(response))
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
    channel: Channel | None = None,
) -> PsiResult:
    """Run both roles in-process: ``mine`` is the requester (who learns the result).

    ``rng`` drives both parties' shuffles (tests; by default each has its own secret-seeded
    generator). ``workers`` processes (default ``os.cpu_count()``) serve both roles. Every
    message crosses ``channel`` (see :func:`exchange`).
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
        return exchange(requester, responder, channel)
