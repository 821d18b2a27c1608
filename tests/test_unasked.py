"""Every reply of a run sent again from a party that was not asked, or for another round or
batch: refused by its receiver, and nothing changes (issue 10: "a message from the wrong
sender, for the wrong round ... refused ... and change no party's state", per kind; F17 in
docs/security-review.md). Before, such a sum, loss, likelihood, latent gradient or
representation waited in its receiver's inbox for good, and a public key was learnt in a role
its sender does not hold; and a contribution to the aggregation server (a representation or a
sealed share) was kept for a batch the server had not seen, or moved the server past the batch
it was collecting. A reply is what answers a request: the driver's own kinds
(:data:`~secure_vfl.federation.messages.DRIVEN_KINDS`) at another round are the driver driving,
not replies. A contribution is refused by its ticket (:mod:`secure_vfl.federation.tickets`)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterator

import pytest
from conftest import MakeData
from test_replays import CASES, _trains_as_its_twin, twins

from secure_vfl.errors import ProtocolError
from secure_vfl.federation.messages import (
    AGGREGATOR,
    DRIVEN_KINDS,
    Message,
    RepresentRequest,
    SealRequest,
)
from secure_vfl.federation.parties import Party
from secure_vfl.federation.tickets import Contribution, TicketCheck, new_ticket_key


def _unasked(message: Message, names: list[str]) -> Iterator[tuple[str, Message]]:
    """``message`` as its receiver never asked for it: from each other party in that party's
    own name, and from its sender for rounds before and after it and for another batch."""
    for other in names:
        if other not in (message.sender, message.receiver):
            yield other, dataclasses.replace(message, sender=other)
    for shift in (-1, 1, 2, 50):
        if message.round + shift >= 0:
            moved = dataclasses.replace(
                message, round=message.round + shift, batch_id=message.batch_id + 7
            )
            yield message.sender, moved
    yield message.sender, dataclasses.replace(message, batch_id=message.batch_id + 1)


def _reply(message: Message) -> bool:
    return message.kind not in DRIVEN_KINDS


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("method", "backend", "heads"), list(CASES))
def test_every_reply_sent_unasked_is_refused_and_changes_nothing(
    make_data: MakeData, method: str, backend: str, heads: str
) -> None:
    run, twin, recorder, rows = twins(make_data, method, backend, heads)
    channel = run.fed.channel
    names = sorted(channel.parties)
    inboxes = {name: len(party._inbox) for name, party in channel.parties.items()}
    refused: Counter[str] = Counter()
    for message in [m for m in recorder.messages if _reply(m)]:
        receiver = channel.parties[message.receiver].name
        for sender, unasked in _unasked(message, names):
            with pytest.raises(ProtocolError, match=f"^{receiver}: "):
                channel.parties[sender].send(unasked)
            refused[message.kind] += 1
    kinds = {m.kind for m in recorder.messages if _reply(m)}
    assert set(refused) == kinds and kinds & {"loss", "sum", "sealed-sum", "gradient"}, kinds
    assert kinds & {"representation", "sealed"}, kinds  # the contributions too
    assert {name: len(party._inbox) for name, party in channel.parties.items()} == inboxes
    _trains_as_its_twin(run, twin, rows)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_a_gradient_from_a_party_whose_head_did_not_train_on_the_pass_is_refused(
    make_data: MakeData, backend: str
) -> None:
    """Under ``--heads active`` each party's forward pass stays open between two steps (the
    driver holds the closing gradients back until its next send). A gradient for it from
    another data party or the aggregation server, in its own name, was added to the pass and
    the next step moved the model; only the driver and the parties whose heads train on the
    pass (its request names them) send its gradients."""
    run, twin, _, rows = twins(make_data, "laser", backend, "active")
    held = [m for m in run.fed.own.deferred if m.kind == "gradient"]
    assert held  # the closing gradients of round 1, whose passes are open
    channel = run.fed.channel
    for gradient in held:
        for forger in sorted({*channel.parties} - {gradient.sender, gradient.receiver}):
            forged = dataclasses.replace(
                gradient, sender=forger, step=False, heads=False, batch_id=9
            )
            with pytest.raises(ProtocolError, match="takes gradients from \\['party-0'\\] only"):
                channel.parties[forger].send(forged)
    _trains_as_its_twin(run, twin, rows)


class _Sidestep:
    """An outgoing hook of a contributor that, before its next contribution (of ``kind``) to
    the aggregation server leaves, sends the server a contribution of its own for the next round
    (a sum nobody asked for), in its own name: the refusal it gets is kept."""

    def __init__(self, party: Party, kind: str) -> None:
        self.party, self.kind = party, kind
        self.sent = False
        self.refusals: list[str] = []

    def on_message(self, message: Message) -> Message:
        contribution = message.receiver == AGGREGATOR and message.kind == self.kind
        if contribution and not self.sent:
            self.sent = True  # (the share sent below passes this hook too)
            ahead = dataclasses.replace(message, round=message.round + 1, tag="ahead")
            try:
                self.party.send(ahead)
            except ProtocolError as error:
                self.refusals.append(str(error))
            else:
                self.refusals.append("")
        return message


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("backend", "heads"), [("plain", "all"), ("masks", "active")])
def test_a_contribution_for_the_next_round_sent_mid_batch_leaves_the_batch_alone(
    make_data: MakeData, backend: str, heads: str
) -> None:
    """While the aggregation server collects a batch, a contributor sends it a share of its own
    for the next round. The server took it as the start of that round and moved past the batch
    it was collecting, whose last shares it then refused ("a batch it has moved past"): one
    party stopped the run. Refused on arrival by its ticket, it leaves the batch alone."""
    run, twin, _, rows = twins(make_data, "laser", backend, heads)
    last = run.fed.names[-1]
    party = run.fed.channel.parties[last]
    assert isinstance(party, Party)
    sidestep = _Sidestep(party, "sealed" if backend == "masks" else "representation")
    party.outgoing.append(sidestep)
    _trains_as_its_twin(run, twin, rows)
    assert len(sidestep.refusals) == 1
    assert sidestep.refusals[0].startswith("aggregator: ")
    assert "that the driver did not ask for" in sidestep.refusals[0]


@pytest.mark.usefixtures("one_thread")
def test_a_ticket_is_for_one_kind_of_contribution_and_a_held_one_gets_none(
    make_data: MakeData,
) -> None:
    """Under a secure sum a representation for the aggregator is held and sealed later: its
    request carried a ticket all the same, which its contributor could put on a sealed share
    the driver never asked for (a helper's review: kept, unused). Now only what is sent gets a
    ticket, and a ticket names the kind of contribution it is for."""
    _, _, recorder, _ = twins(make_data, "laser", "masks", "active")
    asked = [m for m in recorder.messages if isinstance(m, RepresentRequest)]
    sealing = [m for m in recorder.messages if isinstance(m, SealRequest)]
    assert asked and all(m.reply_to == AGGREGATOR and m.ticket == b"" for m in asked)
    assert sealing and all(len(m.ticket) == 32 for m in sealing)
    key, check = new_ticket_key(), TicketCheck()
    check.learn("s", key, by="aggregator")
    named = Contribution(
        kind="representation",
        session="s",
        contributor="party-1",
        round=3,
        batch_id=0,
        phase="train",
        tag="t",
    )
    check.check(named, named.ticket(key), by="aggregator")
    as_sealed = dataclasses.replace(named, kind="sealed")
    with pytest.raises(ProtocolError, match=r"a sealed share from party-1 .* did not ask for"):
        check.check(as_sealed, named.ticket(key), by="aggregator")
