"""The aggregation seam: sums of party contributions, delivered only to the party entitled to them.

A head (the receiver) asks for ``T`` sums per batch row: ``selection[t, b, k]`` says whether party
``k``'s representation of row ``b`` enters sum ``t``. Two kinds of backend serve those sums
(:data:`SumBackend`): an :class:`Aggregator` that the aggregation server runs whole on the
representations it receives in the clear (:class:`PlainAggregator`), or a :class:`SealingScheme`
from the privacy layer (pairwise masks, Paillier, CKKS) split at the party boundary: each
contributor seals its own share, the server adds sealed shares, the receiver opens the sum. No
learning algorithm changes either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from secure_vfl.errors import IntegrityError, ProtocolError
from secure_vfl.federation.messages import (
    AGGREGATOR,
    KeyRequest,
    PublicKeyMessage,
    RepresentationMessage,
    SealedSumMessage,
    SumMessage,
)

logger = logging.getLogger(__name__)


@dataclass
class AggregationCost:
    """What an aggregator's calls cost in seconds; its bytes are the messages it receives and
    sends, counted by the transport they cross."""

    seconds: float = 0.0
    calls: int = 0

    @contextmanager
    def timed(self) -> Iterator[None]:
        """Count the seconds spent inside the block as one call."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


class Aggregator(Protocol):
    """Turns the representations of a batch into per-task sums for one receiver, inside the
    aggregation server, which therefore sees them (plain sums, or a stand-in in tests).

    ``cost`` accumulates the seconds of every call (see :class:`AggregationCost`).
    """

    cost: AggregationCost

    def combine(
        self,
        contributions: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        parties: Sequence[str],
        receiver: str,
        round: int,
        batch_id: int,
        tag: str = "",
    ) -> SumMessage:
        """Sum ``contributions`` as ``selection`` (T, B, K) asks; ``parties`` names columns;
        ``(receiver, round, batch_id, tag)`` names the call."""
        ...


class SenderHalf(Protocol):
    """The sending half of a secure sum, inside one contributing party: it holds that party's
    secret keys (if its scheme has any) and seals the party's values into the sums it enters.
    ``max_key_bytes`` is the most bytes a public key it takes can have."""

    seconds: float
    max_key_bytes: int

    def public_key(self) -> bytes | None:
        """What this party announces to the other contributors (None: nothing)."""
        ...

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """A public key announced by ``peer`` as a contributor (``"sender"``) or a receiver."""
        ...

    def seal(
        self,
        values: np.ndarray,
        selection: np.ndarray,
        *,
        column: int,
        parties: Sequence[str],
        receiver: str,
        context: bytes,
    ) -> tuple[bytes, ...]:
        """Seal ``values`` (B, d) float32, zeros where absent, into the sums where
        ``selection[t, b, column]`` is set, for ``receiver``; ``context`` is unique per sum."""
        ...


class AdderHalf(Protocol):
    """The adding half, inside the aggregation server: it combines sealed contributions
    without any secret key. ``max_key_bytes`` is the most bytes a public key it takes can have."""

    seconds: float
    max_key_bytes: int

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """A receiver's public key (Paillier modulus, CKKS public context), if it needs one."""
        ...

    def add(
        self,
        payloads: Mapping[str, tuple[bytes, ...]],
        *,
        receiver: str,
        shape: tuple[int, int, int],
        parties: int,
        selection: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[bytes, ...]:
        """The sealed (T, B, d) sums of the contributors' ``payloads`` for ``receiver``;
        ``selection[name]`` (T, B) bool, the sums each contributor enters (public: a half may
        check a payload's layout against it; None: not checked)."""
        ...

    def check(
        self,
        payload: tuple[bytes, ...],
        *,
        sender: str,
        receiver: str,
        shape: tuple[int, int, int],
        parties: int,
        selection: np.ndarray | None = None,
    ) -> None:
        """Refuse (ProtocolError, IntegrityError) ``sender``'s ``payload`` if :meth:`add` could
        not add it into the (T, B, d) sums of ``parties`` for ``receiver`` that ``selection``
        (T, B) says it enters: the wrong number of items, items of the wrong size, or that do
        not parse. The server checks each share on its own before it keeps it, so a refusal
        names that share's sender."""
        ...


@dataclass(frozen=True)
class SumMembers:
    """Which sealed sums a receiver opens and who is counted in them: ``selection[t, b, k]``
    says that ``parties[k]``'s share entered sum ``(t, b)`` (the aggregator added it), for
    ``receiver`` under ``context`` (:func:`sum_context`). A scheme whose shares carry a
    per-contributor secret the receiver removes (pairwise masks' self-masks) needs all of it;
    the others read only :attr:`counts`."""

    selection: np.ndarray
    parties: tuple[str, ...]
    receiver: str
    context: bytes

    def __post_init__(self) -> None:
        if self.selection.ndim != 3 or self.selection.shape[2] != len(self.parties):
            raise ProtocolError(
                f"a (T, B, {len(self.parties)}) selection of the sums' members expected, "
                f"found shape {tuple(self.selection.shape)}."
            )

    @property
    def counts(self) -> np.ndarray:
        """(T, B) int64: how many contributors entered each sum."""
        return self.selection.sum(axis=-1, dtype=np.int64)


class ReceiverHalf(Protocol):
    """The opening half, inside the party the sums are for: it holds the secret key (if its
    scheme has one) and turns the sealed sums into float sums. ``max_key_bytes`` is the most
    bytes a public key it takes can have."""

    seconds: float
    max_key_bytes: int

    def public_key(self) -> bytes | None:
        """What this receiver announces to contributors and the aggregator (None: nothing)."""
        ...

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """A public key announced by contributor ``peer`` (``"sender"``), if it needs one."""
        ...

    def open(self, payload: tuple[bytes, ...], *, members: SumMembers, width: int) -> np.ndarray:
        """The float32 (T, B, width) sums over ``members``."""
        ...


@runtime_checkable
class SealingScheme(Protocol):
    """A secure-sum backend that can run split at the party boundary: a factory of its three
    halves, each with fresh keys of its own (made inside the party that will hold it)."""

    scheme: str

    def sender(self) -> SenderHalf: ...

    def adder(self) -> AdderHalf: ...

    def receiver(self) -> ReceiverHalf: ...


SumBackend: TypeAlias = Aggregator | SealingScheme
"""What a run sums through: an :class:`Aggregator` the aggregation server runs whole (plain
sums), or a :class:`SealingScheme` whose halves are made inside the parties that hold them."""


def sum_context(session: str, receiver: str, round: int, batch_id: int, tag: str) -> bytes:
    """The unambiguous bytes naming one secure sum: every sealing binds to them (masks are
    derived from them), and a party seals each context at most once."""
    parts = [session.encode(), receiver.encode(), tag.encode()]
    return b"".join(len(p).to_bytes(4, "big") + p for p in parts) + b"".join(
        v.to_bytes(8, "big") for v in (round, batch_id)
    )


def sum_members(message: SealedSumMessage) -> SumMembers:
    """The members of the sealed sums ``message`` carries, for its receiver and context."""
    return SumMembers(
        selection=message.selection.numpy(),
        parties=message.parties,
        receiver=message.receiver,
        context=sum_context(
            message.session, message.receiver, message.round, message.batch_id, message.tag
        ),
    )


SKIPPED = b""
"""An item of a sealed payload (a ciphertext) that holds none of its sender's values: which
items those are follows from the public selection (:func:`entered_items`), so a sender leaves
them empty instead of encrypting zeros, the adder adds them as nothing, and an item of sums
nobody entered comes back empty."""


def entered_items(entered: np.ndarray, width: int, per_item: int) -> np.ndarray:
    """Which items of a sealed (T, B, ``width``) layout, ``per_item`` values to an item in C
    order, hold a value of a (T, B) sum that ``entered`` flags (a contributor's selection
    column; or the sums with members, counts > 0): (items,) bool."""
    filled = np.repeat(np.asarray(entered, dtype=bool).reshape(-1), width)
    count = -(-filled.size // per_item)
    padded = np.zeros(count * per_item, dtype=bool)
    padded[: filled.size] = filled
    return np.asarray(padded.reshape(count, per_item).any(axis=1))


def check_skipped(payload: Sequence[bytes], entered: np.ndarray, who: str) -> None:
    """Refuse (IntegrityError) a payload whose empty items (:data:`SKIPPED`) are not exactly
    those ``entered`` (items,) leaves out: an empty one where values go (a term missing from
    sums that count it), or a full one where none do (it would add to sums it is not in)."""
    for i, (item, filled) in enumerate(zip(payload, entered, strict=True)):
        if (item == SKIPPED) == bool(filled):
            found = "it empty" if filled else f"{len(item)} bytes"
            expected = (
                "one of its values (its selection enters sums there)"
                if filled
                else "an empty one (no sum it enters has a value there)"
            )
            raise IntegrityError(f"{who}: item {i}: {expected} expected, found {found}.")


def check_payload(payload: tuple[bytes, ...], *, count: int, size: int | None, who: str) -> None:
    """Refuse a sealed payload of the wrong number of items, or of items of the wrong size."""
    if len(payload) != count:
        raise ProtocolError(f"{who}: {count} sealed items expected, found {len(payload)}.")
    if size is not None:
        for item in payload:
            if len(item) != size:
                raise ProtocolError(
                    f"{who}: sealed items of {size} bytes expected, found {len(item)}."
                )


def dense_representations(
    contributions: Sequence[RepresentationMessage], parties: Sequence[str], batch_size: int
) -> tuple[Tensor, Tensor]:
    """Stack contributions into (K, B, d), zeros where absent, and a (B, K) presence mask."""
    if not contributions:
        raise ProtocolError("an aggregation needs at least one contribution, found none.")
    column = {name: k for k, name in enumerate(parties)}
    dim = contributions[0].representation.shape[1]
    dense = torch.zeros(len(parties), batch_size, dim)
    present = torch.zeros(batch_size, len(parties), dtype=torch.bool)
    for message in contributions:
        if message.sender not in column:
            raise ProtocolError(
                f"representation from unknown party {message.sender!r}; expected one of {parties}."
            )
        if message.representation.shape[1] != dim:
            raise ProtocolError(
                f"representation from {message.sender}: width {dim} expected, "
                f"found {message.representation.shape[1]}."
            )
        k = column[message.sender]
        if bool(present[:, k].any()):
            raise ProtocolError(f"two representations from {message.sender} in one batch.")
        if message.positions.numel() and int(message.positions.max()) >= batch_size:
            raise ProtocolError(
                f"representation from {message.sender}: positions must be < {batch_size}, "
                f"found {int(message.positions.max())}."
            )
        dense[k, message.positions] = message.representation
        present[message.positions, k] = True
    return dense, present


def check_selection(selection: Tensor, present: Tensor) -> None:
    """Refuse a selection that asks for a representation nobody sent."""
    if selection.dtype != torch.bool or selection.dim() != 3:
        raise ProtocolError(
            f"selection must be a 3-d bool tensor (tasks, batch, parties), "
            f"found {selection.dim()}-d {selection.dtype}."
        )
    if tuple(selection.shape[1:]) != tuple(present.shape):
        raise ProtocolError(
            f"selection of shape (T, {present.shape[0]}, {present.shape[1]}) expected, "
            f"found {tuple(selection.shape)}."
        )
    if bool((selection & ~present.unsqueeze(0)).any()):
        raise ProtocolError("selection asks for a representation that its party did not send.")


class PlainAggregator:
    """Sums in the clear. Insecure: whoever runs it sees every party's representation.

    Its bytes are the plain messages themselves, counted by the transport they cross.
    """

    def __init__(self) -> None:
        self.cost = AggregationCost()

    def combine(
        self,
        contributions: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        parties: Sequence[str],
        receiver: str,
        round: int,
        batch_id: int,
        tag: str = "",
    ) -> SumMessage:
        with self.cost.timed():
            dense, present = dense_representations(contributions, parties, selection.shape[1])
            check_selection(selection, present)
            sums = torch.einsum("tbk,kbd->tbd", selection.to(dense.dtype), dense)
            result = SumMessage(
                sender=AGGREGATOR,
                receiver=receiver,
                round=round,
                batch_id=batch_id,
                sums=sums,
                counts=selection.sum(dim=2),
            )
        return result


def lone_contributors(selection: Tensor, receiver: int | None) -> Tensor:
    """(T, B, K) bool: the contributor of each sum ``(t, b)`` that is its only one besides the
    receiver (column ``receiver``, or none): the term that sum would hand the receiver."""
    others = selection
    if receiver is not None:
        others = selection.clone()
        others[..., receiver] = False
    single = others.sum(dim=2, keepdim=True) == 1
    return others & single


def refuse_single_contributors(
    released: Tensor,
    parties: Sequence[str],
    *,
    receiver: str | None = None,
    dp_rows: Tensor | None = None,
) -> Tensor:
    """The contributor count of every released sum; refuse any sum that reveals one party.

    A secure backend promises the receiver learns only sums over >= 2 contributors *besides
    itself*: a receiver that is also a contributor (LASER's label party holds a feature block)
    knows its own term, so the sum of its own and one other party's representation would hand
    it the other one. Sums with no other contributor (the receiver's own term alone) are fine,
    and so is one whose lone other contributor sends that row as a DP release (``dp_rows``
    (B, K): clipped and noised inside that party, priced by its accountant).
    """
    column = list(parties).index(receiver) if receiver is not None and receiver in parties else None
    lone = lone_contributors(released, column)
    if dp_rows is not None:
        lone = lone & ~dp_rows.unsqueeze(0)
    single = lone.any(dim=2)
    if bool(single.any()):
        t, b = (int(i) for i in torch.nonzero(single)[0])
        raise ProtocolError(
            f"a sum reveals a single party's representation to {receiver or 'the receiver'}: "
            f"every released sum needs 0 or >= 2 contributors besides the receiver (or its lone "
            f"other contributor's row sent as a DP release), found {int(single.sum())} sums "
            f"with one (first: task {t}, row {b}, party "
            f"{parties[int(torch.nonzero(lone[t, b])[0])]})."
        )
    return released.sum(dim=2)


class ContextLedger:
    """The (receiver, round, batch id, tag) contexts a party has sealed, or the aggregation
    server has added, in a secure sum: each once."""

    def __init__(self) -> None:
        self._served: set[tuple[str, int, int, str]] = set()

    def check(
        self, receiver: str, round: int, batch_id: int, tag: str
    ) -> tuple[str, int, int, str]:
        """Refuse a context served before; return it for :meth:`spend`."""
        context = (receiver, round, batch_id, tag)
        if context in self._served:
            raise ProtocolError(
                f"receiver {receiver!r}, round {round}, batch {batch_id}, tag {tag!r} was "
                "already served in this session; a fresh context is expected for every sum."
            )
        return context

    def spend(self, context: tuple[str, int, int, str]) -> None:
        """Mark ``context`` as served (call once every check has passed)."""
        self._served.add(context)


_Learners = Sequence["SenderHalf | ReceiverHalf | AdderHalf"]
MAX_EARLY_SESSIONS = 2
"""Of how many key sessions not opened yet a party keeps a sender's keys (one of each role a
session): a session's keys can reach it before its key request, and a set-up that lost a party
runs again in a new session, whose keys can come before either request."""


class KeySessions:
    """The key set-up sessions a party has taken part in, newest last: it takes public keys of
    the newest only. Only the driver opens a session, by a key request (the label party, when
    the run starts and when a lost party rejoins: its new keys, every sum context new); a key of
    an earlier session is then a replay (e.g. the rejoined party's key from before it was lost),
    refused before it replaces a newer one. A key of a session not opened yet waits for its
    key request (keys of a new session can reach a party before its own request), each sender's
    kept within bounds of their own: a key no driver opens a session for changes nothing, and a
    sender's such keys crowd out no other's."""

    def __init__(self) -> None:
        self._seen: list[str] = []
        self._keys: dict[tuple[str, str], bytes] = {}  # the newest session's, by sender, role
        # Who announces a key of each role in the newest session (its key request's members),
        # and the round and batch id its key request (so each key, its answer) carries.
        self._members: dict[str, frozenset[str]] = {}
        self._request: tuple[int, int] = (0, 0)
        self._early: list[tuple[PublicKeyMessage, _Learners]] = []

    def _refuse_replay(self, session: str, what: str) -> None:
        if session in self._seen[:-1]:
            raise ProtocolError(
                f"{what} of key session {session!r}, which a newer session replaced; a key of "
                "the newest session only is taken (a replay?)."
            )

    def open(self, owner: str, request: KeyRequest) -> None:
        """Enter the session of the driver's key ``request`` (ProtocolError if a newer one was
        opened since), whose contributors announce sender keys and whose receivers receiver
        keys, and take the keys of it that came before the request."""
        session = request.session
        self._refuse_replay(session, f"{owner}: a key request")
        if self._seen and self._seen[-1] == session:
            return
        self._seen.append(session)
        self._keys = {}
        self._members = {
            "sender": frozenset(request.contributors),
            "receiver": frozenset(request.receivers),
        }
        self._request = (request.round, request.batch_id)
        early, self._early = self._early, []
        for message, learners in early:
            if message.session == session:
                try:
                    self.take_key(owner, message, learners)
                except ProtocolError as error:  # its sender was answered before: say it here
                    logger.warning("%s (taken once its key request came)", error)

    def take_key(self, owner: str, message: PublicKeyMessage, learners: _Learners) -> None:
        """Hand ``message``'s key to ``owner``'s ``learners`` (its halves, each of which refuses
        a key it cannot use before it takes it) if its session is the newest opened and its
        sender announced no other key of it (a key replaced within a session would leave the
        masks of the sums sealed before it uncancelled); keep it for its session's opening if
        that has not come (:meth:`_keep_early`)."""
        what = f"{owner}: a key from {message.sender}"
        self._refuse_replay(message.session, what)
        if not self._seen or self._seen[-1] != message.session:
            self._keep_early(what, message, learners)
            return
        if (message.round, message.batch_id) != self._request:
            round, batch_id = self._request
            raise ProtocolError(
                f"{what} for round {message.round}, batch {message.batch_id}; the key request "
                f"of session {message.session!r} was for round {round}, batch {batch_id}, "
                "which its keys answer."
            )
        members = self._members.get(message.role, frozenset())
        if message.sender not in members:
            group = "contributors" if message.role == "sender" else "receivers"
            raise ProtocolError(
                f"{what}: a {message.role} key, but the {group} of key session "
                f"{message.session!r} are {sorted(members)} (the driver's key request); a "
                f"{message.role} key of any other party is not taken."
            )
        held = (message.sender, message.role)
        if self._keys.get(held, message.key) != message.key:
            raise ProtocolError(
                f"{what}: a second, different {message.role} key of key session "
                f"{message.session!r}; a party announces its key once a session."
            )
        for half in learners:
            half.learn(message.sender, message.role, message.key)
        self._keys[held] = message.key

    def _keep_early(self, what: str, message: PublicKeyMessage, learners: _Learners) -> None:
        """Keep a key of a session not opened yet, within bounds a sender cannot stretch: no
        larger than the scheme's public keys, one of each role a session, and of at most
        :data:`MAX_EARLY_SESSIONS` sessions a sender (so no peer crowds out another's)."""
        session = f"key session {message.session!r}, which no key request opened yet"
        most = max((half.max_key_bytes for half in learners), default=0)
        if len(message.key) > most:
            raise ProtocolError(
                f"{what} of {session}: a {message.role} key of at most {most} bytes expected "
                f"(this run's scheme), found {len(message.key)}."
            )
        kept = [m for m, _ in self._early if m.sender == message.sender]
        if any((m.session, m.role) == (message.session, message.role) for m in kept):
            raise ProtocolError(
                f"{what}: a second {message.role} key of {session}; a party announces its key "
                "once a session."
            )
        sessions = {m.session for m in kept}
        if message.session not in sessions and len(sessions) >= MAX_EARLY_SESSIONS:
            raise ProtocolError(
                f"{what} of {session}: keys of at most {MAX_EARLY_SESSIONS} such sessions are "
                f"kept from one sender, found {message.sender}'s keys of {len(sessions)} "
                "already (a party announces keys of a session once its key request came)."
            )
        self._early.append((message, learners))
