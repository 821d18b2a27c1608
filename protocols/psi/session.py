"""One DH-PSI run in this process: a requester and a responder party on one channel."""

from __future__ import annotations

import secrets

import numpy as np

from protocols.psi.parties import PsiRequester, PsiResponder
from protocols.psi.roles import PsiResult, default_rng
from protocols.psi_kernel import CHUNK, Ids, ScalarPool
from secure_vfl.federation.channel import Channel


def fresh_session_id() -> str:
    """A new random session id (128 bits, hex) that ties a protocol run's messages together."""
    return secrets.token_hex(16)


def party_generators(rng: np.random.Generator | None, parties: int) -> list[np.random.Generator]:
    """One shuffle generator per party: independent children of ``rng`` (tests), else each
    seeded from :mod:`secrets`; no two parties share one."""
    if rng is not None:
        return rng.spawn(parties)
    return [default_rng() for _ in range(parties)]


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
    """DH-PSI between a requester party holding ``mine`` (who learns the result) and a responder
    party holding ``theirs``, connected to ``channel`` (a fresh in-process one by default; its
    transport encodes and decodes every message). The requester's program drives the run.

    ``rng`` seeds each party's own shuffle generator (tests; by default each draws a secret
    seed). ``workers`` processes (default ``os.cpu_count()``) serve both parties in turn.
    """
    session = session_id if session_id is not None else fresh_session_id()
    channel = channel if channel is not None else Channel()
    requester_rng, responder_rng = party_generators(rng, 2)
    with ScalarPool(workers) as pool:
        requester = PsiRequester(mine, rng=requester_rng, workers=pool, chunk_size=chunk_size)
        responder = PsiResponder(theirs, rng=responder_rng, workers=pool, chunk_size=chunk_size)
        requester.connect(channel)
        responder.connect(channel)
        responder.accept(requester.name, session_id=session, mode=mode, key=key_theirs)
        return requester.intersect(responder.name, session_id=session, mode=mode, key=key_mine)
