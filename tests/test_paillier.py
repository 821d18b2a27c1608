"""Packed Paillier secure sums: the aggregator contract, exactness against a plaintext oracle,
standard ciphertexts, refusals that change nothing, wrong keys, tampering, and LASER through it."""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable

import gmpy2
import numpy as np
import pytest
import torch
from aggregator_contract import (
    PARTIES,
    RECEIVER,
    PayloadTap,
    SecureAggregatorContract,
    SumParties,
    combine,
    full_batch,
    vector_sum,
)
from conftest import MakeData
from phe import paillier
from torch import Tensor

from protocols.paillier import (
    KeyPair,
    PackingLayout,
    PaillierAggregator,
    PaillierSender,
    encode_values,
    generate_key_pair,
)
from secure_vfl.errors import (
    ConfigError,
    DivergenceError,
    IntegrityError,
    OutOfRangeError,
    ProtocolError,
)
from secure_vfl.federation.aggregator import PlainAggregator, SumBackend, entered_items
from secure_vfl.federation.messages import (
    Message,
    PublicKeyMessage,
    RepresentationMessage,
    SealedMessage,
    SealedSumMessage,
)
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties
from secure_vfl.methods.laser import MeanFusionMethod

SMALL_KEY = 1024


def cached_key_pair(index: int, bits: int = SMALL_KEY) -> KeyPair:
    """Key generation is slow; tests share a few key pairs (index tells them apart)."""
    return _key_pair(index, bits)


@functools.cache
def _key_pair(index: int, bits: int) -> KeyPair:
    return generate_key_pair(bits)


def paillier_aggregator(seed: int = 0, **kwargs: object) -> PaillierAggregator:
    """A small-key aggregator with a cached key pair and seeded obfuscators (tests only)."""
    options: dict[str, object] = {
        "key_bits": SMALL_KEY,
        "key_generator": lambda bits: cached_key_pair(0, bits),
        "rng": random.Random(seed),
        "pool_size": 8,
    }
    options.update(kwargs)
    return PaillierAggregator(**options)  # type: ignore[arg-type]


def ciphertexts(message: Message) -> list[int]:
    """The Paillier ciphertexts of a sealed share or sum as they crossed."""
    assert isinstance(message, SealedMessage | SealedSumMessage)
    return [int.from_bytes(item, "big") for item in message.payload]


class Replace:
    """A channel layer that rewrites the first ciphertext of ``sender``'s sealed share."""

    def __init__(self, sender: str, rewrite: Callable[[int], int]) -> None:
        self.sender, self.rewrite = sender, rewrite

    def on_message(self, message):  # type: ignore[no-untyped-def]
        if not isinstance(message, SealedMessage) or message.sender != self.sender:
            return message
        first = self.rewrite(int.from_bytes(message.payload[0], "big"))
        width = len(message.payload[0])
        return dataclasses.replace(
            message, payload=(first.to_bytes(width, "big"), *message.payload[1:])
        )


class TestPaillierAggregatorContract(SecureAggregatorContract):
    def make_aggregator(self) -> SumBackend:
        return paillier_aggregator()

    def step(self, parties: int) -> float:
        return paillier_aggregator().step(parties)

    def magnitude_limit(self) -> float:
        return paillier_aggregator().limit()


def rounded_sums(
    messages: list[RepresentationMessage], selection: Tensor, fraction_bits: int
) -> tuple[np.ndarray, np.ndarray]:
    """The oracle in integers: (T, B, d) sums of round(x * 2^f) and per-party offset slots."""
    dense = np.stack([m.representation.double().numpy() for m in messages])
    encoded = np.rint(dense * 2.0**fraction_bits).astype(np.int64)
    chosen = selection.numpy().astype(np.int64)
    return np.einsum("tbk,kbd->tbd", chosen, encoded), encoded


def test_the_secure_sum_is_the_exact_sum_of_the_rounded_values() -> None:
    messages, selection = full_batch(1, batch=32, tasks=3)
    aggregator = paillier_aggregator()
    integers, _ = rounded_sums(messages, selection, aggregator.fraction_bits)
    expected = torch.from_numpy(integers / 2.0**aggregator.fraction_bits).float()
    assert torch.equal(combine(aggregator, messages, selection), expected)


def test_a_stock_phe_private_key_decrypts_the_sum_to_the_expected_packed_integer() -> None:
    messages, selection = full_batch(2, batch=8, width=4)
    aggregator = paillier_aggregator()
    parties = SumParties(aggregator)
    parties.combine(messages, selection)
    layout = aggregator.layout(4)
    assert (layout.slot_bits, layout.slots) == (32 + 2 + 1, 1023 // 35)
    # Independent oracle: sum over contributors of (round(x * 2^16) + 2^31) per slot, in
    # (task, row, column) order, slot i at bit 35 * i.
    _, encoded = rounded_sums(messages, selection, 16)
    chosen = selection.numpy()
    slot_values = [
        sum(int(encoded[k, b, j]) + 2**31 for k in range(4) if chosen[t, b, k])
        for t in range(chosen.shape[0])
        for b in range(chosen.shape[1])
        for j in range(encoded.shape[2])
    ]
    expected = [
        sum(v << (35 * i) for i, v in enumerate(slot_values[start : start + layout.slots]))
        for start in range(0, len(slot_values), layout.slots)
    ]
    stock_public, stock_key = cached_key_pair(0)
    assert isinstance(stock_key, paillier.PaillierPrivateKey)
    summed = ciphertexts(parties.crossed(SealedSumMessage)[-1])
    assert all(0 < c < stock_public.nsquare for c in summed)
    assert [stock_key.raw_decrypt(c) for c in summed] == expected
    # A single party's ciphertext decrypts to its own offset slots (zero where not selected).
    first = stock_key.raw_decrypt(ciphertexts(parties.crossed(SealedMessage, PARTIES[1])[-1])[0])
    mine = [
        int(encoded[1, b, j]) + 2**31 if chosen[t, b, 1] else 0
        for t in range(chosen.shape[0])
        for b in range(chosen.shape[1])
        for j in range(encoded.shape[2])
    ][: layout.slots]
    assert first == sum(v << (35 * i) for i, v in enumerate(mine))


def test_slots_of_sums_a_party_does_not_enter_carry_no_offset() -> None:
    # Per-(t, b) contributor sets of every size 0, 2, 3 and 4, negative and positive values.
    messages, _ = full_batch(3, batch=4, width=3)
    messages = [
        dataclasses.replace(m, representation=-m.representation if k % 2 else m.representation)
        for k, m in enumerate(messages)
    ]
    selection = torch.zeros(2, 4, 4, dtype=torch.bool)
    selection[0, 1, [1, 3]] = True
    selection[0, 2, [1, 2, 3]] = True
    selection[0, 3, :] = True
    selection[1, 0, [2, 3]] = True
    result = SumParties(paillier_aggregator()).combine(messages, selection)
    integers, _ = rounded_sums(messages, selection, 16)
    assert torch.equal(result.sums, torch.from_numpy(integers / 2.0**16).float())
    assert bool((result.sums[0, 0] == 0).all()) and bool((result.sums[1, 1:] == 0).all())
    assert result.counts.tolist() == [[0, 2, 3, 4], [2, 0, 0, 0]]


def test_packing_round_trips_every_slot_value() -> None:
    layout = PackingLayout.for_sum(key_bits=1024, value_bits=32, fraction_bits=16, parties=4)
    values = np.random.default_rng(0).integers(0, 2**35, size=200, dtype=np.uint64)
    values[:3] = [0, 2**35 - 1, 1]
    plaintexts = layout.pack(values)
    assert len(plaintexts) == layout.ciphertexts(200) == -(-200 // 29)
    assert all(0 <= p < 2**1023 for p in plaintexts)
    assert np.array_equal(layout.unpack(plaintexts, 200, key_bits=1024), values)


def test_the_fixed_point_range_is_stated_in_the_refusal() -> None:
    """32768 itself was refused as outside "|value| <= 32768" (the limit, 32767.99998, printed
    to 6 digits): the range is stated as it is, half-open."""
    messages, selection = full_batch(8)
    aggregator = paillier_aggregator()
    assert aggregator.limit() == pytest.approx(32768.0, abs=1e-4)
    stated = r"finite and, rounded to a step of 2\^-16, in \[-32768, 32768\)"
    for value in (-32769.0, 32768.0):
        big = messages[1].representation.clone()
        big[0, 0] = value
        refused = dataclasses.replace(messages[1], representation=big)
        with pytest.raises(OutOfRangeError, match=rf"a value of {value:g} is outside .* {stated}"):
            encode_values(np.array([value]), value_bits=32, fraction_bits=16, parties=4)
        with pytest.raises(
            DivergenceError,
            match=rf"a value of {value:g}, beyond what they encode, values in \[-32768, 32768\)",
        ):
            combine(aggregator, [messages[0], refused, *messages[2:]], selection)
    big = messages[1].representation.clone()
    big[0, 0] = -32768.0  # the range's lowest value is taken
    messages[1] = dataclasses.replace(messages[1], representation=big)
    combine(aggregator, messages, selection)


def test_decrypting_with_another_key_pair_is_detected() -> None:
    messages, selection = full_batch(9)
    parties = SumParties(paillier_aggregator())
    parties.combine(messages, selection)
    # The receiver's half now decrypts with another key pair's private key, while everyone
    # still encrypts under the published public key.
    published, _ = cached_key_pair(0)
    mismatched = paillier_aggregator(key_generator=lambda bits: (published, cached_key_pair(1)[1]))
    receiver = parties.parties[RECEIVER]
    receiver.install("paillier", receiver.sealer, mismatched.receiver())
    messages, selection = full_batch(9, batch_id=1)
    with pytest.raises(IntegrityError, match="wrong key"):
        parties.combine(messages, selection, batch_id=1)


def test_a_ciphertext_replaced_in_transit_is_detected() -> None:
    public, _ = cached_key_pair(0)
    forged = public.raw_encrypt(random.Random(1).getrandbits(1000), r_value=12345)
    messages, selection = full_batch(10)
    parties = SumParties(paillier_aggregator(), layers=[Replace(PARTIES[2], lambda _: forged)])
    with pytest.raises(IntegrityError, match="tampered"):
        parties.combine(messages, selection)


def test_a_homomorphic_shift_in_transit_moves_the_sum_undetected() -> None:
    # Paillier is malleable: adding E(2^16 << 35 * 2), a valid +1.0 in slot 2, goes unnoticed.
    public, _ = cached_key_pair(0)
    shift = public.raw_encrypt(2**16 << (35 * 2), r_value=12345)
    messages, selection = full_batch(11)
    selection[0, 0, :] = True
    honest = combine(paillier_aggregator(), messages, selection)
    layer = Replace(PARTIES[1], lambda c: c * shift % public.nsquare)
    tampered = SumParties(paillier_aggregator(), layers=[layer]).combine(messages, selection)
    moved = (tampered.sums - honest).abs()
    assert float(moved[0, 0, 2]) == pytest.approx(1.0, abs=1e-4)
    moved[0, 0, 2] = 0
    assert float(moved.max()) == 0.0


def test_obfuscators_come_from_the_pool_and_are_never_reused() -> None:
    messages, selection = full_batch(12)
    aggregator = paillier_aggregator()
    parties = SumParties(aggregator)
    senders = [party.sealer for party in parties.parties.values()]
    assert all(isinstance(sender, PaillierSender) for sender in senders)
    for sender in senders:
        sender.prepare(RECEIVER, obfuscators=20)  # type: ignore[union-attr]
    pool = senders[0].pool(RECEIVER)  # type: ignore[union-attr]
    assert (len(pool), pool.generated) == (20, 20)
    parties.combine(messages, selection)
    # One obfuscator per plaintext a party fills; one it enters no sum in is left empty.
    filled = [
        int(entered_items(selection[..., k].numpy(), 8, aggregator.layout(4).slots).sum())
        for k in range(4)
    ]
    assert 0 < filled[0] <= aggregator.layout(4).ciphertexts(2 * 16 * 8)
    assert (len(pool), pool.generated) == (20 - filled[0], 20)
    seen = [c for m in parties.crossed(SealedMessage) for c in ciphertexts(m) if c]
    assert len(seen) == sum(filled) and len(set(seen)) == len(seen)
    pool.draw(len(pool) + 3)  # a shortfall refills on demand
    assert (len(pool), pool.generated) == (0, 23)


def test_whole_vector_sums_work_through_split_paillier() -> None:
    generator = torch.Generator().manual_seed(13)
    vectors = {name: torch.randn(300, generator=generator) for name in PARTIES[:3]}
    plain = vector_sum(PlainAggregator(), vectors, round=1)
    secure = vector_sum(paillier_aggregator(), vectors, round=1)
    assert bool(((secure - plain).abs() <= 3 * 2.0**-17 + 1e-6).all())


def test_the_default_2048_bit_key_sums_exactly() -> None:
    messages, selection = full_batch(14, batch=8, width=4)
    aggregator = paillier_aggregator(
        key_bits=2048, key_generator=lambda bits: cached_key_pair(0, bits)
    )
    integers, _ = rounded_sums(messages, selection, 16)
    expected = torch.from_numpy(integers / 2.0**16).float()
    parties = SumParties(aggregator)
    assert torch.equal(parties.combine(messages, selection).sums, expected)
    assert aggregator.layout(4).slots == 2047 // 35
    announced = parties.crossed(PublicKeyMessage, RECEIVER)
    assert announced and {m.role for m in announced} == {"receiver"}
    assert int.from_bytes(announced[0].key, "big").bit_length() == 2048


def test_a_weak_or_malformed_modulus_is_refused_and_the_key_taken_before_kept() -> None:
    """A modulus of the right width with a small prime factor, a prime one or a prime's square
    was taken (only width and oddness were checked): whoever factors it, the aggregation server
    too, decrypts every share sealed under it."""
    factor = int(gmpy2.next_prime(2**1023 // 3 + 2**64))
    square = int(gmpy2.next_prime(gmpy2.isqrt(2**1023) + 1))
    weak = [
        (
            3 * factor,
            "with no prime factor below 1000 expected from party-0, found one divisible by 3",
        ),
        (
            int(gmpy2.next_prime(2**1023 + 2**64)),
            "of two distinct primes expected from party-0, found a prime",
        ),
        (square * square, "of two distinct primes expected from party-0, found a perfect power"),
    ]
    good, _ = cached_key_pair(0)
    weak.append(
        (
            good.n >> 1 | 1,
            "an odd 1024-bit Paillier modulus expected from party-0, found a 1023-bit",
        )
    )
    aggregator = paillier_aggregator()
    sender, adder = aggregator.sender(), aggregator.adder()
    for half in (sender, adder):
        half.learn(RECEIVER, "receiver", good.n.to_bytes(SMALL_KEY // 8, "big"))
    pool = sender.pool(RECEIVER)
    for n, found in weak:
        for half in (sender, adder):
            with pytest.raises(ProtocolError, match=found):
                half.learn(RECEIVER, "receiver", n.to_bytes(SMALL_KEY // 8, "big"))
    assert sender.pool(RECEIVER) is pool and adder._publics[RECEIVER] == good


def test_configuration_out_of_range_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"`value_bits` must be in \[8, 56\]. Found 60"):
        PaillierAggregator(value_bits=60)
    with pytest.raises(ConfigError, match=r"`fraction_bits` must be in \[0, 30\]. Found 31"):
        PaillierAggregator(fraction_bits=31)
    with pytest.raises(ConfigError, match=r"`key_bits` must be an integer. Found '2048'"):
        PaillierAggregator(key_bits="2048")  # type: ignore[arg-type]
    # 1024 bits, the tests' keys, at the least; 2048 by default, as the CLI always makes them.
    with pytest.raises(ConfigError, match=r"`key_bits` must be in \[1024, 8192\]. Found 512"):
        PaillierAggregator(key_bits=512)


def test_laser_trained_through_paillier_matches_laser_trained_in_the_clear(
    make_data: MakeData,
) -> None:
    data = make_data(n=120)
    config = MethodConfig(heads="active", epochs=1, secure_sums=True)
    models = []
    for aggregator in (PlainAggregator(), paillier_aggregator(pool_size=0)):
        method = MeanFusionMethod(
            data, config, seed=3, planner="laser", name="laser", aggregator=aggregator
        )
        method.fit()
        modules = [p.model for p in in_process_parties(method.fed.channel)] + [
            h.module for p in in_process_parties(method.fed.channel) for h in p.heads.values()
        ]
        models.append([t.detach().clone() for m in modules for t in m.parameters()])
    plain, secure = models
    # Sums are rounded to 2^-16 per value, which moves the weights of a few steps far less.
    assert all(
        torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(plain, secure, strict=True)
    )


def test_a_plaintext_a_party_enters_no_sum_in_is_not_encrypted_and_its_layout_checked() -> None:
    """A step's sums per part (the label party's own term, the block of the others): each
    party fills some of the packed plaintexts only, and encrypting the others (zeros) cost a
    full encryption each. They go empty (the public selection says which), add as nothing,
    and the sums are those of the plain sum; an empty item where its values go, or a full one
    where none do, is refused at the aggregation server naming its sender and the item."""
    messages, _ = full_batch(3, batch=32, width=16, tasks=2)
    selection = torch.zeros(2, 32, 4, dtype=torch.bool)
    selection[0, :, 0] = True  # the receiver's own term
    selection[1, :, 1:] = True  # the block of the others
    aggregator = paillier_aggregator()
    parties = SumParties(aggregator)
    plain = combine(PlainAggregator(), messages, selection)
    assert torch.allclose(parties.combine(messages, selection).sums, plain, atol=4 * 2.0**-16)
    slots = aggregator.layout(4).slots
    payloads = {m.sender: m.payload for m in parties.crossed(SealedMessage)}
    for k, name in enumerate(PARTIES):
        entered = entered_items(selection[..., k].numpy(), 16, slots)
        assert [bool(item) for item in payloads[name]] == entered.tolist()
        assert 0 < entered.sum() < entered.size  # some left empty, some filled
    member = PARTIES[1]
    entered = entered_items(selection[..., 1].numpy(), 16, slots)
    full, empty = int(entered.argmax()), int((~entered).argmax())

    def emptied(items: list[bytes]) -> list[bytes]:
        return [b"" if i == full else item for i, item in enumerate(items)]

    def filled(items: list[bytes]) -> list[bytes]:
        return [items[full] if i == empty else item for i, item in enumerate(items)]

    for rewrite, said in (
        (emptied, rf"share from {member}: item {full}: .*found it empty"),
        (filled, rf"share from {member}: item {empty}: an empty one .*expected"),
    ):
        with pytest.raises(IntegrityError, match=said):
            SumParties(paillier_aggregator(), layers=[PayloadTap(rewrite, sender=member)]).combine(
                messages, selection
            )
