"""A lost data party rejoins at an epoch boundary, in one process: a channel that loses a party
(its posts fail, it is unreachable) and, once probed enough times, has it answer again, when
the channel's readmission builds it anew as a restarted process would (the process tests in
test_deploy.py restart a real one)."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
import torch
from conftest import MakeData

from protocols.secagg import MaskingAggregator
from secure_vfl.data.vertical import VerticalData
from secure_vfl.errors import ProtocolError, TransportError
from secure_vfl.federation.aggregator import SealingScheme
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import (
    Message,
    PublicKeyMessage,
    RepresentRequest,
    TicketKeyMessage,
)
from secure_vfl.federation.parties import ROLES, Party
from secure_vfl.methods import METHODS, PARTY_MODELS, MethodConfig
from secure_vfl.methods.base import (
    REJOINED,
    build_party,
    in_process_parties,
    install_halves,
    lost_parties,
    split_tensors,
    training_sampler,
)
from secure_vfl.methods.laser import MeanFusionMethod

FAST = MethodConfig(epochs=3, batch_size=64, lr=0.05)
SEED = 3
LOST = "party-2"
COLUMN = 2


class FlakyChannel(Channel):
    """Loses ``LOST`` when the first ``kind`` of each round in ``losses`` is posted to it:
    that post and every later one to it fail, and :meth:`unreachable` names it. The probes
    (:meth:`returned`, counted from 1) numbered in ``back_at`` find it back: its operator
    restarted it. ``after_loss`` counts posts to it while it is lost, ``probes`` the probes,
    ``posted`` every message posted."""

    def __init__(self, kind: str, losses: tuple[int, ...], back_at: tuple[int, ...]) -> None:
        super().__init__()
        self.kind = kind
        self.losses = set(losses)
        self.back_at = back_at
        self.alive = True
        self.after_loss = 0
        self.probes = 0
        self.posted: list[Message] = []

    def post(self, message: Message, *, sender: Party) -> None:
        self.posted.append(message)
        if message.receiver == LOST:
            if self.alive and message.kind == self.kind and message.round in self.losses:
                self.losses.discard(message.round)
                self.alive = False
                raise TransportError(f"{message.kind} to {LOST}: its process is gone")
            if not self.alive:
                self.after_loss += 1
                raise TransportError(f"{message.kind} to {LOST}: nothing listens")
        super().post(message, sender=sender)

    def unreachable(self, names: list[str]) -> list[str]:  # type: ignore[override]
        return [name for name in names if name == LOST and not self.alive]

    def returned(self, names: list[str], *, quick: bool = False) -> list[str]:  # type: ignore[override]
        assert names == [LOST]  # only the lost party is probed
        self.probes += 1
        if self.probes in self.back_at:
            self.alive = True
        return [name for name in names if self.alive]


def readmission(
    channel: Channel,
    data: VerticalData,
    config: MethodConfig,
    scheme: SealingScheme | None = None,
) -> list[str]:
    """Give ``channel`` the readmission of a restarted process: the party built anew with the
    seed rule of the run's start (initial models, fresh secure-sum halves), in place of the
    lost one. Returns the list the readmitted names are appended to."""
    readmitted: list[str] = []
    splits = split_tensors(data)
    heads = PARTY_MODELS.get("laser")(config, data.block_shapes, data.num_classes, SEED).heads

    def readmit(name: str) -> int:
        k = int(name.removeprefix("party-"))
        party = build_party(
            k,
            name,
            blocks={key: torch.from_numpy(split.blocks[k]) for key, split in splits.items()},
            observed=data.train.mask[:, k],
            labels={key: torch.from_numpy(split.labels) for key, split in splits.items()},
            config=config,
            seed=SEED,
            role=ROLES.get("data-party"),
            heads=heads.get(k, {}),
        )
        if scheme is not None:
            install_halves(party, scheme)
        channel.detach(name)
        party.connect(channel)
        readmitted.append(name)
        return 0  # initial models: no checkpoint restored

    channel.readmit = readmit
    return readmitted


def _train(
    data: VerticalData, config: MethodConfig, channel: Channel, **kwargs: object
) -> MeanFusionMethod:
    method = METHODS.get("laser")(data, config, seed=SEED, channel=channel, **kwargs)  # type: ignore[arg-type]
    assert isinstance(method, MeanFusionMethod)
    method.fit()
    return method


def _train_rounds_asked(channel: FlakyChannel) -> set[int]:
    """The training rounds in which ``LOST`` was asked for representations."""
    return {
        m.round
        for m in channel.posted
        if isinstance(m, RepresentRequest) and m.receiver == LOST and m.phase == "train"
    }


def test_a_party_lost_in_epoch_1_rejoins_at_epoch_2_and_is_observed_again(
    make_data: MakeData,
) -> None:
    data = make_data(train_missing="mcar:0.2")
    channel = FlakyChannel("represent-request", losses=(1,), back_at=(1,))
    readmitted = readmission(channel, data, FAST)
    method = _train(data, FAST, channel)
    steps = len(method.sampler)
    assert readmitted == [LOST]
    assert channel.after_loss == 0  # nothing was posted to it while it was lost
    assert channel.probes == 1  # probed once, at epoch 2's start, and back
    lost, back = method.fed.faults
    assert lost == {
        "party": LOST,
        "step": 2,
        "epoch": 1,
        "phase": "training",
        "what": f"represent-request to {LOST}: its process is gone",
    }
    assert back == {
        "party": LOST,
        "step": steps + 1,
        "epoch": 2,
        "phase": "training",
        "what": REJOINED,
    }
    assert lost_parties(method.fed.faults) == [] and channel.lost_now == set()
    # Asked for its block in steps 1 and 2 (lost in the second), in none until epoch 2, then
    # in every step (each batch of 64 holds rows of it).
    asked = _train_rounds_asked(channel)
    assert asked == {0, 1, *range(steps, 3 * steps)}
    # Its availability column is back exactly as the label party knew it.
    for key, split in split_tensors(method.data).items():
        assert np.array_equal(split.mask, split_tensors(data)[key].mask), key
    # At evaluation its head predicts every sample it holds (heads="all").
    for name in data.tests:
        predicted = method.predict(name)
        assert np.array_equal(predicted[:, COLUMN] >= 0, data.tests[name].mask[:, COLUMN])
    evaluated = [
        m for m in channel.posted if isinstance(m, RepresentRequest) and m.receiver == LOST
    ]
    assert any(m.phase == "predict" for m in evaluated)


def _state(method: MeanFusionMethod) -> list[torch.Tensor]:
    parties = [p for p in in_process_parties(method.fed.channel) if p.name != LOST]
    modules = [p.model for p in parties] + [h.module for p in parties for h in p.heads.values()]
    return [t.detach().clone() for m in modules for t in m.parameters()]


def test_a_party_that_never_comes_back_costs_the_run_only_the_probes(
    make_data: MakeData, one_thread: None
) -> None:
    data = make_data(train_missing="mcar:0.2")
    config = dataclasses.replace(FAST, epochs=4)
    probed = FlakyChannel("gradient", losses=(2,), back_at=())
    readmitted = readmission(probed, data, config)
    method = _train(data, config, probed)
    assert probed.probes == 3  # one probe at each of epochs 2, 3 and 4, all unanswered
    assert readmitted == [] and probed.after_loss == 0
    assert [fault["what"] for fault in method.fed.faults] == [
        f"gradient to {LOST}: its process is gone"
    ]
    assert lost_parties(method.fed.faults) == [LOST]
    # What a deployed run that stops does not try to end (it tried, 1.5 s of retries)
    assert probed.lost_now == {LOST}
    # Without a readmission nothing is probed; the two runs are the same run.
    unprobed = FlakyChannel("gradient", losses=(2,), back_at=())
    alone = _train(data, config, unprobed)
    assert unprobed.probes == 0
    assert method.fed.faults == alone.fed.faults
    for a, b in zip(_state(method), _state(alone), strict=True):
        assert torch.equal(a, b)
    for name in data.tests:
        assert np.array_equal(method.predict(name), alone.predict(name))


def test_under_masks_a_party_rejoins_with_new_keys_in_a_new_session_and_is_lost_again(
    make_data: MakeData,
) -> None:
    data = make_data(train_missing="mcar:0.2")
    config = dataclasses.replace(FAST, epochs=4, heads="active", secure_sums=True)
    channel = FlakyChannel("seal-request", losses=(1,), back_at=(1,))
    scheme = MaskingAggregator()
    readmitted = readmission(channel, data, config, scheme)
    first = METHODS.get("laser")(data, config, seed=SEED, channel=channel, aggregator=scheme)
    steps = len(first.sampler)
    channel.losses.add(2 * steps + 1)  # lost again in epoch 3, for good
    assert isinstance(first, MeanFusionMethod)
    old_session = first.fed.session
    first.fit()
    fed = first.fed
    assert readmitted == [LOST]
    assert [(f["party"], f["step"], f["what"] == REJOINED) for f in fed.faults] == [
        (LOST, 2, False),
        (LOST, steps + 1, True),
        (LOST, 2 * steps + 2, False),
    ]
    assert lost_parties(fed.faults) == [LOST]
    assert channel.probes == 2  # at epoch 2 (back) and epoch 4 (still lost)
    # It sealed shares between its return and its second loss: the sums counted it again.
    sealed = {m.round for m in channel.posted if m.kind == "sealed" and m.sender == LOST}
    assert sealed & set(range(steps, 2 * steps + 1))
    assert not sealed & set(range(2, steps))
    # The rejoin opened a new session: every key set-up message of it carries the new session,
    # and the rebuilt party announced a new key.
    assert fed.session != old_session
    keys = [m for m in channel.posted if isinstance(m, PublicKeyMessage) and m.sender == LOST]
    old_keys = {m.key for m in keys if m.session == old_session}
    new_keys = {m.key for m in keys if m.session != old_session}
    assert old_keys and new_keys and not old_keys & new_keys
    # Its evaluation ran without it (lost again), every sample still predicted.
    for name in data.tests:
        assert (first.predict(name) >= 0).any(axis=1).all()


def test_a_key_from_before_the_rejoin_is_refused_as_a_replay(make_data: MakeData) -> None:
    data = make_data(train_missing="mcar:0.2")
    config = dataclasses.replace(FAST, epochs=2, heads="active", secure_sums=True)
    channel = FlakyChannel("represent-request", losses=(1,), back_at=(1,))
    scheme = MaskingAggregator()
    readmission(channel, data, config, scheme)
    method = _train(data, config, channel, aggregator=scheme)
    assert [f["what"] == REJOINED for f in method.fed.faults] == [False, True]
    old_session = channel.posted[0].session
    [old_key, *_] = [
        m
        for m in channel.posted
        if isinstance(m, PublicKeyMessage)
        and m.sender == LOST
        and m.receiver == "party-1"
        and m.session == old_session
    ]
    # The lost party's key from its old session, replayed to a peer after the rejoin: refused,
    # whatever it would replace; the aggregator refuses an old-session key too.
    with pytest.raises(ProtocolError, match=r"a second public-key .*\(a replay\?\)"):
        channel.parties["party-1"].receive(old_key)
    with pytest.raises(ProtocolError, match="a newer session replaced"):
        channel.parties["party-1"].receive(dataclasses.replace(old_key, batch_id=1))
    # The label party's receiver key of the old session, replayed to the aggregator: refused.
    [old_to_server, *_] = [
        m
        for m in channel.posted
        if isinstance(m, PublicKeyMessage)
        and m.receiver == "aggregator"
        and m.session == old_session
    ]
    with pytest.raises(ProtocolError, match=r"a second public-key .*\(a replay\?\)"):
        channel.parties["aggregator"].receive(old_to_server)
    with pytest.raises(ProtocolError, match="a newer session replaced"):
        channel.parties["aggregator"].receive(dataclasses.replace(old_to_server, batch_id=1))
    # Training after the rejoin still opens every sum: the peers kept the new key.
    for name in data.tests:
        assert (method.predict(name) >= 0).any(axis=1).all()


class _SecondLoss(FlakyChannel):
    """A :class:`FlakyChannel` that also loses ``party-3`` at the closing gradient of round
    ``closing``, which the driver holds back to go with its next send."""

    def __init__(self, *args: Any, closing: int) -> None:
        super().__init__(*args)
        self.closing = closing
        self.second_alive = True

    def post(self, message: Message, *, sender: Party) -> None:
        if message.receiver == "party-3":
            if message.kind == "gradient" and message.round == self.closing:
                self.second_alive = False
            if not self.second_alive:
                raise TransportError(f"{message.kind} to party-3: its process is gone")
        super().post(message, sender=sender)

    def unreachable(self, names: list[str]) -> list[str]:  # type: ignore[override]
        lost = [] if self.second_alive else ["party-3"]
        return [*super().unreachable(names), *[name for name in names if name in lost]]


def test_a_party_lost_with_the_new_sessions_ticket_key_is_dropped_and_the_run_goes_on(
    make_data: MakeData,
) -> None:
    """party-2 rejoins at the second epoch, which opens a new session; under plain sums the
    session's ticket key is the driver's first send after it, and goes with the closing
    gradients held back from the epoch's last step. party-3 is gone at its gradient: the send
    fails though the aggregator took the key. The driver dropped party-3 and retried the
    step, which sent a new key for the session: the aggregator refused a second key of the
    session, and the run stopped. The retry sends the session's key again, the same key (the
    send could not tell whether it arrived), which the aggregator takes: the run goes on
    without party-3."""
    data = make_data(train_missing="mcar:0.2")
    config = dataclasses.replace(FAST, epochs=2, heads="active")
    steps = len(training_sampler("laser", data, config, SEED))
    channel = _SecondLoss("represent-request", (1,), (1,), closing=steps - 1)
    readmission(channel, data, config)
    method = _train(data, config, channel)
    assert [fault["party"] for fault in method.fed.faults] == [LOST, LOST, "party-3"]
    assert [fault["what"] for fault in method.fed.faults][1] == "rejoined"
    keys = [m for m in channel.posted if isinstance(m, TicketKeyMessage)]
    assert [m.batch_id for m in keys] == [0, 0, 1]  # the second session's, sent again
    assert len({m.session for m in keys}) == 2 and keys[1].key == keys[2].key


def test_a_party_lost_before_a_resumed_checkpoint_is_absent_from_the_start_and_lost_once(
    make_data: MakeData,
) -> None:
    """A resumed deployment knows the parties lost before its checkpoint when it builds the
    federation (left out of the key set-up, which asked a lost party for its keys and failed);
    restoring the losses then loses each once, and a name the checkpoint lists twice is still
    refused."""
    data = make_data(train_missing="mcar:0.2")
    channel = Channel()
    channel.absent = frozenset({LOST})
    method = METHODS.get("laser")(data, FAST, seed=SEED, channel=channel)
    assert method.fed.dropped == [LOST]  # counted absent when built
    method.fed.restore_losses([LOST], [])
    assert method.fed.dropped == [LOST] and channel.lost_now == {LOST}
    assert not method.fed.data.train.mask[:, COLUMN].any()  # its block missing, as after a loss
    twice = Channel()
    twice.absent = frozenset({LOST})
    again = METHODS.get("laser")(data, FAST, seed=SEED, channel=twice)
    with pytest.raises(ProtocolError, match="can drop one of the data parties"):
        again.fed.restore_losses([LOST, LOST], [])
