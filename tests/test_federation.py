"""The seam's parts on their own: messages, channel, aggregator and party roles."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from secure_vfl.errors import IntegrityError, ProtocolError
from secure_vfl.federation.aggregator import PlainAggregator, sum_vectors
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import (
    AGGREGATOR,
    GradientMessage,
    RepresentationMessage,
    check_header,
)
from secure_vfl.federation.parties import DataParty, gradient_messages

PARTIES = ["party-0", "party-1", "party-2"]


def representation(sender: str, positions: list[int], values: torch.Tensor, **header: int):
    return RepresentationMessage(
        sender=sender,
        receiver=AGGREGATOR,
        round=header.get("round", 0),
        batch_id=header.get("batch_id", 0),
        positions=torch.tensor(positions, dtype=torch.int64),
        representation=values,
    )


def test_message_with_non_finite_values_is_refused() -> None:
    message = representation("party-0", [0, 1], torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(IntegrityError, match="non-finite"):
        message.validate()


def test_message_with_wrong_dtype_shape_or_graph_is_refused() -> None:
    with pytest.raises(ProtocolError, match="float32"):
        representation("party-0", [0], torch.ones(1, 2, dtype=torch.float64)).validate()
    with pytest.raises(ProtocolError, match="2 rows announced, found 1"):
        representation("party-0", [0, 1], torch.ones(1, 2)).validate()
    with pytest.raises(ProtocolError, match="detached"):
        representation("party-0", [0], torch.ones(1, 2, requires_grad=True)).validate()
    with pytest.raises(ProtocolError, match="strictly increasing"):
        representation("party-0", [1, 0], torch.ones(2, 2)).validate()


def test_message_from_another_schema_version_is_refused() -> None:
    message = dataclasses.replace(
        representation("party-0", [0], torch.ones(1, 2)), schema_version=99
    )
    with pytest.raises(ProtocolError, match="schema version 1 expected, found 99"):
        message.validate()


def test_replayed_message_from_another_round_or_batch_is_refused() -> None:
    message = representation("party-0", [0], torch.ones(1, 2), round=3, batch_id=1)
    check_header(message, sender="party-0", receiver=AGGREGATOR, round=3, batch_id=1)
    with pytest.raises(ProtocolError, match="round 4 expected, found 3"):
        check_header(message, receiver=AGGREGATOR, round=4, batch_id=1)
    with pytest.raises(ProtocolError, match="batch_id 2 expected, found 1"):
        check_header(message, receiver=AGGREGATOR, round=3, batch_id=2)
    with pytest.raises(ProtocolError, match="sender 'party-1' expected"):
        check_header(message, sender="party-1", receiver=AGGREGATOR, round=3, batch_id=1)


def test_channel_layers_see_messages_in_order_and_transport_validates() -> None:
    recorder = RecordingLayer()
    channel = Channel([recorder])
    good = representation("party-0", [0], torch.ones(1, 2))
    assert channel.send(good) is good
    bad = representation("party-1", [0], torch.full((1, 2), float("inf")))
    with pytest.raises(IntegrityError):
        channel.send(bad)
    assert [m.sender for m in recorder.messages] == ["party-0", "party-1"]


def test_plain_aggregator_sums_exactly_the_selected_contributions() -> None:
    a = representation("party-0", [0, 1, 2], torch.tensor([[1.0], [2.0], [3.0]]))
    b = representation("party-1", [1, 2], torch.tensor([[10.0], [20.0]]))
    c = representation("party-2", [0, 2], torch.tensor([[100.0], [300.0]]))
    selection = torch.tensor(
        [
            [[True, False, True], [True, True, False], [True, True, True]],
            [[False, False, True], [False, True, False], [False, False, False]],
        ]
    )
    summed = PlainAggregator().combine(
        [a, b, c], selection, parties=PARTIES, receiver="party-0", round=0, batch_id=0
    )
    assert summed.sums[..., 0].tolist() == [[101.0, 12.0, 323.0], [100.0, 10.0, 0.0]]
    assert summed.counts.tolist() == [[2, 2, 3], [1, 1, 0]]


def test_aggregator_refuses_selection_of_a_representation_never_sent() -> None:
    a = representation("party-0", [0], torch.ones(1, 1))
    selection = torch.tensor([[[True, True, False]]])
    with pytest.raises(ProtocolError, match="did not send"):
        PlainAggregator().combine(
            [a], selection, parties=PARTIES, receiver="party-0", round=0, batch_id=0
        )


def test_aggregator_refuses_duplicate_or_unknown_senders() -> None:
    a = representation("party-0", [0], torch.ones(1, 1))
    selection = torch.ones(1, 1, 3, dtype=torch.bool)
    with pytest.raises(ProtocolError, match="two representations"):
        PlainAggregator().combine(
            [a, a], selection, parties=PARTIES, receiver="party-0", round=0, batch_id=0
        )
    stranger = representation("mallory", [0], torch.ones(1, 1))
    with pytest.raises(ProtocolError, match="unknown party 'mallory'"):
        PlainAggregator().combine(
            [stranger], selection, parties=PARTIES, receiver="party-0", round=0, batch_id=0
        )


def _party() -> DataParty:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    return DataParty("party-0", {"train": torch.randn(5, 3)}, model, None)


def test_data_party_sends_detached_output_and_backward_starts_from_the_message() -> None:
    party = _party()
    positions = torch.tensor([0, 1])
    sent = party.represent(
        "train",
        torch.tensor([3, 4]),
        positions,
        receiver=AGGREGATOR,
        round=7,
        batch_id=0,
        train=True,
    )
    assert not sent.representation.requires_grad
    gradient = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    message = GradientMessage(
        sender="party-1",
        receiver="party-0",
        round=7,
        batch_id=0,
        positions=positions,
        gradient=gradient,
    )
    party.backward([message, message], round=7)
    x = party._blocks["train"][torch.tensor([3, 4])]
    expected = (2 * gradient).T @ x  # d(sum g * (xW^T + b))/dW for two identical messages
    assert party.model.weight.grad is not None
    assert torch.allclose(party.model.weight.grad, expected)


def test_data_party_refuses_gradients_it_did_not_ask_for() -> None:
    party = _party()
    gradient = GradientMessage(
        sender="party-1",
        receiver="party-0",
        round=1,
        batch_id=0,
        positions=torch.tensor([0]),
        gradient=torch.ones(1, 2),
    )
    with pytest.raises(ProtocolError, match="no pending forward pass"):
        party.backward([gradient], round=1)
    party.represent(
        "train",
        torch.tensor([0, 1]),
        torch.tensor([0, 1]),
        receiver=AGGREGATOR,
        round=1,
        batch_id=0,
        train=True,
    )
    with pytest.raises(ProtocolError, match="do not match"):
        party.backward([gradient], round=1)


def test_gradient_messages_cover_exactly_the_rows_each_party_sent() -> None:
    present = torch.tensor([[True, False], [True, True], [False, True]])
    dense = torch.arange(12, dtype=torch.float32).view(2, 3, 2)
    messages = gradient_messages(
        "party-0", dense, present, ["party-0", "party-1"], round=0, batch_id=0
    )
    assert [m.positions.tolist() for m in messages] == [[0, 1], [1, 2]]
    assert torch.equal(messages[1].gradient, dense[1, 1:])


def test_vector_sums_go_through_the_channel_and_the_aggregator() -> None:
    recorder = RecordingLayer()
    contributions = {"client-0": torch.tensor([1.0, 2.0]), "client-1": torch.tensor([10.0, 20.0])}
    total = sum_vectors(
        PlainAggregator(), Channel([recorder]), contributions, receiver="server", round=4
    )
    assert total.tolist() == [11.0, 22.0]
    assert recorder.kinds() == ["representation", "representation", "sum"]
    assert all(m.round == 4 for m in recorder.messages)
    with pytest.raises(ProtocolError, match="flat vector"):
        sum_vectors(
            PlainAggregator(), Channel(), {"c": torch.ones(2, 2)}, receiver="server", round=0
        )
