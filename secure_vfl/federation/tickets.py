"""Tickets: how the aggregation server tells a contribution the driver asked for from one it
did not, on arrival.

The driver asks each contributor for its representation or sealed share, and sends the server
the request for the sum, at once (a step waits once, :meth:`~secure_vfl.federation.parties.
Party.send_all`). So a share may reach the server before the request that says who contributes
to which sum, and the server could not refuse a share sent unasked: from a party the driver did
not ask, or for another round, batch or sum. Instead each request for a contribution that its
contributor sends as it is (a representation under plain sums, a sealed share under a secure
one: a representation held for sealing gets none) carries a ticket, an HMAC-SHA256 under a key
the driver sends the server once per session (:class:`~secure_vfl.federation.messages.
TicketKeyMessage`) of everything that names the contribution: its kind, session, contributor,
round, batch, phase, tag and whom the sum is for.
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
from dataclasses import dataclass

from secure_vfl.errors import ProtocolError

TICKET_KEY_BYTES = 32


def new_ticket_key() -> bytes:
    """A fresh key for one session's tickets (from the operating system: a ticket key is a
    secret, not a seeded draw)."""
    return secrets.token_bytes(TICKET_KEY_BYTES)


@dataclass(frozen=True, kw_only=True)
class Contribution:
    """What names one contribution to the aggregation server: its ``kind`` (a
    ``representation`` in the clear or a ``sealed`` share), session, contributor, round, batch,
    phase and tag, and whom its sum is for (a sealed share's receiver; ``""`` for a
    representation, summed for whoever a sum request names)."""

    kind: str
    session: str
    contributor: str
    round: int
    batch_id: int
    phase: str
    tag: str
    deliver_to: str = ""

    def ticket(self, key: bytes) -> bytes:
        """Its ticket under ``key``: what names it, in one canonical encoding (a JSON list),
        authenticated by HMAC-SHA256."""
        named = [
            self.kind,
            self.session,
            self.contributor,
            self.round,
            self.batch_id,
            self.phase,
            self.tag,
            self.deliver_to,
        ]
        return hmac.digest(key, json.dumps(named, separators=(",", ":")).encode("utf-8"), "sha256")

    def __str__(self) -> str:
        return (
            f"from {self.contributor} for round {self.round}, batch {self.batch_id} "
            f"({self.phase}), tag {self.tag!r}"
        )


class TicketCheck:
    """The server's side: the key of the driver's current session, and the check of each
    contribution's ticket against it."""

    def __init__(self) -> None:
        self._session = ""
        self._key = b""

    def learn(self, session: str, key: bytes, *, by: str) -> None:
        """Take the driver's key for ``session`` (a new session's replaces the last one's; the
        same key again is the driver resending one whose delivery it could not confirm);
        ProtocolError for another key of the same session."""
        if self._key and session == self._session:
            if hmac.compare_digest(key, self._key):
                return
            raise ProtocolError(
                f"{by}: another ticket key for session {session!r}, which has one; one key "
                "per session expected."
            )
        self._session, self._key = session, bytes(key)

    def check(self, contribution: Contribution, given: bytes, *, by: str) -> None:
        """Refuse (ProtocolError) a contribution whose ticket ``given`` is not the one the
        driver gave for exactly ``contribution``: unasked, or asked of another party, round,
        batch, phase or sum, or as the other kind."""
        what = "sealed share" if contribution.kind == "sealed" else contribution.kind
        if not self._key:
            raise ProtocolError(
                f"{by}: a {what} {contribution} before the driver's ticket key: nothing was "
                "asked for yet."
            )
        if contribution.session != self._session:
            raise ProtocolError(
                f"{by}: a {what} {contribution} of session {contribution.session!r}; the "
                f"driver's session is {self._session!r}."
            )
        if not hmac.compare_digest(contribution.ticket(self._key), given):
            raise ProtocolError(
                f"{by}: a {what} {contribution} that the driver did not ask for (its ticket is "
                "not the driver's for it: unasked, or asked of another party, round, batch or "
                "sum?); it is not kept."
            )


class TicketIssuer:
    """The driver's side: one key per session, handed to ``send_key`` (which sends it to the
    aggregation server) by the first ticket of the session, before the request that carries the
    ticket goes out. Until a send of it returns, each ticket sends it again, the same key: a send
    that failed (for another receiver of what went with it, or for the server) may or may not
    have reached the server, which takes the same key again. ``send_key(session, key, attempt)``
    gets the attempt's number (from 0), so that no two sends are the same message."""

    def __init__(self, send_key: Callable[[str, bytes, int], None]) -> None:
        self._send_key = send_key
        self._session: str | None = None  # none yet
        self._key = b""
        self._attempts = 0  # sends of the session's key so far
        self._confirmed = False

    def mint(self, contribution: Contribution) -> bytes:
        """The ticket of a contribution the driver asks for."""
        if contribution.session != self._session:
            self._session, self._key = contribution.session, new_ticket_key()
            self._attempts, self._confirmed = 0, False
        if not self._confirmed:  # the server learns it before any ticket
            attempt, self._attempts = self._attempts, self._attempts + 1
            self._send_key(contribution.session, self._key, attempt)
            self._confirmed = True
        return contribution.ticket(self._key)
