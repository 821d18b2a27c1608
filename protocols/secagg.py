"""Pairwise-mask secure aggregation with double masking (after Bonawitz et al., CCS 2017).

Each pair of parties agrees on a key by X25519 and HKDF-SHA256; per aggregation call they expand
it, with ChaCha20 keyed by the call's context (session, receiver, round, batch id, tag, counter),
into masks that one adds and the other subtracts. Values travel as fixed-point integers in the
ring Z_2^64, so a masked contribution is uniform and tells the aggregator nothing, while the masks
cancel exactly in the sum the receiver gets.

Double masking: on top of the pair masks every contribution carries a *self-mask*, expanded the
same way from a key the contributor shares with the sum's receiver (X25519 of its own key and
the receiver's, announced at key set-up; HKDF and ChaCha20 under their own info strings, so a
self-mask never equals a pair mask). The receiver removes the self-masks of exactly the
contributors the sealed sum counts (:class:`~secure_vfl.federation.aggregator.SumMembers`); the
aggregator, which holds no self-mask key, never can.

This is an equivalent of Bonawitz's double masking with no extra round. There, each user's
self-mask seed is Shamir-shared among the users and, at unmasking, the survivors send the server
shares of the survivors' seeds (never a dropped one's): one more message round per sum and a
threshold to choose, with only K = 3-4 parties here. Here the receiver plays the part of the
threshold of honest users: it is the only party that can strip a self-mask, and it already
learns which contributors a sum counts. What each party learns: the aggregator, ring elements
that are uniform even for a share that arrives after its sender was declared dropped (the late
share less the survivors' reveals is the sender's value plus its self-mask); the receiver, the
sums over the members it is told of, as before; the network, nothing. Collusion: the aggregator
with the receiver reads every share (the receiver removes the self-mask, the aggregator holds
the pair masks' reveals, or both pair keys when it is a contributor itself): the same as
Bonawitz's server colluding with a threshold of users, and outside the model, where the
aggregator does not collude with the label party.

It runs split at the party boundary (:class:`MaskingAggregator` is the factory of the halves):
:class:`MaskSender` inside each contributor with its own key pair, :class:`MaskAdder` inside the
aggregation server, :class:`MaskReceiver` inside the receiver with its own key pair; keys and
shares cross as messages. A contributor whose share never comes can be recovered from: every
survivor reveals the pair masks it shared with the dropped party (:meth:`MaskSender.reveal`),
which the server adds like a share, so the receiver gets the sum over the survivors. The runs
do not call it: a run that loses a contributor abandons the step's sums (their contexts are
refused from then on) and does the step again over the survivors under fresh contexts, so
nothing is revealed; the recovery is for a caller that cannot do a step again.

Promises (semi-honest parties, non-colluding aggregator): the receiver learns only sums over at
least two contributors; the aggregator and the network see uniform ring elements, including a
dropped party's share that arrives after the reveals. Masks give privacy, not integrity: a
tampered masked contribution silently shifts the sum (only a wrap-around beyond the overflow
headroom, as an inconsistent key produces, is detected).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from secure_vfl.errors import ConfigError, IntegrityError, OutOfRangeError, ProtocolError
from secure_vfl.federation.aggregator import check_payload, refuse_single_contributors

if TYPE_CHECKING:
    from protocols.sum_range import SumRange
    from secure_vfl.federation.aggregator import SumMembers

DEFAULT_FRACTION_BITS = 24
RING_BITS = 64
HEADROOM_BITS = 62  # |sum| < 2^62 leaves two bits to detect masks that fail to cancel

Entropy = Callable[[int], bytes]

_PAIR_INFO = b"secure-vfl/secagg/pair-key/v1"
_MASK_INFO = b"secure-vfl/secagg/mask/v1"
_SELF_KEY_INFO = b"secure-vfl/secagg/self-key/v1"
_SELF_MASK_INFO = b"secure-vfl/secagg/self-mask/v1"


def fixed_point_limit(fraction_bits: int, parties: int) -> float:
    """Largest magnitude a value may have so that a sum of ``parties`` of them cannot wrap."""
    return float(2**HEADROOM_BITS) / parties / float(2**fraction_bits)


def fraction_bits_for(value_range: SumRange, *, most: int) -> int:
    """The most fraction bits, up to ``most``, at which ``value_range.contributors`` values of
    ``|value| <= value_range.value_bound`` sum within the headroom (``bound * 2^f <= 2^62 /
    K``); ConfigError if not even whole numbers fit."""
    room = value_range.bits_within(2**HEADROOM_BITS)
    if room < 0:
        raise ConfigError(
            f"pairwise masks cannot hold sums of {value_range.contributors} values of "
            f"{value_range.describe()} in Z_2^64 (at most 2^{HEADROOM_BITS} in all); "
            "expected a smaller clip or noise."
        )
    return min(most, room)


def encode_fixed_point(values: np.ndarray, *, fraction_bits: int, parties: int) -> np.ndarray:
    """round(value * 2^f) mod 2^64 as uint64; refuse values that could overflow a K-party sum.

    The bound ``|value| * 2^f <= 2^62 / K`` keeps every sum of K encodings within the signed
    range with two bits to spare, so decoding never wraps and a garbled sum is detectable.
    """
    scaled = np.asarray(values, dtype=np.float64) * float(2**fraction_bits)
    if scaled.size:
        limit = fixed_point_limit(fraction_bits, parties)
        holds = f"|value| <= {limit:.10g} ({fraction_bits} fraction bits, {parties} parties)"
        if not np.isfinite(scaled).all():
            raise OutOfRangeError(
                "fixed-point encoding needs finite values, found NaN or inf.",
                found="non-finite values",
                limit=holds,
            )
        largest = float(np.abs(scaled).max())
        bound = float(2**HEADROOM_BITS) / parties
        if largest > bound:
            magnitude = f"{largest / 2**fraction_bits:.10g}"
            raise OutOfRangeError(
                f"a value of magnitude {magnitude} overflows the fixed-point ring: with "
                f"{fraction_bits} fraction bits and {parties} parties every |value| must be "
                f"<= {limit:.10g}; clip the values or lower fraction_bits.",
                found=f"|value| {magnitude}",
                limit=holds,
            )
    return np.rint(scaled).astype(np.int64).view(np.uint64)


def decode_fixed_point(ring: np.ndarray, *, fraction_bits: int) -> np.ndarray:
    """Read ring elements as signed int64 and divide by 2^f (float64)."""
    return ring.view(np.int64).astype(np.float64) / float(2**fraction_bits)


def _agree(private: X25519PrivateKey, peer_public: bytes, owner: str, peer: str) -> bytes:
    """The X25519 secret of ``owner``'s key and ``peer``'s announced public key."""
    try:
        return private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:
        raise ProtocolError(
            f"key agreement between {owner} and {peer} failed: a valid X25519 public key "
            f"was expected, found one giving a degenerate secret ({error})."
        ) from error


def derive_pair_key(private: X25519PrivateKey, peer_public: bytes, owner: str, peer: str) -> bytes:
    """``owner``'s key with ``peer``: HKDF-SHA256 of their X25519 secret, bound to both names
    (sorted, so both ends derive the same key); each sum's masks are bound to its context
    (session included) when they are expanded (:func:`add_pair_mask`)."""
    first, second = sorted((owner, peer))
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=b"",
        info=b"|".join([_PAIR_INFO, first.encode(), second.encode()]),
    ).derive(_agree(private, peer_public, owner, peer))


def derive_self_key(
    private: X25519PrivateKey, peer_public: bytes, contributor: str, receiver: str
) -> bytes:
    """The self-mask key of ``contributor`` towards ``receiver``: HKDF-SHA256 of the X25519
    secret of the contributor's sender key and the receiver's receiver key (``private`` is
    either end's), bound to both names in role order and to its own info string, so it never
    equals a pair key."""
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=b"",
        info=b"|".join([_SELF_KEY_INFO, contributor.encode(), receiver.encode()]),
    ).derive(_agree(private, peer_public, contributor, receiver))


def add_pair_mask(
    target: np.ndarray, pair_key: bytes, sign: int, shared: np.ndarray, info: bytes
) -> None:
    """Add ``sign`` times the pair's mask to ``target`` (T, B, d) where both are selected
    (``shared``, (T, B)). The mask is a ChaCha20 keystream of the pair key and the call's
    context ``info``, laid over the shared rows in (t, b) order, so both ends draw the same."""
    rows = int(shared.sum())
    if rows == 0:
        return
    width = target.shape[2]
    derived = HKDF(algorithm=hashes.SHA256(), length=44, salt=None, info=info).derive(pair_key)
    nonce = bytes(4) + derived[32:]  # 32-bit block counter starting at 0, then 96-bit nonce
    stream = Cipher(algorithms.ChaCha20(derived[:32], nonce), mode=None).encryptor()
    mask = np.frombuffer(stream.update(bytes(8 * rows * width)), dtype="<u8")
    mask = mask.reshape(rows, width)
    if sign > 0:
        target[shared] += mask
    else:
        target[shared] -= mask


def add_self_mask(
    target: np.ndarray, self_key: bytes, sign: int, rows: np.ndarray, context: bytes
) -> None:
    """Add ``sign`` times a contributor's self-mask for the sum ``context`` to ``target`` where
    it enters (``rows``, (T, B)): the keystream of its self-mask key, expanded like a pair mask
    but under its own info string, so it never equals a pair mask of the same context."""
    add_pair_mask(target, self_key, sign, rows, _SELF_MASK_INFO + context)


_FIELD_PRIME = 2**255 - 19
PUBLIC_KEY_BYTES = 32
"""An X25519 public key's size: every key of this scheme, sender's and receiver's."""


def _read_key(peer: str, role: str, key: bytes, private: X25519PrivateKey) -> bytes:
    """``peer``'s announced X25519 public key, refused on arrival (before it replaces one taken
    before) unless it is 32 bytes, canonically encoded (u < 2^255 - 19) and of full order: one
    that gives ``private`` the all-zero secret (a low-order point) would fail only at the next
    sum, with no good key left."""
    if len(key) != PUBLIC_KEY_BYTES:
        raise ProtocolError(
            f"an X25519 public key of {PUBLIC_KEY_BYTES} bytes expected from {peer} as {role}, "
            f"found {len(key)}."
        )
    if int.from_bytes(key, "little") >= _FIELD_PRIME:
        raise ProtocolError(
            f"a canonically encoded X25519 public key (u < 2^255 - 19) expected from {peer} as "
            f"{role}, found one that is not."
        )
    _agree(private, bytes(key), "this party", peer)  # refuses a low-order point
    return bytes(key)


def decode_ring_sum(total: np.ndarray, *, fraction_bits: int) -> np.ndarray:
    """Float32 sums from a ring sum; refuse one outside the headroom (masks didn't cancel)."""
    signed = total.view(np.int64)
    limit = 2**HEADROOM_BITS
    if signed.size and bool((np.abs(signed.astype(np.float64)) > limit).any()):
        raise IntegrityError(
            f"the secure sum left the fixed-point range (|sum| <= 2^{HEADROOM_BITS} expected, "
            "found larger): the masks did not cancel, so a party's key or masked "
            "contribution is inconsistent."
        )
    return decode_fixed_point(total, fraction_bits=fraction_bits).astype(np.float32)


def _ring(payload: tuple[bytes, ...], shape: tuple[int, int, int], who: str) -> np.ndarray:
    """One sealed item read as (T, B, d) little-endian ring elements."""
    check_payload(payload, count=1, size=8 * shape[0] * shape[1] * shape[2], who=who)
    return np.frombuffer(payload[0], dtype="<u8").reshape(shape).astype(np.uint64)


class MaskSender:
    """A contributor's half of pairwise-mask secure sums: its own X25519 key pair (from
    ``entropy``, the OS's by default) and the public keys its peers announced."""

    def __init__(self, *, fraction_bits: int, entropy: Entropy = os.urandom) -> None:
        self.fraction_bits = fraction_bits
        self._most_fraction_bits = fraction_bits
        self._private = X25519PrivateKey.from_private_bytes(entropy(32))
        self._peers: dict[str, bytes] = {}
        self._pair_keys: dict[str, bytes] = {}
        self._receivers: dict[str, bytes] = {}
        self._self_keys: dict[str, bytes] = {}
        self.seconds = 0.0
        self.max_key_bytes = PUBLIC_KEY_BYTES

    def public_key(self) -> bytes:
        return self._private.public_key().public_bytes_raw()

    def use_range(self, value_range: SumRange) -> None:
        """Encode with as many fraction bits (up to the configured ones) as sums of
        ``value_range`` leave room for; the receiver derives the same."""
        self.fraction_bits = fraction_bits_for(value_range, most=self._most_fraction_bits)

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """A peer contributor's key (pair masks) or a receiver's key (self-masks)."""
        if role == "sender":
            self._peers[peer] = _read_key(peer, role, key, self._private)
            self._pair_keys.pop(peer, None)
        elif role == "receiver":
            self._receivers[peer] = _read_key(peer, role, key, self._private)
            self._self_keys.pop(peer, None)

    def _pair_key(self, owner: str, peer: str) -> bytes:
        key = self._pair_keys.get(peer)
        if key is None:
            public = self._peers.get(peer)
            if public is None:
                raise ProtocolError(
                    f"{owner} holds no public key of {peer}: the key set-up (a key-request to "
                    "every contributor) must come before the first secure sum."
                )
            key = derive_pair_key(self._private, public, owner, peer)
            self._pair_keys[peer] = key
        return key

    def _self_key(self, owner: str, receiver: str) -> bytes:
        key = self._self_keys.get(receiver)
        if key is None:
            public = self._receivers.get(receiver)
            if public is None:
                raise ProtocolError(
                    f"{owner} holds no receiver key of {receiver}: its self-masks need the "
                    "receiver's key from the key set-up before the first secure sum for it."
                )
            key = derive_self_key(self._private, public, owner, receiver)
            self._self_keys[receiver] = key
        return key

    def seal(
        self,
        values: np.ndarray,
        selection: np.ndarray,
        *,
        column: int,
        parties: Sequence[str],
        receiver: str,
        context: bytes,
    ) -> tuple[bytes, ...]:
        """Its fixed-point values in every sum it enters, plus its self-mask for ``receiver``
        and a pair mask with every other contributor of that sum (added towards later parties,
        subtracted towards earlier)."""
        start = time.perf_counter()
        encoded = encode_fixed_point(values, fraction_bits=self.fraction_bits, parties=len(parties))
        mine = selection[..., column]
        value = np.where(mine[..., None], encoded[None], np.uint64(0))
        info = _MASK_INFO + context
        owner = parties[column]
        add_self_mask(value, self._self_key(owner, receiver), 1, mine, context)
        for j, peer in enumerate(parties):
            shared = mine & selection[..., j]
            if j != column and shared.any():
                sign = 1 if column < j else -1
                add_pair_mask(value, self._pair_key(owner, peer), sign, shared, info)
        self.seconds += time.perf_counter() - start
        return (value.astype("<u8").tobytes(),)

    def reveal(
        self,
        dropped: Collection[str],
        selection: np.ndarray,
        *,
        column: int,
        width: int,
        parties: Sequence[str],
        receiver: str,
        context: bytes,
    ) -> tuple[bytes, ...]:
        """Dropout recovery for the sums ``context`` that this party sealed with ``selection``,
        whose ``dropped`` contributors' shares never came: minus the pair masks it added with
        each of them where both entered, (T, B, ``width``) ring elements. The aggregator adds
        them like a share (:meth:`MaskAdder.add`), so the survivors' masks with the dropped
        cancel and the receiver opens the sums over the survivors (counts without the dropped).

        A dropped party's share of ``context`` that arrives after the reveals tells the
        aggregator nothing: less the reveals it is that party's value under its self-mask,
        which only the receiver can remove (and the receiver removes only the self-masks of
        the members it is told a sum counts). Refused before anything is revealed
        (ProtocolError): a dropped party that is this one or no contributor; a sum the
        survivors would release to the receiver over a single other contributor; a sum this
        party shares with a dropped one and no other survivor (its share there, stripped of
        every pair mask by the reveal, would be its value under its self-mask alone: kept as
        defence in depth, should a self-mask key ever leak).
        """
        start = time.perf_counter()
        owner = parties[column]
        others = [name for name in parties if name != owner]
        if not set(dropped) <= set(others):
            raise ProtocolError(
                f"{owner}: dropped contributors must be among the other parties {others}, "
                f"found {sorted(dropped)}."
            )
        survivors = np.array([name not in dropped for name in parties])
        released = selection & survivors
        refuse_single_contributors(torch.from_numpy(released), parties, receiver=receiver)
        mine = selection[..., column]
        with_dropped = selection[..., ~survivors].any(axis=-1)
        alone = mine & with_dropped & (released.sum(axis=-1) == 1)
        if alone.any():
            t, b = (int(i) for i in np.argwhere(alone)[0])
            raise ProtocolError(
                f"{owner}: revealing its masks with {sorted(dropped)} would leave it the only "
                f"survivor of {int(alone.sum())} sums it shares with them (first: task {t}, row "
                f"{b}), where the aggregator would read its value; each needs another survivor."
            )
        correction = np.zeros((*mine.shape, width), dtype=np.uint64)
        info = _MASK_INFO + context
        for j, peer in enumerate(parties):
            shared = mine & selection[..., j]
            if not survivors[j] and shared.any():
                sign = -1 if column < j else 1  # the opposite of the mask it added
                add_pair_mask(correction, self._pair_key(owner, peer), sign, shared, info)
        self.seconds += time.perf_counter() - start
        return (correction.astype("<u8").tobytes(),)


class MaskAdder:
    """The aggregator's half: adds masked contributions in Z_2^64 (no key)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.max_key_bytes = PUBLIC_KEY_BYTES

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """Pairwise masks need no receiver key."""

    def add(
        self,
        payloads: Mapping[str, tuple[bytes, ...]],
        *,
        receiver: str,
        shape: tuple[int, int, int],
        parties: int,
        selection: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[bytes, ...]:
        start = time.perf_counter()
        total = np.zeros(shape, dtype=np.uint64)
        for name, payload in payloads.items():
            total += _ring(payload, shape, f"masked share from {name}")
        self.seconds += time.perf_counter() - start
        return (total.astype("<u8").tobytes(),)

    def check(
        self,
        payload: tuple[bytes, ...],
        *,
        sender: str,
        receiver: str,
        shape: tuple[int, int, int],
        parties: int,
        selection: np.ndarray | None = None,
    ) -> None:
        start = time.perf_counter()
        size = 8 * shape[0] * shape[1] * shape[2]
        check_payload(payload, count=1, size=size, who=f"masked share from {sender}")
        self.seconds += time.perf_counter() - start


class MaskReceiver:
    """The receiver's half: its own X25519 key pair, with which it derives every contributor's
    self-mask key (from the contributors' announced keys) and removes the self-masks of exactly
    the contributors a sum counts; the pair masks cancelled in the sum."""

    def __init__(self, *, fraction_bits: int, entropy: Entropy = os.urandom) -> None:
        self.fraction_bits = fraction_bits
        self._most_fraction_bits = fraction_bits
        self._private = X25519PrivateKey.from_private_bytes(entropy(32))
        self._senders: dict[str, bytes] = {}
        self._self_keys: dict[tuple[str, str], bytes] = {}
        self.seconds = 0.0
        self.max_key_bytes = PUBLIC_KEY_BYTES

    def public_key(self) -> bytes:
        return self._private.public_key().public_bytes_raw()

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """A contributor's announced key, from which its self-mask key is derived."""
        if role == "sender":
            self._senders[peer] = _read_key(peer, role, key, self._private)
            self._self_keys = {k: v for k, v in self._self_keys.items() if k[0] != peer}

    def use_range(self, value_range: SumRange) -> None:
        """Decode with the fraction bits the senders derive from ``value_range``."""
        self.fraction_bits = fraction_bits_for(value_range, most=self._most_fraction_bits)

    def _self_key(self, contributor: str, receiver: str) -> bytes:
        key = self._self_keys.get((contributor, receiver))
        if key is None:
            public = self._senders.get(contributor)
            if public is None:
                raise ProtocolError(
                    f"{receiver} holds no key of contributor {contributor}, so it cannot remove "
                    f"{contributor}'s self-mask: the key set-up must announce every "
                    "contributor's key to the receiver before the first secure sum."
                )
            key = derive_self_key(self._private, public, contributor, receiver)
            self._self_keys[(contributor, receiver)] = key
        return key

    def open(self, payload: tuple[bytes, ...], *, members: SumMembers, width: int) -> np.ndarray:
        """The sums over ``members``: the ring sum less the self-mask of every counted
        contributor where it is counted, decoded (IntegrityError if outside the headroom)."""
        start = time.perf_counter()
        selection = members.selection
        total = _ring(payload, (*selection.shape[:2], width), "the masked sum")
        for k, contributor in enumerate(members.parties):
            counted = selection[..., k]
            if counted.any():
                key = self._self_key(contributor, members.receiver)
                add_self_mask(total, key, -1, counted, members.context)
        sums = decode_ring_sum(total, fraction_bits=self.fraction_bits)
        self.seconds += time.perf_counter() - start
        return sums


class MaskingAggregator:
    """Secure sums by pairwise additive masks in Z_2^64: a :class:`SealingScheme`, the factory
    of the halves each party makes for itself.

    ``entropy`` (default ``os.urandom``) supplies each sender's and receiver's key pair; inject
    a seeded source only in tests.
    """

    scheme = "masks"

    def __init__(
        self, *, fraction_bits: int = DEFAULT_FRACTION_BITS, entropy: Entropy = os.urandom
    ) -> None:
        if isinstance(fraction_bits, bool) or not isinstance(fraction_bits, int):
            raise ConfigError(f"`fraction_bits` must be an integer. Found {fraction_bits!r}.")
        if not 0 <= fraction_bits <= 40:
            raise ConfigError(f"`fraction_bits` must be in [0, 40]. Found {fraction_bits}.")
        self.fraction_bits = fraction_bits
        self._entropy = entropy

    def step(self, parties: int) -> float:
        """Largest distance between a secure sum of ``parties`` values and their float sum."""
        return parties * 2.0 ** -(self.fraction_bits + 1)

    def sender(self) -> MaskSender:
        """A fresh contributor half (its own key pair, from this backend's entropy)."""
        return MaskSender(fraction_bits=self.fraction_bits, entropy=self._entropy)

    def adder(self) -> MaskAdder:
        return MaskAdder()

    def receiver(self) -> MaskReceiver:
        """A fresh receiver half (its own key pair, from this backend's entropy)."""
        return MaskReceiver(fraction_bits=self.fraction_bits, entropy=self._entropy)
