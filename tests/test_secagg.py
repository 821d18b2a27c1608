"""Pairwise-mask secure aggregation: the aggregator contract, exactness, privacy of what crosses
the wire, refusals that change nothing, dropouts, and LASER / FedAvg trained through it."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch
from aggregator_contract import (
    AGGREGATOR,
    PARTIES,
    RECEIVER,
    AggregatorContract,
    SecureAggregatorContract,
    SumParties,
    combine,
    full_batch,
    oracle,
    representations,
)
from conftest import MakeData
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from test_fedhf import synthetic_task
from torch import Tensor

from protocols import secagg
from protocols.secagg import (
    MaskingAggregator,
    MaskReceiver,
    MaskSender,
    add_pair_mask,
    add_self_mask,
    decode_fixed_point,
    derive_pair_key,
    derive_self_key,
    encode_fixed_point,
    fixed_point_limit,
)
from secure_vfl.errors import ConfigError, DivergenceError, IntegrityError, ProtocolError
from secure_vfl.federation.aggregator import (
    PlainAggregator,
    SumBackend,
    SumMembers,
    sum_context,
)
from secure_vfl.federation.messages import (
    Message,
    PublicKeyMessage,
    RepresentationMessage,
    SealedMessage,
    SealedSumMessage,
    SumMessage,
    SumRequest,
)
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.imputation import IMPUTERS, ImputeConfig
from secure_vfl.methods.laser import MeanFusionMethod


def masking(seed: int = 0, **kwargs: object) -> MaskingAggregator:
    """A masking aggregator whose keys come from a seeded source (tests only)."""
    return MaskingAggregator(entropy=np.random.default_rng(seed).bytes, **kwargs)  # type: ignore[arg-type]


def ring(message: Message) -> np.ndarray:
    """The uint64 ring elements of a sealed share or sum as they crossed."""
    assert isinstance(message, SealedMessage | SealedSumMessage)
    return np.frombuffer(message.payload[0], dtype="<u8").astype(np.uint64)


class TestPlainAggregatorContract(AggregatorContract):
    def make_aggregator(self) -> SumBackend:
        return PlainAggregator()

    @pytest.mark.parametrize("order", ["request first", "representations first"])
    @pytest.mark.parametrize("fault", ["another width", "rows outside the batch", "a row missing"])
    def test_a_bad_representation_is_refused_naming_its_sender_and_nothing_of_it_kept(
        self, order: str, fault: str
    ) -> None:
        """The server kept a plain representation before checking it against its sum: the sum
        failed once the last representation or the request came (on that one's sender, and
        a row missing named nobody), the request was lost and the bad representation stayed
        kept. Refused as soon as its sum's request and it are both here (its width against
        those kept for the sum on arrival), naming its sender; nothing of it is kept."""
        messages, selection = full_batch(18)
        good = messages[2]
        if fault == "another width":
            bad = dataclasses.replace(good, representation=torch.cat([good.representation] * 2, 1))
            said = (
                r"of width 16, where the representations kept for it \(from party-0, party-1\) "
                r"are of width 8: representations of one width expected\."
            )
        elif fault == "rows outside the batch":
            bad = dataclasses.replace(good, positions=good.positions + 16)
            said = r"rows of a batch of 16 expected, found row 31\."
        else:
            row = int(torch.nonzero(selection[..., 2].any(dim=0))[0])
            kept = good.positions != row
            bad = dataclasses.replace(
                good, positions=good.positions[kept], representation=good.representation[kept]
            )
            said = rf"the rows the sum selects of party-2 expected, found row {row} missing\."
        parties = SumParties(self.make_aggregator())
        request = SumRequest(**parties._header(AGGREGATOR, 0, 0), **parties._plan(selection, ""))
        refused = (
            r"^aggregator: the representation from party-2 for round 0, batch 0, tag '' does "
            rf"not fit its sum: {said}$"
        )
        if order == "request first" or fault == "another width":
            if order == "request first":
                parties.driver.send(request)
            parties.contribute(messages[:2])
            with pytest.raises(ProtocolError, match=refused):
                parties.contribute([bad])
            parties.contribute([messages[3]])  # another's representation is not blamed
            if order == "request first":
                assert list(parties.server._waiting)  # the request still waits
        else:
            parties.contribute([*messages[:2], bad, messages[3]])
            with pytest.raises(ProtocolError, match=refused):
                parties.driver.send(request)
            assert not parties.server._waiting
        assert sorted(parties.server._contributions[""]) == [PARTIES[0], PARTIES[1], PARTIES[3]]
        parties.contribute([good])  # sent again as its party made it: taken
        if order == "representations first":
            parties.driver.send(request)
        summed = parties.driver.take("sum", sender=AGGREGATOR, round=0, batch_id=0, tag="")
        assert isinstance(summed, SumMessage)
        self.assert_close_to_oracle(summed.sums, messages, selection)


class TestMaskingAggregatorContract(SecureAggregatorContract):
    def make_aggregator(self) -> SumBackend:
        return masking()

    def step(self, parties: int) -> float:
        return masking().step(parties)

    def magnitude_limit(self) -> float:
        return fixed_point_limit(24, 4)


def test_the_secure_sum_is_the_exact_ring_sum_of_the_rounded_values() -> None:
    messages, selection = full_batch(1, batch=64, tasks=4)
    aggregator = masking()
    dense = torch.stack([m.representation for m in messages]).numpy()
    encoded = encode_fixed_point(dense, fraction_bits=aggregator.fraction_bits, parties=4)
    chosen = selection.numpy().astype(np.uint64)
    ring_sum = np.einsum("tbk,kbd->tbd", chosen, encoded)  # uint64: wraps like the protocol
    expected = decode_fixed_point(ring_sum, fraction_bits=aggregator.fraction_bits)
    assert torch.equal(combine(aggregator, messages, selection), torch.from_numpy(expected).float())


def test_fixed_point_round_trip_is_within_half_a_step() -> None:
    values = np.random.default_rng(0).normal(0.0, 100.0, size=1000)
    decoded = decode_fixed_point(
        encode_fixed_point(values, fraction_bits=24, parties=4), fraction_bits=24
    )
    assert np.abs(decoded - values).max() <= 2.0**-25


def test_masked_contributions_look_uniform_whatever_the_value() -> None:
    generator = torch.Generator().manual_seed(2)
    present = torch.ones(128, 4, dtype=torch.bool)
    selection = torch.ones(2, 128, 4, dtype=torch.bool)
    parties = SumParties(masking())
    observed = []
    for batch_id, scale in enumerate([0.0, 1000.0]):
        messages = representations(present, 16, generator, round=0, batch_id=batch_id)
        messages = [
            dataclasses.replace(m, representation=m.representation * 0 + scale) for m in messages
        ]
        parties.combine(messages, selection, batch_id=batch_id)
        masked = ring(parties.crossed(SealedMessage, PARTIES[1])[-1])  # as the server got it
        encoded = encode_fixed_point(np.full(masked.shape, scale), fraction_bits=24, parties=4)
        assert not np.any(masked == encoded)
        observed.append(masked)
    for masked in observed:
        top_bit = (masked >> np.uint64(63)).astype(np.float64)
        assert abs(top_bit.mean() - 0.5) < 0.03
        assert abs((masked / 2.0**64).mean() - 0.5) < 0.03
    assert {m.sender for m in parties.crossed(SealedMessage)} == set(PARTIES)


def test_a_value_that_could_overflow_the_ring_is_refused() -> None:
    messages, selection = full_batch(7)
    limit = fixed_point_limit(24, 4)
    big = messages[1].representation.clone()
    big[0, 0] = 1.01 * limit
    messages[1] = dataclasses.replace(messages[1], representation=big)
    parties = SumParties(masking())
    said = r"beyond what they encode, \|value\| <= 6\.871947674e\+10 \(24 fraction bits, 4 parties"
    with pytest.raises(DivergenceError, match=said):
        parties.combine(messages, selection)
    assert parties.crossed(SealedMessage, PARTIES[1]) == []


def test_a_party_with_a_replaced_key_breaks_the_sum_and_is_detected() -> None:
    messages, selection = full_batch(8)
    aggregator = masking()
    parties = SumParties(aggregator)
    parties.combine(messages, selection)
    # party-1 swaps in a fresh key pair but announces it to nobody: its peers keep the old key.
    replaced = aggregator.sender()
    for message in parties.crossed(PublicKeyMessage):
        if message.receiver == PARTIES[1]:
            replaced.learn(message.sender, message.role, message.key)
    parties.parties[PARTIES[1]].install("masks", replaced, None)
    messages, selection = full_batch(8, batch_id=1)
    with pytest.raises(IntegrityError, match="masks did not cancel"):
        parties.combine(messages, selection, batch_id=1)


def test_a_tampered_masked_contribution_shifts_the_sum_undetected() -> None:
    # Masks give privacy, not integrity: the server cannot tell a tampered contribution.
    class Tamper:
        def on_message(self, message):  # type: ignore[no-untyped-def]
            if not isinstance(message, SealedMessage) or message.sender != PARTIES[1]:
                return message
            changed = ring(message).reshape(2, 16, 8)
            changed[0, 3, 2] += np.uint64(2**24)  # +1.0 in fixed point
            return dataclasses.replace(message, payload=(changed.astype("<u8").tobytes(),))

    messages, selection = full_batch(9)
    selection[0, 3, :] = True
    honest = combine(masking(), messages, selection)
    tampered = SumParties(masking(), layers=[Tamper()]).combine(messages, selection).sums
    shift = (tampered - honest).abs()
    assert float(shift[0, 3, 2]) == pytest.approx(1.0, abs=1e-5)
    shift[0, 3, 2] = 0
    assert float(shift.max()) == 0.0


def _halves(aggregator: MaskingAggregator) -> tuple[dict[str, MaskSender], MaskReceiver]:
    """Each party's sender half and the receiver's half (:data:`RECEIVER`'s), with the keys
    the key set-up would have announced to them learnt."""
    senders = {name: aggregator.sender() for name in PARTIES}
    receiver = aggregator.receiver()
    for name, sender in senders.items():
        sender.learn(RECEIVER, "receiver", receiver.public_key())
        receiver.learn(name, "sender", sender.public_key())
        for peer, other in senders.items():
            if peer != name:
                other.learn(name, "sender", sender.public_key())
    return senders, receiver


def _members(selection: np.ndarray, context: bytes) -> SumMembers:
    """The sums of ``selection`` over :data:`PARTIES` for :data:`RECEIVER` under ``context``."""
    return SumMembers(
        selection=selection, parties=tuple(PARTIES), receiver=RECEIVER, context=context
    )


def _recover(
    messages: list[RepresentationMessage], selection: Tensor, dropped: str, width: int
) -> np.ndarray:
    """A sum whose ``dropped`` contributor sealed but whose share never came: the survivors'
    shares and reveals added by the server's half, opened by the receiver's half."""
    aggregator = masking()
    senders, receiver = _halves(aggregator)
    chosen = selection.numpy()
    context = sum_context("s", RECEIVER, 0, 0, "")
    batch = chosen.shape[1]
    sealed: dict[str, tuple[bytes, ...]] = {}
    reveals: dict[str, tuple[bytes, ...]] = {}
    for k, name in enumerate(PARTIES):
        if name == dropped or not chosen[..., k].any():
            continue
        values = np.zeros((batch, width), dtype=np.float32)
        for m in messages:
            if m.sender == name:
                values[m.positions.numpy()] = m.representation.numpy()
        options: dict[str, Any] = {
            "column": k,
            "parties": PARTIES,
            "receiver": RECEIVER,
            "context": context,
        }
        sealed[name] = senders[name].seal(values, chosen, **options)
        reveals[name] = senders[name].reveal([dropped], chosen, width=width, **options)
    kept = chosen.copy()
    kept[..., PARTIES.index(dropped)] = False
    shape = (chosen.shape[0], batch, width)
    adder = aggregator.adder()
    total = adder.add(
        {**sealed, **{f"{name} (reveal)": r for name, r in reveals.items()}},
        receiver=RECEIVER,
        shape=shape,
        parties=len(PARTIES),
    )
    return receiver.open(total, members=_members(kept, context), width=width)


def test_the_survivors_reveals_remove_a_dropped_party_and_the_sum_is_exact() -> None:
    generator = torch.Generator().manual_seed(10)
    present = torch.ones(32, 4, dtype=torch.bool)
    messages = representations(present, 8, generator, round=0, batch_id=0)
    selection = torch.rand(3, 32, 4, generator=generator) < 0.7
    # Releasable before and after party-3 drops out: 0 or >= 2 contributors besides the
    # receiver (party-0) in every sum, so parties 1 and 2 enter together or not at all.
    partial = selection[..., 1:3].sum(dim=2) < 2
    selection[..., 1:][partial] = False
    assert bool(selection[..., 3].any())
    survivors = [m for m in messages if m.sender != PARTIES[3]]  # its share never arrives
    sums = _recover(messages, selection, PARTIES[3], 8)
    kept = selection.clone()
    kept[..., 3] = False
    expected, magnitude = oracle(survivors, kept)
    assert bool(
        ((torch.from_numpy(sums).double() - expected).abs() <= 1e-6 + 2e-7 * magnitude).all()
    )


def test_without_the_reveals_the_survivors_masks_do_not_cancel() -> None:
    messages, selection = full_batch(10)
    selection[..., 1:] = selection[..., 1:].any(dim=2, keepdim=True)  # 1, 2, 3 together
    aggregator = masking()
    senders, receiver = _halves(aggregator)
    chosen = selection.numpy()
    context = sum_context("s", RECEIVER, 0, 0, "")
    sealed = {
        name: senders[name].seal(
            messages[k].representation.numpy(),
            chosen,
            column=k,
            parties=PARTIES,
            receiver=RECEIVER,
            context=context,
        )
        for k, name in enumerate(PARTIES[:3])
    }
    total = aggregator.adder().add(sealed, receiver=RECEIVER, shape=(2, 16, 8), parties=4)
    kept = chosen.copy()
    kept[..., 3] = False
    with pytest.raises(IntegrityError, match="masks did not cancel"):
        receiver.open(total, members=_members(kept, context), width=8)


def test_a_reveal_that_leaves_a_single_survivor_is_refused() -> None:
    messages, _ = full_batch(11)
    selection = torch.zeros(1, 16, 4, dtype=torch.bool)
    selection[0, 0, [0, 1, 2]] = True
    selection[0, 1, [1, 3]] = True  # party-1 alone (besides the receiver) once party-3 drops
    with pytest.raises(ProtocolError, match="row 1, party party-1"):
        _recover(messages, selection, PARTIES[3], 8)


def test_a_reveal_that_would_unmask_the_survivors_own_value_is_refused() -> None:
    # Row 0: party-0 (the receiver) and party-3 only. Once party-3 drops, the receiver's own
    # term alone is releasable to the receiver, but party-0's share there carries no mask but
    # the one with party-3: revealing it would hand the server party-0's value.
    senders, _ = _halves(masking())
    selection = np.zeros((1, 4, 4), dtype=bool)
    selection[0, 0, [0, 3]] = True
    with pytest.raises(ProtocolError, match=r"only survivor of 1 sums .*task 0, row 0"):
        senders[RECEIVER].reveal(
            [PARTIES[3]],
            selection,
            column=0,
            width=2,
            parties=PARTIES,
            receiver=RECEIVER,
            context=b"c",
        )


def test_only_another_contributor_can_be_dropped() -> None:
    senders, _ = _halves(masking())
    selection = np.ones((1, 4, 4), dtype=bool)
    for dropped in (["party-1"], ["nobody"]):
        with pytest.raises(ProtocolError, match="must be among the other parties"):
            senders["party-1"].reveal(
                dropped,
                selection,
                column=1,
                width=2,
                parties=PARTIES,
                receiver=RECEIVER,
                context=b"c",
            )


def test_fraction_bits_out_of_range_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"`fraction_bits` must be in \[0, 40\]. Found 63"):
        MaskingAggregator(fraction_bits=63)


@pytest.mark.usefixtures("one_thread")
def test_federated_averaging_through_masks_matches_the_plain_average() -> None:
    """One FedAvg round of the client actors: masked shares give the plain average within the
    fixed-point step (the clients' updates are the same: one thread, one seed)."""
    task = synthetic_task(rows=40, test_rows=5, features=6)
    config = ImputeConfig(rounds=1, local_epochs=1, hidden=16)
    averages = []
    for aggregator in (PlainAggregator(), masking()):
        imputer = IMPUTERS.get("fed-dae")(task, config, seed=0, aggregator=aggregator)
        imputer.fit()
        averages.append(imputer.theta)  # type: ignore[attr-defined]
    plain, secure = averages
    assert plain is not None and secure is not None and plain.numel() > 500
    assert not torch.equal(secure, plain)  # the masked sum went through fixed point
    assert torch.allclose(secure, plain, atol=1e-6, rtol=1e-6)


def test_laser_trained_through_masks_matches_laser_trained_in_the_clear(
    make_data: MakeData,
) -> None:
    data = make_data()
    config = MethodConfig(heads="active", epochs=1, secure_sums=True)
    models, predictions = [], []
    for aggregator in (PlainAggregator(), masking()):
        method = MeanFusionMethod(
            data, config, seed=3, planner="laser", name="laser", aggregator=aggregator
        )
        method.fit()
        modules = [p.model for p in in_process_parties(method.fed.channel)] + [
            h.module for p in in_process_parties(method.fed.channel) for h in p.heads.values()
        ]
        models.append([t.detach().clone() for m in modules for t in m.parameters()])
        # Prediction after training uses fresh mask contexts (its own tag), never a reuse.
        predictions.append(method.predict("mcar:0"))
    plain, secure = models
    assert all(
        torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(plain, secure, strict=True)
    )
    assert (predictions[0] == predictions[1]).mean() > 0.99


# -- double masking: a late share stays sealed to the aggregator ----------------------------

LATE = PARTIES[3]


def _late_arrival(value: float, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Any]:
    """A sum of all four parties over 4 rows of width 3 for :data:`RECEIVER`, where
    :data:`LATE` (whose values are all ``value``) is declared dropped: the survivors seal and
    reveal, the server adds, the receiver opens. Then the late share arrives anyway. Returns the
    receiver's sums, the survivors' values summed in float64, the aggregator's best
    reconstruction of the late party's term (its share less every reveal, in the ring: exactly
    its fixed-point value under masks without a self-mask) and the receiver's half."""
    aggregator = masking(seed)
    senders, receiver = _halves(aggregator)
    selection = np.ones((1, 4, 4), dtype=bool)
    context = sum_context("s", RECEIVER, 0, 0, "late")
    options: dict[str, Any] = {"parties": PARTIES, "receiver": RECEIVER, "context": context}
    rng = np.random.default_rng(seed)
    values = {name: rng.normal(0.0, 2.0, size=(4, 3)).astype(np.float32) for name in PARTIES}
    values[LATE][:] = value
    survivors = PARTIES[:3]
    sealed = {
        name: senders[name].seal(values[name], selection, column=k, **options)
        for k, name in enumerate(survivors)
    }
    reveals = {
        name: senders[name].reveal([LATE], selection, column=k, width=3, **options)
        for k, name in enumerate(survivors)
    }
    adder = aggregator.adder()
    total = adder.add(
        {**sealed, **{f"{n} (reveal)": r for n, r in reveals.items()}},
        receiver=RECEIVER,
        shape=(1, 4, 3),
        parties=4,
    )
    kept = selection.copy()
    kept[..., 3] = False
    sums = receiver.open(total, members=_members(kept, context), width=3)
    late = senders[LATE].seal(values[LATE], selection, column=3, **options)
    reconstruction = np.frombuffer(late[0], dtype="<u8").reshape(1, 4, 3).astype(np.uint64)
    for reveal in reveals.values():
        reconstruction -= np.frombuffer(reveal[0], dtype="<u8").reshape(1, 4, 3)
    expected = sum(values[name].astype(np.float64) for name in survivors)
    return sums, np.asarray(expected), reconstruction, receiver


def test_a_share_arriving_after_its_sender_was_dropped_stays_sealed_to_the_aggregator() -> None:
    sums, expected, reconstruction, receiver = _late_arrival(1.5, seed=20)
    # The survivors' sum opens exactly (within the fixed-point step) without the late party.
    assert np.abs(sums - expected).max() <= 3 * 2.0**-25 + 1e-5
    # Everything the aggregator holds (the late share, the reveals, the survivors' shares and
    # their sum) leaves the late party's term under its self-mask: not its value anywhere.
    # (Without a self-mask the share less the reveals is exactly the value 1.5 everywhere.)
    read = decode_fixed_point(reconstruction, fraction_bits=24)
    assert not np.any(np.abs(read - 1.5) < 1.0)
    # What stands between the aggregator and the value is the self-mask only the receiver can
    # remove: opened as the late party's own sum, the reconstruction is its value. (So an
    # aggregator colluding with the receiver would read it: documented, not prevented.)
    alone = np.zeros((1, 4, 4), dtype=bool)
    alone[..., 3] = True
    context = sum_context("s", RECEIVER, 0, 0, "late")
    opened = receiver.open(
        (reconstruction.astype("<u8").tobytes(),), members=_members(alone, context), width=3
    )
    assert np.array_equal(opened, np.full((1, 4, 3), 1.5, dtype=np.float32))


def test_the_aggregators_view_of_a_late_share_has_the_same_distribution_for_any_value() -> None:
    # Over fresh keys, the aggregator's reconstruction of the late party's term is uniform in
    # Z_2^64 whatever that party's value: its top bit (the sign of a fixed-point value, which
    # without a self-mask would be 0 for +1.5 and 1 for -1.5 every time) is a fair coin for both.
    for value in (1.5, -1.5):
        bits = np.concatenate(
            [(_late_arrival(value, seed)[2] >> np.uint64(63)).ravel() for seed in range(40)]
        )
        assert abs(bits.astype(np.float64).mean() - 0.5) < 0.1, value


def test_self_masks_never_equal_pair_masks_of_the_same_context() -> None:
    rng = np.random.default_rng(21)
    ours, theirs = (X25519PrivateKey.from_private_bytes(rng.bytes(32)) for _ in range(2))
    peer_public = theirs.public_key().public_bytes_raw()
    pair_key = derive_pair_key(ours, peer_public, PARTIES[1], PARTIES[2])
    self_key = derive_self_key(ours, peer_public, PARTIES[1], PARTIES[2])
    assert pair_key != self_key  # the same X25519 secret, separated by the HKDF info
    rows = np.ones((2, 8), dtype=bool)
    context = sum_context("s", RECEIVER, 0, 0, "t")
    for key in (pair_key, self_key):  # and even under one key, by the expansion's info
        pair = np.zeros((2, 8, 4), dtype=np.uint64)
        own = np.zeros((2, 8, 4), dtype=np.uint64)
        add_pair_mask(pair, key, 1, rows, secagg._MASK_INFO + context)
        add_self_mask(own, key, 1, rows, context)
        assert pair.any() and own.any() and not np.any(pair == own)


def test_a_receiver_without_a_contributors_key_refuses_to_open() -> None:
    aggregator = masking(22)
    senders, _ = _halves(aggregator)
    receiver = aggregator.receiver()
    for name in PARTIES[:3]:  # party-3's announcement never reached it
        receiver.learn(name, "sender", senders[name].public_key())
    selection = np.ones((1, 2, 4), dtype=bool)
    payload = aggregator.adder().add({}, receiver=RECEIVER, shape=(1, 2, 3), parties=4)
    with pytest.raises(ProtocolError, match=r"holds no key of contributor party-3.*self-mask"):
        receiver.open(payload, members=_members(selection, b"c"), width=3)


def test_a_contributor_without_the_receivers_key_refuses_to_seal() -> None:
    sender = masking(23).sender()
    with pytest.raises(ProtocolError, match="holds no receiver key of party-0"):
        sender.seal(
            np.zeros((2, 3), dtype=np.float32),
            np.ones((1, 2, 4), dtype=bool),
            column=1,
            parties=PARTIES,
            receiver=RECEIVER,
            context=b"c",
        )


def test_a_masked_step_sends_the_same_messages_and_share_bytes_as_without_self_masks() -> None:
    # Double masking adds no message to a step: a seal request to each other contributor (the
    # driver's own is handed over, not sent), a sealed share per contributor, one sum request
    # and one sealed sum; each share is the T * B * d ring elements it was, the self-mask riding
    # in them. (The driver's ticket key goes to the server once per session, with the first
    # seal request: tickets add no message to a step but the session's first.)
    messages, selection = full_batch(24, batch=16, width=8, tasks=2)
    parties = SumParties(masking())
    setup = len(parties.recorder.messages)
    parties.combine(messages, selection)
    step = parties.recorder.messages[setup:]
    assert Counter(m.kind for m in step) == {
        "ticket-key": 1,
        "seal-request": 3,
        "sealed": 4,
        "sum-request": 1,
        "sealed-sum": 1,
    }
    shares = [m for m in step if isinstance(m, SealedMessage)]
    assert [len(m.payload[0]) for m in shares] == [8 * 2 * 16 * 8] * 4
    (summed,) = [m for m in step if isinstance(m, SealedSumMessage)]
    assert torch.equal(summed.selection, selection)
