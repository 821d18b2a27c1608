"""Party roles as actors: each organisation is one object that owns only its own state and acts
only on the messages it receives.

A :class:`Party` sends through the :class:`~secure_vfl.federation.channel.Channel` it is attached
to (the network) and receives what other parties post to it: a message kind with a handler
(``on_<kind>``) is acted on at once, any other waits in the party's inbox until its own program
takes it (:meth:`Party.take`). A message a party sends to itself (the label party's own block)
crosses no boundary and is handed over directly.

- :class:`SecureSumParty`: what every party that contributes to or receives secure sums shares:
  its own halves of the scheme, the key set-up, sealing what it keeps and opening what it is
  owed. :class:`DataParty` and the imputation clients and coordinator build on it.
- :class:`DataParty`: a feature block per split and the bottom model(s) that read it. It answers
  a :class:`RepresentRequest` with a detached :class:`RepresentationMessage`, keeps the autograd
  graph, collects the :class:`GradientMessage` s that come back and, on an
  :class:`UpdateRequest`, starts its backward pass from their sum (``representation.backward``)
  and steps its optimiser. It may also hold labels and heads (:class:`Head`): then it trains a
  head on the sums the aggregator delivers (:class:`HeadTask`) and predicts from them
  (:class:`PredictTask`).
- :class:`AggregationServer`: holds the contributions of a batch and answers a
  :class:`SumRequest` with the sums of its backend (:class:`~secure_vfl.federation.aggregator.
  Aggregator`); it holds no labels, features or models.

Roles are replaceable by name (:data:`ROLES`): an attacker is a subclass of the role it plays,
with hooks on what it sends (``outgoing``) and receives (``incoming``) and after training
(:meth:`Party.after_training`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from secure_vfl.data.party_files import PartyTable
from secure_vfl.data.party_preprocessing import PartyPreprocessing
from secure_vfl.errors import ConfigError, DivergenceError, OutOfRangeError, ProtocolError
from secure_vfl.federation import parts
from secure_vfl.federation.aggregator import (
    ContextLedger,
    KeySessions,
    PlainAggregator,
    SealingScheme,
    check_selection,
    refuse_single_contributors,
    sum_context,
    sum_members,
)
from secure_vfl.federation.messages import (
    AGGREGATOR,
    DRIVEN_KINDS,
    AbortRequest,
    GradientMessage,
    HeadTask,
    KeyRequest,
    LossMessage,
    Message,
    PredictionMessage,
    PredictTask,
    PublicKeyMessage,
    RepresentationMessage,
    RepresentRequest,
    SealedMessage,
    SealedSumMessage,
    SealRequest,
    SumMessage,
    SumRequest,
    TicketKeyMessage,
    UpdateRequest,
)
from secure_vfl.federation.parts import ClassValue
from secure_vfl.federation.tickets import Contribution, TicketCheck, TicketIssuer
from secure_vfl.registry import Registry

if TYPE_CHECKING:
    from secure_vfl.federation.aggregator import (
        AdderHalf,
        Aggregator,
        ReceiverHalf,
        SenderHalf,
        SumBackend,
    )
    from secure_vfl.federation.channel import Channel, ChannelLayer

Handler = Callable[[Any], None]
logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class ExposedRowRelease(Protocol):
    """What a party sends in place of the rows of its contribution that a secure sum cannot
    hide (a ``release="dp"`` policy, installed by the privacy layer inside the party): those
    rows clipped and noised, the release recorded by the party's own accountant."""

    def release_exposed(
        self, contribution: RepresentationMessage, exposed: Tensor
    ) -> RepresentationMessage:
        """``contribution`` with its rows where ``exposed`` (bool, one per row) is set
        replaced by their DP release; the message passed in is not mutated."""
        ...


REPLAY_WINDOW = 1024
"""How many rounds behind the newest it has taken of a kind from a sender a party still tells a
message apart from a replay; older ones are refused as replays (and forgotten, so what it keeps
stays bounded)."""

_Stream = tuple[str, str, str, str]
_Item = tuple[int, str, str, str, str]


class Receipts:
    """What a party has taken (acted on, or kept in its inbox), by each message's identity: its
    session, kind, sender and phase, round, batch id, tag, model, key role and whom a sum is
    for. A party takes each message once; a second with the same identity is a replay (or a
    sender repeating itself), refused before anything looks at it. A step the driver abandons
    is retried under a fresh batch id, and each abort has its own: the retry's messages and a
    second abort are new ones, a replay of the abandoned attempt's is not. A message it refused
    is not taken: a refusal changes nothing; one it answered before a refusal further on failed
    it is. No sender sends two messages of one identity in a run but a head its gradients
    (:data:`UNLEDGERED_KINDS`)."""

    def __init__(self) -> None:
        self._taken: dict[_Stream, dict[int, set[_Item]]] = {}
        self._newest: dict[_Stream, int] = {}

    @staticmethod
    def identity(message: Message) -> tuple[_Stream, int, _Item]:
        """What tells ``message`` apart from every other message its receiver takes."""
        get = message.__dict__.get
        stream = (message.session, message.kind, message.sender, get("phase", ""))
        item = (
            message.batch_id,
            get("tag", ""),
            get("model", ""),
            get("role", ""),
            get("deliver_to", ""),
        )
        return stream, message.round, item

    def check(self, name: str, message: Message) -> tuple[_Stream, int, _Item]:
        """Refuse ``message`` if one of its identity was taken (ProtocolError); else return its
        identity, for :meth:`take`."""
        stream, round, item = self.identity(message)
        newest = self._newest.get(stream)
        if newest is not None and round < newest - REPLAY_WINDOW:
            raise ProtocolError(
                f"{name}: a {message.kind} from {message.sender} for round {round}, batch "
                f"{item[0]}, over {REPLAY_WINDOW} rounds behind the newest it took of that kind "
                f"from that sender ({newest}): refused as a replay."
            )
        rounds = self._taken.get(stream)
        if rounds is not None and item in rounds.get(round, ()):
            tag = f", tag {item[1]!r}" if item[1] else ""
            raise ProtocolError(
                f"{name}: a second {message.kind} from {message.sender} for round {round}, "
                f"batch {item[0]}{tag} (a replay?): it takes each message once."
            )
        return stream, round, item

    def forget(self, message: Message) -> None:
        """Forget that ``message`` was taken: a message kept and refused later, once it could be
        checked (a sealed share that does not fit the request for its sum, which came after
        it), is as if it never came."""
        stream, round, item = self.identity(message)
        self._taken.get(stream, {}).get(round, set()).discard(item)

    def take(self, identity: tuple[_Stream, int, _Item]) -> None:
        """Record the message of ``identity`` (from :meth:`check`) as taken; forget the rounds
        of its stream that fall out of the window, oldest first (rounds come in order: a
        round taken out of order goes with those taken before it)."""
        stream, round, item = identity
        rounds = self._taken.get(stream)
        if rounds is None:
            rounds = self._taken[stream] = {}
        taken = rounds.get(round)
        if taken is None:
            rounds[round] = {item}
        else:
            taken.add(item)
        newest = self._newest.get(stream)
        if newest is None or round > newest:
            self._newest[stream] = round
            while True:  # ends at the latest: this round is within the window
                oldest = next(iter(rounds))
                if oldest >= round - REPLAY_WINDOW:
                    break
                del rounds[oldest]


UNLEDGERED_KINDS = frozenset({"error", "gradient"})
"""Kinds a party may take more than once with one identity: a refusal says the same for each
message it refuses, and a head trained task by task sends a party one gradient per task. A
gradient is taken only for a forward pass still open, so a replayed one after the step closed
is refused all the same."""


class Party:
    """One organisation: a name, an inbox and hooks; subclasses add state and handlers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.outgoing: list[ChannelLayer] = []
        self.incoming: list[ChannelLayer] = []
        self.hook_seconds = 0.0
        # The party's own privacy accountant, installed by the privacy layer with its
        # mechanisms (protocols.privacy): it records only this party's releases.
        self.accountant: Any = None
        self._channel: Channel | None = None
        self._inbox: list[Message] = []
        self._deferred: list[Message] = []
        self._outbox: list[Message] | None = None
        self._after: list[Message] = []
        self.receipts = Receipts()
        # The replies it asked for and has not had: (kind, sender, round, batch_id, tag or None
        # for any tag) -> how many. Its inbox keeps nothing else (:meth:`expect`).
        self._expected: dict[tuple[str, str, int, int, str | None], int] = {}
        # What it expected of attempts abandoned since (:meth:`abandon_expected`): a late
        # answer of one is dropped, neither kept nor refused.
        self._abandoned_expected: set[tuple[str, str, int, int, str | None]] = set()
        self._sends = 0  # calls of send_all: whether a handler answered before it failed
        self.driver: str | None = None
        """The party that drives its run (the label party; an imputation run's coordinator),
        the only one it takes the kinds :data:`DRIVEN_KINDS` from; None: any sender's (a party
        used on its own)."""

    def connect(self, channel: Channel) -> None:
        """Attach this party to ``channel`` (the network it sends and receives on)."""
        channel.attach(self)
        self._channel = channel

    def release(self, message: M) -> M:
        """``message`` as it leaves this party: through its outgoing hooks (DP noise, an
        attacker's tampering); ``hook_seconds`` counts their time."""
        if self.outgoing:
            start = time.perf_counter()
            for layer in self.outgoing:
                message = layer.on_message(message)
            self.hook_seconds += time.perf_counter() - start
        return message

    def send(self, message: Message) -> None:
        """Send ``message`` in this party's name, through its outgoing hooks
        (:meth:`send_all` of one message)."""
        self.send_all([message])

    def send_all(self, messages: Sequence[Message]) -> None:
        """Send ``messages``, none of which depends on another's answer, in this party's name
        and order, each through the outgoing hooks. Those to itself are acted on where they
        stand; what it sends meanwhile (acting on them) and the messages to other parties go
        out together after them, behind the messages :meth:`defer` held back, at once
        (:meth:`Channel.post_all`: over the network each receiver's messages are one
        delivery, and the receivers act concurrently); if none is for another party, the
        held-back ones wait on. Called while acting on its own message inside another
        ``send_all``, the messages join that one's."""
        self._sends += 1
        released = [self.release(message) for message in messages]
        if self._outbox is not None:
            self._queue(released)
            return
        deferred, self._deferred = self._deferred, []
        self._outbox = []
        try:
            self._queue(released)
            outgoing = self._outbox
        except BaseException:
            self._deferred = deferred + self._deferred  # they go with the next send
            raise
        finally:
            self._outbox = None
        if not outgoing:  # nothing for another party: the held-back messages wait for one
            self._deferred = deferred + self._deferred
            return
        self._post_all(deferred + outgoing)

    def _queue(self, messages: list[Message]) -> None:
        assert self._outbox is not None
        for message in messages:
            if message.receiver == self.name:
                self.receive(message)
            else:
                self._outbox.append(message)

    def defer(self, messages: Sequence[Message]) -> None:
        """Hold ``messages`` back (through the outgoing hooks now, in their order) to go first
        with this party's next :meth:`send_all`: messages whose effect nothing waits for (a
        step's closing gradients) then share a delivery with the next message to each of their
        receivers instead of taking a round trip of their own."""
        self._deferred += [self.release(message) for message in messages]

    def send_after(self, message: Message) -> None:
        """Send ``message`` (through the outgoing hooks now) once this party has acted on the
        message it is acting on, rather than before its sender's send returns: over the
        network that sender goes on while this one goes out (the aggregator's answer to the
        last contribution of a sum does not wait for the label party to train on the sum); in
        one process the channel posts it right after, in the same order as :meth:`send`, and
        its failure reaches the same sender. For a reply its receiver waits for with
        :meth:`take`."""
        self._after.append(self.release(message))

    def flush_after(self) -> None:
        """Send what :meth:`send_after` held (the channel calls this once this party has acted
        on a delivery)."""
        if self._after:
            after, self._after = self._after, []
            if self._channel is None:
                raise ProtocolError(f"{self.name} is not connected to a channel; cannot send.")
            self._channel.post_all(after, sender=self, detached=True)

    def flush(self) -> None:
        """Send the messages :meth:`defer` holds back now, at once."""
        deferred, self._deferred = self._deferred, []
        self._post_all(deferred)

    @property
    def deferred(self) -> tuple[Message, ...]:
        """The messages :meth:`defer` holds back, in order."""
        return tuple(self._deferred)

    def withdraw(self, receiver: str) -> None:
        """Forget the held-back messages to ``receiver`` (a party lost: nothing goes to it)."""
        self._deferred = [m for m in self._deferred if m.receiver != receiver]

    def _post_all(self, messages: list[Message]) -> None:
        if not messages:
            return
        if self._channel is None:
            raise ProtocolError(f"{self.name} is not connected to a channel; cannot send.")
        self._channel.post_all(messages, sender=self)

    def receive(self, message: Message) -> None:
        """Act on a message delivered to this party (its handler, or its inbox)."""
        if message.receiver != self.name:
            raise ProtocolError(
                f"{message.kind} from {message.sender} for {message.receiver!r} was delivered "
                f"to {self.name!r}."
            )
        if message.kind in DRIVEN_KINDS and self.driver not in (None, message.sender):
            raise ProtocolError(
                f"{self.name}: a {message.kind} from {message.sender}; only the run's driver, "
                f"{self.driver}, sends one."
            )
        identity = None
        if message.kind not in UNLEDGERED_KINDS:
            identity = self.receipts.check(self.name, message)
        for layer in self.incoming:
            message = layer.on_message(message)
        handler = getattr(self, "on_" + message.kind.replace("-", "_"), None)
        if handler is None:
            self.keep(message)
        else:
            sends = self._sends
            try:
                handler(message)
            except BaseException:
                # It acted, far enough to answer, before a refusal further on failed it: taken,
                # or the same message again would be acted on twice.
                if identity is not None and self._sends != sends:
                    self.receipts.take(identity)
                raise
        if identity is not None:
            self.receipts.take(identity)

    def note_accepted(self, request: Message) -> None:
        """Tell the incoming hooks that keep what a request asks for (``on_accepted``: the rows
        a privacy hook prices and journals) that this party acts on ``request``: its handler
        calls this once its checks passed, before it acts, so a request it refuses leaves no
        record there."""
        for layer in self.incoming:
            accepted = getattr(layer, "on_accepted", None)
            if accepted is not None:
                accepted(request)

    def expect(
        self,
        kind: str,
        *,
        senders: Sequence[str],
        round: int,
        batch_id: int,
        tag: str | None = None,
    ) -> None:
        """Keep a ``kind`` from each of ``senders`` for ``(round, batch_id[, tag])`` when it
        comes, for :meth:`take`: a reply this party asks for, expected before the request
        goes (in one process the reply comes before ``send`` returns). Its inbox keeps
        nothing it did not expect (:meth:`keep`)."""
        for sender in senders:
            key = (kind, sender, round, batch_id, tag)
            self._expected[key] = self._expected.get(key, 0) + 1

    def keep(self, message: Message) -> None:
        """Keep ``message`` in the inbox for :meth:`take` if this party expects it; drop it if
        it expected it of an attempt abandoned since (:meth:`abandon_expected`); else refuse it
        (ProtocolError) before anything changes: a reply nobody asked for, for another round or
        batch, or from another party than the one asked, would wait there for good."""
        key = self._expectation(message.kind, message)
        if key is None:
            if self._late(message.kind, message):
                return
            raise self._unasked(message)
        count = self._expected[key]
        if count == 1:
            del self._expected[key]
        else:
            self._expected[key] = count - 1
        self._inbox.append(message)

    def _expectation(
        self,
        kind: str,
        message: Message,
        expected: Mapping[Any, int] | set[Any] | None = None,
    ) -> tuple[str, str, int, int, str | None] | None:
        """The expectation a ``kind`` with ``message``'s header would meet among ``expected``
        (default: what it expects now; None: none)."""
        expected = self._expected if expected is None else expected
        head = (kind, message.sender, message.round, message.batch_id)
        for key in ((*head, getattr(message, "tag", "")), (*head, None)):
            if key in expected and (not isinstance(expected, Mapping) or expected[key]):
                return key
        return None

    def _late(self, kind: str, message: Message) -> bool:
        """Whether ``message`` is a late ``kind`` it expected of an attempt abandoned since (it
        is then dropped, and logged)."""
        if self._expectation(kind, message, self._abandoned_expected) is None:
            return False
        logger.info(
            "%s: a late %s from %s of the abandoned attempt at round %d, dropped",
            self.name,
            message.kind,
            message.sender,
            message.round,
        )
        return True

    def abandon_expected(self, round: int) -> None:
        """Stop expecting the answers of round ``round`` (an attempt abandoned): one that comes
        late is dropped where it arrives (over the network a sum sent after its server answered
        may come after the abort; refusing it would fail the retry's next wait), never kept in
        the inbox."""
        for key in [key for key in self._expected if key[2] == round]:
            del self._expected[key]
            self._abandoned_expected.add(key)

    def _unasked(self, message: Message) -> ProtocolError:
        tag = getattr(message, "tag", "")
        return ProtocolError(
            f"{self.name}: a {message.kind} from {message.sender} for round {message.round}, "
            f"batch {message.batch_id}{f', tag {tag!r}' if tag else ''} that it did not ask "
            "for (for another round or batch, from another party than the one asked, or of a "
            "step abandoned since?): it keeps only the replies it asked for."
        )

    def take(
        self, kind: str, *, sender: str, round: int, batch_id: int, tag: str | None = None
    ) -> Message:
        """The waiting message of ``kind`` from ``sender`` for ``(round, batch_id[, tag])``.

        In one process a message is delivered before ``send`` returns, so one that is not here
        never came: that is a protocol error, not something to wait for. Over the network a
        reply sent after its sender answered (:meth:`send_after`) may still be on its way: the
        party acts on what arrives until it is here (:meth:`Channel.wait`).
        """
        while True:
            for i, message in enumerate(self._inbox):
                if (message.kind, message.sender, message.round, message.batch_id) == (
                    kind,
                    sender,
                    round,
                    batch_id,
                ) and (tag is None or getattr(message, "tag", "") == tag):
                    return self._inbox.pop(i)
            awaiting = f"{kind} from {sender} for round {round}, batch {batch_id}"
            if self._channel is None or not self._channel.wait(awaiting):
                break
        raise ProtocolError(
            f"{self.name}: a {kind} from {sender} for round {round}, batch {batch_id}"
            f"{'' if tag is None else f', tag {tag!r}'} expected, found none (waiting: "
            f"{[(m.kind, m.sender, m.round, m.batch_id) for m in self._inbox][:5]})."
        )

    def after_training(self) -> None:
        """Called once training ends (attacks evaluate what the party learnt here)."""

    def reply_header(self, request: Message, receiver: str | None = None) -> dict[str, Any]:
        """The header of this party's answer to ``request``: to its sender (or ``receiver``),
        in the same session, round and batch."""
        return {
            "sender": self.name,
            "receiver": request.sender if receiver is None else receiver,
            "round": request.round,
            "batch_id": request.batch_id,
            "session": request.session,
        }


class Head:
    """Labels of every split and a fusion head (LASER's g_k, a split network's top model) on
    representations of ``width`` (the sums it is delivered are of that width)."""

    def __init__(
        self,
        labels: Mapping[str, Tensor],
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        width: int,
    ) -> None:
        self._labels = dict(labels)
        self.module = module
        self.optimizer = optimizer
        self.width = width

    def labels(self, split: str, rows: Tensor) -> Tensor:
        """The labels of ``rows`` of ``split``."""
        return self._labels[split][rows]

    def size(self, split: str) -> int:
        """How many rows of ``split`` it holds labels of (0 for a split it does not hold)."""
        labels = self._labels.get(split)
        return 0 if labels is None else int(labels.shape[0])

    def all_labels(self, split: str) -> Tensor:
        """A copy of every label of ``split`` (for mechanisms the label holder runs itself)."""
        return self._labels[split].clone()

    def step(self) -> None:
        """Apply and clear the accumulated gradients of the head."""
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)


class SecureSumParty(Party):
    """A party in secure sums split at the party boundary: it holds its own halves of the
    scheme (its secret keys live in them, nowhere else), announces its public keys on a
    :class:`KeyRequest`, seals what it contributes on a :class:`SealRequest` and opens the
    sealed sums it is owed (:meth:`take_sum` then acts on them as on plain sums)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        # Secure sums: this party's own halves (its secret keys live in them, nowhere else).
        self.sealer: SenderHalf | None = None
        self.opener: ReceiverHalf | None = None
        self.scheme = ""
        self._held: dict[tuple[int, int, str, str], RepresentationMessage] = {}
        self._sealed = ContextLedger()
        self._key_sessions = KeySessions()
        # The layout of each sum it asked for itself, by (round, batch id, tag): expect_sums.
        self._sum_layouts: dict[tuple[int, int, str], SumLayout] = {}
        # What it sends for rows a sum cannot hide (release="dp"; None: it refuses to).
        self.exposure: ExposedRowRelease | None = None

    # -- secure sums: key set-up, sealing what it holds, opening what it is owed -------------

    def expect_sums(self, layout: SumLayout, *, round: int, batch_id: int, tag: str) -> None:
        """Expect the sums ``tag`` of ``(round, batch_id)`` it asks the aggregation server for
        itself (:meth:`expect`), laid out as ``layout`` says: one that comes otherwise is
        refused (ProtocolError) before its key opens it or its inbox keeps it, and the
        expectation stays for the right one."""
        self.expect("sum", senders=[AGGREGATOR], round=round, batch_id=batch_id, tag=tag)
        self._sum_layouts[(round, batch_id, tag)] = layout

    def abandon_expected(self, round: int) -> None:
        super().abandon_expected(round)
        for key in [key for key in self._sum_layouts if key[0] == round]:
            del self._sum_layouts[key]

    def install(self, scheme: str, sealer: SenderHalf | None, opener: ReceiverHalf | None) -> None:
        """Take this party's halves of a secure-sum scheme (made inside it: their keys are its
        own): ``sealer`` for what it contributes, ``opener`` for the sums it is owed (a party
        that only receives sums takes no sealer)."""
        self.scheme, self.sealer, self.opener = scheme, sealer, opener

    def contribute(self, message: RepresentationMessage) -> None:
        """Send ``message`` on its way; under a secure sum, one addressed to the aggregator is
        kept instead (after this party's own hooks, e.g. its DP noise) until a
        :class:`SealRequest` says which sums to seal it into: nothing leaves in the clear."""
        if self.sealer is not None and message.receiver == AGGREGATOR:
            for stale in [k for k in self._held if k[0] < message.round]:
                del self._held[stale]
            self._held[(message.round, message.batch_id, message.phase, message.tag)] = (
                self.release(message)
            )
        else:
            self.send(message)

    def on_key_request(self, request: KeyRequest) -> None:
        if (self.sealer is None and self.opener is None) or request.scheme != self.scheme:
            raise ProtocolError(
                f"{self.name}: a key set-up for scheme {request.scheme!r}, but it runs "
                f"{self.scheme or 'no secure sum'}."
            )
        self._key_sessions.open(self.name, request)
        announced = self.sealer.public_key() if self.sealer is not None else None
        if announced is not None:
            # To the other contributors (pair masks) and to the receivers (self-masks).
            for peer in dict.fromkeys((*request.contributors, *request.receivers)):
                if peer != self.name:
                    self._announce(request, peer, "sender", announced)
                elif self.opener is not None and self.name in request.receivers:
                    self.opener.learn(self.name, "sender", announced)
        if self.name in request.receivers and self.opener is not None:
            key = self.opener.public_key()
            if key is not None:
                for peer in (*request.contributors, AGGREGATOR):
                    self._announce(request, peer, "receiver", key)

    def _announce(self, request: KeyRequest, peer: str, role: str, key: bytes) -> None:
        self.send(
            PublicKeyMessage(
                **self.reply_header(request, peer), scheme=self.scheme, role=role, key=key
            )
        )

    def on_public_key(self, message: PublicKeyMessage) -> None:
        """A contributor's key goes to both its halves (its sealer's pair masks, its opener's
        self-masks), a receiver's key to its sealer."""
        halves = [self.sealer] if message.role == "receiver" else [self.sealer, self.opener]
        learners = [half for half in halves if half is not None]
        if not learners or message.scheme != self.scheme:
            raise ProtocolError(
                f"{self.name}: a {message.scheme!r} {message.role} public key from "
                f"{message.sender}, but it runs {self.scheme or 'no secure sum'} with no half "
                f"that takes a {message.role} key."
            )
        self._key_sessions.take_key(self.name, message, learners)

    def on_seal_request(self, request: SealRequest) -> None:
        """Seal the representation kept for the request's source into the sums it asks for,
        after checking that no sum it enters would reveal it alone to the receiver."""
        if self.sealer is None or self.name not in request.parties:
            raise ProtocolError(
                f"{self.name}: asked to seal a share, but it runs no secure sum or is not among "
                f"the contributors {list(request.parties)}."
            )
        key = (request.round, request.batch_id, request.phase, request.source_tag)
        held = self._held.get(key)
        column = request.parties.index(self.name)
        selection = request.selection
        present = torch.zeros(selection.shape[1:], dtype=torch.bool)
        if held is not None:
            if held.positions.numel() and int(held.positions.max()) >= selection.shape[1]:
                raise ProtocolError(
                    f"{self.name}: a selection over >= {int(held.positions.max()) + 1} batch "
                    f"rows expected, found {selection.shape[1]}."
                )
            present[held.positions, column] = True
        mine = selection[..., column : column + 1]
        if not bool(mine.any()):
            raise ProtocolError(
                f"{self.name}: asked to seal a share of sums {request.tag!r} that it enters "
                "nowhere (its selection column is empty)."
            )
        check_selection(mine, present[:, column : column + 1])
        refuse_single_contributors(
            selection, request.parties, receiver=request.deliver_to, dp_rows=request.dp_rows
        )
        context = self._sealed.check(
            request.deliver_to, request.round, request.batch_id, request.tag
        )
        assert held is not None  # a selected row was checked to be held
        if request.dp_rows is not None and bool(request.dp_rows[held.positions, column].any()):
            held = self._release_exposed(held, request.dp_rows[held.positions, column])
        values = torch.zeros(selection.shape[1], held.representation.shape[1])
        values[held.positions] = held.representation
        try:
            payload = self.sealer.seal(
                values.numpy(),
                selection.numpy(),
                column=column,
                parties=request.parties,
                receiver=request.deliver_to,
                context=sum_context(
                    request.session,
                    request.deliver_to,
                    request.round,
                    request.batch_id,
                    request.tag,
                ),
            )
        except OutOfRangeError as error:  # its own values: divergence, said as a plain run says it
            raise self.diverged(request, error) from None
        self._sealed.spend(context)
        self.send(
            SealedMessage(
                **self.reply_header(request, AGGREGATOR),
                scheme=self.scheme,
                deliver_to=request.deliver_to,
                tag=request.tag,
                width=int(values.shape[1]),
                payload=payload,
                phase=request.phase,
                ticket=request.ticket,
            )
        )

    def diverged(self, request: SealRequest, error: OutOfRangeError) -> DivergenceError:
        """The divergence of what this party was about to seal for ``request``, past what the
        sums encode (``error``): said in a training run's words; a party of another kind of
        run says it in its own."""
        where = f"at step {request.round}" if request.phase == "train" else "at prediction"
        return DivergenceError(
            f"training diverged {where}: {self.name}'s representation for the {self.scheme} "
            f"sums of {request.deliver_to} has {error.found}, beyond what they encode, "
            f"{error.limit}; try a lower --lr or fewer --epochs, or --dp-embeddings SIGMA:CLIP, "
            "which clips every representation.",
            step=request.round if request.phase == "train" else None,
        )

    def on_abort(self, request: AbortRequest) -> None:
        """Forget what it keeps of the abandoned step ``request.round``: representations held
        for sealing, answers waiting in its inbox and (the driver) the answers it expected
        (:meth:`abandon_expected`; its retry uses a fresh batch id)."""
        for key in [key for key in self._held if key[0] == request.round]:
            del self._held[key]
        self._inbox = [m for m in self._inbox if m.round != request.round]
        self.abandon_expected(request.round)

    def _release_exposed(
        self, held: RepresentationMessage, exposed: Tensor
    ) -> RepresentationMessage:
        """``held`` with its ``exposed`` rows (which a sum would hand the receiver alone)
        replaced by this party's DP release of them; ProtocolError if it has no such
        mechanism: it never lets them out in the clear."""
        if self.exposure is None:
            raise ProtocolError(
                f"{self.name}: asked to send {int(exposed.sum())} rows as a DP release (a sum "
                "where it is the only contributor besides the receiver), but it holds no "
                "release mechanism (the privacy layer installs one under release='dp')."
            )
        return self.exposure.release_exposed(held, exposed)

    def on_sealed_sum(self, message: SealedSumMessage) -> None:
        """Open the sums it is owed with its own key and act on them as on plain sums."""
        _check_from_aggregator(self.name, message)
        if self.opener is None or message.scheme != self.scheme:
            raise ProtocolError(
                f"{self.name}: sealed {message.scheme!r} sums from {message.sender}, but it "
                "holds no key to open them."
            )
        if not self.owes_sum(message):  # before its key does any work on it
            if self._late("sum", message):
                return
            raise self._unasked(message)
        self.check_sealed_sum(message)  # so is what it expects of the sum
        sums = self.opener.open(message.payload, members=sum_members(message), width=message.width)
        self.take_sum(
            SumMessage(
                sender=message.sender,
                receiver=self.name,
                round=message.round,
                batch_id=message.batch_id,
                session=message.session,
                sums=torch.from_numpy(sums),
                counts=message.counts,
                tag=message.tag,
                phase=message.phase,
            )
        )

    def check_sealed_sum(self, message: SealedSumMessage) -> None:
        """Refuse a sealed sum it is owed whose header (width, tasks and rows, members) does
        not fit what it expects of it (:meth:`expect_sums`), before its key opens it."""
        layout = self._sum_layouts.get((message.round, message.batch_id, message.tag))
        if layout is not None:
            layout.check(_sum_where(self.name, message), message)

    def on_sum(self, message: SumMessage) -> None:
        """A plain sum from the aggregation server, which it acts on (:meth:`take_sum`); under a
        secure sum it takes sealed sums only, which it opens itself."""
        _check_from_aggregator(self.name, message)
        if self.opener is not None:
            raise ProtocolError(
                f"{self.name}: a plain sum from {message.sender}, but its sums are sealed "
                f"({self.scheme}): it takes them sealed only."
            )
        self.take_sum(message)

    def owes_sum(self, message: SumMessage | SealedSumMessage) -> bool:
        """Whether it asked for a sum of ``message``'s round, batch and tag."""
        return self._expectation("sum", message) is not None

    def take_sum(self, message: SumMessage) -> None:
        """A sum it is owed (plain, or opened) waits in its inbox until its program takes it
        (if it asked for it: :meth:`keep`), once it fits the layout it asked for
        (:meth:`expect_sums`)."""
        key = (message.round, message.batch_id, message.tag)
        layout = self._sum_layouts.get(key)
        if layout is not None:
            layout.check(_sum_where(self.name, message), message)
        self.keep(message)
        self._sum_layouts.pop(key, None)


def _check_from_aggregator(name: str, message: Message) -> None:
    """Refuse a sum that does not come from the aggregation server, the only party that sums."""
    if message.sender != AGGREGATOR:
        raise ProtocolError(
            f"{name}: a {message.kind} from {message.sender}; sums come from {AGGREGATOR} only."
        )


def _sum_where(name: str, message: SumMessage | SealedSumMessage) -> str:
    return f"{name}: the sum {message.tag!r} of round {message.round} from {message.sender}"


def _sum_shape(message: SumMessage | SealedSumMessage) -> tuple[int, tuple[int, int]]:
    """The width and (tasks, rows) of the sums ``message`` carries: a sealed one's by its
    header, before it is opened."""
    if isinstance(message, SealedSumMessage):
        tasks, rows = message.selection.shape[:2]
        return message.width, (int(tasks), int(rows))
    tasks, rows, width = message.sums.shape
    return int(width), (int(tasks), int(rows))


@dataclasses.dataclass(frozen=True)
class SumLayout:
    """What a receiver expects of sums: (T, B, ``width``) sums, sum ``(t, b)`` over the
    contributors ``selection[t, b, k]`` of ``parties`` names. The words of a refusal say where
    each comes from: ``width_from`` (whose width), ``selected_by`` (who selected the members)
    and ``axis`` (what the first axis counts)."""

    selection: Tensor
    parties: tuple[str, ...]
    width: int
    width_from: str = "what it asked for"
    selected_by: str = "its request"
    axis: str = "tasks"

    def check(self, where: str, message: SumMessage | SealedSumMessage) -> None:
        """Refuse (ProtocolError, after ``where``) sums of another width, (tasks, rows), or
        members than this layout's; a sealed sum by its header, before it is opened."""
        found_width, found = _sum_shape(message)
        if found_width != self.width:
            raise ProtocolError(
                f"{where}: sums of width {self.width} ({self.width_from}) expected, found "
                f"{found_width}."
            )
        expected = tuple(self.selection.shape[:2])
        if found != expected:
            raise ProtocolError(
                f"{where}: sums of ({self.axis}, rows) {expected} expected, found {found}."
            )
        if not torch.equal(message.counts, self.selection.sum(dim=2)):
            raise ProtocolError(
                f"{where}: each sum over the contributors {self.selected_by} selected expected, "
                "found other counts."
            )
        if isinstance(message, SealedSumMessage) and not (
            message.parties == self.parties and torch.equal(message.selection, self.selection)
        ):  # the members it is opened for: whose self-masks come off
            raise ProtocolError(
                f"{where}: each sum over exactly the contributors {self.selected_by} selected "
                "expected, found other members."
            )


def _check_sum_fits(
    name: str, message: SumMessage | SealedSumMessage, task: HeadTask | PredictTask, width: int
) -> None:
    """Refuse a sum that is not the one ``task`` waits for: sums of the ``width`` its head
    takes; a training task's sums of its tasks and rows, each over the contributors its
    selection names (:class:`SumLayout`); a prediction's, sums of the rows it predicts. A
    sealed sum is checked by its header (its width and selection), before it is opened."""
    where = _sum_where(name, message)
    if isinstance(task, HeadTask):
        # Sums per part when the task has parts (each task adds its parts'), else per task.
        SumLayout(
            selection=task.selection if task.parts is None else task.parts,
            parties=task.parties,
            width=width,
            width_from="what its head takes",
            selected_by="its task",
            axis="tasks" if task.parts is None else "parts",
        ).check(where, message)
        return
    found_width, found = _sum_shape(message)
    if found_width != width:
        raise ProtocolError(
            f"{where}: sums of width {width} (what its head takes) expected, found {found_width}."
        )
    if (
        task.positions.numel()
        and not 0 <= int(task.positions.min()) <= int(task.positions.max()) < found[1]
    ):
        raise ProtocolError(
            f"{where}: sums of the rows to predict (up to position {int(task.positions.max())}) "
            f"expected, found {found[1]} rows."
        )


class DataParty(SecureSumParty):
    """A feature block per split, its bottom model(s) and, at a label holder, its head(s).

    ``models[""]`` is the bottom model; further models (Combinatorial's per-subset bottoms) are
    added with :meth:`add_model` and named in the requests. ``heads`` are keyed the same way.
    """

    def __init__(
        self,
        name: str,
        blocks: Mapping[str, Tensor],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        heads: Mapping[str, Head] | None = None,
    ) -> None:
        super().__init__(name)
        self._blocks = dict(blocks)
        self.models: dict[str, nn.Module] = {"": model}
        self.optimizers: dict[str, torch.optim.Optimizer | None] = {"": optimizer}
        self.heads: dict[str, Head] = dict(heads or {})
        # The largest norm of a model update (its gradient) this party steps with, or None: it
        # clips what it backpropagated from the gradients it received, post-processing that
        # costs no privacy and keeps noisy gradients (--dp-gradients) from blowing up its model.
        self.max_update_norm: float | None = None
        # Each open forward pass: its output, positions, model and who may send its gradients
        # (in the order their gradients are added up).
        self._pending: dict[tuple[int, str], tuple[Tensor, Tensor, str, tuple[str, ...]]] = {}
        # The gradients received for each, with their senders, in the order they came.
        self._gradients: dict[tuple[int, str], list[tuple[str, Tensor]]] = {}
        self._tasks: dict[tuple[int, int, str], HeadTask | PredictTask] = {}
        # A held task's gradients for other parties, by (round, batch): HeadTask.hold.
        self._held_gradients: dict[tuple[int, int], list[GradientMessage]] = {}
        # What turns its raw rows into model inputs, and (at the label party) the original
        # label value of each class: its own, kept in its saved part.
        self.preprocessing: PartyPreprocessing | None = None
        self.classes: tuple[ClassValue, ...] | None = None
        # The label party of a deployed run under secure sums: the samples it trained on.
        self.training_samples: parts.TrainingSamples | None = None
        self._training_digest: str | None = None

    @property
    def receives_sums(self) -> bool:
        """Whether sums are delivered to this party (it holds a head), so a secure-sum scheme
        gives it a receiver half."""
        return bool(self.heads)

    @property
    def model(self) -> nn.Module:
        """The bottom model."""
        return self.models[""]

    @model.setter
    def model(self, module: nn.Module) -> None:
        self.models[""] = module

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The bottom model's optimiser."""
        return self.optimizers[""]

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.optimizers[""] = optimizer

    def add_model(self, key: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Hold a further bottom model, used when a request names ``key``."""
        if key in self.models:
            raise ProtocolError(f"{self.name} already holds a model named {key!r}.")
        self.models[key] = model
        self.optimizers[key] = optimizer

    def training_digest(self) -> str:
        """The SHA-256 of what this party trains on: its training block and, at a label
        holder, its heads' training labels (their shapes, dtypes and bytes). A checkpoint
        keeps it, so that a resume on other rows (a data file changed since) is refused.
        Computed once: its training rows cannot be replaced (:meth:`hold_split`)."""
        if self._training_digest is not None:
            return self._training_digest
        digest = hashlib.sha256()
        named = [("block", self._blocks["train"])]
        named += [
            (f"labels/{key}", head.all_labels("train")) for key, head in sorted(self.heads.items())
        ]
        for name, tensor in named:
            array = tensor.detach().contiguous().numpy()
            digest.update(f"{name} {array.dtype.str} {array.shape}\n".encode())
            digest.update(array.data)
        self._training_digest = digest.hexdigest()
        return self._training_digest

    # -- its saved part: kept and loaded by this party alone --------------------------------

    def own_modules(self) -> dict[str, nn.Module]:
        """Every trained module this party holds, by part name: its bottom model(s) and
        head(s); a role with more (FALSE-VFL's label party) adds its own."""
        modules = {("bottom" if not key else f"bottom/{key}"): m for key, m in self.models.items()}
        modules.update(
            {("head" if not key else f"head/{key}"): h.module for key, h in self.heads.items()}
        )
        return modules

    def own_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        """Every optimiser this party holds, by the part name of what it trains (as
        :meth:`own_modules`); a role with more adds its own."""
        found = {
            ("bottom" if not key else f"bottom/{key}"): optimizer
            for key, optimizer in self.optimizers.items()
            if optimizer is not None
        }
        found.update(
            {
                ("head" if not key else f"head/{key}"): head.optimizer
                for key, head in self.heads.items()
                if head.optimizer is not None
            }
        )
        return found

    def save_part(self, directory: Path) -> dict[str, str]:
        """Write this party's own part (modules, preprocessing, class values) into
        ``directory``; return each file's SHA-256 for the federation's manifest."""
        return parts.save_part(
            directory,
            party=self.name,
            role=type(self).__name__,
            modules=self.own_modules(),
            preprocessing=self.preprocessing,
            classes=self.classes,
            training_samples=self.training_samples,
        )

    def load_part(self, part: parts.Part) -> None:
        """Take its own saved ``part`` (:func:`~secure_vfl.federation.parts.load_part` read
        it, every file checked against the manifest): its modules' states, its preprocessing
        and the class values."""
        parts.load_states(self.own_modules(), part.states, party=self.name)
        self.preprocessing, self.classes = part.preprocessing, part.classes
        self.training_samples = part.training_samples

    def hold_rows(
        self, split: str, table: PartyTable | None, rows: np.ndarray, *, source: str
    ) -> None:
        """Take new rows of its own as split ``split``: sample ``i`` is row ``rows[i]`` of
        ``table`` (its file, read from ``source``), -1 where it does not hold sample ``i``
        (``table`` None: it holds none). Its own preprocessing checks the columns against its
        schema and standardises them. A party without a file needs no preprocessing (one lost
        in a deployed run's training saved none): it holds zeros of its training block's shape."""
        held = rows >= 0
        if table is None:
            if bool(held.any()):
                raise ProtocolError(f"{self.name}: rows of a file expected, found no file.")
            shape = self._blocks["train"].shape[1:]
            self.hold_split(split, torch.zeros((rows.shape[0], *shape)), torch.from_numpy(held))
            return
        if self.preprocessing is None:
            raise ProtocolError(f"{self.name} keeps no preprocessing; cannot read new rows.")
        block = np.zeros((rows.shape[0], *self.preprocessing.block_shape), dtype=np.float32)
        where = source if source == table.name else f"{source} ({table.name})"
        block[held] = self.preprocessing.apply(table, where=where)[rows[held]]
        self.hold_split(split, torch.from_numpy(block), torch.from_numpy(held))

    def hold_split(self, split: str, block: Tensor, held: Tensor) -> None:
        """Hold ``block`` (zero where ``held`` is False) as its block of a new split."""
        if split == "train":
            raise ProtocolError(f"{self.name}: its training rows cannot be replaced.")
        self._blocks[split] = block

    def block_rows(self, split: str, rows: Tensor) -> Tensor:
        """Rows ``rows`` of this party's block of ``split``, refusing a split it does not hold
        or a row beyond its table (ProtocolError)."""
        block = self._blocks.get(split)
        if block is None:
            raise ProtocolError(
                f"{self.name}: split {split!r} requested; it holds splits {sorted(self._blocks)}."
            )
        if rows.numel() and int(rows.max()) >= block.shape[0]:
            raise ProtocolError(
                f"{self.name}: rows < {block.shape[0]} of split {split!r} expected, "
                f"found {int(rows.max())}."
            )
        return block[rows]

    # -- forward and backward of the bottom models ------------------------------------------

    def on_represent_request(self, request: RepresentRequest) -> None:
        model = self.models.get(request.model)
        if model is None:
            raise ProtocolError(
                f"{self.name}: model {request.model!r} requested; it holds models "
                f"{sorted(self.models)}."
            )
        x = self.block_rows(request.split, request.rows)
        key = (request.round, request.tag)
        train = request.phase == "train" and request.backward
        if train and key in self._pending:
            raise ProtocolError(
                f"{self.name}: a second forward pass for round {request.round}, tag "
                f"{request.tag!r} (a replayed request?)."
            )
        self.note_accepted(request)
        if train:
            model.train()
            output = model(x)
            # The heads' holders in the driver's order, then the driver: whatever order their
            # gradients arrive in (over the network, heads train at once), they are added up in
            # this one, so a deployed run steps with the same sums as one in process.
            senders = tuple(dict.fromkeys((*request.gradients_from, request.sender)))
            self._pending[key] = (output, request.positions, request.model, senders)
            sent = output.detach()
        else:
            model.eval()
            with torch.no_grad():
                sent = model(x)
        message = RepresentationMessage(
            **self.reply_header(request, request.reply_to),
            positions=request.positions,
            tag=request.tag,
            phase=request.phase,
            representation=sent,
            ticket=request.ticket,
        )
        self.contribute(message)

    def on_gradient(self, message: GradientMessage) -> None:
        if message.step and self.driver not in (None, message.sender):
            raise ProtocolError(  # a gradient that closes the step is an update: the driver's
                f"{self.name}: a gradient that closes its step from {message.sender}; only the "
                f"run's driver, {self.driver}, closes a step."
            )
        key = (message.round, message.tag)
        pending = self._pending.get(key)
        if pending is None:
            raise ProtocolError(
                f"{self.name}: gradient for round {message.round} (tag {message.tag!r}) "
                "but no pending forward pass."
            )
        output, positions, _, senders = pending
        if self.driver is not None and message.sender not in senders:
            raise ProtocolError(
                f"{self.name}: a gradient from {message.sender} for round {message.round} "
                f"(tag {message.tag!r}); its forward pass takes gradients from "
                f"{sorted(senders)} only (the driver's request named them)."
            )
        if not torch.equal(message.positions, positions) or (
            message.gradient.shape != output.shape
        ):
            raise ProtocolError(
                f"{self.name}: a gradient for the {positions.numel()} rows of width "
                f"{output.shape[1]} sent expected, found {message.positions.numel()} rows of "
                f"shape {tuple(message.gradient.shape)}."
            )
        self._gradients.setdefault(key, []).append((message.sender, message.gradient))
        if message.step:
            self.on_update(
                UpdateRequest(
                    sender=message.sender,
                    receiver=self.name,
                    round=message.round,
                    batch_id=0,
                    session=message.session,
                    tag=message.tag,
                    heads=message.heads,
                )
            )

    def on_update(self, message: UpdateRequest) -> None:
        model_key = self.backpropagate(message.round, message.tag)
        optimizer = self.optimizers[model_key]
        if optimizer is not None:
            if self.max_update_norm is not None:
                parameters = [p for group in optimizer.param_groups for p in group["params"]]
                nn.utils.clip_grad_norm_(parameters, self.max_update_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if message.heads and message.tag in self.heads:
            self.heads[message.tag].step()

    def on_abort(self, request: AbortRequest) -> None:
        """Discard the abandoned step ``request.round``: its forward passes (their graphs),
        the gradients and head tasks received for it, and what its heads accumulated, so that
        nothing of the step is applied when the retry's update comes."""
        super().on_abort(request)
        round = request.round
        self._pending = {key: v for key, v in self._pending.items() if key[0] != round}
        self._gradients = {key: v for key, v in self._gradients.items() if key[0] != round}
        self._tasks = {key: v for key, v in self._tasks.items() if key[0] != round}
        self._held_gradients = {
            key: v for key, v in self._held_gradients.items() if key[0] != round
        }
        for head in self.heads.values():
            head.module.zero_grad(set_to_none=True)

    def backpropagate(self, round: int, tag: str = "") -> str:
        """Start the backward pass of ``(round, tag)``'s forward from the sum of the gradients
        received for it (if any), forget forward passes whose gradients will not come, and
        return the name of the model that served it (``""``: the bottom model)."""
        key = (round, tag)
        pending = self._pending.pop(key, None)
        gradients = self._gradients.pop(key, [])
        for stale in [k for k in self._pending if k[0] < round]:
            del self._pending[stale]
        if pending is None:
            return ""
        output, _, model_key, senders = pending
        if gradients:
            rank = {sender: i for i, sender in enumerate(senders)}
            total = torch.zeros_like(output)
            # By sender in the forward pass's order (a stable sort: each sender's in the order
            # it sent them): addition in floating point depends on the order.
            for _, gradient in sorted(gradients, key=lambda item: rank.get(item[0], len(rank))):
                total += gradient
            output.backward(total)
        return model_key

    # -- heads: training and prediction on delivered sums ------------------------------------

    def held_gradients(self, round: int, batch_id: int) -> list[GradientMessage]:
        """The gradients for other parties its own held task of ``(round, batch_id)`` computed
        (:attr:`HeadTask.hold`), handed over once; ProtocolError if there are none."""
        held = self._held_gradients.pop((round, batch_id), None)
        if held is None:
            raise ProtocolError(
                f"{self.name}: no held gradients for round {round}, batch {batch_id}."
            )
        return held

    def on_head_task(self, task: HeadTask) -> None:
        self._expect_sum(task, task.head)

    def on_predict_task(self, task: PredictTask) -> None:
        self._expect_sum(task, task.head)

    def _expect_sum(self, task: HeadTask | PredictTask, head: str) -> None:
        if head not in self.heads:
            raise ProtocolError(f"{self.name} holds no head named {head!r}.")
        if isinstance(task, HeadTask) and task.hold and task.sender != self.name:
            raise ProtocolError(
                f"{self.name}: a head task from {task.sender} that holds its gradients; a head "
                "holds them only for its own driver."
            )
        if isinstance(task, HeadTask) and task.rows.numel():
            size = self.heads[head].size("train")
            low, high = int(task.rows.min()), int(task.rows.max())
            if low < 0 or high >= size:
                raise ProtocolError(
                    f"{self.name}: a head task from {task.sender} for round {task.round}, "
                    f"batch {task.batch_id}: training rows in [0, {size}) of its labels "
                    f"expected, found [{low}, {high}]."
                )
        key = (task.round, task.batch_id, task.tag)
        if key in self._tasks:
            raise ProtocolError(
                f"{self.name}: a second task for round {task.round}, batch {task.batch_id}, "
                f"tag {task.tag!r} (a replayed request?)."
            )
        self._tasks[key] = task

    def owes_sum(self, message: SumMessage | SealedSumMessage) -> bool:
        """Whether its head has a task for a sum of ``message``'s round, batch and tag, or it
        asked for such a sum itself."""
        key = (message.round, message.batch_id, message.tag)
        return key in self._tasks or super().owes_sum(message)

    def check_sealed_sum(self, message: SealedSumMessage) -> None:
        """Refuse a sealed sum for a task of its head that does not fit the task (as
        :meth:`take_sum` refuses an opened one), before its key opens it."""
        task = self._tasks.get((message.round, message.batch_id, message.tag))
        if task is None:
            super().check_sealed_sum(message)
        else:
            _check_sum_fits(self.name, message, task, self.heads[task.head].width)

    def take_sum(self, message: SumMessage) -> None:
        """A sum for a task of its head is acted on (the driver sends a task before asking
        for its sums, so the task is here first); any other waits in the inbox only if this
        party asked for it, as it asked (:meth:`SecureSumParty.take_sum`: FALSE-VFL's label
        party takes its posterior's sum itself)."""
        key = (message.round, message.batch_id, message.tag)
        task = self._tasks.get(key)
        if task is None:
            super().take_sum(message)
            return
        _check_sum_fits(self.name, message, task, self.heads[task.head].width)
        del self._tasks[key]
        sums, counts = message.sums, message.counts
        if isinstance(task, HeadTask) and task.parts is not None:  # each task's from its parts'
            sums = torch.einsum("tsb,sbw->tbw", task.composition().to(sums.dtype), sums)
            counts = task.selection.sum(dim=2)
        counts = counts.clamp(min=1).unsqueeze(-1).to(sums.dtype)
        means = sums / counts
        if isinstance(task, PredictTask):
            self._predict(task, means)
        else:
            self._train_head(task, means, counts)

    def _predict(self, task: PredictTask, means: Tensor) -> None:
        head = self.heads[task.head]
        head.module.eval()
        with torch.no_grad():
            logits = head.module(means[0])
        predicted = logits.argmax(dim=-1)
        probabilities = None
        if task.probabilities:
            probabilities = torch.softmax(logits[task.positions], dim=-1).contiguous()
        self.send(
            PredictionMessage(
                **self.reply_header(task),
                positions=task.positions,
                tag=task.tag,
                phase="predict",
                predictions=predicted[task.positions].contiguous(),
                probabilities=probabilities,
            )
        )

    def _train_head(self, task: HeadTask, means: Tensor, counts: Tensor) -> None:
        """The head's weighted task loss ``sum(weights * CE) / normaliser``; backward into the
        head; the gradient owed to each contributing party for the rows it sent."""
        head = self.heads[task.head]
        means.requires_grad_(True)
        head.module.train()
        logits = head.module(means)
        tasks, batch, classes = logits.shape
        labels = head.labels("train", task.rows)
        losses = F.cross_entropy(
            logits.reshape(-1, classes), labels.repeat(tasks), reduction="none"
        ).view(tasks, batch)
        loss = (task.weights * losses).sum() / task.normaliser
        loss.backward()
        assert means.grad is not None
        per_contribution = means.grad / counts
        dense = torch.einsum(
            "tbk,tbd->kbd", task.selection.to(per_contribution.dtype), per_contribution
        )
        used = task.selection.flatten(0, 1).any(dim=0)
        messages = [
            dataclasses.replace(message, session=task.session)
            for message in gradient_messages(
                self.name,
                dense,
                task.present & used.unsqueeze(0),
                task.parties,
                round=task.round,
                batch_id=task.batch_id,
                tag=task.head,
            )
        ]
        if task.hold:
            others = [m for m in messages if m.receiver != self.name]
            self._held_gradients[(task.round, task.batch_id)] = others
            messages = [m for m in messages if m.receiver == self.name]
        self.send_all(messages)
        self.send(
            LossMessage(
                **self.reply_header(task),
                tag=task.tag,
                loss=float(loss.item()),
            )
        )


class AggregationServer(Party):
    """Holds the contributions of the current batch and sums them for whoever is owed a sum.

    It holds no labels, features, models or secret keys; what it sees is what its backend
    receives (masked ring elements or ciphertexts under a secure backend).
    """

    def __init__(self, aggregator: Aggregator, name: str = AGGREGATOR) -> None:
        super().__init__(name)
        self.aggregator = aggregator
        self._batch: tuple[int, int, str] | None = None
        self._contributions: dict[str, dict[str, RepresentationMessage]] = {}
        # Secure sums split at the boundary: the adding half (no secret key) and the sealed
        # shares of the current batch, by sum tag and sender.
        self.adder: AdderHalf | None = None
        self.scheme = ""
        self._sealed: dict[str, dict[str, SealedMessage]] = {}
        self._served = ContextLedger()
        self._key_sessions = KeySessions()
        # (round, batch id, phase) of the batches it has moved past: a contribution or a sum
        # request for one, under any tag, is a replay or for the wrong round, refused before it
        # touches the current batch (a driver never goes back to a batch).
        self._past: set[tuple[int, int, str]] = set()
        # (round, batch id, phase) of the batches of abandoned steps: nothing more is kept.
        self._abandoned: set[tuple[int, int, str]] = set()
        # Sum requests that came before every contribution they sum (the driver sends a step's
        # requests together), by (round, batch id, phase, tag): served when the last one comes.
        self._waiting: dict[tuple[int, int, str, str], SumRequest] = {}
        # The driver's key of the tickets of the contributions it asks for: one without its
        # ticket is refused on arrival, before it touches a batch.
        self._tickets = TicketCheck()

    def install(self, scheme: str, adder: AdderHalf) -> None:
        """Take the adding half of a secure-sum scheme."""
        self.scheme, self.adder = scheme, adder

    def on_key_request(self, request: KeyRequest) -> None:
        """The driver opens a key session: the server takes its keys (it announces none)."""
        if self.adder is None or request.scheme != self.scheme:
            raise ProtocolError(
                f"{self.name}: a key set-up for scheme {request.scheme!r}, but it runs "
                f"{self.scheme or 'no secure sum'}."
            )
        self._key_sessions.open(self.name, request)

    def on_public_key(self, message: PublicKeyMessage) -> None:
        """A receiver's key, under which it adds (it takes no contributor's: nobody sends it
        one, and it would keep it unused)."""
        if self.adder is None or message.scheme != self.scheme:
            raise ProtocolError(
                f"{self.name}: a {message.scheme!r} public key from {message.sender}, but it "
                f"runs {self.scheme or 'no secure sum'}."
            )
        if message.role != "receiver":
            raise ProtocolError(
                f"{self.name}: a {message.role} key from {message.sender}; the aggregation "
                "server takes receivers' keys only."
            )
        self._key_sessions.take_key(self.name, message, [self.adder])

    def on_ticket_key(self, message: TicketKeyMessage) -> None:
        """The driver's key of its session's tickets (:mod:`~secure_vfl.federation.tickets`)."""
        self._tickets.learn(message.session, message.key, by=self.name)

    def _admit(self, message: SealedMessage | RepresentationMessage) -> None:
        """Refuse ``message`` without its ticket, or for a batch past or abandoned."""
        contribution = Contribution(
            kind=message.kind,
            session=message.session,
            contributor=message.sender,
            round=message.round,
            batch_id=message.batch_id,
            phase=message.phase,
            tag=message.tag,
            deliver_to=message.deliver_to if isinstance(message, SealedMessage) else "",
        )
        self._tickets.check(contribution, message.ticket, by=self.name)
        batch = (message.round, message.batch_id, message.phase)
        if batch in self._abandoned:
            raise ProtocolError(
                f"{self.name}: a contribution from {message.sender} for round {message.round}, "
                f"batch {message.batch_id}, of a step the driver abandoned; it is not kept."
            )
        if batch in self._past:
            raise ProtocolError(
                f"{self.name}: a contribution from {message.sender} for round {message.round}, "
                f"batch {message.batch_id} ({message.phase}), tag {message.tag!r}, a batch it "
                "has moved past (a replay, or for the wrong round?)."
            )

    def _move_to(self, batch: tuple[int, int, str]) -> None:
        """Make ``batch`` the current one (what it kept of another is dropped)."""
        if batch != self._batch:
            if self._batch is not None:
                self._past.add(self._batch)
            self._forget_waiting(batch)
            self._batch, self._contributions, self._sealed = batch, {}, {}

    def _forget_waiting(self, batch: tuple[int, int, str]) -> None:
        """Drop the requests waiting for contributions to a batch other than ``batch``, the one
        it moves to: one they sum never came."""
        for key in [key for key in self._waiting if key[:3] != batch]:
            request = self._waiting.pop(key)
            logger.warning(
                "%s: the sum %r for round %d, batch %d was never served: not every contribution "
                "it sums arrived before the batch closed.",
                self.name,
                request.tag,
                request.round,
                request.batch_id,
            )

    def _keep(
        self,
        store: dict[str, dict[str, Any]],
        message: SealedMessage | RepresentationMessage,
        what: str,
    ) -> None:
        """Keep ``message`` under its tag and sender; a second one is a replay."""
        by_sender = store.setdefault(message.tag, {})
        if message.sender in by_sender:
            raise ProtocolError(
                f"{self.name}: two {what} from {message.sender} for round "
                f"{message.round}, batch {message.batch_id}, tag {message.tag!r} (a replay?)."
            )
        by_sender[message.sender] = message

    def on_abort(self, request: AbortRequest) -> None:
        """Close the batch of the abandoned step ``request.round`` unserved: its contributions
        are discarded, and one arriving for it later (a lost party's late share) is refused as
        a replay, never added."""
        self._waiting = {k: v for k, v in self._waiting.items() if k[0] != request.round}
        if self._batch is not None and self._batch[0] == request.round:
            self._abandoned.add(self._batch)
            self._batch, self._contributions, self._sealed = None, {}, {}

    def on_sealed(self, message: SealedMessage) -> None:
        if self.adder is None or message.scheme != self.scheme:
            raise ProtocolError(
                f"{self.name}: a sealed {message.scheme!r} share from {message.sender}, but it "
                f"runs {self.scheme or 'no secure sum'}."
            )
        # A share of a sum already served is a replay: refused before it touches the batch.
        self._served.check(message.deliver_to, message.round, message.batch_id, message.tag)
        self._take_contribution(message)

    def on_representation(self, message: RepresentationMessage) -> None:
        if self.adder is not None:
            raise ProtocolError(
                f"{self.name}: a representation in the clear from {message.sender}, but sums "
                f"are sealed by {self.scheme!r} here; it refuses to see it."
            )
        self._take_contribution(message)

    def _take_contribution(self, message: SealedMessage | RepresentationMessage) -> None:
        """Check ``message``'s ticket and batch (:meth:`_admit`) and that it fits its sum
        (:meth:`_check_contribution`), then move to its batch (the driver asked for it: only a
        ticket says so), keep it and serve the requests it completes."""
        self._admit(message)
        batch = (message.round, message.batch_id, message.phase)
        waiting = [
            request
            for key, request in self._waiting.items()
            if key[:3] == batch and self._source(request) == message.tag
        ]
        self._check_contribution(message, waiting)
        self._move_to(batch)
        store, what = self._store(message)
        self._keep(store, message, what)
        self._serve_waiting(message.tag)

    def _store(
        self, message: SealedMessage | RepresentationMessage
    ) -> tuple[dict[str, dict[str, Any]], str]:
        """Where ``message``'s kind is kept for the current batch, and what it is called."""
        if isinstance(message, SealedMessage):
            return self._sealed, "sealed shares"
        return self._contributions, "representations"

    def _check_contribution(
        self, message: SealedMessage | RepresentationMessage, requests: Sequence[SumRequest]
    ) -> None:
        """Refuse a contribution that cannot enter its sum, before anything of it is kept: of
        another width (a share: or receiver) than those kept for that sum; and against each
        of the sum ``requests`` here too (none: not yet), a share as :meth:`_check_share`
        says, a representation as :meth:`_check_representation` says. Either way the refusal
        names the contribution's sender."""
        sealed = isinstance(message, SealedMessage)
        noun = "sealed share" if sealed else "representation"
        where = (
            f"{self.name}: the {noun} from {message.sender} for round {message.round}, "
            f"batch {message.batch_id}, tag {message.tag!r} does not fit its sum"
        )
        batch = (message.round, message.batch_id, message.phase)
        store, _ = self._store(message)
        kept = store.get(message.tag, {}) if batch == self._batch else {}
        others = [m for m in kept.values() if m.sender != message.sender]
        what = "shares" if sealed else "representations"
        kept_from = f"the {what} kept for it (from {', '.join(m.sender for m in others)})"
        width = _contribution_width(message)
        if others and width != _contribution_width(others[0]):
            raise ProtocolError(
                f"{where}: of width {width}, where {kept_from} are of width "
                f"{_contribution_width(others[0])}: {what} of one width expected."
            )
        if isinstance(message, SealedMessage):
            if others and message.deliver_to != others[0].deliver_to:
                raise ProtocolError(
                    f"{where}: for {message.deliver_to}, where {kept_from} are for "
                    f"{others[0].deliver_to}: shares for one receiver expected."
                )
            for request in requests:
                self._check_share(where, message, request)
        else:
            for request in requests:
                _check_representation(where, message, request)

    def _check_share(self, where: str, message: SealedMessage, request: SumRequest) -> None:
        """Refuse a sealed share from a party its sum's ``request`` does not select, for
        another receiver, or with a payload that does not seal sums of its shape (the adder's
        :meth:`~secure_vfl.federation.aggregator.AdderHalf.check`)."""
        assert self.adder is not None
        selection = request.selection
        selected = [name for k, name in enumerate(request.parties) if bool(selection[..., k].any())]
        if message.sender not in selected:
            raise ProtocolError(
                f"{where}: a share from one of {selected} (the contributors it selects) expected."
            )
        if message.deliver_to != request.deliver_to:
            raise ProtocolError(
                f"{where}: a share for {request.deliver_to} expected, found one for "
                f"{message.deliver_to}."
            )
        try:
            self.adder.check(
                message.payload,
                sender=message.sender,
                receiver=request.deliver_to,
                shape=(selection.shape[0], selection.shape[1], message.width),
                parties=len(request.parties),
                selection=selection[..., request.parties.index(message.sender)].numpy(),
            )
        except ProtocolError as error:  # IntegrityError included: said as the server's refusal
            raise type(error)(f"{where}: {error}") from None

    def on_sum_request(self, request: SumRequest) -> None:
        """Serve the sum at once if every contribution it sums is here; else keep the request
        until the last one comes (:meth:`_serve_waiting`). One for a batch the server has moved
        past or that was abandoned is refused."""
        batch = (request.round, request.batch_id, request.phase)
        if batch in self._abandoned or batch in self._past:
            raise ProtocolError(
                f"{self.name}: a sum for round {request.round}, batch {request.batch_id} "
                f"({request.phase}) requested, a batch it has moved past or that was abandoned."
            )
        if self.adder is not None:  # refused before anything is waited for or added
            self._served.check(request.deliver_to, request.round, request.batch_id, request.tag)
            refuse_single_contributors(
                request.selection,
                request.parties,
                receiver=request.deliver_to,
                dp_rows=request.dp_rows,
            )
        key = (*batch, request.tag)
        if key in self._waiting:
            raise ProtocolError(
                f"{self.name}: a second request for the sum {request.tag!r} of round "
                f"{request.round}, batch {request.batch_id} (a replay?)."
            )
        if batch == self._batch:
            self._check_kept(request)
        if batch != self._batch or self._missing(request):
            self._waiting[key] = request
            return
        self._serve(request)

    def _check_kept(self, request: SumRequest) -> None:
        """Check the contributions kept for ``request``'s sum, which came before it, as one
        that comes after it is checked on arrival (:meth:`_check_contribution`). One that does
        not fit is refused as it would have been, and the request with it (nothing waits for a
        sum that cannot be served): the contribution is dropped, and forgotten as taken, so
        the server is as it was before it came; the request is not kept."""
        store: dict[str, dict[str, Any]] = (
            self._sealed if self.adder is not None else self._contributions
        )
        kept = store.get(self._source(request), {})
        for message in list(kept.values()):
            try:
                self._check_contribution(message, [request])
            except ProtocolError:
                del kept[message.sender]
                self.receipts.forget(message)
                raise

    def _source(self, request: SumRequest) -> str:
        """The tag its contributions are kept under: sealed shares under the sum's own tag,
        representations under the tag they were sent with."""
        return request.tag if self.adder is not None else request.source_tag

    def _missing(self, request: SumRequest) -> bool:
        """Whether a contributor the request selects has not sent its contribution yet."""
        store = self._sealed if self.adder is not None else self._contributions
        arrived = store.get(self._source(request), {})
        return any(
            name not in arrived
            for k, name in enumerate(request.parties)
            if bool(request.selection[..., k].any())
        )

    def _serve_waiting(self, tag: str) -> None:
        """Serve the waiting requests of the current batch that sum contributions kept under
        ``tag`` and now have every one of them."""
        if self._batch is None:
            return
        for key, request in list(self._waiting.items()):
            ready = key[:3] == self._batch and self._source(request) == tag
            if ready and not self._missing(request):
                del self._waiting[key]
                self._serve(request)

    def _serve(self, request: SumRequest) -> None:
        if self.adder is not None:
            self._add_sealed(request)
            return
        arrived = self._contributions.get(request.source_tag, {})
        contributions = [arrived[name] for name in request.parties if name in arrived]
        result = self.aggregator.combine(
            contributions,
            request.selection,
            parties=request.parties,
            receiver=request.deliver_to,
            round=request.round,
            batch_id=request.batch_id,
            tag=request.tag,
        )
        self._deliver(
            request,
            dataclasses.replace(
                result, session=request.session, tag=request.tag, phase=request.phase
            ),
        )

    def _deliver(self, request: SumRequest, result: Message) -> None:
        """Send the sum ``request`` asked for. To the party that asked (the label party, which
        waits for it with :meth:`Party.take`) it goes once this server has answered the message
        that completed it (:meth:`Party.send_after`): over the network the contributor whose
        representation that was goes on while the label party trains on the sum, instead of
        waiting for it. To another party (a data party's head) it goes at once, so the asker's
        send returns once that head has acted on it, as before."""
        if result.receiver == request.sender:
            self.send_after(result)
        else:
            self.send(result)

    def _add_sealed(self, request: SumRequest) -> None:
        """Combine the sealed shares of exactly the selected contributors, once per context
        (a sum over a single contributor was refused on arrival, :meth:`on_sum_request`; each
        share was checked against the request, :meth:`_check_contribution`, before it was kept or
        before the request was)."""
        assert self.adder is not None
        selection = request.selection
        expected = [name for k, name in enumerate(request.parties) if bool(selection[..., k].any())]
        arrived = self._sealed.get(request.tag, {})
        width = next(iter(arrived.values())).width if arrived else 1
        context = self._served.check(
            request.deliver_to, request.round, request.batch_id, request.tag
        )
        payload = self.adder.add(
            {name: arrived[name].payload for name in expected},
            receiver=request.deliver_to,
            shape=(selection.shape[0], selection.shape[1], width),
            parties=len(request.parties),
            selection={
                name: selection[..., request.parties.index(name)].numpy() for name in expected
            },
        )
        self._served.spend(context)
        del self._sealed[request.tag]
        self._deliver(
            request,
            SealedSumMessage(
                **self.reply_header(request, request.deliver_to),
                scheme=self.scheme,
                tag=request.tag,
                width=width,
                selection=selection,
                parties=request.parties,
                payload=payload,
                phase=request.phase,
            ),
        )


def _contribution_width(message: SealedMessage | RepresentationMessage) -> int:
    if isinstance(message, SealedMessage):
        return message.width
    return int(message.representation.shape[1])


def _check_representation(where: str, message: RepresentationMessage, request: SumRequest) -> None:
    """Refuse a plain representation with rows outside the batch its sum's ``request``
    sums, or without a row the request selects of its sender (a party the request does not
    name is not added: nothing to check)."""
    if message.sender not in request.parties:
        return
    selection = request.selection
    batch = selection.shape[1]
    positions = message.positions
    if positions.numel() and int(positions.max()) >= batch:
        raise ProtocolError(
            f"{where}: rows of a batch of {batch} expected, found row {int(positions.max())}."
        )
    selected = selection[..., request.parties.index(message.sender)].any(dim=0)
    selected[positions] = False
    if bool(selected.any()):
        raise ProtocolError(
            f"{where}: the rows the sum selects of {message.sender} expected, found row "
            f"{int(torch.nonzero(selected)[0])} missing."
        )


def gradient_messages(
    sender: str,
    gradients: Tensor,
    present: Tensor,
    parties: Sequence[str],
    *,
    round: int,
    batch_id: int,
    tag: str = "",
) -> list[GradientMessage]:
    """Split dense (K, B, d) gradients into one message per party for the rows it sent."""
    messages = []
    for k, name in enumerate(parties):
        positions = torch.nonzero(present[:, k]).flatten()
        if positions.numel() == 0:
            continue
        messages.append(
            GradientMessage(
                sender=sender,
                receiver=name,
                round=round,
                batch_id=batch_id,
                positions=positions,
                tag=tag,
                gradient=gradients[k, positions].detach().contiguous(),
            )
        )
    return messages


def make_aggregation_server(
    aggregator: SumBackend | None, role: str = "aggregation-server"
) -> AggregationServer:
    """The aggregation server, playing the role registered as ``role``: it sums with
    ``aggregator`` in the clear (plain by default); under a scheme split at the party boundary
    it gets only the scheme's adding half (``install``), never the backend object that makes
    every party's halves. ConfigError if the role is not an :class:`AggregationServer`."""
    split = isinstance(aggregator, SealingScheme)
    server = ROLES.get(role)(
        aggregator if aggregator is not None and not split else PlainAggregator()
    )
    if not isinstance(server, AggregationServer):
        raise ConfigError(
            f"the aggregator's role must be an AggregationServer; found {type(server).__name__}."
        )
    return server


def ticket_issuer(driver: Party) -> TicketIssuer:
    """The tickets of the contributions ``driver`` asks for: the key of each session goes to
    the aggregation server in a message (:class:`~secure_vfl.federation.messages.
    TicketKeyMessage`) before the first request of the session that carries one."""

    def send_key(session: str, key: bytes, attempt: int) -> None:
        driver.send(
            TicketKeyMessage(
                sender=driver.name,
                receiver=AGGREGATOR,
                round=0,
                batch_id=attempt,  # a send again after one that failed is not a replay
                session=session,
                key=key,
            )
        )

    return TicketIssuer(send_key)


RoleFactory = Callable[..., Party]
ROLES: Registry[RoleFactory] = Registry("role")
ROLES.register("data-party", DataParty)
ROLES.register("aggregation-server", AggregationServer)
