"""Every message of a run, sent again as it was by its sender: refused by its receiver with a
clear error, and nothing changes (issue 10: "a replay ... refused ... and change no party's
state", per kind). Before a party took each message once (:class:`~secure_vfl.federation.
parties.Receipts`), the driver's head task, update and sum request and the aggregation server's
sums of steps already done were taken again: heads trained twice on old sums, and under a
secure sum a past round's representation request ran a new forward pass."""

from __future__ import annotations

import functools
from collections import Counter

import numpy as np
import pytest
import torch
from conftest import MakeData
from test_faults import LOST, LosingChannel

from protocols.paillier import KeyPair, PaillierAggregator, generate_key_pair
from protocols.secagg import MaskingAggregator
from secure_vfl.errors import ProtocolError
from secure_vfl.federation.aggregator import PlainAggregator, SumBackend
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import RepresentRequest
from secure_vfl.federation.parties import REPLAY_WINDOW, DataParty, Receipts
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.false_vfl import FalseVflConfig

SMALL_FALSE = FalseVflConfig(
    latent_dim=4, global_latent_dim=2, hidden=16, kappa=3, inference_samples=8
)


@functools.cache
def _key_pair(bits: int) -> KeyPair:
    return generate_key_pair(bits)


BACKENDS = {
    "plain": PlainAggregator,
    "masks": MaskingAggregator,
    # Its sums decrypt exactly, so the twins train alike (CKKS's fresh noise would not).
    "paillier": lambda: PaillierAggregator(key_bits=1024, key_generator=_key_pair),
}

# (method, backend, heads): the kinds that cross the transport in two of its steps.
CASES = {
    ("laser", "plain", "all"): {
        "represent-request",
        "representation",
        "sum-request",
        "head-task",
        "sum",
        "gradient",  # the label party's head's close the others' steps: no update crosses
        "loss",
    },
    ("laser", "masks", "active"): {
        "key-request",
        "public-key",
        "represent-request",
        "seal-request",
        "sealed",
        "sum-request",
        "sealed-sum",
        "gradient",
    },
    ("laser", "paillier", "active"): {"public-key", "sealed", "sealed-sum", "gradient"},
    ("false-vfl-2", "masks", "active"): {
        "latent",
        "likelihood",
        "latent-gradient",
        "sealed",
        "sealed-sum",
        "gradient",
    },
    ("standard", "plain", "active"): {"represent-request", "representation", "update"},
    ("combinatorial", "plain", "all"): {"head-task", "sum", "loss", "update"},
}


def _build(make_data: MakeData, method: str, backend: str, heads: str, channel: Channel):  # type: ignore[no-untyped-def]
    config = MethodConfig(
        heads=heads,  # type: ignore[arg-type]
        epochs=1,
        batch_size=32,
        lr=0.05,
        representation_dim=8,
        secure_sums=backend != "plain",
    )
    aggregator: SumBackend = BACKENDS[backend]()
    options = {"false_vfl": SMALL_FALSE} if method.startswith("false-vfl") else {}
    return METHODS.get(method)(
        make_data(), config, seed=0, channel=channel, aggregator=aggregator, **options
    )


def _parameters(channel: Channel) -> list[torch.Tensor]:
    """Every trained module's state of every party, in one order."""
    state = []
    for name in sorted(channel.parties):
        party = channel.parties[name]
        if isinstance(party, DataParty):
            for _, module in sorted(party.own_modules().items()):
                state += [t.detach().clone() for t in module.state_dict().values()]
    return state


def _trains_as_its_twin(replayed, twin, rows: np.ndarray) -> None:  # type: ignore[no-untyped-def]
    """The next step (round 2) of the run that saw the replays gives the loss of the twin's
    that saw none, and leaves every party's modules as the twin's."""
    assert replayed.train_step(rows, 2, 0) == twin.train_step(rows, 2, 0)
    after, expected = _parameters(replayed.fed.channel), _parameters(twin.fed.channel)
    assert len(after) == len(expected) > 0
    assert all(torch.equal(a, b) for a, b in zip(after, expected, strict=True))


def twins(make_data: MakeData, method: str, backend: str, heads: str):  # type: ignore[no-untyped-def]
    """A run whose messages are recorded and its twin, each two steps in (with equal losses),
    the recorder, and the rows of the next batch."""
    recorder = RecordingLayer()
    run = _build(make_data, method, backend, heads, Channel([recorder]))
    twin = _build(make_data, method, backend, heads, Channel())
    batches = [np.arange(32 * i, 32 * (i + 1)) for i in range(3)]
    for round in range(2):
        assert run.train_step(batches[round], round, 0) == twin.train_step(batches[round], round, 0)
    return run, twin, recorder, batches[2]


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("method", "backend", "heads"), list(CASES))
def test_every_message_of_a_run_replayed_is_refused_and_changes_nothing(
    make_data: MakeData, method: str, backend: str, heads: str
) -> None:
    replayed, twin, recorder, rows = twins(make_data, method, backend, heads)
    channel = replayed.fed.channel
    inboxes = {name: len(party._inbox) for name, party in channel.parties.items()}
    refused: Counter[str] = Counter()
    for message in list(recorder.messages):
        receiver = channel.parties[message.receiver].name
        with pytest.raises(ProtocolError, match=f"^{receiver}: ") as error:
            channel.parties[message.sender].send(message)
        assert f"round {message.round}" in str(error.value), (message.kind, str(error.value))
        refused[message.kind] += 1
    assert CASES[(method, backend, heads)] <= set(refused), sorted(refused)
    assert set(refused) == {m.kind for m in recorder.messages}
    assert {name: len(party._inbox) for name, party in channel.parties.items()} == inboxes
    _trains_as_its_twin(replayed, twin, rows)


@pytest.mark.usefixtures("one_thread")
def test_a_step_retried_without_a_lost_party_refuses_both_attempts_and_its_aborts_replayed(
    make_data: MakeData,
) -> None:
    """party-2 is lost at step 1's head tasks; the step is abandoned (an abort to every party)
    and retried under a fresh batch id. Every message of both attempts and the aborts, sent
    again, is refused: an abort forgot what its round's first attempt had sent, and then those
    messages trained the heads again (a replayed abort wiped the retry's too)."""
    config = MethodConfig(heads="all", epochs=1, batch_size=32, lr=0.05, representation_dim=8)
    replayed, twin = (
        METHODS.get("laser")(
            make_data(), config, seed=0, channel=LosingChannel("head-task", step=1)
        )
        for _ in range(2)
    )
    batches = [np.arange(32 * i, 32 * (i + 1)) for i in range(3)]
    for round in range(2):
        assert replayed.train_step(batches[round], round, 0) == twin.train_step(
            batches[round], round, 0
        )
    channel = replayed.fed.channel
    assert isinstance(channel, LosingChannel) and channel.lost
    again = [m for m in channel.posted if m.round == 1 and m.receiver != LOST]
    assert len({m.batch_id for m in again if m.kind == "head-task"}) == 2  # both attempts
    assert any(m.kind == "abort" for m in again)
    for message in again:
        with pytest.raises(ProtocolError, match=f"^{message.receiver}: .*round 1") as error:
            channel.parties[message.sender].send(message)
        assert "a second" in str(error.value) or message.kind == "gradient", str(error.value)
    _trains_as_its_twin(replayed, twin, batches[2])


def _request(round: int, **changes: object) -> RepresentRequest:
    rows = torch.arange(2)
    fields: dict[str, object] = {
        "sender": "party-0",
        "receiver": "party-1",
        "round": round,
        "batch_id": 0,
        "split": "train",
        "rows": rows,
        "positions": rows,
        "reply_to": "aggregator",
    }
    fields.update(changes)
    return RepresentRequest(**fields)  # type: ignore[arg-type]


def test_receipts_tell_messages_apart_by_identity_and_stay_bounded() -> None:
    receipts = Receipts()
    receipts.take(receipts.check("party-1", _request(3)))
    with pytest.raises(ProtocolError, match="party-1: a second represent-request from party-0"):
        receipts.check("party-1", _request(3, rows=torch.arange(1, 3)))  # its payload aside
    # Another session, phase, batch, tag, model or sender: another message.
    for changes in (
        {"session": "s2"},
        {"phase": "predict"},
        {"batch_id": 1},
        {"tag": "t"},
        {"model": "m"},
        {"sender": "party-2"},
    ):
        receipts.check("party-1", _request(3, **changes))
    for round in range(4, REPLAY_WINDOW + 10):
        receipts.take(receipts.check("party-1", _request(round)))
    with pytest.raises(ProtocolError, match=f"over {REPLAY_WINDOW} rounds behind"):
        receipts.check("party-1", _request(5))
    kept = receipts._taken[("", "represent-request", "party-0", "train")]
    assert min(kept) == 9 and len(kept) == REPLAY_WINDOW + 1
    # A round taken out of order (5 after 10) goes with the rounds taken before it.
    receipts = Receipts()
    for round in (0, 10, 5, REPLAY_WINDOW + 6):
        receipts.take(receipts.check("party-1", _request(round)))
    kept = receipts._taken[("", "represent-request", "party-0", "train")]
    assert list(kept) == [10, 5, REPLAY_WINDOW + 6]
    receipts.take(receipts.check("party-1", _request(REPLAY_WINDOW + 11)))
    assert list(kept) == [REPLAY_WINDOW + 6, REPLAY_WINDOW + 11]
