"""Secure sums split at the party boundary: each half runs inside its party, keys meet by
messages, and every secret is reachable from its owner only."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import numpy as np
import pytest
import tenseal as ts
import torch
from conftest import MakeData
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from phe import paillier
from reachability import reachable

from protocols.ckks import CkksAggregator, make_secret_context, public_context_bytes
from protocols.paillier import KeyPair, PaillierAggregator, generate_key_pair
from protocols.secagg import MaskingAggregator
from secure_vfl.errors import IntegrityError, ProtocolError
from secure_vfl.federation.aggregator import (
    MAX_EARLY_SESSIONS,
    PlainAggregator,
    SealingScheme,
    SumBackend,
)
from secure_vfl.federation.channel import Channel, RecordingLayer
from secure_vfl.federation.messages import (
    AGGREGATOR,
    DRIVEN_KINDS,
    GradientMessage,
    HeadTask,
    PredictTask,
    PublicKeyMessage,
    RepresentationMessage,
    RepresentRequest,
    SealedMessage,
    SealedSumMessage,
    SealRequest,
    SumMessage,
    SumRequest,
)
from secure_vfl.federation.parties import DataParty, Party
from secure_vfl.methods import METHODS, MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.false_vfl import FalseVflConfig

CONFIG = MethodConfig(
    heads="active", epochs=1, batch_size=32, lr=0.05, representation_dim=8, secure_sums=True
)
ROWS = np.arange(32)


@functools.cache
def _key_pair(bits: int) -> KeyPair:
    return generate_key_pair(bits)


BACKENDS: dict[str, Callable[[], SumBackend]] = {
    "masks": MaskingAggregator,
    "paillier": lambda: PaillierAggregator(key_bits=1024, key_generator=_key_pair),
    "ckks": CkksAggregator,
}


# LASER and FALSE-VFL (whose posterior factors are summed for the label party) share the split.
SPLIT_METHODS = ["laser", "false-vfl-2"]
SMALL_FALSE = FalseVflConfig(
    latent_dim=4, global_latent_dim=2, hidden=16, kappa=3, inference_samples=8
)


def _method(  # type: ignore[no-untyped-def]
    make_data: MakeData, backend: str, channel: Channel | None = None, method: str = "laser"
):
    aggregator = BACKENDS[backend]()
    assert isinstance(aggregator, SealingScheme)
    return _build(method, make_data(), aggregator, channel)


def _build(method: str, data, aggregator: SumBackend, channel: Channel | None = None):  # type: ignore[no-untyped-def]
    options = {"false_vfl": SMALL_FALSE} if method.startswith("false-vfl") else {}
    return METHODS.get(method)(
        data, CONFIG, seed=0, channel=channel, aggregator=aggregator, **options
    )


def _secret(value: object) -> bool:
    return isinstance(value, X25519PrivateKey | paillier.PaillierPrivateKey) or (
        isinstance(value, ts.Context) and value.has_secret_key()
    )


@pytest.mark.parametrize("method_name", SPLIT_METHODS)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_each_secret_is_reachable_from_its_owner_only(
    make_data: MakeData, backend: str, method_name: str
) -> None:
    method = _method(make_data, backend, method=method_name)
    method.train_step(ROWS, 0, 0)
    channel = method.fed.channel
    parties = channel.parties
    owners: dict[int, list[str]] = {}
    for name, party in parties.items():
        for value in reachable(party, stop={id(channel)}):
            if _secret(value):
                owners.setdefault(id(value), []).append(name)
    assert owners, "no secret found: the test would pass vacuously"
    assert all(len(names) == 1 for names in owners.values()), owners
    held = sorted(names[0] for names in owners.values())
    contributors = sorted(n for n in parties if n != AGGREGATOR)
    # Masks: one X25519 key per contributor, and the receiver's (party-0) own for the
    # self-masks. Paillier, CKKS: the receiver alone.
    assert held == (sorted([*contributors, "party-0"]) if backend == "masks" else ["party-0"])
    # The label party's view of the run reaches no secret of anyone else's either.
    seen = reachable(method, stop={id(channel)})
    assert {id(v) for v in seen if _secret(v)} <= {
        key for key, names in owners.items() if names == ["party-0"]
    }


@pytest.mark.parametrize("method_name", SPLIT_METHODS)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_nothing_crosses_in_the_clear_and_keys_meet_by_messages(
    make_data: MakeData, backend: str, method_name: str
) -> None:
    recorder = RecordingLayer()
    method = _method(make_data, backend, Channel([recorder]), method=method_name)
    setup = recorder.kinds()
    assert set(setup) == {"key-request", "public-key"}
    announced = {
        (m.sender, m.receiver, m.role) for m in recorder.messages if m.kind == "public-key"
    }
    receiver_keys = {(s, r) for s, r, role in announced if role == "receiver"}
    # The receiver to the other contributors and the aggregator (masks: for the self-masks).
    assert receiver_keys == {("party-0", r) for r in ("party-1", "party-2", "party-3", AGGREGATOR)}
    if backend == "masks":  # and every contributor to every other contributor
        assert len(announced) == 4 * 3 + len(receiver_keys)
    else:
        assert len(announced) == len(receiver_keys)
    method.train_step(ROWS, 0, 0)
    method.predict("mcar:0")
    kinds = set(recorder.kinds())
    assert {"sealed", "sealed-sum", "seal-request"} <= kinds
    assert not kinds & {"representation", "sum"}, "a representation or a sum crossed in the clear"


@pytest.mark.parametrize("method_name", SPLIT_METHODS)
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_split_secure_step_trains_as_the_plain_one(
    make_data: MakeData, backend: str, method_name: str
) -> None:
    data = make_data()
    plain = _build(method_name, data, PlainAggregator())
    secure = _build(method_name, data, BACKENDS[backend]())
    for round in range(3):
        expected = plain.train_step(ROWS + 32 * round, round, 0)
        found = secure.train_step(ROWS + 32 * round, round, 0)
        assert found == pytest.approx(expected, rel=1e-3)
    assert np.array_equal(plain.predict("mcar:0"), secure.predict("mcar:0"))


@pytest.mark.parametrize("method_name", SPLIT_METHODS)
def test_a_secure_step_sends_each_party_its_messages_at_once_in_their_order(
    make_data: MakeData, method_name: str
) -> None:
    """Every message the label party sends a data party in a step leaves in one send (over the
    network, one delivery): the previous step's closing gradient, then the representation
    request, then the seal request for what that request computes."""
    recorder = RecordingLayer()
    method = _method(make_data, "masks", Channel([recorder]), method=method_name)
    method.train_step(ROWS, 0, 0)
    label = method.fed.own
    sends: list[list[tuple[str, str]]] = []
    post_all = method.fed.channel.post_all

    def noted(messages, *, sender, **options):  # type: ignore[no-untyped-def]
        if sender is label:
            sends.append([(m.kind, m.receiver) for m in messages])
        post_all(messages, sender=sender, **options)

    method.fed.channel.post_all = noted  # type: ignore[method-assign]
    recorder.messages.clear()
    method.train_step(ROWS + 32, 1, 0)
    first = sends[0]
    for party in ("party-1", "party-2", "party-3"):
        to_party = [kind for kind, receiver in first if receiver == party]
        kinds = ["gradient", "represent-request", "seal-request"]
        assert to_party == kinds, (party, first)
        asked = ("represent-request", "seal-request")  # once, in the first send
        assert all(
            receiver != party for send in sends[1:] for kind, receiver in send if kind in asked
        )
    assert ("sum-request", AGGREGATOR) in first
    delivered = [m for m in recorder.messages if m.receiver == "party-1"]
    assert [m.kind for m in delivered][: len(kinds)] == kinds


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_secure_laser_step_seals_each_term_once_into_its_own_part(
    make_data: MakeData, backend: str
) -> None:
    """LASER under secure sums trains on every union of a row's blocks (and the label party's
    own term); the sums asked for are the blocks' (the head task's ``parts``), which the head
    adds up, so each contributor's row goes into one sum a step, not into every task it is in."""
    recorder = RecordingLayer()
    method = _method(make_data, backend, Channel([recorder]))
    label = method.fed.own
    tasks: list[HeadTask] = []
    take_task = label.on_head_task  # the label party's own head: a task it sends itself

    def noted(task: HeadTask) -> None:
        tasks.append(task)
        take_task(task)

    label.on_head_task = noted  # type: ignore[method-assign]
    method.train_step(ROWS, 0, 0)
    (task,) = tasks
    (request,) = [m for m in recorder.messages if type(m) is SumRequest]
    seals = [m for m in recorder.messages if isinstance(m, SealRequest)]
    assert task.parts is not None and torch.equal(request.selection, task.parts)
    assert task.selection.shape[0] > task.parts.shape[0]  # fewer sums than tasks
    # One seal request to each other party (the label party's own does not cross the channel).
    assert sorted(m.receiver for m in seals) == sorted(request.parties[1:])
    assert int(request.selection.sum(dim=0).max()) == 1  # a row's term in one sum
    assert torch.equal(
        task.composition().float().sum(dim=1) > 0, task.selection.any(dim=2)
    )  # every task that has a row is made of parts there


def _stepped(make_data: MakeData, backend: str = "masks"):  # type: ignore[no-untyped-def]
    recorder = RecordingLayer()
    method = _method(make_data, backend, Channel([recorder]))
    method.train_step(ROWS, 0, 0)
    return method, recorder


def _last(recorder: RecordingLayer, kind: type, sender: str | None = None):  # type: ignore[no-untyped-def]
    return [m for m in recorder.messages if isinstance(m, kind) and sender in (None, m.sender)][-1]


def _parties(method) -> dict[str, Party]:  # type: ignore[no-untyped-def]
    """Every party that takes keys (the aggregation server included)."""
    return {
        name: party
        for name, party in method.fed.channel.parties.items()
        if hasattr(party, "_key_sessions")
    }


def _party(method, name: str) -> Party:  # type: ignore[no-untyped-def]
    return method.fed.channel.parties[name]


def test_a_contributor_refuses_to_seal_a_sum_that_reveals_it_alone(make_data: MakeData) -> None:
    method, recorder = _stepped(make_data)
    request = _last(recorder, SealRequest, None)
    column = request.parties.index(request.receiver)
    alone = torch.zeros_like(request.selection)
    alone[0, :, column] = request.selection[..., column].any(dim=0)  # its rows, alone
    bad = dataclasses.replace(request, selection=alone, tag="again")
    with pytest.raises(ProtocolError, match="reveals a single party's representation"):
        method.fed.own.send(bad)


def test_a_replayed_seal_request_or_sealed_share_is_refused(make_data: MakeData) -> None:
    method, recorder = _stepped(make_data)
    seal = _last(recorder, SealRequest)
    with pytest.raises(ProtocolError, match=r"a second seal-request .*\(a replay\?\)"):
        method.fed.own.send(seal)
    share = _last(recorder, SealedMessage)
    server = _party(method, AGGREGATOR)
    with pytest.raises(ProtocolError, match=r"a second sealed .*\(a replay\?\)"):
        server.receive(share)
    # In another session (a message the server never took), its sum was delivered all the same.
    with pytest.raises(ProtocolError, match="already served"):
        server.receive(dataclasses.replace(share, session="other"))
    # Under a tag the driver gave no ticket for, it is not kept (nor when its ticket is moved
    # to another session); with the driver's ticket for that tag, it is, once.
    fresh = dataclasses.replace(share, tag="not-yet-served")
    with pytest.raises(ProtocolError, match="that the driver did not ask for"):
        server.receive(fresh)
    ticket = method.fed.ticket(
        "sealed",
        share.sender,
        round=share.round,
        batch_id=share.batch_id,
        phase=share.phase,
        tag=fresh.tag,
        deliver_to=share.deliver_to,
    )
    fresh = dataclasses.replace(fresh, ticket=ticket)
    server.receive(fresh)
    with pytest.raises(ProtocolError, match=r"a second sealed .*\(a replay\?\)"):
        server.receive(fresh)
    with pytest.raises(ProtocolError, match="of session 'other'; the driver's session is"):
        server.receive(dataclasses.replace(fresh, session="other"))


def test_the_secure_server_refuses_a_representation_in_the_clear(make_data: MakeData) -> None:
    method, _ = _stepped(make_data)
    party = in_process_parties(method.fed.channel)[1]
    clear = RepresentationMessage(
        sender=party.name,
        receiver=AGGREGATOR,
        round=9,
        batch_id=0,
        positions=torch.arange(2),
        representation=torch.zeros(2, 8),
    )
    with pytest.raises(ProtocolError, match="refuses to see it"):
        party.send(clear)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_tampered_or_truncated_sealed_sum_is_refused(make_data: MakeData, backend: str) -> None:
    method, recorder = _stepped(make_data, backend)
    sealed = _last(recorder, SealedSumMessage)
    receiver = _party(method, sealed.receiver)

    def opened(batch_id: int, payload: tuple[bytes, ...]) -> str:
        """The refusal of ``sealed`` with ``payload``, as a sum the receiver is owed (a new
        message: its key opens it, neither the receipts nor the expectations refuse it)."""
        receiver.expect(
            "sum", senders=[AGGREGATOR], round=sealed.round, batch_id=batch_id, tag=sealed.tag
        )
        with pytest.raises((ProtocolError, IntegrityError)) as error:
            receiver.receive(dataclasses.replace(sealed, batch_id=batch_id, payload=payload))
        assert "did not ask" not in str(error.value) and "a second" not in str(error.value)
        return str(error.value)

    opened(101, (sealed.payload[0][:-8], *sealed.payload[1:]))  # truncated
    # Garbage beyond what honest inputs give (masks promise no more than that: they are
    # malleable, so a small shift passes; see protocols.secagg).
    opened(102, tuple(bytes([0x7F]) * len(item) for item in sealed.payload))
    # No ciphertext at all: Paillier and CKKS opened it as sums of zeros.
    assert "expected, found 0" in opened(103, ())


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_sealed_sum_that_does_not_fit_its_task_is_refused_before_the_key_opens_it(
    make_data: MakeData, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sealed sum for a task of the receiver's head was opened first (a decryption, for
    nothing) and only then checked against the task; one of another width failed inside the
    opener ("sealed items of ... bytes expected", or "... ciphertexts expected"), saying nothing
    of the head. Its width, tasks and rows and counts are checked against the task first."""
    method, recorder = _stepped(make_data, backend)
    sealed = dataclasses.replace(_last(recorder, SealedSumMessage), round=5)
    receiver = _party(method, sealed.receiver)
    assert isinstance(receiver, DataParty) and receiver.opener is not None
    opened: list[int] = []
    opener = receiver.opener
    real_open = opener.open
    monkeypatch.setattr(opener, "open", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    tasks, batch, _ = sealed.selection.shape
    predict = PredictTask(
        **receiver.reply_header(sealed, receiver.name),
        positions=torch.arange(batch),
        tag="predict/x",
    )
    train = HeadTask(
        **receiver.reply_header(sealed, receiver.name),
        rows=torch.arange(batch),
        weights=torch.ones(tasks, batch),
        normaliser=float(batch),
        selection=sealed.selection,
        present=sealed.selection.any(dim=0),
        parties=sealed.parties,
        tag=sealed.tag,
    )
    width = sealed.width
    more = sealed.selection.clone()
    more[0, 0] = True
    assert not torch.equal(more, sealed.selection)
    swapped = sealed.selection[..., [1, 0, *range(2, sealed.selection.shape[2])]].contiguous()
    assert not torch.equal(swapped, sealed.selection)
    for task in (train, predict):
        receiver.receive(dataclasses.replace(task, sender=receiver.name))
        owed = dataclasses.replace(sealed, tag=task.tag)
        wrong = [
            (dataclasses.replace(owed, width=width + 1), rf"width {width} \(what its head takes\)")
        ]
        if task is train:
            wrong += [
                (
                    dataclasses.replace(owed, selection=sealed.selection[:, 1:]),
                    rf"sums of \(tasks, rows\) \({tasks}, {batch}\) expected, found "
                    rf"\({tasks}, {batch - 1}\)",
                ),
                (dataclasses.replace(owed, selection=more), "over the contributors its task"),
                (  # the same counts, other members: the opener would take off others' masks
                    dataclasses.replace(owed, selection=swapped),
                    "over exactly the contributors its task selected expected, found other",
                ),
            ]
        else:
            wrong.append(
                (
                    dataclasses.replace(owed, selection=sealed.selection[:, : batch // 2]),
                    rf"up to position {batch - 1}\) expected, found {batch // 2} rows",
                )
            )
        for message, said in wrong:
            with pytest.raises(
                ProtocolError, match=rf"^{receiver.name}: the sum '{task.tag}' of round 5 .*{said}"
            ):
                receiver.receive(message)
            assert opened == []  # its key did no work on it
            assert (5, sealed.batch_id, task.tag) in receiver._tasks  # the task still waits


def _every_head_stepped(make_data: MakeData, aggregator: SumBackend):  # type: ignore[no-untyped-def]
    """LASER with a head at every party (head tasks cross to the data parties: plain sums
    only), one step."""
    recorder = RecordingLayer()
    method = METHODS.get("laser")(
        make_data(),
        dataclasses.replace(CONFIG, heads="all", secure_sums=False),
        seed=0,
        channel=Channel([recorder]),
        aggregator=aggregator,
    )
    method.train_step(ROWS, 0, 0)
    return method, recorder


def test_a_sum_comes_from_the_aggregation_server_only_and_sealed_under_a_secure_sum(
    make_data: MakeData,
) -> None:
    """A data party could send the label party, in its own name, a plain sum for the step's
    head task: the head trained on it (loss 522 instead of 2.7). A sum from anyone but the
    aggregation server is refused, and under a secure sum a plain one from it too."""
    method, recorder = _stepped(make_data)
    sealed = _last(recorder, SealedSumMessage)
    receiver = _party(method, sealed.receiver)
    forged = SumMessage(
        sender="party-2",
        receiver=receiver.name,
        round=1,
        batch_id=sealed.batch_id,
        tag=sealed.tag,
        sums=torch.full((*sealed.selection.shape[:2], 8), 1000.0),
        counts=sealed.selection.sum(dim=2),
    )
    with pytest.raises(ProtocolError, match="sums come from aggregator only"):
        receiver.receive(forged)
    with pytest.raises(ProtocolError, match="sums come from aggregator only"):
        receiver.receive(dataclasses.replace(sealed, sender="party-2", round=1))
    with pytest.raises(ProtocolError, match="it takes them sealed only"):
        receiver.receive(dataclasses.replace(forged, sender=AGGREGATOR))
    method.train_step(ROWS + 32, 1, 0)  # nothing was taken: the next step trains


def test_a_sum_that_does_not_fit_its_head_task_is_refused_and_the_task_kept(
    make_data: MakeData,
) -> None:
    method, recorder = _every_head_stepped(make_data, PlainAggregator())
    task = dataclasses.replace(_last(recorder, HeadTask), round=5)
    party = _party(method, task.receiver)
    assert isinstance(party, DataParty)
    party.receive(task)
    right = dataclasses.replace(
        [m for m in recorder.messages if isinstance(m, SumMessage) and m.tag == task.tag][-1],
        round=5,
    )
    more = dataclasses.replace(right, counts=right.counts + 1)
    with pytest.raises(ProtocolError, match="over the contributors its task selected"):
        party.receive(more)
    wider = dataclasses.replace(right, sums=torch.cat([right.sums, right.sums], dim=1))
    with pytest.raises(ProtocolError, match=r"sums of \(tasks, rows\)"):
        party.receive(wider)
    # The task still waits for its sum: a second one for it is a replay.
    with pytest.raises(ProtocolError, match=r"a second head-task .*\(a replay\?\)"):
        party.receive(task)
    with pytest.raises(ProtocolError, match="a second task"):
        party.receive(dataclasses.replace(task, session="other"))


@pytest.mark.parametrize("backend", ["plain", "masks"])
def test_the_drivers_requests_and_plans_are_refused_from_anyone_else(
    make_data: MakeData, backend: str
) -> None:
    """Every kind only the label party sends, sent by another party (in its own name, as the
    channel makes it), is refused by its receiver before anything acts on it."""
    if backend == "plain":
        method, recorder = _every_head_stepped(make_data, PlainAggregator())
    else:
        method, recorder = _stepped(make_data)
    driven = {}
    for message in recorder.messages:
        if message.kind in DRIVEN_KINDS and message.receiver != message.sender:
            driven.setdefault(message.kind, message)
    expected = {
        "plain": {"represent-request", "head-task", "sum-request"},
        "masks": {"represent-request", "sum-request", "seal-request", "key-request"},
    }[backend]
    assert expected <= set(driven), sorted(driven)
    for kind, message in driven.items():
        assert message.sender == "party-0", kind
        forger = "party-2" if message.receiver != "party-2" else "party-1"
        receiver = _party(method, message.receiver)
        inbox = list(receiver._inbox)
        with pytest.raises(ProtocolError, match="only the run's driver, party-0, sends one"):
            receiver.receive(dataclasses.replace(message, sender=forger, round=7))
        assert receiver._inbox == inbox, kind
    method.train_step(ROWS + 32, 1, 0)  # nothing was acted on: the next step trains


def test_a_gradient_that_acts_as_the_drivers_is_refused_from_anyone_else(
    make_data: MakeData,
) -> None:
    """A gradient that closes its step is the driver's update, and under FALSE-VFL every
    gradient is the label party's (a likelihood gradient is answered with the gradient of the
    latent samples): from another party, each stepped the receiver's model or answered it."""
    method, recorder = _stepped(make_data)
    method.train_step(ROWS + 32, 1, 0)  # the first step's closing gradients go with it
    closing = next(m for m in recorder.messages if isinstance(m, GradientMessage) and m.step)
    receiver = _party(method, closing.receiver)
    request = [
        m
        for m in recorder.messages
        if isinstance(m, RepresentRequest) and m.receiver == receiver.name
    ][-1]
    receiver.receive(dataclasses.replace(request, round=9))  # a forward pass waits
    before = [p.detach().clone() for p in receiver.models[""].parameters()]
    forged = dataclasses.replace(
        closing,
        sender="party-2",
        round=9,
        tag=request.tag,
        positions=request.positions,
        gradient=torch.ones(len(request.positions), closing.gradient.shape[1]),
    )
    with pytest.raises(ProtocolError, match="only the run's driver, party-0, closes a step"):
        receiver.receive(forged)
    after = list(receiver.models[""].parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    recorder = RecordingLayer()
    latent = _build("false-vfl-2", make_data(), PlainAggregator(), Channel([recorder]))
    latent.train_step(ROWS, 0, 0)
    gradients = [m for m in recorder.messages if isinstance(m, GradientMessage)]
    assert {m.sender for m in gradients} == {"party-0"}
    likelihood = next(m for m in gradients if m.tag.endswith("likelihood"))
    receiver = _party(latent, likelihood.receiver)
    drawn = [m for m in recorder.messages if m.kind == "latent" and m.receiver == receiver.name]
    # The driver's latent of round 9 (the driver expects its likelihoods): they wait.
    latent.fed.own.expect(
        "likelihood", senders=[receiver.name], round=9, batch_id=0, tag=drawn[0].tag
    )
    receiver.receive(dataclasses.replace(drawn[0], round=9))
    forged = dataclasses.replace(
        likelihood,
        sender="party-2",
        round=9,
        positions=drawn[0].positions,
        gradient=torch.ones(len(drawn[0].positions), likelihood.gradient.shape[1]),
    )
    with pytest.raises(ProtocolError, match="only the run's driver, party-0, sends gradients"):
        receiver.receive(forged)


@pytest.mark.parametrize(
    ("backend", "key", "expected"),
    [
        ("masks", b"\x01" * 31, "32 bytes expected"),
        # A low-order point (all-zero secret) and a non-canonical u >= 2^255 - 19: taken, they
        # replaced the good key and failed only at the next sum.
        ("masks", b"\x00" * 32, "degenerate secret"),
        ("masks", b"\xff" * 31 + b"\x7f", "canonically encoded"),
        ("paillier", b"\x80" + b"\x00" * 127, "odd 1024-bit Paillier modulus"),
        ("ckks", b"not a context", "does not load"),
        (
            "ckks",
            public_context_bytes(make_secret_context(4096, [40, 20, 40], 30)),
            r"context of N = 8192 with 2 coefficient-modulus primes of \[60, 60\] bits expected",
        ),
    ],
)
def test_a_bad_public_key_is_refused(
    make_data: MakeData, backend: str, key: bytes, expected: str
) -> None:
    method, recorder = _stepped(make_data, backend)
    party = in_process_parties(method.fed.channel)[1]
    role = "sender" if backend == "masks" else "receiver"
    # A session the driver opens anew (a key of a session no key request opened only waits).
    request = [m for m in recorder.messages if m.kind == "key-request"][-1]
    party.receive(dataclasses.replace(request, receiver=party.name, session="fresh"))
    message = PublicKeyMessage(
        sender="party-0",
        receiver=party.name,
        round=0,
        batch_id=0,
        session="fresh",
        scheme=backend,
        role=role,
        key=key,
    )
    with pytest.raises((ProtocolError, IntegrityError), match=expected):
        party.receive(message)


def test_a_second_different_key_in_one_key_session_is_refused_and_the_first_kept(
    make_data: MakeData,
) -> None:
    """A peer's key replaced within a session left the sums sealed under the first with masks
    that no longer cancelled ("masks did not cancel" at the next sum)."""
    method, recorder = _stepped(make_data)
    announced = _last(recorder, PublicKeyMessage, "party-2")
    party = _party(method, announced.receiver)
    with pytest.raises(ProtocolError, match=r"a second public-key .*\(a replay\?\)"):
        party.receive(announced)
    other = X25519PrivateKey.generate().public_key().public_bytes_raw()
    # Another message (another batch id) answers no key request of the session.
    with pytest.raises(ProtocolError, match=r"the key request of session .* round 0, batch 0"):
        party.receive(dataclasses.replace(announced, batch_id=2, key=other))
    # The session's own check, past the receipts and the request's header: the same key again
    # changes nothing, another is refused.
    sessions = party._key_sessions
    sessions.take_key(party.name, announced, [])
    with pytest.raises(ProtocolError, match="a second, different sender key of key session"):
        sessions.take_key(party.name, dataclasses.replace(announced, key=other), [])
    method.train_step(ROWS + 32, 1, 0)  # the first key stands: the next step's masks cancel


def test_a_key_of_a_session_no_driver_opened_changes_nothing(make_data: MakeData) -> None:
    """A key of an unknown session was taken as the newest session, after which the driver's
    own keys were refused as replays: any party could stop a run at its key set-up."""
    method, recorder = _stepped(make_data)
    announced = _last(recorder, PublicKeyMessage, "party-2")
    party = _party(method, announced.receiver)
    other = X25519PrivateKey.generate().public_key().public_bytes_raw()
    party.receive(dataclasses.replace(announced, session="forged", key=other))
    # The driver's session is still the newest (it was a replay of an older session).
    assert party._key_sessions._seen[-1] == announced.session
    server = _party(method, AGGREGATOR)
    receiver_key = next(
        m
        for m in recorder.messages
        if isinstance(m, PublicKeyMessage) and m.receiver == AGGREGATOR and m.role == "receiver"
    )
    server.receive(dataclasses.replace(receiver_key, session="forged"))
    method.train_step(ROWS + 32, 1, 0)  # the session stands at every party


def test_keys_of_sessions_not_opened_are_bounded_per_sender_and_in_bytes(
    make_data: MakeData,
) -> None:
    """Keys of sessions no key request opened were kept bounded by their count only (256, all
    senders together): a peer's 16 keys of 16 MiB grew a party by 550 MiB, and 240 more had the
    honest early key of the next session refused. Each sender's are bounded now, and in bytes."""
    method, recorder = _stepped(make_data)
    announced = _last(recorder, PublicKeyMessage, "party-2")
    party = _party(method, announced.receiver)
    sessions = party._key_sessions

    def key() -> bytes:
        return X25519PrivateKey.generate().public_key().public_bytes_raw()

    with pytest.raises(ProtocolError, match=r"party-2 .* at most 32 bytes expected .* found 33"):
        party.receive(dataclasses.replace(announced, session="big", key=bytes(33)))
    for n in range(MAX_EARLY_SESSIONS):
        party.receive(dataclasses.replace(announced, session=f"bogus{n}", key=key()))
    with pytest.raises(ProtocolError, match="a second sender key of key session 'bogus0'"):
        party.receive(dataclasses.replace(announced, session="bogus0", batch_id=1, key=key()))
    with pytest.raises(ProtocolError, match=r"at most 2 such sessions .* found party-2's keys"):
        party.receive(dataclasses.replace(announced, session="bogus9", key=key()))
    assert len(sessions._early) == MAX_EARLY_SESSIONS
    # Another member's key of the next session is kept, and taken when the session opens.
    honest = next(
        m
        for m in recorder.messages
        if isinstance(m, PublicKeyMessage) and m.receiver == party.name and m.sender != "party-2"
    )
    fresh = key()
    party.receive(dataclasses.replace(honest, session="next", key=fresh))
    request = [m for m in recorder.messages if m.kind == "key-request"][-1]
    party.receive(dataclasses.replace(request, receiver=party.name, session="next"))
    assert sessions._keys == {(honest.sender, honest.role): fresh} and sessions._early == []


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_key_in_a_role_its_sender_does_not_hold_is_refused_and_learnt_by_no_one(
    make_data: MakeData, backend: str
) -> None:
    """A receiver's key sent again by a party that receives no sum, and by the aggregation
    server (which holds no secret key), was learnt as that party's receiver key; a contributor's
    key from the server as its sender key. Each is refused against the driver's key request,
    and no party's keys change."""
    method, recorder = _stepped(make_data, backend)
    keys = [m for m in recorder.messages if isinstance(m, PublicKeyMessage)]
    roles = {role: {m.sender for m in keys if m.role == role} for role in ("sender", "receiver")}
    held = {name: dict(party._key_sessions._keys) for name, party in _parties(method).items()}
    refused = 0
    for message in keys:
        for other in [*_parties(method), AGGREGATOR]:
            if other in roles[message.role] or other == message.receiver:
                continue
            forged = dataclasses.replace(message, sender=other)
            with pytest.raises(ProtocolError, match=f"a {message.role} key, but the "):
                _party(method, message.receiver).receive(forged)
            refused += 1
    assert refused > 0
    # The aggregation server takes receivers' keys only (under masks it kept a contributor's).
    for message in keys:
        if message.role == "sender":
            to_server = dataclasses.replace(message, receiver=AGGREGATOR)
            with pytest.raises(ProtocolError, match="takes receivers' keys only"):
                _party(method, AGGREGATOR).receive(to_server)
    assert held == {n: dict(p._key_sessions._keys) for n, p in _parties(method).items()}
    method.train_step(ROWS + 32, 1, 0)  # the session's keys stand: the next sums open


def test_a_party_of_another_scheme_refuses_the_key_set_up(make_data: MakeData) -> None:
    method, recorder = _stepped(make_data)
    request = _last(recorder, PublicKeyMessage)
    party = _party(method, request.receiver)
    assert isinstance(party, DataParty)
    with pytest.raises(ProtocolError, match="but it runs masks"):
        party.receive(dataclasses.replace(request, scheme="ckks", batch_id=1))


def test_plain_backends_are_not_split(make_data: MakeData) -> None:
    aggregator: SumBackend = PlainAggregator()
    assert not isinstance(aggregator, SealingScheme)
    method = METHODS.get("laser")(make_data(), CONFIG, seed=0, aggregator=aggregator)
    assert all(p.sealer is None for p in in_process_parties(method.fed.channel))  # type: ignore[attr-defined]
