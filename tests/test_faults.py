"""A data party lost mid-step, in one process: a channel that loses a party when a chosen
message is posted to it (the process tests in test_deploy.py kill a real process, which is
always noticed at the start of a step; these reach the other places a step can break)."""

from __future__ import annotations

import dataclasses
import logging
import time
import types
import warnings
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from conftest import MakeData

from protocols.privacy import PrivacyEngine, PrivacySpec
from protocols.secagg import MaskingAggregator
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ProtocolError, RunWarning, TransportError
from secure_vfl.experiment import TrainConfig, run_training
from secure_vfl.federation import network
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    AGGREGATOR,
    LossMessage,
    Message,
    SealRequest,
    TicketKeyMessage,
    UpdateRequest,
)
from secure_vfl.federation.parties import Party
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.laser import MeanFusionMethod

FAST = MethodConfig(epochs=3, batch_size=64, lr=0.05)
LOST = "party-2"
STEP = 4  # the round (0-based) in which it is lost


class LosingChannel(Channel):
    """Loses ``LOST`` when the first ``kind`` of round ``step`` (default ``STEP``; with
    ``closing``, the first gradient that closes its step) is posted to it: that post and every
    later one to it raise TransportError, and :meth:`unreachable` names it from then on.
    ``after_loss`` counts the posts to it once it is lost."""

    def __init__(self, kind: str, *, step: int = STEP, closing: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self.step = step
        self.closing = closing  # only a gradient that closes its receiver's step loses it
        self.lost = False
        self.after_loss = 0
        self.posted: list[Message] = []

    def post(self, message: Message, *, sender: Party) -> None:
        self.posted.append(message)
        if message.receiver == LOST:
            chosen = message.kind == self.kind and message.round == self.step
            if chosen and getattr(message, "step", False) >= self.closing and not self.lost:
                self.lost = True
            elif self.lost:
                self.after_loss += 1
            if self.lost:
                raise TransportError(f"{message.kind} to {LOST}: its process is gone")
        super().post(message, sender=sender)

    def unreachable(self, names: list[str]) -> list[str]:  # type: ignore[override]
        return [name for name in names if self.lost and name == LOST]


def _train(
    data: VerticalData, config: MethodConfig, channel: Channel, **kwargs: object
) -> MeanFusionMethod:
    method = METHODS.get("laser")(data, config, seed=3, channel=channel, **kwargs)  # type: ignore[arg-type]
    assert isinstance(method, MeanFusionMethod)
    method.fit()
    return method


@pytest.mark.parametrize(
    ("changes", "kind", "closing"),
    [
        ({"heads": "all"}, "represent-request", False),  # noticed by the driver itself
        ({"heads": "all"}, "gradient", False),  # inside a head, inside the aggregator's delivery
        ({"heads": "all"}, "head-task", False),  # after two heads trained and sent their gradients
        # The label party's head's closing gradient: the step's last message to it, held back
        # for the next step's first, lost there (heads active: its only gradient).
        ({"heads": "all"}, "gradient", True),
        # Chunked tasks (one a task size): the label party's head trains several, holds none,
        # and the update closes the step: the other parties complete it.
        ({"heads": "all", "vectorised": False}, "update", False),
        ({"heads": "active"}, "represent-request", False),
        ({"heads": "active"}, "gradient", True),
    ],
    ids=["all-request", "all-gradient", "all-head-task", "all-closing", "all-chunked-update",
         "active-request", "active-closing"],
)  # fmt: skip
def test_a_party_lost_mid_step_is_dropped_and_training_goes_on(
    make_data: MakeData, changes: dict[str, Any], kind: str, closing: bool
) -> None:
    data = make_data(train_missing="mcar:0.2")
    channel = LosingChannel(kind, closing=closing)
    method = _train(data, dataclasses.replace(FAST, **changes), channel)
    assert channel.lost
    noticed = STEP + 1 if closing else STEP
    assert method.fed.faults == [
        {
            "party": LOST,
            "step": noticed + 1,
            "epoch": noticed // len(method.sampler) + 1,
            "phase": "training",
            "what": f"{kind} to {LOST}: its process is gone",
        }
    ]
    assert channel.after_loss == 0  # nothing was sent to it again
    for name in data.tests:
        predicted = method.predict(name)
        assert (predicted[:, 2] == -1).all()  # its block is missing in evaluation
        assert (predicted >= 0).any(axis=1).all()  # and every sample is still predicted


class RefusingOnLoss(LosingChannel):
    """Over the network, a reply that came while the label party waited on the send that
    found ``LOST`` gone (the aggregator's sum for its own head) may have been refused, its
    gradient to ``LOST`` failing; nobody waits for that reply, so the label party's next wait
    raises the refusal. Here the retry's first request does, unless :meth:`forget_refusals`
    forgot it."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.refusals: list[str] = []
        self.forgotten: list[str] = []

    def post(self, message: Message, *, sender: Party) -> None:
        if self.refusals and message.kind == "represent-request":  # the retry's first
            raise ProtocolError(self.refusals.pop())
        try:
            super().post(message, sender=sender)
        except TransportError:
            if not self.forgotten:
                self.refusals.append(f"party-0 refused sum from aggregator: gradient to {LOST}")
            raise

    def forget_refusals(self) -> list[str]:
        self.forgotten += self.refusals
        forgotten, self.refusals = self.refusals, []
        return forgotten


def test_a_refused_reply_to_the_attempt_a_party_was_lost_in_does_not_fail_the_retry(
    make_data: MakeData,
) -> None:
    channel = RefusingOnLoss("head-task")
    method = _train(
        make_data(train_missing="mcar:0.2"), dataclasses.replace(FAST, heads="all"), channel
    )
    assert channel.forgotten == [f"party-0 refused sum from aggregator: gradient to {LOST}"]
    assert [fault["party"] for fault in method.fed.faults] == [LOST]


def test_a_party_lost_at_its_closing_gradient_leaves_the_step_to_the_others(
    make_data: MakeData,
) -> None:
    # With the label party's head alone, a gradient is the last message of a party's step: it
    # goes once the step's loss is in, ahead of the party's next request (one delivery). Lost
    # there, the step it closes stands (the others have applied it: it is not retried, and
    # each of their closing gradients went once); the next one is abandoned and retried
    # without the lost party, as when a party is found lost at a step's start.
    data = make_data(train_missing="mcar:0")
    channel = LosingChannel("gradient")
    method = _train(data, dataclasses.replace(FAST, heads="active"), channel)
    assert [(fault["party"], fault["step"]) for fault in method.fed.faults] == [(LOST, STEP + 2)]
    in_step = [m for m in channel.posted if m.round == STEP]
    assert sum(m.kind == "represent-request" for m in in_step) == 3  # asked once: no retry
    assert not any(m.kind == "abort" for m in in_step)
    closing = [m.receiver for m in in_step if m.kind == "gradient"]
    assert sorted(closing) == ["party-1", "party-2", "party-3"]
    assert all(m.step for m in in_step if m.kind == "gradient")
    after = [m for m in channel.posted if m.round == STEP + 1]
    aborted = sorted(m.receiver for m in after if m.kind == "abort")
    assert aborted == ["aggregator", "party-1", "party-3"]  # the label party's own: in place
    asked = [m.receiver for m in after if m.kind == "represent-request"]
    assert sorted(asked) == ["party-1", "party-1", "party-3", "party-3"]  # retried


def _state(method: MeanFusionMethod) -> list[torch.Tensor]:
    parties = [p for p in in_process_parties(method.fed.channel) if p.name != LOST]
    modules = [p.model for p in parties] + [h.module for p in parties for h in p.heads.values()]
    return [t.detach().clone() for m in modules for t in m.parameters()]


def test_an_abandoned_step_leaves_nothing_behind(make_data: MakeData, one_thread: None) -> None:
    # Lost at its first gradient (head 0 has trained, nothing else) or at its head task (heads
    # 0 and 1 have trained and sent gradients to every party): both abandon the step after
    # its plan was drawn and retry it, so if the survivors discard all the attempt left, the
    # two runs are the same run.
    data = make_data(train_missing="mcar:0.2")
    config = dataclasses.replace(FAST, heads="all")
    early = _train(data, config, LosingChannel("gradient"))
    late = _train(data, config, LosingChannel("head-task"))
    for a, b in zip(_state(early), _state(late), strict=True):
        assert torch.equal(a, b)
    for name in data.tests:
        assert np.array_equal(early.predict(name), late.predict(name))


def test_under_masks_the_lost_partys_late_share_is_refused(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0.2")
    channel = LosingChannel("seal-request")
    config = dataclasses.replace(FAST, heads="active", secure_sums=True)
    method = _train(data, config, channel, aggregator=MaskingAggregator())
    assert [fault["party"] for fault in method.fed.faults] == [LOST]
    # The seal request it never acted on: it does so now, late, and its share reaches the
    # aggregator after the step was abandoned (and retried under fresh sum contexts).
    [request] = [
        m
        for m in channel.posted
        if isinstance(m, SealRequest) and m.receiver == LOST and m.round == STEP
    ]
    lost = channel.parties[LOST]
    with pytest.raises(ProtocolError, match="abandoned"):
        lost.receive(request)


class LosingInEvaluation(Channel):
    """Loses ``LOST`` when the first message of the prediction pass over ``split`` is posted to
    it (its representations for that pass: the process died after training)."""

    def __init__(self, split: str) -> None:
        super().__init__()
        self.split = split
        self.lost = False
        self.posted: list[Message] = []

    def post(self, message: Message, *, sender: Party) -> None:
        self.posted.append(message)
        if message.receiver == LOST:
            if getattr(message, "tag", "") == f"predict/{self.split}":
                self.lost = True
            if self.lost:
                raise TransportError(f"{message.kind} to {LOST}: its process is gone")
        super().post(message, sender=sender)

    def unreachable(self, names: list[str]) -> list[str]:  # type: ignore[override]
        return [name for name in names if self.lost and name == LOST]


@pytest.mark.parametrize(("heads", "secure"), [("all", False), ("active", False), ("active", True)])
def test_a_party_lost_in_evaluation_is_dropped_and_the_split_is_predicted_without_it(
    make_data: MakeData, one_thread: None, heads: str, secure: bool
) -> None:
    data = make_data(train_missing="mcar:0.2")
    first, second = data.tests  # lost while the second split is predicted
    config = dataclasses.replace(FAST, heads=heads, secure_sums=secure)

    def train(channel: Channel) -> MeanFusionMethod:
        aggregator = MaskingAggregator() if secure else None
        return _train(data, config, channel, aggregator=aggregator)

    losing = LosingInEvaluation(second)
    method = train(losing)
    before = method.predict(first)
    assert not losing.lost and (before[:, 2] >= 0).any()  # the first split still has it
    after = method.predict(second)
    assert losing.lost
    steps = method.total_steps
    assert method.fed.faults == [
        {
            "party": LOST,
            "step": steps,
            "epoch": FAST.epochs,
            "phase": "evaluation",
            "what": f"represent-request to {LOST}: its process is gone",
        }
    ]
    assert (after[:, 2] == -1).all() and (after >= 0).any(axis=1).all()
    # The failed pass was abandoned at the aggregator: the lost party's representations for
    # it, should they arrive late, are refused, never added (under masks it only holds them
    # for a seal request that never comes).
    [request] = [
        m
        for m in losing.posted
        if m.receiver == LOST and getattr(m, "tag", "") == f"predict/{second}"
    ]
    if secure:
        posted = len(losing.posted)
        losing.parties[LOST].receive(request)
        assert len(losing.posted) == posted
    else:
        with pytest.raises(ProtocolError, match="abandoned"):
            losing.parties[LOST].receive(request)
    # The same trained federation, told of the loss before it predicts: the same predictions
    # (the failed pass left nothing behind at the parties that carried on).
    reference = train(Channel())
    reference.fed.drop(LOST, round=steps - 1, what="gone")
    assert np.array_equal(after, reference.predict(second))
    assert np.array_equal(method.predict(first), reference.predict(first))


def test_the_summary_says_when_a_party_was_lost_in_evaluation_or_at_a_checkpoint() -> None:
    from secure_vfl.cli import _fault_lines

    faults = [
        {"party": "shop", "step": 3, "epoch": 1, "phase": "training", "what": "gone"},
        {"party": "shop", "step": 9, "epoch": 2, "phase": "training", "what": "rejoined"},
        {"party": "telco", "step": 12, "epoch": 2, "phase": "evaluation", "what": "gone"},
        {"party": "insurer", "step": 10, "epoch": 2, "phase": "checkpoint", "what": "gone"},
        {"party": "insurer", "step": 13, "epoch": 3, "what": "rejoined", "restored": 5},
    ]
    assert _fault_lines(faults) == [
        "lost: shop at step 3 (epoch 1); its block was missing until it rejoined",
        "rejoined: shop at step 9 (epoch 2), set up anew (initial models); its block took part "
        "again from then on",
        "lost: telco in the evaluation after step 12 (epoch 2); its block was missing from then on",
        "lost: insurer when asked for its checkpoint of step 10 (epoch 2); its block was missing "
        "until it rejoined",
        "rejoined: insurer at step 13 (epoch 3), set up anew (from its checkpoint of step 5); its "
        "block took part again from then on",
    ]


@pytest.mark.parametrize("method", ["standard", "plugvfl", "combinatorial"])
def test_a_method_that_needs_every_party_stops_on_a_lost_one_and_names_it(
    make_data: MakeData, method: str
) -> None:
    data = make_data(train_missing="mcar:0.2")
    channel = LosingChannel("represent-request")
    trainer = METHODS.get(method)(data, FAST, seed=3, channel=channel)
    with pytest.raises(TransportError, match="false-vfl-2 go on without a lost party") as raised:
        trainer.fit()  # a lost party the run cannot go on without: exit 1 (it was 2)
    assert channel.lost
    assert str(raised.value).startswith(
        f"{LOST} can no longer be reached (represent-request to {LOST}: its process is gone). "
        "This method needs every data party's representation of every row it trains on, so "
        "the run stops"
    )
    assert isinstance(raised.value.__cause__, TransportError)
    assert raised.value.party == LOST  # the end of the run need not warn of it again
    assert not trainer.fed.faults  # nothing was dropped: the run stops


def _empty_draw_run(method: str, channel: LosingChannel) -> tuple[PrivacyEngine, Any]:
    """A DP-SGD run of ``method`` on wine at batch 2 whose draw 10 holds no row (seed 2 of the
    reproducible sample), through ``channel``: the result, or the error it raised."""
    spec = PrivacySpec(dp_sgd=(1.0, 1.0), insecure_reproducible_noise=True, seed=2)
    config = TrainConfig(
        method=method,
        dataset="wine",
        train_missing="mcar:0.2",
        method_config=MethodConfig(heads="active", epochs=1, batch_size=2, lr=0.01),
    )
    engine = PrivacyEngine(spec)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RunWarning)
            outcome: Any = run_training(config, privacy=engine, channel=channel)
    except TransportError as error:
        outcome = error
    assert engine.poisson is not None
    assert [engine.poisson.schedule[t].size for t in (9, 10)] == [3, 0]  # as the test needs
    return engine, outcome


def test_a_party_lost_by_a_closing_gradient_before_an_empty_draw_is_dropped_once() -> None:
    """The closing gradients of step 9 wait to go with the next message to each party: after
    an empty draw that is its update, so both were sent together, and the party lost there
    was dropped twice (a ProtocolError ended the run)."""
    _, result = _empty_draw_run("laser", LosingChannel("gradient", step=9, closing=True))
    assert not isinstance(result, Exception), result
    assert [(f["party"], f["step"]) for f in result.faults] == [(LOST, 11)]


def test_a_party_lost_at_an_empty_draw_stops_a_method_that_needs_it_and_names_it() -> None:
    """An empty draw's update finds the party gone: the run stops as at any step, naming the
    party (its `party` is what the end of the run reads not to warn of it again)."""
    _, raised = _empty_draw_run("plugvfl", LosingChannel("update", step=10))
    assert isinstance(raised, TransportError)
    assert str(raised).startswith(f"{LOST} can no longer be reached (update to {LOST}")
    assert raised.party == LOST


def test_a_lost_aggregation_server_is_named_whatever_refusal_said_it(
    make_data: MakeData,
) -> None:
    """A data party's refusal of a seal request (it could not reach the aggregator) stopped the
    run as that party's protocol error (exit 2), naming the wrong party."""
    data = make_data(train_missing="mcar:0.2")
    channel = LosingChannel("represent-request")
    channel.unreachable = lambda names: [AGGREGATOR] if channel.lost else []  # type: ignore[method-assign]
    with pytest.raises(
        TransportError, match="the aggregation server can no longer be reached"
    ) as raised:
        _train(data, FAST, channel)
    assert raised.value.party == AGGREGATOR


def test_a_method_that_needs_every_party_passes_on_a_protocol_error_with_nobody_lost(
    make_data: MakeData,
) -> None:
    # The same refusal with every party reachable is a protocol error, not a fault: unchanged.
    data = make_data(train_missing="mcar:0.2")
    channel = LosingChannel("represent-request")
    channel.unreachable = lambda names: []  # type: ignore[method-assign]
    trainer = METHODS.get("standard")(data, FAST, seed=3, channel=channel)
    with pytest.raises(TransportError, match=f"represent-request to {LOST}: its process is gone"):
        trainer.fit()


def test_a_late_reply_of_the_abandoned_attempt_is_dropped_by_the_driver(
    make_data: MakeData, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver expected party-2's loss for its head task of the attempt it abandoned (party-2
    was lost at that task). The loss, coming late, waited in its inbox for good (kept as an
    answer it had asked for). Now the abort stops expecting it: it is dropped where it arrives,
    not refused (over the network a late sum of the attempt would fail the retry's next wait),
    and anything else of that round is refused as unasked."""
    data = make_data(train_missing="mcar:0.2")
    channel = LosingChannel("head-task")
    method = _train(data, dataclasses.replace(FAST, heads="all"), channel)
    assert [fault["party"] for fault in method.fed.faults] == [LOST]
    tasks = [m for m in channel.posted if m.kind == "head-task" and m.receiver == LOST]
    task = next(m for m in tasks if m.round == STEP)  # the one it was lost at
    late = LossMessage(
        sender=LOST,
        receiver=task.sender,
        round=task.round,
        batch_id=task.batch_id,
        session=task.session,
        tag=task.tag,
        loss=1.0,
    )
    label = channel.parties[task.sender]
    inbox = list(label._inbox)
    with caplog.at_level(logging.INFO, logger="secure_vfl.federation.parties"):
        label.receive(late)
    assert label._inbox == inbox
    assert "a late loss from party-2 of the abandoned attempt" in caplog.text
    with pytest.raises(ProtocolError, match="that it did not ask for"):
        label.receive(dataclasses.replace(late, tag="another"))


class _KeyLost(Channel):
    """The first ticket key never reaches the aggregation server (its delivery fails, the
    server still reachable), and ``LOST`` is found gone at the same time."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: list[Message] = []
        self.lost = False

    def post(self, message: Message, *, sender: Party) -> None:
        if message.kind == "ticket-key":
            self.keys.append(message)
            if len(self.keys) == 1:
                self.lost = True
                raise TransportError("ticket-key to aggregator: connection reset")
        if self.lost and message.receiver == LOST:
            raise TransportError(f"{message.kind} to {LOST}: its process is gone")
        super().post(message, sender=sender)

    def unreachable(self, names: list[str]) -> list[str]:  # type: ignore[override]
        return [name for name in names if self.lost and name == LOST]


def test_a_ticket_key_that_did_not_arrive_is_sent_again_with_the_retry(
    make_data: MakeData,
) -> None:
    """The session's ticket key was taken as sent once its send was tried: when the send
    failed and a party was found lost with it, the step's retry asked for contributions under
    a key the aggregator never had, and every one was refused ("before the driver's ticket
    key"). Until a send of the key returns, the key goes again (the same key, a new message)."""
    data = make_data(train_missing="mcar:0.2")
    channel = _KeyLost()
    method = _train(data, dataclasses.replace(FAST, epochs=1, heads="all"), channel)
    assert [fault["party"] for fault in method.fed.faults] == [LOST]
    assert [m.batch_id for m in channel.keys] == [0, 1]
    assert len({(m.session, m.key) for m in channel.keys if isinstance(m, TicketKeyMessage)}) == 1


@pytest.mark.parametrize(
    ("code", "details", "lost"),
    [
        (grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses: Connection refused", 1),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", 0),
        (grpc.StatusCode.UNAVAILABLE, "Ssl handshake failed: CERTIFICATE_VERIFY_FAILED", 0),
    ],
    ids=["unreachable", "late", "certificate"],
)
def test_a_send_failure_names_its_receiver_lost_only_where_nothing_answers_there(
    code: grpc.StatusCode, details: str, lost: int
) -> None:
    """The end of a failed deployment does not warn again of the party its error reports lost;
    a party that is only late, or refuses this party's certificate, may still be running (and
    waiting), so its error names none: the end warns that it could not end the run there."""

    class Failure(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return code

        def details(self) -> str:
            return details

    endpoint = types.SimpleNamespace(name="bank", _peers={"shop": "127.0.0.1:1"}, restarted=set())
    message = UpdateRequest(sender="bank", receiver="shop", round=3, batch_id=0)
    error = network.PartyEndpoint._failure(
        endpoint,  # type: ignore[arg-type]
        message,
        Failure(),
        5,
        time.monotonic(),
    )
    assert isinstance(error, TransportError), error
    assert error.party == ("shop" if lost else None)
