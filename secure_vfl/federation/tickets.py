"""Tickets: how the aggregation server tells a contribution the driver asked for from one it
did not, on arrival.

The driver asks each contributor for its representation or sealed share, and sends the server
the request for the sum, at once (a step waits once, :meth:`~secure_vfl.federation.parties.
Party.send_all`). So a share may reach the server before the request that says who contributes
to which sum, and the server could not refuse a share sent unasked: from a party the driver did
not ask, or for another round, batch or sum. Instead each request for a contribution carries a
ticket, an HMAC-SHA256 under a key the driver sends the server once per session
(:class:`~secure_vfl.federation.messages.TicketKeyMessage`) of everything that names the
contribution: the session, the contributor, round, batch, phase, tag and whom the sum is for.
The contributor copies the ticket into its contribution, and the server recomputes it. A
contributor learns only the tickets of its own contributions, so it cannot make one for another
party, round or sum; the key never reaches a contributor. The key protects no data: it says only
which contributions the driver asked for, to the server, which holds no other secret.
"""

from __future__ import annotations

import hmac
import json
import secrets
from collections.abc import Callable

from secure_vfl.errors import ProtocolError

TICKET_KEY_BYTES = 32
TICKET_BYTES = 32  # an HMAC-SHA256


def new_ticket_key() -> bytes:
    """A fresh key for one session's tickets (from the operating system: a ticket key is a
    secret, not a seeded draw)."""
    return secrets.token_bytes(TICKET_KEY_BYTES)


def ticket(
    key: bytes,
    *,
    session: str,
    contributor: str,
    round: int,
    batch_id: int,
    phase: str,
    tag: str,
    deliver_to: str = "",
) -> bytes:
    """The ticket of one contribution: what names it, in one canonical encoding (a JSON list),
    authenticated under ``key``."""
    named = [session, contributor, round, batch_id, phase, tag, deliver_to]
    return hmac.digest(key, json.dumps(named, separators=(",", ":")).encode("utf-8"), "sha256")


class TicketCheck:
    """The server's side: the key of the driver's current session, and the check of each
    contribution's ticket against it."""

    def __init__(self) -> None:
        self._session = ""
        self._key = b""

    def learn(self, session: str, key: bytes, *, by: str) -> None:
        """Take the driver's key for ``session`` (a new session's replaces the last one's);
        ProtocolError for a second key of the same session."""
        if self._key and session == self._session:
            raise ProtocolError(
                f"{by}: a second ticket key for session {session!r} (a replay?); one per "
                "session expected."
            )
        self._session, self._key = session, bytes(key)

    def check(
        self,
        *,
        by: str,
        what: str,
        session: str,
        contributor: str,
        round: int,
        batch_id: int,
        phase: str,
        tag: str,
        given: bytes,
        deliver_to: str = "",
    ) -> None:
        """Refuse (ProtocolError) a contribution whose ticket is not the one the driver gave
        for exactly it: unasked, or asked of another party, round, batch, phase or sum."""
        named = (
            f"{what} from {contributor} for round {round}, batch {batch_id} ({phase}), tag {tag!r}"
        )
        if not self._key:
            raise ProtocolError(
                f"{by}: a {named} before the driver's ticket key: nothing was asked for yet."
            )
        if session != self._session:
            raise ProtocolError(
                f"{by}: a {named} of session {session!r}; the driver's session is "
                f"{self._session!r}."
            )
        expected = ticket(
            self._key,
            session=session,
            contributor=contributor,
            round=round,
            batch_id=batch_id,
            phase=phase,
            tag=tag,
            deliver_to=deliver_to,
        )
        if not hmac.compare_digest(expected, given):
            raise ProtocolError(
                f"{by}: a {named} that the driver did not ask for (its ticket is not the "
                "driver's for it: unasked, or asked of another party, round, batch or sum?); "
                "it is not kept."
            )


class TicketIssuer:
    """The driver's side: one key per session, handed to ``send_key`` (which sends it to the
    aggregation server and returns once the server has it) by the first ticket of the session,
    before the request that carries the ticket goes out."""

    def __init__(self, send_key: Callable[[str, bytes], None]) -> None:
        self._send_key = send_key
        self._session: str | None = None  # none yet
        self._key = b""

    def mint(
        self,
        *,
        session: str,
        contributor: str,
        round: int,
        batch_id: int,
        phase: str,
        tag: str,
        deliver_to: str = "",
    ) -> bytes:
        """The ticket of one contribution the driver asks for (:func:`ticket`)."""
        if session != self._session:
            key = new_ticket_key()
            self._send_key(session, key)  # the server learns it before any ticket is used
            self._session, self._key = session, key
        return ticket(
            self._key,
            session=session,
            contributor=contributor,
            round=round,
            batch_id=batch_id,
            phase=phase,
            tag=tag,
            deliver_to=deliver_to,
        )
