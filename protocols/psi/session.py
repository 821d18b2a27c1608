"""One DH-PSI run in this process: a requester and a responder party on one channel."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping
from typing import TypeVar

import numpy as np

from protocols.psi.parties import PsiRequester, PsiResponder
from protocols.psi.roles import PsiResult, default_rng
from protocols.psi_kernel import CHUNK, Ids, ScalarPool
from secure_vfl.errors import ConfigError
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import ROLES, Party

REQUESTER = "requester"
RESPONDER = "responder"
P = TypeVar("P", bound=Party)


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
    roles: Mapping[str, str] | None = None,
    progress: Callable[[int], object] | None = None,
) -> PsiResult:
    """DH-PSI between a requester party holding ``mine`` (who learns the result) and a responder
    party holding ``theirs``, connected to ``channel`` (a fresh in-process one by default; its
    transport encodes and decodes every message). The requester's program drives the run.

    ``rng`` seeds each party's own shuffle generator (tests; by default each draws a secret
    seed). ``workers`` processes (default ``os.cpu_count()``) serve both parties in turn.
    ``roles`` replaces a party (``"requester"``, ``"responder"``) by the role registered under a
    name in :data:`~secure_vfl.federation.parties.ROLES` (an attacker is a subclass of the side
    it plays: ``psi-requester``, ``psi-responder``): ``{"responder": "my-curious-responder"}``.
    ``progress`` is called with the points of each masking task as it completes,
    ``2 * (len(mine) + len(theirs))`` in all (:class:`~protocols.psi_kernel.ScalarPool`).
    """
    requester_role, responder_role = psi_roles(roles)
    session = session_id if session_id is not None else fresh_session_id()
    channel = channel if channel is not None else Channel()
    requester_rng, responder_rng = party_generators(rng, 2)
    with ScalarPool(workers, progress=progress) as pool:
        requester = requester_role(mine, rng=requester_rng, workers=pool, chunk_size=chunk_size)
        responder = responder_role(theirs, rng=responder_rng, workers=pool, chunk_size=chunk_size)
        requester.connect(channel)
        responder.connect(channel)
        responder.accept(requester.name, session_id=session, mode=mode, key=key_theirs)
        return requester.intersect(responder.name, session_id=session, mode=mode, key=key_mine)


def psi_roles(roles: Mapping[str, str] | None) -> tuple[type[PsiRequester], type[PsiResponder]]:
    """The classes of the requester and the responder: the roles registered as
    ``psi-requester`` and ``psi-responder`` unless ``roles`` names others. ConfigError for a
    party that is neither side or a role that does not play its side (RegistryError for a name
    nobody registered), before any party is made."""
    roles = dict(roles or {})
    unknown = sorted(set(roles) - {REQUESTER, RESPONDER})
    if unknown:
        raise ConfigError(
            f"roles can replace the {REQUESTER} and the {RESPONDER} of a PSI run; found "
            f"{', '.join(unknown)}."
        )
    return (
        _side(REQUESTER, roles.get(REQUESTER, "psi-requester"), PsiRequester),
        _side(RESPONDER, roles.get(RESPONDER, "psi-responder"), PsiResponder),
    )


def _side(party: str, role: str, side: type[P]) -> type[P]:
    factory = ROLES.get(role)
    if not (isinstance(factory, type) and issubclass(factory, side)):
        raise ConfigError(
            f"the {party} of a PSI run plays a {side.__name__} (or a subclass); role {role!r} "
            f"is {getattr(factory, '__name__', repr(factory))}."
        )
    return factory
