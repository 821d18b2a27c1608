"""The contract every secure-sum backend inherits: its sums equal the plain oracle's.

Subclass :class:`AggregatorContract` as ``Test...`` and implement :meth:`make_aggregator` (and
:meth:`step` when the backend rounds). Every sum runs through the parties as a run has them
(:class:`SumParties`): a :class:`PlainAggregator` inside the aggregation server, a
:class:`SealingScheme` split into each party's own halves with keys met by messages. The oracle
is a float64 einsum of the same float32 inputs; the allowed error is the backend's own step plus
float32 accumulation error, which bounds even the plain backend's float32 einsum.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from torch import Tensor

from secure_vfl.errors import ProtocolError
from secure_vfl.federation.aggregator import SealingScheme, SumBackend, SumMembers, sum_context
from secure_vfl.federation.channel import Channel, ChannelLayer, RecordingLayer
from secure_vfl.federation.messages import (
    AGGREGATOR,
    AbortRequest,
    KeyRequest,
    Message,
    RepresentationMessage,
    SealedMessage,
    SealedSumMessage,
    SealRequest,
    SumMessage,
    SumRequest,
    party_name,
)
from secure_vfl.federation.parties import (
    AggregationServer,
    SecureSumParty,
    make_aggregation_server,
    ticket_issuer,
)
from secure_vfl.federation.tickets import Contribution

M = TypeVar("M", bound=Message)

PARTIES = [party_name(k) for k in range(4)]
RECEIVER = party_name(0)


def representations(
    present: Tensor, width: int, generator: torch.Generator, *, round: int, batch_id: int
) -> list[RepresentationMessage]:
    """One message per party with any present row (``present`` (B, K)), normal values * 3."""
    messages = []
    for k, name in enumerate(PARTIES):
        positions = torch.nonzero(present[:, k]).flatten()
        if positions.numel() == 0:
            continue
        values = 3.0 * torch.randn(positions.numel(), width, generator=generator)
        messages.append(
            RepresentationMessage(
                sender=name,
                receiver=AGGREGATOR,
                round=round,
                batch_id=batch_id,
                positions=positions,
                representation=values,
            )
        )
    return messages


def releasable_selection(present: Tensor, tasks: int, generator: torch.Generator) -> Tensor:
    """A random (T, B, K) selection of present parties whose sums have 0 or >= 2 contributors
    besides the receiver (party 0)."""
    selection = torch.rand((tasks, *present.shape), generator=generator) < 0.6
    selection &= present.unsqueeze(0)
    selection[selection[..., 1:].sum(dim=2) == 1] = False
    return selection


def oracle(messages: list[RepresentationMessage], selection: Tensor) -> tuple[Tensor, Tensor]:
    """Float64 sums of the selected representations and the sums of their magnitudes."""
    _, batch, parties = selection.shape
    width = messages[0].representation.shape[1]
    dense = torch.zeros(parties, batch, width, dtype=torch.float64)
    for message in messages:
        dense[PARTIES.index(message.sender), message.positions] = message.representation.double()
    chosen = selection.double()
    return (
        torch.einsum("tbk,kbd->tbd", chosen, dense),
        torch.einsum("tbk,kbd->tbd", chosen, dense.abs()),
    )


class PayloadTap:
    """A channel layer that rewrites in transit the items (ciphertexts, masked ring elements)
    of every ``kind`` message (a sealed share; or a sealed sum) from ``sender`` (None: any)."""

    def __init__(
        self,
        rewrite: Callable[[list[bytes]], list[bytes]],
        *,
        sender: str | None = None,
        kind: type[SealedMessage | SealedSumMessage] = SealedMessage,
    ) -> None:
        self.rewrite, self.sender, self.kind = rewrite, sender, kind

    def on_message(self, message: Message) -> Message:
        if not isinstance(message, self.kind) or self.sender not in (None, message.sender):
            return message
        return dataclasses.replace(message, payload=tuple(self.rewrite(list(message.payload))))


def full_batch(
    seed: int, *, batch: int = 16, width: int = 8, tasks: int = 2, round: int = 0, batch_id: int = 0
) -> tuple[list[RepresentationMessage], Tensor]:
    """Representations from all four parties and a selection with 0 or >= 2 per sum."""
    generator = torch.Generator().manual_seed(seed)
    present = torch.ones(batch, 4, dtype=torch.bool)
    messages = representations(present, width, generator, round=round, batch_id=batch_id)
    return messages, releasable_selection(present, tasks, generator)


class SumDriver(SecureSumParty):
    """A receiver that drives, as the label party does: it expects the sum each of its sum
    requests asks to be delivered to it (its inbox keeps nothing it did not ask for), and gives
    each seal request the ticket of its share (:meth:`ticket`)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.tickets = ticket_issuer(self)

    def ticket(self, message: RepresentationMessage | SealRequest) -> bytes:
        """The ticket of the contribution ``message`` is (a representation to the aggregator)
        or asks for (a seal request)."""
        sealing = isinstance(message, SealRequest)
        named = Contribution(
            kind="sealed" if sealing else "representation",
            session=message.session,
            contributor=message.receiver if sealing else message.sender,
            round=message.round,
            batch_id=message.batch_id,
            phase=message.phase,
            tag=message.tag,
            deliver_to=message.deliver_to if isinstance(message, SealRequest) else "",
        )
        return self.tickets.mint(named)

    def send_all(self, messages: Sequence[Message]) -> None:
        messages = [
            dataclasses.replace(m, ticket=self.ticket(m))
            if isinstance(m, SealRequest) and not m.ticket
            else m
            for m in messages
        ]
        for message in messages:
            if isinstance(message, SumRequest) and message.deliver_to == self.name:
                self.expect(
                    "sum",
                    senders=[AGGREGATOR],
                    round=message.round,
                    batch_id=message.batch_id,
                    tag=message.tag,
                )
        super().send_all(messages)


class TamperedSum:
    """The aggregation server's outgoing hook that changes the first sum it sends: sums of
    another width, or over other members (a plain sum shows them by its counts, a sealed one
    by its parties); ``kept`` keeps the sum as it was."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.kept: list[Message] = []

    def on_message(self, message: Message) -> Message:
        if message.kind not in ("sum", "sealed-sum") or self.kept:
            return message
        self.kept.append(message)
        wider = self.fault == "another width"
        if isinstance(message, SealedSumMessage):
            if wider:
                return dataclasses.replace(message, width=message.width + 1)
            return dataclasses.replace(message, parties=message.parties[::-1])
        assert isinstance(message, SumMessage)
        if wider:
            extra = torch.zeros(*message.sums.shape[:2], 1)
            return dataclasses.replace(message, sums=torch.cat([message.sums, extra], dim=2))
        return dataclasses.replace(message, counts=message.counts + 1)


def vector_sum(
    aggregator: SumBackend,
    vectors: dict[str, Tensor],
    *,
    channel: Channel | None = None,
    receiver: str = "server",
    round: int = 0,
) -> Tensor:
    """The sum of one flat vector per contributor as ``receiver`` gets it: each contributor is a
    :class:`SecureSumParty` that contributes its vector as one row, an aggregation server adds
    (``aggregator`` split into its halves, keys meeting by messages, when it is a
    :class:`SealingScheme`)."""
    channel = channel if channel is not None else Channel()
    contributors = [SecureSumParty(name) for name in vectors]
    owner = SumDriver(receiver)
    split = isinstance(aggregator, SealingScheme)
    server = make_aggregation_server(aggregator)
    for party in (*contributors, owner, server):
        party.connect(channel)
    names = tuple(vectors)
    header: dict[str, Any] = {"sender": receiver, "round": round, "batch_id": 0}
    if isinstance(aggregator, SealingScheme):
        for party in contributors:
            party.install(aggregator.scheme, aggregator.sender(), None)
        owner.install(aggregator.scheme, None, aggregator.receiver())
        server.install(aggregator.scheme, aggregator.adder())
        for name in (AGGREGATOR, *names, receiver):
            owner.send(
                KeyRequest(
                    **header,
                    receiver=name,
                    scheme=aggregator.scheme,
                    contributors=names,
                    receivers=(receiver,),
                )
            )
    for party in contributors:
        contribution = RepresentationMessage(
            sender=party.name,
            receiver=AGGREGATOR,
            round=round,
            batch_id=0,
            positions=torch.zeros(1, dtype=torch.int64),
            tag="vectors",
            representation=vectors[party.name].reshape(1, -1),
        )
        party.contribute(dataclasses.replace(contribution, ticket=owner.ticket(contribution)))
    plan: dict[str, Any] = {
        "selection": torch.ones(1, 1, len(names), dtype=torch.bool),
        "parties": names,
        "deliver_to": receiver,
        "tag": "vectors",
        "source_tag": "vectors",
    }
    for name in names if split else ():
        owner.send(SealRequest(**header, receiver=name, **plan))
    owner.send(SumRequest(**header, receiver=AGGREGATOR, **plan))
    summed = owner.take("sum", sender=AGGREGATOR, round=round, batch_id=0, tag="vectors")
    assert isinstance(summed, SumMessage)
    return summed.sums[0, 0]


class SumParties:
    """The parties of a run's sums: a :class:`SecureSumParty` per name in :data:`PARTIES` (the
    receiver :data:`RECEIVER` among them, which drives, as the label party does) and an
    aggregation server, on one channel; ``backend`` split into each party's own halves when it
    is a :class:`SealingScheme`, keys met by messages. ``layers`` sit on the channel before
    ``recorder``, which therefore keeps every message as it arrived."""

    def __init__(
        self, backend: SumBackend, *, layers: Sequence[ChannelLayer] = (), session: str = "s"
    ) -> None:
        self.recorder = RecordingLayer()
        self.channel = Channel([*layers, self.recorder])
        self.session = session
        self.parties = {
            name: SumDriver(name) if name == RECEIVER else SecureSumParty(name) for name in PARTIES
        }
        self.driver = self.parties[RECEIVER]
        self.server: AggregationServer = make_aggregation_server(backend)
        for party in (*self.parties.values(), self.server):
            party.connect(self.channel)
        self.split = isinstance(backend, SealingScheme)
        if isinstance(backend, SealingScheme):
            for name, party in self.parties.items():
                opener = backend.receiver() if name == RECEIVER else None
                party.install(backend.scheme, backend.sender(), opener)
            self.server.install(backend.scheme, backend.adder())
            for name in (AGGREGATOR, *PARTIES):
                self.driver.send(
                    KeyRequest(
                        **self._header(name, 0, 0),
                        scheme=backend.scheme,
                        contributors=tuple(PARTIES),
                        receivers=(RECEIVER,),
                    )
                )

    def _header(self, receiver: str, round: int, batch_id: int) -> dict[str, Any]:
        return {
            "sender": RECEIVER,
            "receiver": receiver,
            "round": round,
            "batch_id": batch_id,
            "session": self.session,
        }

    def contribute(self, messages: Sequence[RepresentationMessage]) -> None:
        """Each party's representation on its way to the server, with the driver's ticket for
        it: kept by its party under a split scheme (until a seal request), sent in the clear
        otherwise."""
        for message in messages:
            if not self.split:  # sent as it is: in this run's session, with its ticket
                message = dataclasses.replace(message, session=self.session)
                message = dataclasses.replace(message, ticket=self.driver.ticket(message))
            self.parties[message.sender].contribute(message)

    def seal(
        self,
        selection: Tensor,
        *,
        round: int = 0,
        batch_id: int = 0,
        tag: str = "",
        only: Sequence[str] | None = None,
    ) -> None:
        """Under a split scheme, ask each party that enters a sum of ``selection`` (or only
        those in ``only``) to seal its share, as the driver does, in party order."""
        for k, name in enumerate(PARTIES):
            if self.split and bool(selection[..., k].any()) and (only is None or name in only):
                self.driver.send(
                    SealRequest(
                        **self._header(name, round, batch_id),
                        **self._plan(selection, tag),
                    )
                )

    def request_sum(
        self, selection: Tensor, *, round: int = 0, batch_id: int = 0, tag: str = ""
    ) -> SumMessage:
        """Ask the server for the sums ``selection`` and take what the receiver gets."""
        self.driver.send(
            SumRequest(
                **self._header(AGGREGATOR, round, batch_id),
                **self._plan(selection, tag),
            )
        )
        summed = self.driver.take("sum", sender=AGGREGATOR, round=round, batch_id=batch_id, tag=tag)
        assert isinstance(summed, SumMessage)
        return summed

    def combine(
        self,
        messages: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        round: int = 0,
        batch_id: int = 0,
        tag: str = "",
    ) -> SumMessage:
        """One sum as a run makes it: contributions, seal requests, the sum request."""
        self.contribute(messages)
        self.seal(selection, round=round, batch_id=batch_id, tag=tag)
        return self.request_sum(selection, round=round, batch_id=batch_id, tag=tag)

    def crossed(self, kind: type[M], sender: str | None = None) -> list[M]:
        """The recorded messages of ``kind`` (from ``sender``), in order."""
        return [
            m for m in self.recorder.messages if isinstance(m, kind) and sender in (None, m.sender)
        ]

    @staticmethod
    def _plan(selection: Tensor, tag: str) -> dict[str, Any]:
        return {
            "selection": selection,
            "parties": tuple(PARTIES),
            "deliver_to": RECEIVER,
            "tag": tag,
        }


def combine(
    backend: SumBackend,
    messages: list[RepresentationMessage],
    selection: Tensor,
    *,
    round: int = 0,
    batch_id: int = 0,
    tag: str = "",
) -> Tensor:
    """The sums :data:`RECEIVER` gets for ``selection`` from a fresh federation of ``backend``."""
    return (
        SumParties(backend)
        .combine(messages, selection, round=round, batch_id=batch_id, tag=tag)
        .sums
    )


class AggregatorContract:
    """Behaviour every aggregation backend shares, checked against the plain oracle."""

    def make_aggregator(self) -> SumBackend:
        """A fresh backend under test."""
        raise NotImplementedError

    def step(self, parties: int) -> float:
        """The backend's rounding bound on a sum of ``parties`` values (0 for exact backends)."""
        return 0.0

    def assert_close_to_oracle(
        self, sums: Tensor, messages: list[RepresentationMessage], selection: Tensor
    ) -> None:
        expected, magnitude = oracle(messages, selection)
        bound = self.step(selection.shape[2]) + 2.0**-23 * selection.shape[2] * magnitude
        assert sums.dtype == torch.float32
        error = (sums.double() - expected).abs()
        assert bool((error <= bound).all()), f"largest error {float((error - bound).max())}"

    def test_random_selections_sum_like_the_plain_oracle(self) -> None:
        generator = torch.Generator().manual_seed(11)
        parties = SumParties(self.make_aggregator())
        for batch_id in range(3):
            present = torch.rand(32, 4, generator=generator) < 0.8
            messages = representations(present, 8, generator, round=5, batch_id=batch_id)
            selection = releasable_selection(present, 3, generator)
            result = parties.combine(messages, selection, round=5, batch_id=batch_id)
            self.assert_close_to_oracle(result.sums, messages, selection)
            assert torch.equal(result.counts, selection.sum(dim=2))
            assert (result.receiver, result.round, result.batch_id) == (RECEIVER, 5, batch_id)
            result.validate()

    def test_an_absent_party_is_left_out_of_every_sum(self) -> None:
        generator = torch.Generator().manual_seed(12)
        present = torch.rand(24, 4, generator=generator) < 0.9
        present[:, 2] = False  # party-2 sends nothing this batch (a missing block)
        messages = representations(present, 6, generator, round=1, batch_id=0)
        assert party_name(2) not in {m.sender for m in messages}
        selection = releasable_selection(present, 4, generator)
        result = SumParties(self.make_aggregator()).combine(messages, selection, round=1)
        self.assert_close_to_oracle(result.sums, messages, selection)
        nobody = selection.sum(dim=2) == 0
        assert bool((result.sums[nobody] == 0).all())

    def test_whole_vectors_are_summed_through_the_parties_and_the_server(self) -> None:
        generator = torch.Generator().manual_seed(13)
        vectors = {name: torch.randn(50, generator=generator) for name in PARTIES[:3]}
        total = vector_sum(self.make_aggregator(), vectors, round=2)
        expected = sum(v.double() for v in vectors.values())
        magnitude = sum(v.double().abs() for v in vectors.values())
        assert isinstance(expected, Tensor) and isinstance(magnitude, Tensor)
        bound = self.step(3) + 2.0**-23 * 3 * magnitude
        assert bool(((total.double() - expected).abs() <= bound).all())

    def test_a_sum_requested_before_its_contributions_is_served_when_the_last_comes(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        # The driver sends a step's sum request together with the requests for what it sums.
        messages, selection = full_batch(5)
        parties = SumParties(self.make_aggregator())
        request = SumRequest(**parties._header(AGGREGATOR, 0, 0), **parties._plan(selection, ""))
        parties.driver.send(request)
        with pytest.raises(ProtocolError, match="expected, found none"):
            parties.driver.take("sum", sender=AGGREGATOR, round=0, batch_id=0, tag="")
        parties.contribute(messages)
        parties.seal(selection)
        summed = parties.driver.take("sum", sender=AGGREGATOR, round=0, batch_id=0, tag="")
        assert isinstance(summed, SumMessage)
        self.assert_close_to_oracle(summed.sums, messages, selection)
        # One that waits for a batch the server moves past is dropped, with a warning ...
        later, _ = full_batch(6, round=1)
        parties.driver.send(dataclasses.replace(request, round=2))
        parties.contribute(later)
        parties.seal(selection, round=1)
        assert "never served" in caplog.text
        assert not parties.server._waiting
        # Round 0's sum again: a message the server took already; under another tag, its
        # contributions are closed all the same.
        with pytest.raises(ProtocolError, match=r"a second sum-request .*\(a replay\?\)"):
            parties.driver.send(request)
        with pytest.raises(ProtocolError, match=r"moved past"):
            parties.driver.send(dataclasses.replace(request, tag="other"))
        # ... and an abandoned step takes its waiting requests with it.
        parties.driver.send(dataclasses.replace(request, round=3))
        parties.driver.send(AbortRequest(**parties._header(AGGREGATOR, 3, 0)))
        assert not parties.server._waiting

    def test_a_selection_of_a_representation_never_sent_is_refused(self) -> None:
        generator = torch.Generator().manual_seed(14)
        present = torch.ones(8, 4, dtype=torch.bool)
        present[3, 1] = False
        messages = representations(present, 4, generator, round=0, batch_id=0)
        selection = torch.zeros(1, 8, 4, dtype=torch.bool)
        selection[0, 3, :3] = True  # party-1 is asked for its row 3
        # Sealed: party-1 refuses to seal; plain: the server refuses its representation.
        with pytest.raises(ProtocolError, match=r"did not send|of party-1 expected, found row 3"):
            SumParties(self.make_aggregator()).combine(messages, selection)


class SecureAggregatorContract(AggregatorContract):
    """What every *secure* backend adds: refusals before anything is sealed, and fresh
    contexts. Each refusal is checked to have let nothing cross (no sealed share reached the
    server) and to have spent no context: the same sum then succeeds."""

    def magnitude_limit(self) -> float:
        """The largest |value| the backend accepts (its fixed-point or encoding range)."""
        raise NotImplementedError

    def test_values_beyond_the_range_are_refused_and_spend_nothing(self) -> None:
        messages, selection = full_batch(8)
        parties = SumParties(self.make_aggregator())
        assert bool(selection[..., 1].any())
        for bad in (-1.01 * self.magnitude_limit(), float("nan")):
            values = messages[1].representation.clone()
            values[0, 0] = bad
            parties.contribute([dataclasses.replace(messages[1], representation=values)])
            with pytest.raises(ProtocolError):
                parties.seal(selection, only=[PARTIES[1]])
            assert parties.crossed(SealedMessage) == []
        # Nothing was spent by the refusals: every party seals this very sum.
        result = parties.combine(messages, selection)
        self.assert_close_to_oracle(result.sums, messages, selection)
        assert len(parties.crossed(SealedMessage, PARTIES[1])) == 1

    def test_a_sum_over_a_single_contributor_is_refused_and_changes_nothing(self) -> None:
        messages, selection = full_batch(4)
        parties = SumParties(self.make_aggregator())
        lonely = selection.clone()
        lonely[0, 5] = False
        lonely[0, 5, 2] = True
        with pytest.raises(ProtocolError, match=r"single party.*task 0, row 5, party party-2"):
            parties.combine(messages, lonely)
        assert parties.crossed(SealedMessage) == []
        result = parties.combine(messages, selection)  # the same context is still fresh
        self.assert_close_to_oracle(result.sums, messages, selection)

    def test_the_server_refuses_a_sum_over_a_single_contributor_too(self) -> None:
        messages, selection = full_batch(4)
        parties = SumParties(self.make_aggregator())
        parties.combine(messages, selection, tag="honest")
        lonely = torch.zeros_like(selection)
        lonely[0, :, 2] = True  # its shares were never asked for: the server refuses first
        with pytest.raises(ProtocolError, match=r"single party.*task 0, row 0, party party-2"):
            parties.request_sum(lonely, tag="lonely")

    def test_the_receivers_own_term_does_not_count_as_a_second_contributor(self) -> None:
        messages, selection = full_batch(4)
        parties = SumParties(self.make_aggregator())
        pair = selection.clone()
        pair[0, 3] = False
        pair[0, 3, 0] = True  # the receiver's own block ...
        pair[0, 3, 1] = True  # ... and one other: the receiver would learn party-1's term
        with pytest.raises(ProtocolError, match=r"to party-0.*row 3, party party-1"):
            parties.combine(messages, pair)
        assert parties.crossed(SealedMessage) == []
        own = selection.clone()
        own[0, 3] = False
        own[0, 3, 0] = True  # the receiver's own term alone reveals nothing new
        self.assert_close_to_oracle(parties.combine(messages, own).sums, messages, own)

    def test_a_sum_over_nobody_is_zero(self) -> None:
        messages, selection = full_batch(5)
        selection[0] = False  # task 0: nobody, beside sums with contributors
        result = SumParties(self.make_aggregator()).combine(messages, selection)
        assert bool((result.sums[0] == 0).all()) and bool((result.counts[0] == 0).all())
        self.assert_close_to_oracle(result.sums, messages, selection)

    def test_a_sealed_sum_nobody_entered_opens_to_zeros(self) -> None:
        backend = self.make_aggregator()
        assert isinstance(backend, SealingScheme)
        adder, receiver = backend.adder(), backend.receiver()
        key = receiver.public_key()
        if key is not None:
            adder.learn(RECEIVER, "receiver", key)
        payload = adder.add({}, receiver=RECEIVER, shape=(2, 16, 8), parties=4)
        members = SumMembers(
            selection=np.zeros((2, 16, 4), dtype=bool),
            parties=tuple(PARTIES),
            receiver=RECEIVER,
            context=sum_context("s", RECEIVER, 0, 0, ""),
        )
        opened = receiver.open(payload, members=members, width=8)
        assert opened.shape == (2, 16, 8) and not opened.any()

    def test_a_replayed_context_is_refused_and_another_tag_is_fresh(self) -> None:
        messages, selection = full_batch(6, round=3, batch_id=7)
        parties = SumParties(self.make_aggregator())
        first = parties.combine(messages, selection, round=3, batch_id=7, tag="train")
        # The request and the share again are messages their receivers took already ...
        with pytest.raises(ProtocolError, match=r"a second seal-request .*\(a replay\?\)"):
            parties.seal(selection, round=3, batch_id=7, tag="train")
        share = parties.crossed(SealedMessage, PARTIES[1])[-1]
        with pytest.raises(ProtocolError, match=r"a second sealed .*\(a replay\?\)"):
            parties.server.receive(share)
        # ... and were they not, the context they seal or add is spent.
        if parties.split:
            [request] = [
                m
                for m in parties.recorder.messages
                if isinstance(m, SealRequest) and m.receiver == PARTIES[1] and m.round == 3
            ]
            with pytest.raises(ProtocolError, match=r"round 3, batch 7, tag 'train' was already"):
                parties.parties[PARTIES[1]].on_seal_request(request)
            with pytest.raises(ProtocolError, match=r"round 3, batch 7, tag 'train' was already"):
                parties.server.on_sealed(share)
        again = parties.combine(messages, selection, round=3, batch_id=7, tag="predict/x")
        self.assert_close_to_oracle(first.sums, messages, selection)
        self.assert_close_to_oracle(again.sums, messages, selection)

    def test_a_representation_from_another_round_or_batch_is_not_sealed(self) -> None:
        messages, selection = full_batch(7, round=3, batch_id=7)
        parties = SumParties(self.make_aggregator())
        parties.contribute(messages)
        for round, batch_id in ((4, 7), (3, 8)):
            with pytest.raises(ProtocolError, match="did not send"):
                parties.seal(selection, round=round, batch_id=batch_id)
        assert parties.crossed(SealedMessage) == []
        result = parties.combine(messages, selection, round=3, batch_id=7)
        self.assert_close_to_oracle(result.sums, messages, selection)

    @pytest.mark.parametrize("order", ["request first", "shares first"])
    @pytest.mark.parametrize("fault", ["an item cut short", "an item too many"])
    def test_a_malformed_share_is_refused_naming_its_sender_and_nothing_of_it_kept(
        self, order: str, fault: str
    ) -> None:
        """A share whose payload does not fit its sum was kept; it failed the sum only once
        the last share or the request came (blaming that one's sender, the request lost).
        Refused as soon as its sum's request and it are both here, naming its sender; nothing
        of it is kept, so the share as its party sealed it is taken after."""
        messages, selection = full_batch(15)
        sealed: list[SealedMessage] = []

        class Malform:
            def on_message(self, message: M) -> M:
                # Party-2's first share only: sent again, it crosses intact.
                if not isinstance(message, SealedMessage) or message.sender != PARTIES[2] or sealed:
                    return message
                sealed.append(message)
                first, *rest = message.payload
                payload = (
                    (first[:-8], *rest)
                    if fault == "an item cut short"
                    else (*message.payload, first)
                )
                return dataclasses.replace(message, payload=payload)  # type: ignore[return-value]

        parties = SumParties(self.make_aggregator(), layers=[Malform()])
        request = SumRequest(**parties._header(AGGREGATOR, 0, 0), **parties._plan(selection, ""))
        refused = (
            r"^aggregator: the sealed share from party-2 for round 0, batch 0, tag '' "
            r"does not fit its sum: .*(expected|does not deserialize)"
        )
        parties.contribute(messages)
        if order == "request first":
            parties.driver.send(request)
            parties.seal(selection, only=PARTIES[:2])
            with pytest.raises(ProtocolError, match=refused):
                parties.seal(selection, only=[PARTIES[2]])
            parties.seal(selection, only=[PARTIES[3]])  # another's share is not blamed
            assert list(parties.server._waiting)  # the request still waits
        else:
            parties.seal(selection)
            with pytest.raises(ProtocolError, match=refused):
                parties.driver.send(request)
            assert not parties.server._waiting
        assert sorted(parties.server._sealed[""]) == [PARTIES[0], PARTIES[1], PARTIES[3]]
        parties.channel.post(sealed[0], sender=parties.parties[PARTIES[2]])
        if order == "shares first":
            parties.driver.send(request)
        summed = parties.driver.take("sum", sender=AGGREGATOR, round=0, batch_id=0, tag="")
        assert isinstance(summed, SumMessage)
        self.assert_close_to_oracle(summed.sums, messages, selection)

    @pytest.mark.parametrize("order", ["request first", "shares first"])
    def test_a_share_from_a_party_its_sum_does_not_select_is_refused_naming_it(
        self, order: str
    ) -> None:
        """A share the driver asked for under a tag whose sum does not select its party was
        kept; the sum then failed on whichever message came last."""
        messages, selection = full_batch(16)
        selection[..., 3] = False
        selection[selection[..., 1:].sum(dim=2) == 1] = False
        asked = selection.clone()
        asked[0, :, 3] = asked[0, :, 1]  # party-3 is asked, with party-1 in every sum it enters
        parties = SumParties(self.make_aggregator())
        request = SumRequest(**parties._header(AGGREGATOR, 0, 0), **parties._plan(selection, ""))
        refused = (
            r"^aggregator: the sealed share from party-3 for round 0, batch 0, tag '' "
            r"does not fit its sum: a share from one of \['party-0', 'party-1', 'party-2'\] "
            r"\(the contributors it selects\) expected\.$"
        )
        parties.contribute(messages)
        stray = SealRequest(**parties._header(PARTIES[3], 0, 0), **parties._plan(asked, ""))
        if order == "request first":
            parties.driver.send(request)
            parties.seal(selection, only=PARTIES[:2])
            with pytest.raises(ProtocolError, match=refused):
                parties.driver.send(stray)
            parties.seal(selection, only=[PARTIES[2]])
        else:
            parties.seal(selection)
            parties.driver.send(stray)
            with pytest.raises(ProtocolError, match=refused):
                parties.driver.send(request)
            assert sorted(parties.server._sealed[""]) == PARTIES[:3]
            parties.driver.send(request)  # the request refused was not kept: sent again
        summed = parties.driver.take("sum", sender=AGGREGATOR, round=0, batch_id=0, tag="")
        assert isinstance(summed, SumMessage)
        self.assert_close_to_oracle(summed.sums, messages, selection)

    def test_a_share_of_another_width_than_those_kept_for_its_sum_is_refused_on_arrival(
        self,
    ) -> None:
        messages, selection = full_batch(17)
        wider = dataclasses.replace(
            messages[2], representation=torch.cat([messages[2].representation] * 2, dim=1)
        )
        parties = SumParties(self.make_aggregator())
        parties.contribute([*messages[:2], wider, messages[3]])
        parties.seal(selection, only=PARTIES[:2])
        with pytest.raises(
            ProtocolError,
            match=r"^aggregator: the sealed share from party-2 for round 0, batch 0, "
            r"tag '' does not fit its sum: of width 16, where the shares kept for it "
            r"\(from party-0, party-1\) are of width 8: shares of one width expected\.$",
        ):
            parties.seal(selection, only=[PARTIES[2]])
        assert sorted(parties.server._sealed[""]) == PARTIES[:2]
