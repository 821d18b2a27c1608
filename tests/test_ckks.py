"""Packed CKKS secure sums: the aggregator contract, the stated error bound against a float64
oracle, a public context that cannot decrypt, refusals that change nothing, wrong keys,
corrupted bytes, packing, and LASER through it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest
import tenseal as ts
import torch
from aggregator_contract import (
    AGGREGATOR,
    PARTIES,
    PayloadTap,
    SecureAggregatorContract,
    SumParties,
    combine,
    full_batch,
    oracle,
    vector_sum,
)
from conftest import MakeData

from protocols.ckks import (
    CkksAggregator,
    load_public_context,
    make_secret_context,
    public_context_bytes,
)
from secure_vfl.errors import ConfigError, DivergenceError, IntegrityError, ProtocolError
from secure_vfl.federation.aggregator import PlainAggregator, SumBackend
from secure_vfl.federation.messages import (
    RepresentationMessage,
    SealedMessage,
    SealedSumMessage,
    SumMessage,
    SumRequest,
)
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.laser import MeanFusionMethod


class TestCkksAggregatorContract(SecureAggregatorContract):
    def make_aggregator(self) -> SumBackend:
        return CkksAggregator()

    def step(self, parties: int) -> float:
        return CkksAggregator().step(parties)

    def magnitude_limit(self) -> float:
        return CkksAggregator().max_magnitude


def within_bound(
    sums: torch.Tensor, messages: list[RepresentationMessage], selection: torch.Tensor
) -> float:
    """Largest |secure - float64 oracle| minus the stated bound plus float32 output rounding."""
    expected, magnitude = oracle(messages, selection)
    bound = CkksAggregator().step(selection.shape[2]) + 2.0**-24 * magnitude
    return float(((sums.double() - expected).abs() - bound).max())


def test_the_secure_sum_is_within_the_stated_bound_of_the_float64_sum() -> None:
    aggregator = CkksAggregator()
    assert aggregator.step(4) == 4 * 2.0**-20
    parties = SumParties(aggregator)
    generator = torch.Generator().manual_seed(1)
    for batch_id, scale in enumerate([1.0, 100.0, aggregator.max_magnitude]):
        messages, selection = full_batch(1, batch=64, width=16, tasks=3, batch_id=batch_id)
        messages = [
            dataclasses.replace(
                m,
                representation=(
                    (torch.rand(m.representation.shape, generator=generator) * 2 - 1) * scale
                ),
            )
            for m in messages
        ]
        sums = parties.combine(messages, selection, batch_id=batch_id).sums
        assert sums.dtype == torch.float32
        assert within_bound(sums, messages, selection) <= 0.0
        expected, _ = oracle(messages, selection)
        if scale == 100.0:  # the brief's yardstick: 1e-5 absolute for |values| <= 100
            assert float((sums.double() - expected).abs().max()) <= 1e-5 + 100 * 4 * 2.0**-24


def test_the_smallest_scale_offered_sums_within_its_stated_bound() -> None:
    """scale_bits=30, which the configuration takes, failed every honest sum as tampered with:
    its bound was the 2^40 scale's, and the noise decoded at 2^30 is 2^10 times larger."""
    messages, selection = full_batch(9)
    aggregator = CkksAggregator(scale_bits=30)
    sums = SumParties(aggregator).combine(messages, selection).sums
    expected, magnitude = oracle(messages, selection)
    bound = aggregator.step(selection.shape[2]) + 2.0**-24 * magnitude
    assert float(((sums.double() - expected).abs() - bound).max()) <= 0.0


def test_a_longer_modulus_chain_holds_no_larger_sums_than_double_precision_keeps_exact() -> None:
    """Three 60-bit primes took |value| <= 1e10, whose double-precision encoding and decoding
    err by ~|sum| 2^-52 (1e-3 here), far past the stated bound: honest sums failed as tampered
    with. Every chain now holds what one 60-bit data prime does, and refuses larger values."""
    messages, selection = full_batch(11)
    signs = torch.where(messages[0].representation >= 0, 1.0, -1.0)
    big = [dataclasses.replace(m, representation=signs * 1e10) for m in messages]
    aggregator = CkksAggregator(coeff_mod_bit_sizes=(60, 60, 60), max_magnitude=1e10)
    with pytest.raises(ProtocolError, match=r"could sum beyond 262144, the most a 40-bit scale"):
        SumParties(aggregator).combine(big, selection)
    held = CkksAggregator(coeff_mod_bit_sizes=(60, 60, 60), max_magnitude=65536.0)
    full = [dataclasses.replace(m, representation=signs * 65536.0) for m in messages]
    sums = SumParties(held).combine(full, selection).sums
    expected, _ = oracle(full, selection)
    assert float((sums.double() - expected).abs().max()) <= held.step(4)
    with pytest.raises(ConfigError, match=r"`scale_bits` must be in \[30, 56\] for 120"):
        CkksAggregator(coeff_mod_bit_sizes=(60, 60, 60), scale_bits=57)


def test_a_contribution_is_packed_into_n_over_2_slot_vectors() -> None:
    # T=1, B=256, d=64: 16384 values in 4 ciphertexts of 4096 slots, not 256.
    messages, _ = full_batch(2, batch=256, width=64, tasks=1)
    selection = torch.zeros(1, 256, 4, dtype=torch.bool)
    selection[0, :, :3] = True
    aggregator = CkksAggregator()
    parties = SumParties(aggregator)
    result = parties.combine(messages, selection)
    assert aggregator.slots == 4096
    shares = parties.crossed(SealedMessage)
    assert {m.sender for m in shares} == set(PARTIES[:3])  # party-3 entered no sum
    assert all(len(m.payload) == 4 for m in shares)
    assert len(parties.crossed(SealedSumMessage)[-1].payload) == 4
    assert within_bound(result.sums, messages, selection) <= 0.0


def test_the_public_context_cannot_decrypt_and_carries_no_secret_key() -> None:
    secret = make_secret_context()
    published = public_context_bytes(secret)
    public = load_public_context(published)
    assert secret.has_secret_key() and not public.has_secret_key() and public.is_public()
    # The published bytes reload to a context without a secret key, again and again.
    assert not ts.context_from(published).has_secret_key()
    assert not ts.context_from(public.serialize(save_secret_key=True)).has_secret_key()
    vector = ts.ckks_vector(public, [1.5, -2.0, 3.25])
    with pytest.raises(ValueError, match="secret"):
        vector.decrypt()
    vector.link_context(secret)
    assert np.allclose(vector.decrypt(), [1.5, -2.0, 3.25], atol=1e-6)
    # A context published with its secret key is refused by a sender.
    with pytest.raises(ProtocolError, match="must not hold the secret key"):
        load_public_context(secret.serialize(save_secret_key=True))
    # Nor one with evaluation keys, which no sum needs (a fresh context has relinearization keys).
    with pytest.raises(
        ProtocolError, match=r"without evaluation keys expected .* found relinearization keys"
    ):
        load_public_context(secret.serialize(save_secret_key=False, save_relin_keys=True))
    # What a receiver half announces has no secret key either.
    announced = CkksAggregator().receiver().public_key()
    assert not ts.context_from(announced).has_secret_key()
    assert not load_public_context(announced).has_secret_key()


def test_the_ckks_range_is_stated_in_the_refusal() -> None:
    messages, selection = full_batch(8)
    aggregator = CkksAggregator()
    big = messages[1].representation.clone()
    big[0, 0] = -4097.0
    messages[1] = dataclasses.replace(messages[1], representation=big)
    with pytest.raises(
        DivergenceError, match=r"\|value\| 4097, beyond what they encode, \|value\| <= 4096 \("
    ):
        combine(aggregator, messages, selection)
    messages[1] = dataclasses.replace(messages[1], representation=big.clamp(-4096, 4096))
    # Too many parties for the magnitude: 2^18 / 2^17 = 2 parties at most, 4 asked.
    with pytest.raises(ProtocolError, match=r"4 parties .* could sum beyond 262144"):
        combine(CkksAggregator(max_magnitude=2.0**17), messages, selection)


def test_decrypting_with_another_secret_key_is_detected() -> None:
    messages, selection = full_batch(9)
    parties = SumParties(CkksAggregator())
    parties.combine(messages, selection)
    # Garbage far outside the bound: another key decrypts the sum to ~1e18.
    stranger = make_secret_context()
    summed = parties.crossed(SealedSumMessage)[-1].payload[0]
    garbage = ts.ckks_vector_from(stranger, summed).decrypt()
    assert float(np.abs(garbage).max()) > 1e6
    # The receiver swaps in another secret context's half without announcing it.
    receiver = parties.parties[PARTIES[0]]
    receiver.install("ckks", receiver.sealer, CkksAggregator().receiver())
    messages, selection = full_batch(9, batch_id=1)
    with pytest.raises(IntegrityError, match="wrong key"):
        parties.combine(messages, selection, batch_id=1)


def test_corrupted_ciphertext_bytes_are_refused() -> None:
    def corrupt_header(sent: list[bytes]) -> list[bytes]:
        broken = bytearray(sent[0])
        broken[10] ^= 0xFF
        return [bytes(broken), *sent[1:]]

    def truncate(sent: list[bytes]) -> list[bytes]:
        return [sent[0][:100], *sent[1:]]

    def corrupt_body(sent: list[bytes]) -> list[bytes]:
        broken = bytearray(sent[0])
        broken[len(broken) // 2] ^= 0xFF  # parses, but the sum decrypts to garbage
        return [bytes(broken), *sent[1:]]

    def drop(sent: list[bytes]) -> list[bytes]:
        return []

    messages, selection = full_batch(10)
    selection[0, 0, :] = True
    for tap, pattern in [
        (PayloadTap(corrupt_header, sender=PARTIES[2]), "from party-2 does not deserialize"),
        (PayloadTap(truncate, sender=PARTIES[1]), "from party-1 does not deserialize"),
        (PayloadTap(corrupt_body, sender=PARTIES[3]), "tampered with"),
        (PayloadTap(drop, sender=PARTIES[0]), "1 ciphertexts expected from party-0, found 0"),
    ]:
        with pytest.raises(IntegrityError, match=pattern):
            SumParties(CkksAggregator(), layers=[tap]).combine(messages, selection)


def test_a_share_of_another_size_or_scale_is_refused_naming_its_sender() -> None:
    """Under the receiver's own public context, a share vector of another length or scale made
    the aggregation server fail with tenseal's ValueError, which named no party."""
    messages, selection = full_batch(10)
    selection[0, 0, :] = True
    public: dict[str, ts.Context] = {}

    def replaced(fewer: int, scale_bits: int) -> Callable[[list[bytes]], list[bytes]]:
        def rewrite(sent: list[bytes]) -> list[bytes]:
            values = [0.5] * (ts.ckks_vector_from(public["ckks"], sent[0]).size() - fewer)
            vector = ts.ckks_vector(public["ckks"], values, scale=float(2**scale_bits))
            return [bytes(vector.serialize()), *sent[1:]]

        return rewrite

    for rewrite, pattern in [
        (replaced(3, 40), r"ciphertext 0 from party-1: \d+ values expected, found \d+"),
        # Below the scales a sender may use (at least 2**30): it cannot be the honest one's.
        (replaced(0, 25), r"ciphertext 0 from party-1: sealed at a scale of 2\^s .* found 2\^25"),
    ]:
        parties = SumParties(CkksAggregator(), layers=[PayloadTap(rewrite, sender=PARTIES[1])])
        receiver = parties.parties[PARTIES[0]]
        assert receiver.opener is not None
        public["ckks"] = load_public_context(receiver.opener.public_key())
        with pytest.raises(IntegrityError, match=pattern):
            parties.combine(messages, selection)


@pytest.mark.parametrize("scale_bits", [25, 41])
@pytest.mark.parametrize("order", ["request first", "shares first"])
def test_a_share_sealed_at_another_scale_is_refused_on_arrival_naming_its_sender(
    order: str, scale_bits: int
) -> None:
    """A share sealed at a scale no sender of the run uses (below 2^30, or above its 2^40)
    passed the server's check of each share and failed only when the shares were added: with
    the request first, the refusal fell on the last share to come (an honest party blamed), the
    request was dropped and the bad share stayed kept. Refused on arrival naming its sender,
    nothing of it kept, the request still waiting for the honest share."""
    messages, selection = full_batch(10)
    selection[0, 0, :] = True
    public: dict[str, ts.Context] = {}
    sealed: list[SealedMessage] = []

    class Rescale:
        def on_message(self, message):  # type: ignore[no-untyped-def]
            # Party-1's first share only: sent again, it crosses intact.
            if not isinstance(message, SealedMessage) or message.sender != PARTIES[1] or sealed:
                return message
            sealed.append(message)
            first, *rest = message.payload
            size = ts.ckks_vector_from(public["ckks"], first).size()
            vector = ts.ckks_vector(public["ckks"], [0.5] * size, scale=float(2**scale_bits))
            return dataclasses.replace(message, payload=(bytes(vector.serialize()), *rest))

    parties = SumParties(CkksAggregator(), layers=[Rescale()])
    receiver = parties.parties[PARTIES[0]]
    assert receiver.opener is not None
    public["ckks"] = load_public_context(receiver.opener.public_key())
    request = SumRequest(**parties._header(AGGREGATOR, 0, 0), **parties._plan(selection, ""))
    refused = (
        r"^aggregator: the sealed share from party-1 for round 0, batch 0, tag '' does not fit "
        r"its sum: CKKS ciphertext 0 from party-1: sealed at a scale of 2\^s with s in \[30, 40\] "
        rf"expected \(the scales this run's senders use\), found 2\^{scale_bits}\.$"
    )
    parties.contribute(messages)
    if order == "request first":
        parties.driver.send(request)
        parties.seal(selection, only=[PARTIES[0]])
        with pytest.raises(IntegrityError, match=refused):
            parties.seal(selection, only=[PARTIES[1]])
        parties.seal(selection, only=PARTIES[2:])  # the honest ones are not blamed
        assert list(parties.server._waiting)  # the request still waits
    else:
        parties.seal(selection)
        with pytest.raises(IntegrityError, match=refused):
            parties.driver.send(request)
        assert not parties.server._waiting
    assert sorted(parties.server._sealed[""]) == [PARTIES[0], *PARTIES[2:]]
    parties.channel.post(sealed[0], sender=parties.parties[PARTIES[1]])
    if order == "shares first":
        parties.driver.send(request)
    summed = parties.driver.take("sum", sender=AGGREGATOR, round=0, batch_id=0, tag="")
    assert isinstance(summed, SumMessage)
    assert within_bound(summed.sums, messages, selection) <= 0.0


def test_a_receivers_context_is_checked_against_the_runs_parameters() -> None:
    """Each honest setting's context is taken (SEAL gives the primes' product one bit fewer
    than their sizes' sum where small primes sit far below 2^b: [21] * 4 at N = 8192 is 83
    bits, which a check of the sum refused), and another setting's is refused."""
    honest = [(8192, [21, 21, 21, 21]), (16384, [22, 22, 22, 22]), (8192, [60, 40, 40, 60])]
    for degree, sizes in honest:
        published = public_context_bytes(make_secret_context(degree, sizes, 20))
        load_public_context(published, modulus=(degree, sizes))
    other = public_context_bytes(make_secret_context(8192, [40, 40, 40], 30))
    with pytest.raises(ProtocolError, match=r"3 primes of 120 bits in all"):
        load_public_context(other, modulus=(8192, [60, 60]))
    with pytest.raises(ProtocolError, match=r"found N = 8192 with 2 primes"):
        load_public_context(
            public_context_bytes(make_secret_context(8192, [60, 60], 40)), modulus=(8192, [60, 59])
        )


def test_a_bfv_context_or_one_without_its_public_key_is_refused_and_the_good_one_kept() -> None:
    """Both were taken, replacing the receiver's good context at every contributor and the
    server, and the next sum failed inside the sealing with tenseal's ValueError ("unsupported
    scheme", "this context doesn't support encryption")."""
    bfv = ts.context(
        ts.SCHEME_TYPE.BFV,
        poly_modulus_degree=8192,
        plain_modulus=1032193,
        coeff_mod_bit_sizes=[60, 60],
    )
    keyless = make_secret_context().serialize(
        save_public_key=False,
        save_secret_key=False,
        save_galois_keys=False,
        save_relin_keys=False,
    )
    messages, selection = full_batch(12)
    parties = SumParties(CkksAggregator())
    parties.combine(messages, selection)
    halves = [parties.parties[PARTIES[1]].sealer, parties.server.adder]
    for published, pattern in [
        (public_context_bytes(bfv), "a CKKS context expected from party-0, found a BFV one"),
        (keyless, "with its public key expected from party-0, found one without"),
    ]:
        for half in halves:
            assert half is not None
            with pytest.raises(ProtocolError, match=pattern):
                half.learn(PARTIES[0], "receiver", bytes(published))
    messages, selection = full_batch(12, batch_id=1)
    result = parties.combine(messages, selection, batch_id=1)  # the good context stands
    assert within_bound(result.sums, messages, selection) <= 0.0


def test_whole_vector_sums_work_through_split_ckks() -> None:
    generator = torch.Generator().manual_seed(13)
    vectors = {name: torch.randn(5000, generator=generator) for name in PARTIES[:3]}
    plain = vector_sum(PlainAggregator(), vectors, round=1)
    secure = vector_sum(CkksAggregator(), vectors, round=1)
    assert bool(((secure - plain).abs() <= 3 * 2.0**-20 + 1e-5).all())


def test_configuration_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"`poly_modulus_degree` must be one of"):
        CkksAggregator(poly_modulus_degree=1000)
    with pytest.raises(ConfigError, match=r"above the 218 bits"):
        CkksAggregator(coeff_mod_bit_sizes=(60, 60, 60, 60))
    with pytest.raises(ConfigError, match=r"`scale_bits` must be in \[30, 56\]"):
        CkksAggregator(scale_bits=58)
    with pytest.raises(ConfigError, match=r"`max_magnitude` must be positive"):
        CkksAggregator(max_magnitude=float("inf"))


def test_laser_trained_through_ckks_matches_laser_trained_in_the_clear(
    make_data: MakeData,
) -> None:
    data = make_data(n=120)
    config = MethodConfig(heads="active", epochs=1, secure_sums=True)
    models = []
    for aggregator in (PlainAggregator(), CkksAggregator()):
        method = MeanFusionMethod(
            data, config, seed=3, planner="laser", name="laser", aggregator=aggregator
        )
        method.fit()
        modules = [p.model for p in in_process_parties(method.fed.channel)] + [
            h.module for p in in_process_parties(method.fed.channel) for h in p.heads.values()
        ]
        models.append([t.detach().clone() for m in modules for t in m.parameters()])
    plain, secure = models
    # Sums are within ~2^-18 per value, which moves the weights of a few steps far less.
    assert all(
        torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(plain, secure, strict=True)
    )


def test_a_chunk_of_slots_a_party_enters_no_sum_with_is_not_encrypted() -> None:
    """A secure step asks for several sums (the label party's own term, a block, both): each
    party's values fill only some of them, and a ciphertext of slots it enters no sum with was
    an encryption of zeros. Such a chunk is sent empty (the public selection says which), added
    as nothing; the sums are the same within the bound, and a sum chunk with contributors that
    comes back empty is refused."""
    messages, _ = full_batch(3, batch=32, width=128, tasks=3)
    selection = torch.zeros(3, 32, 4, dtype=torch.bool)
    selection[0, :, 0] = True  # the receiver's own term alone
    selection[1, :, 1:] = True  # the block of the others
    selection[2, :, :] = True  # both
    parties = SumParties(CkksAggregator())
    result = parties.combine(messages, selection)
    assert within_bound(result.sums, messages, selection) <= 0.0
    # 32 rows x 128 values: one ciphertext per sum; each party fills two of the three.
    payloads = {m.sender: m.payload for m in parties.crossed(SealedMessage)}
    assert [len(p[0]) > 0 for p in payloads.values()] == [True, False, False, False]
    assert all(len(p[1]) > 0 for n, p in payloads.items() if n != PARTIES[0])
    assert not payloads[PARTIES[0]][1]
    assert all(p[2] for p in payloads.values())
    assert all(parties.crossed(SealedSumMessage)[-1].payload)

    def dropped(sent: list[bytes]) -> list[bytes]:
        return [sent[0], b"", sent[2]]

    with pytest.raises(IntegrityError, match="ciphertext 1 came back empty, but its sums"):
        SumParties(CkksAggregator(), layers=[PayloadTap(dropped, kind=SealedSumMessage)]).combine(
            messages, selection
        )


def test_the_aggregator_refuses_a_share_whose_empty_chunks_are_not_its_selections() -> None:
    """Which ciphertexts a contributor leaves empty is fixed by the public selection: one left
    empty where its values go would drop its term from sums that count it (the receiver would
    take a sum of fewer parties for a sum of more), one filled where it enters no sum would add
    to sums it is not in. The aggregator refuses both, naming the sender and the ciphertext."""
    messages, _ = full_batch(3, batch=32, width=128, tasks=3)
    selection = torch.zeros(3, 32, 4, dtype=torch.bool)
    selection[0, :, 0] = True
    selection[1, :, 1:] = True
    selection[2, :, :] = True
    member = PARTIES[1]

    def emptied(sent: list[bytes]) -> list[bytes]:
        return [sent[0], sent[1], b""]

    def filled(sent: list[bytes]) -> list[bytes]:
        return [sent[1], sent[1], sent[2]]

    for rewrite, found in (
        (emptied, "share from party-1: item 2: .*found it empty"),
        (filled, "share from party-1: item 0: an empty one .*expected"),
    ):
        parties = SumParties(CkksAggregator(), layers=[PayloadTap(rewrite, sender=member)])
        with pytest.raises(IntegrityError, match=found):
            parties.combine(messages, selection)
    untouched = SumParties(CkksAggregator(), layers=[PayloadTap(lambda sent: sent, sender=member)])
    assert within_bound(untouched.combine(messages, selection).sums, messages, selection) <= 0.0
