"""The seam's parts on their own: messages, channel, aggregator and party roles."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from aggregator_contract import vector_sum
from torch import Tensor, nn

from secure_vfl.errors import IntegrityError, ProtocolError
from secure_vfl.federation.aggregator import PlainAggregator
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import (
    AGGREGATOR,
    SCHEMA_VERSION,
    GradientMessage,
    HeadTask,
    Message,
    PredictTask,
    RepresentationMessage,
    RepresentRequest,
    SumMessage,
    UpdateRequest,
    check_header,
)
from secure_vfl.federation.parties import DataParty, Head, Party, gradient_messages

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


def test_message_with_non_finite_values_is_refused_on_receipt() -> None:
    message = representation("party-0", [0, 1], torch.tensor([[1.0, float("nan")], [0.0, 1.0]]))
    with pytest.raises(IntegrityError, match="finite values expected"):
        Channel().send(message)


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
    with pytest.raises(ProtocolError, match=f"schema version {SCHEMA_VERSION} expected, found 99"):
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
    delivered = channel.send(good)
    # The receiver gets its own copy, decoded from the bytes that crossed.
    assert delivered is not good and delivered.representation.data_ptr() != (
        good.representation.data_ptr()
    )
    assert torch.equal(delivered.representation, good.representation)
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


class _Inbox(Party):
    """A party that only collects what it receives, asked for or not (stands in for a label
    party)."""

    def keep(self, message: Message) -> None:
        self._inbox.append(message)


def _federation() -> tuple[DataParty, _Inbox, Channel]:
    torch.manual_seed(0)
    channel = Channel()
    party = DataParty("party-1", {"train": torch.randn(5, 3)}, nn.Linear(3, 2), None)
    driver = _Inbox("party-0")
    party.connect(channel)
    driver.connect(channel)
    return party, driver, channel


def _request(rows: list[int], positions: list[int], round: int = 7) -> RepresentRequest:
    return RepresentRequest(
        sender="party-0",
        receiver="party-1",
        round=round,
        batch_id=0,
        split="train",
        rows=torch.tensor(rows),
        positions=torch.tensor(positions),
        reply_to="party-0",
    )


def _gradient(positions: list[int], values: torch.Tensor, round: int = 7) -> GradientMessage:
    return GradientMessage(
        sender="party-0",
        receiver="party-1",
        round=round,
        batch_id=0,
        positions=torch.tensor(positions),
        gradient=values,
    )


def test_data_party_sends_detached_output_and_backward_starts_from_the_message() -> None:
    party, driver, _ = _federation()
    driver.send(_request([3, 4], [0, 1]))
    sent = driver.take("representation", sender="party-1", round=7, batch_id=0)
    assert isinstance(sent, RepresentationMessage)
    assert not sent.representation.requires_grad
    gradient = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    driver.send(_gradient([0, 1], gradient))
    driver.send(_gradient([0, 1], gradient))
    before = party.model.weight.detach().clone()
    party.optimizer = torch.optim.SGD(party.model.parameters(), lr=1.0)
    driver.send(UpdateRequest(sender="party-0", receiver="party-1", round=7, batch_id=0))
    x = party._blocks["train"][torch.tensor([3, 4])]
    expected = (2 * gradient).T @ x  # d(sum g * (xW^T + b))/dW for two identical messages
    assert torch.allclose(before - party.model.weight.detach(), expected)


def test_a_gradient_that_closes_the_step_is_the_gradient_and_the_update() -> None:
    gradient = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
    weights = []
    for closing in (False, True):
        party, driver, _ = _federation()
        party.optimizer = torch.optim.SGD(party.model.parameters(), lr=0.5, momentum=0.8)
        for round in (7, 8):  # two steps, so momentum carries from the first into the second
            driver.send(_request([3, 4], [0, 1], round=round))
            driver.send(dataclasses.replace(_gradient([0, 1], gradient, round), step=closing))
            if not closing:
                driver.send(
                    UpdateRequest(sender="party-0", receiver="party-1", round=round, batch_id=0)
                )
        assert not party._pending and not party._gradients  # nothing of either step is left
        weights.append(party.model.weight.detach().clone())
    assert torch.equal(weights[0], weights[1])
    assert not torch.equal(weights[0], _federation()[0].model.weight)  # and the steps moved it
    # A replay of a closing gradient finds no forward pass to close and is refused.
    party, driver, _ = _federation()
    driver.send(_request([3, 4], [0, 1]))
    driver.send(dataclasses.replace(_gradient([0, 1], gradient), step=True))
    with pytest.raises(ProtocolError, match="no pending forward pass"):
        driver.send(dataclasses.replace(_gradient([0, 1], gradient), step=True))


def test_gradients_are_added_up_in_the_forward_pass_order_whatever_order_they_arrive_in() -> None:
    """Over the network the heads train at once, so a forward pass's gradients arrive in any
    order; floating-point addition depends on it. A party adds them up by sender, heads in the
    driver's order and then the driver, so every arrival order steps with the same sum."""
    # In float32, (1e8 + 1) - 1e8 is 0 and (1e8 - 1e8) + 1 is 1: the order shows.
    values = {"party-2": 1e8, "party-3": -1e8, "party-0": 1.0}
    grads = []
    for order in (("party-2", "party-3", "party-0"), ("party-0", "party-2", "party-3")):
        party, driver, channel = _federation()
        heads = {name: _Inbox(name) for name in ("party-2", "party-3")}
        for head in heads.values():
            head.connect(channel)
        request = dataclasses.replace(_request([3, 4], [0, 1]), gradients_from=tuple(heads))
        driver.send(request)
        for sender in order:
            message = dataclasses.replace(
                _gradient([0, 1], torch.full((2, 2), values[sender])), sender=sender
            )
            (driver if sender == "party-0" else heads[sender]).send(message)
        driver.send(UpdateRequest(sender="party-0", receiver="party-1", round=7, batch_id=0))
        assert party.model.bias.grad is not None
        grads.append(party.model.bias.grad.clone())
    assert torch.equal(grads[0], grads[1])
    assert torch.equal(grads[0], torch.full((2,), 2.0))  # the heads' first, then the driver's


def _head_party_and_task(
    labels: list[int], *, hold: bool = False
) -> tuple[DataParty, _Inbox, HeadTask]:
    """party-1 holding a head with training ``labels``, its driver party-0 on one channel, and
    a head task of round 3 for training rows 0 and 1 (``hold``: it keeps its gradients)."""
    torch.manual_seed(0)
    channel = Channel()
    head = Head({"train": torch.tensor(labels)}, nn.Linear(2, 2), None, width=2)
    party = DataParty(
        "party-1", {"train": torch.randn(5, 3)}, nn.Linear(3, 2), None, heads={"": head}
    )
    driver = _Inbox("party-0")
    party.connect(channel)
    driver.connect(channel)
    task = HeadTask(
        sender="party-0",
        receiver="party-1",
        round=3,
        batch_id=0,
        rows=torch.tensor([0, 1]),
        weights=torch.ones(1, 2),
        normaliser=2.0,
        selection=torch.ones(1, 2, 2, dtype=torch.bool),
        present=torch.ones(2, 2, dtype=torch.bool),
        parties=("party-0", "party-1"),
        tag="train",
        hold=hold,
    )
    return party, driver, task


def test_a_head_holds_its_gradients_only_for_its_own_driver() -> None:
    party, driver, task = _head_party_and_task([0, 1], hold=True)
    with pytest.raises(ProtocolError, match="holds them only for its own driver"):
        driver.send(task)
    assert not party._tasks  # refused before it changed anything
    party.send(dataclasses.replace(task, sender="party-1"))  # its own driver's: kept
    assert list(party._tasks) == [(3, 0, "train")]
    with pytest.raises(ProtocolError, match="no held gradients"):
        party.held_gradients(3, 0)


def test_a_closing_gradient_with_heads_steps_the_receivers_head_too() -> None:
    """Under heads all the label party's head closes the other parties' steps, their heads'
    too (``heads``, as on the update it stands for); without it the head is left as it is,
    and a gradient that does not close its step cannot carry it."""
    gradient = torch.tensor([[1.0, -1.0], [0.5, 2.0]])
    moved = []
    for heads in (False, True):
        party, driver, _ = _head_party_and_task([0, 1])
        head = party.heads[""]
        head.optimizer = torch.optim.SGD(head.module.parameters(), lr=1.0)
        for parameter in head.module.parameters():
            parameter.grad = torch.ones_like(parameter)  # what its task accumulated
        before = head.module.weight.detach().clone()
        driver.send(dataclasses.replace(_request([3, 4], [0, 1], round=3), tag=""))
        closing = dataclasses.replace(_gradient([0, 1], gradient, round=3), step=True, heads=heads)
        driver.send(closing)
        assert not party._pending  # the bottom's step is closed either way
        moved.append(not torch.equal(before, head.module.weight))
    assert moved == [False, True]
    party, driver, _ = _head_party_and_task([0, 1])
    driver.send(_request([3, 4], [0, 1], round=3))
    with pytest.raises(ProtocolError, match="heads set on a gradient that does not close"):
        driver.send(dataclasses.replace(_gradient([0, 1], gradient, round=3), heads=True))
    assert list(party._pending) == [(3, "")]  # refused before it changed anything
    assert not party._gradients


def test_a_head_task_for_rows_beyond_its_labels_is_refused_on_receipt() -> None:
    """A head task naming training rows its head holds no label of was kept; its sum then
    failed in indexing (an IndexError) once the head had run, and a negative row trained the
    head on another row's label without a word."""
    party, driver, task = _head_party_and_task([0, 1, 1])
    for batch_id, rows in enumerate(([0, 3], [-1, 2]), start=1):
        wrong = dataclasses.replace(task, batch_id=batch_id, rows=torch.tensor(rows))
        with pytest.raises(
            ProtocolError,
            match=rf"^party-1: a head task from party-0 .* rows in \[0, 3\) of its labels "
            rf"expected, found \[{min(rows)}, {max(rows)}\]",
        ):
            driver.send(wrong)
        assert not party._tasks
    driver.send(task)
    assert list(party._tasks) == [(3, 0, "train")]


def test_a_sum_of_another_width_than_its_head_takes_is_refused_and_the_task_kept() -> None:
    """A sum of the right tasks and rows but another width (only a malicious aggregator sends
    one) failed inside torch ("mat1 and mat2 shapes cannot be multiplied", a RuntimeError) once
    the head task had been forgotten; it is refused naming the widths, the task kept."""
    party, driver, task = _head_party_and_task([0, 1])
    alone = torch.tensor([True, False])  # party-0 alone contributed: it alone is owed gradients
    task = dataclasses.replace(
        task, selection=alone.expand(1, 2, 2).clone(), present=alone.expand(2, 2).clone()
    )
    predict = PredictTask(
        sender="party-0",
        receiver="party-1",
        round=4,
        batch_id=0,
        positions=torch.tensor([1]),
        tag="p",
    )
    driver.send(task)
    driver.send(predict)

    def sum_for(message: HeadTask | PredictTask, width: int) -> SumMessage:
        shape = (1, 2)
        return SumMessage(
            sender=AGGREGATOR,
            receiver="party-1",
            round=message.round,
            batch_id=0,
            tag=message.tag,
            sums=torch.ones(*shape, width),
            counts=torch.ones(shape, dtype=torch.int64),
        )

    for message in (task, predict):
        with pytest.raises(
            ProtocolError,
            match=rf"^party-1: the sum '{message.tag}' of round {message.round} from aggregator: "
            r"sums of width 2 \(what its head takes\) expected, found 3\.$",
        ):
            party.receive(sum_for(message, 3))
        assert (message.round, 0, message.tag) in party._tasks
        party.receive(sum_for(message, 2))  # the right sum is still taken
        assert (message.round, 0, message.tag) not in party._tasks
    assert [m.kind for m in driver._inbox] == ["gradient", "loss", "prediction"]


def _train_sum(sums: Tensor, counts: Tensor) -> SumMessage:
    """The aggregator's sums for party-1's head task of round 3 (``_head_party_and_task``)."""
    return SumMessage(
        sender=AGGREGATOR,
        receiver="party-1",
        round=3,
        batch_id=0,
        tag="train",
        sums=sums,
        counts=counts,
    )


def _three_tasks_of_two_parts(task: HeadTask) -> tuple[HeadTask, HeadTask]:
    """``task`` with the tasks {party-0}, {party-1} and both, weighted unevenly: once with its
    sums per task, once per part ({party-0}, {party-1}), whose sums the head adds up."""
    selection = torch.tensor([[True, False], [False, True], [True, True]])
    tasks = dataclasses.replace(
        task,
        weights=torch.tensor([[1.0, 0.5], [2.0, 1.0], [0.25, 3.0]]),
        selection=selection.unsqueeze(1).expand(3, 2, 2).clone(),
        present=torch.tensor([[True, False], [True, False]]),  # party-0 is owed gradients
    )
    parts = torch.eye(2, dtype=torch.bool).unsqueeze(1).expand(2, 2, 2).clone()
    return tasks, dataclasses.replace(tasks, parts=parts)


def test_a_head_adds_up_its_tasks_sums_from_the_sums_of_their_parts() -> None:
    """Under secure sums every contributor seals its term once a step, into its own part, and
    the head adds each task's sum from its parts': the same loss and the same gradients as
    the tasks' sums delivered whole."""
    terms = torch.randn(2, 2, 2, generator=torch.Generator().manual_seed(1))  # (part, row, w)
    answers = []
    for with_parts in (False, True):
        party, driver, task = _head_party_and_task([0, 1])
        tasks, parted = _three_tasks_of_two_parts(task)
        sent = parted if with_parts else tasks
        driver.send(sent)
        sums = terms if with_parts else torch.stack([terms[0], terms[1], terms.sum(dim=0)])
        layout = sent.parts if sent.parts is not None else sent.selection
        party.receive(_train_sum(sums, layout.sum(dim=2)))
        answers.append(driver._inbox)
    plain, parted_answers = answers
    assert [m.kind for m in parted_answers] == ["gradient", "loss"]
    assert parted_answers[1].loss == pytest.approx(plain[1].loss, rel=1e-6)
    assert torch.allclose(parted_answers[0].gradient, plain[0].gradient, atol=1e-6)


def test_a_head_task_whose_parts_do_not_make_up_its_tasks_is_refused() -> None:
    """The parts must be disjoint at each row and every task a union of them; sums of the
    parts, not of the tasks, are what such a task takes."""
    party, driver, task = _head_party_and_task([0, 1])
    _, parted = _three_tasks_of_two_parts(task)
    assert parted.parts is not None
    both = torch.ones(1, 2, 2, dtype=torch.bool)
    for parts, found in (
        (torch.cat([parted.parts, both]), "disjoint parts expected, found a party in two"),
        (parted.parts[:1], "each task a union of parts expected"),
        (parted.parts[:, :1], r"parts \(S, 2, 2\) expected, found \(2, 1, 2\)"),
    ):
        with pytest.raises(ProtocolError, match=found):
            driver.send(dataclasses.replace(parted, parts=parts))
        assert not party._tasks
    driver.send(parted)
    with pytest.raises(
        ProtocolError, match=r"sums of \(parts, rows\) \(2, 2\) expected, found \(3, 2\)"
    ):
        party.receive(_train_sum(torch.zeros(3, 2, 2), parted.selection.sum(dim=2)))
    assert (3, 0, "train") in party._tasks


def test_data_party_refuses_gradients_it_did_not_ask_for() -> None:
    _, driver, _ = _federation()
    with pytest.raises(ProtocolError, match="no pending forward pass"):
        driver.send(_gradient([0], torch.ones(1, 2), round=1))
    driver.send(_request([0, 1], [0, 1], round=1))
    with pytest.raises(ProtocolError, match="rows of width 2 sent expected"):
        driver.send(_gradient([0], torch.ones(1, 2), round=1))


def test_a_replayed_request_is_refused_and_changes_nothing() -> None:
    party, driver, _ = _federation()
    driver.send(_request([0, 1], [0, 1]))
    pending = dict(party._pending)
    with pytest.raises(ProtocolError, match=r"a second represent-request .*\(a replay\?\)"):
        driver.send(_request([2, 3], [0, 1]))
    with pytest.raises(ProtocolError, match="replayed request"):  # not the same message
        driver.send(dataclasses.replace(_request([2, 3], [0, 1]), batch_id=1))
    assert party._pending.keys() == pending.keys()
    assert party._pending[(7, "")][0] is pending[(7, "")][0]


def test_a_party_sends_only_in_its_own_name_and_to_parties_that_exist() -> None:
    _, driver, _ = _federation()
    forged = dataclasses.replace(_request([0], [0]), sender="aggregator")
    with pytest.raises(ProtocolError, match="posted by 'party-0'"):
        driver.send(forged)
    with pytest.raises(ProtocolError, match="no such party"):
        driver.send(dataclasses.replace(_request([0], [0]), receiver="party-9"))


def test_a_request_for_rows_the_party_does_not_hold_is_refused() -> None:
    party, driver, _ = _federation()
    with pytest.raises(ProtocolError, match="rows < 5"):
        driver.send(_request([5], [0]))
    assert not party._pending


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
    total = vector_sum(PlainAggregator(), contributions, channel=Channel([recorder]), round=4)
    assert total.tolist() == [11.0, 22.0]
    # The driver's ticket key (once per session) comes before the first contribution.
    kinds = ["ticket-key", "representation", "representation", "sum-request", "sum"]
    assert recorder.kinds() == kinds
    assert all(m.round == 4 for m in recorder.messages[1:])
    with pytest.raises(ProtocolError, match=r"of width 3, where .* \(from a\) are of width 2"):
        vector_sum(PlainAggregator(), {"a": torch.ones(2), "b": torch.ones(3)})
