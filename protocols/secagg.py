"""Pairwise-mask secure aggregation (Bonawitz et al., CCS 2017, without the secret sharing).

Each pair of parties agrees on a key by X25519 and HKDF-SHA256; per aggregation call they expand
it, with ChaCha20 keyed by the call's context (session, receiver, round, batch id, tag, counter),
into masks that one adds and the other subtracts. Values travel as fixed-point integers in the
ring Z_2^64, so a masked contribution is uniform and tells the aggregator nothing, while the masks
cancel exactly in the sum the receiver gets.

Two ways to run it, with the same cryptography: split at the party boundary (:class:`MaskSender`
inside each contributor with its own key pair, :class:`MaskAdder` inside the aggregation server,
:class:`MaskReceiver` inside the receiver; keys and shares cross as messages), which is how
LASER, FedHF-Impute and their baselines run; or whole, :class:`MaskingAggregator`'s ``combine``
simulating every part in one object. A contributor whose share never comes can be recovered
from on the halves too: every survivor reveals the pair masks it shared with the dropped party
(:meth:`MaskSender.reveal`), which the server adds like a share.

Promises (semi-honest parties, non-colluding aggregator): the receiver learns only sums over at
least two contributors; the aggregator and the network see uniform ring elements. Masks give
privacy, not integrity: a tampered masked contribution silently shifts the sum (only a
wrap-around beyond the overflow headroom, as an inconsistent key produces, is detected).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np
import torch
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from torch import Tensor

from secure_vfl.errors import ConfigError, IntegrityError, ProtocolError
from secure_vfl.federation.aggregator import (
    AggregationCost,
    ContextLedger,
    check_contribution_headers,
    check_payload,
    check_selection,
    dense_representations,
    refuse_single_contributors,
)
from secure_vfl.federation.messages import AGGREGATOR, RepresentationMessage, SumMessage

DEFAULT_FRACTION_BITS = 24
RING_BITS = 64
HEADROOM_BITS = 62  # |sum| < 2^62 leaves two bits to detect masks that fail to cancel

Entropy = Callable[[int], bytes]
WireTap = Callable[[str, np.ndarray], np.ndarray]

_PAIR_INFO = b"secure-vfl/secagg/pair-key/v1"
_MASK_INFO = b"secure-vfl/secagg/mask/v1"


def fixed_point_limit(fraction_bits: int, parties: int) -> float:
    """Largest magnitude a value may have so that a sum of ``parties`` of them cannot wrap."""
    return float(2**HEADROOM_BITS) / parties / float(2**fraction_bits)


def encode_fixed_point(values: np.ndarray, *, fraction_bits: int, parties: int) -> np.ndarray:
    """round(value * 2^f) mod 2^64 as uint64; refuse values that could overflow a K-party sum.

    The bound ``|value| * 2^f <= 2^62 / K`` keeps every sum of K encodings within the signed
    range with two bits to spare, so decoding never wraps and a garbled sum is detectable.
    """
    scaled = np.asarray(values, dtype=np.float64) * float(2**fraction_bits)
    if scaled.size:
        if not np.isfinite(scaled).all():
            raise ProtocolError("fixed-point encoding needs finite values, found NaN or inf.")
        largest = float(np.abs(scaled).max())
        bound = float(2**HEADROOM_BITS) / parties
        if largest > bound:
            raise ProtocolError(
                f"a value of magnitude {largest / 2**fraction_bits:.6g} overflows the fixed-point "
                f"ring: with {fraction_bits} fraction bits and {parties} parties every |value| "
                f"must be <= {fixed_point_limit(fraction_bits, parties):.6g}; clip the values or "
                "lower fraction_bits."
            )
    return np.rint(scaled).astype(np.int64).view(np.uint64)


def decode_fixed_point(ring: np.ndarray, *, fraction_bits: int) -> np.ndarray:
    """Read ring elements as signed int64 and divide by 2^f (float64)."""
    return ring.view(np.int64).astype(np.float64) / float(2**fraction_bits)


def derive_pair_key(
    private: X25519PrivateKey, peer_public: bytes, owner: str, peer: str, salt: bytes
) -> bytes:
    """``owner``'s key with ``peer``: HKDF-SHA256 of their X25519 secret, bound to both names
    (sorted, so both ends derive the same key) and ``salt``."""
    try:
        secret = private.exchange(X25519PublicKey.from_public_bytes(peer_public))
    except ValueError as error:
        raise ProtocolError(
            f"key agreement between {owner} and {peer} failed: a valid X25519 public key "
            f"was expected, found one giving a degenerate secret ({error})."
        ) from error
    first, second = sorted((owner, peer))
    return HKDF(
        algorithm=hashes.SHA256(),
        length=32,
        salt=salt,
        info=b"|".join([_PAIR_INFO, first.encode(), second.encode()]),
    ).derive(secret)


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
        self._private = X25519PrivateKey.from_private_bytes(entropy(32))
        self._peers: dict[str, bytes] = {}
        self._pair_keys: dict[str, bytes] = {}
        self.seconds = 0.0

    def public_key(self) -> bytes:
        return self._private.public_key().public_bytes_raw()

    def learn(self, peer: str, role: str, key: bytes) -> None:
        if role != "sender":
            return
        if len(key) != 32:
            raise ProtocolError(
                f"an X25519 public key of 32 bytes expected from {peer}, found {len(key)}."
            )
        self._peers[peer] = bytes(key)
        self._pair_keys.pop(peer, None)

    def _pair_key(self, owner: str, peer: str) -> bytes:
        key = self._pair_keys.get(peer)
        if key is None:
            public = self._peers.get(peer)
            if public is None:
                raise ProtocolError(
                    f"{owner} holds no public key of {peer}: the key set-up (a key-request to "
                    "every contributor) must come before the first secure sum."
                )
            key = derive_pair_key(self._private, public, owner, peer, b"")
            self._pair_keys[peer] = key
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
        """Its fixed-point values in every sum it enters, plus a pair mask with every other
        contributor of that sum (added towards later parties, subtracted towards earlier)."""
        start = time.perf_counter()
        encoded = encode_fixed_point(values, fraction_bits=self.fraction_bits, parties=len(parties))
        mine = selection[..., column]
        value = np.where(mine[..., None], encoded[None], np.uint64(0))
        info = _MASK_INFO + context
        owner = parties[column]
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

        Safe only if the dropped parties' shares of ``context`` are then refused for good: added
        after the reveals, one would hand the aggregator that party's value. Refused before
        anything is revealed (ProtocolError): a dropped party that is this one or no
        contributor; a sum the survivors would release to the receiver over a single other
        contributor; a sum this party shares with a dropped one and no other survivor (its
        share there, unmasked by the reveal, would be its value in the aggregator's eyes).
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

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """Pairwise masks need no receiver key."""

    def add(
        self,
        payloads: Mapping[str, tuple[bytes, ...]],
        *,
        receiver: str,
        shape: tuple[int, int, int],
        parties: int,
    ) -> tuple[bytes, ...]:
        start = time.perf_counter()
        total = np.zeros(shape, dtype=np.uint64)
        for name, payload in payloads.items():
            total += _ring(payload, shape, f"masked share from {name}")
        self.seconds += time.perf_counter() - start
        return (total.astype("<u8").tobytes(),)


class MaskReceiver:
    """The receiver's half: the masks cancelled in the sum, so it only decodes (no key)."""

    def __init__(self, *, fraction_bits: int) -> None:
        self.fraction_bits = fraction_bits
        self.seconds = 0.0

    def public_key(self) -> None:
        return None

    def open(
        self, payload: tuple[bytes, ...], *, counts: np.ndarray, width: int, parties: int
    ) -> np.ndarray:
        start = time.perf_counter()
        total = _ring(payload, (*counts.shape, width), "the masked sum")
        sums = decode_ring_sum(total, fraction_bits=self.fraction_bits)
        self.seconds += time.perf_counter() - start
        return sums


class MaskingAggregator:
    """Secure sums by pairwise additive masks in Z_2^64, behind the :class:`Aggregator` seam.

    ``entropy`` (default ``os.urandom``) supplies the key pairs and the session id; inject a
    seeded source only in tests. ``wire`` sees each party's masked contribution on its way to the
    server and returns what arrives (identity by default): a hook for recording or tampering.
    Every (receiver, round, batch id, tag) context is used at most once: a replay is refused.

    Observable state (simulation only): ``party_keys`` (each party's X25519 secret; deployed, only
    its owner holds it), ``public_keys`` (the published directory) and ``last_masked`` (the uint64
    (T, B, d) contribution of each party as it reached the server in the last call).
    """

    def __init__(
        self,
        *,
        fraction_bits: int = DEFAULT_FRACTION_BITS,
        entropy: Entropy = os.urandom,
        wire: WireTap | None = None,
    ) -> None:
        if isinstance(fraction_bits, bool) or not isinstance(fraction_bits, int):
            raise ConfigError(f"`fraction_bits` must be an integer. Found {fraction_bits!r}.")
        if not 0 <= fraction_bits <= 40:
            raise ConfigError(f"`fraction_bits` must be in [0, 40]. Found {fraction_bits}.")
        self.fraction_bits = fraction_bits
        self._entropy = entropy
        self._wire = wire
        self.session_id: bytes = entropy(16)
        # In-process simulation: every secret key lives here; deployed, only its owner has it.
        self.party_keys: dict[str, X25519PrivateKey] = {}
        self.public_keys: dict[str, bytes] = {}
        self._pair_keys: dict[tuple[str, str], tuple[X25519PrivateKey, bytes, bytes]] = {}
        self._contexts = ContextLedger()
        self.cost = AggregationCost()
        self._calls = 0
        self.last_masked: dict[str, np.ndarray] = {}

    def setup(self, parties: Sequence[str]) -> None:
        """Give every new party an X25519 key pair and publish its public key to the others."""
        for name in parties:
            if name in self.party_keys:
                continue
            key = X25519PrivateKey.from_private_bytes(self._entropy(32))
            self.party_keys[name] = key
            self.public_keys[name] = key.public_key().public_bytes_raw()

    def step(self, parties: int) -> float:
        """Largest distance between a secure sum of ``parties`` values and their float sum."""
        return parties * 2.0 ** -(self.fraction_bits + 1)

    def combine(
        self,
        contributions: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        parties: Sequence[str],
        receiver: str,
        round: int,
        batch_id: int,
        tag: str = "",
    ) -> SumMessage:
        """Secure per-task sums: every contributor masks, the server adds, the masks cancel."""
        with self.cost.timed():
            return self._aggregate(
                contributions,
                selection,
                parties=parties,
                receiver=receiver,
                round=round,
                batch_id=batch_id,
                tag=tag,
                dropped=frozenset(),
            )

    def recover(
        self,
        contributions: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        parties: Sequence[str],
        receiver: str,
        round: int,
        batch_id: int,
        dropped: Collection[str],
        tag: str = "",
    ) -> SumMessage:
        """A round in which the ``dropped`` parties were selected but their messages never came.

        Their representations may be left out of ``contributions`` (the server never had them).
        The survivors reveal their pair masks with each dropped party for the rows they shared,
        the server removes them, and the receiver gets the sums over the survivors only (counts
        say so). A row left with a single survivor is refused, as in :meth:`combine`. Revealing
        those masks is safe only because the dropped party's masked message is then refused for
        good (the context is spent); a late arrival must never be added.
        """
        unknown = sorted(set(dropped) - set(parties))
        if unknown:
            raise ProtocolError(f"dropped parties must be among {list(parties)}, found {unknown}.")
        with self.cost.timed():
            return self._aggregate(
                contributions,
                selection,
                parties=parties,
                receiver=receiver,
                round=round,
                batch_id=batch_id,
                tag=tag,
                dropped=frozenset(dropped),
            )

    def _aggregate(
        self,
        contributions: Sequence[RepresentationMessage],
        selection: Tensor,
        *,
        parties: Sequence[str],
        receiver: str,
        round: int,
        batch_id: int,
        tag: str,
        dropped: frozenset[str],
    ) -> SumMessage:
        """Check everything, then mask per party, sum at the server and unmask dropouts."""
        # Everything is checked before any key, counter or context changes.
        dense, present = dense_representations(contributions, parties, selection.shape[1])
        check_selection(selection, torch.ones_like(present))
        check_contribution_headers(contributions, round=round, batch_id=batch_id)
        survivors = torch.tensor([name not in dropped for name in parties], dtype=torch.bool)
        released = selection & survivors.view(1, 1, -1)
        check_selection(released, present)
        counts = refuse_single_contributors(released, parties, receiver=receiver)
        context = self._contexts.check(receiver, round, batch_id, tag)
        encoded = encode_fixed_point(
            dense.numpy(), fraction_bits=self.fraction_bits, parties=len(parties)
        )

        self._contexts.spend(context)
        self._calls += 1
        self.setup(parties)
        info = self._mask_context(receiver, round, batch_id, tag, self._calls)
        chosen = selection.numpy()
        masked = self._mask_all(encoded, chosen, parties, info, dropped)
        arrived = {
            name: self._wire(name, value) if self._wire is not None else value
            for name, value in masked.items()
        }
        self.last_masked = arrived
        for name, value in arrived.items():
            self.cost.add_bytes(name, tag, value.nbytes)
        total = np.zeros((*chosen.shape[:2], encoded.shape[2]), dtype=np.uint64)
        for value in arrived.values():
            total += value
        # Each survivor reveals the masks it added for a dropped peer; the server takes them out.
        for j, peer in enumerate(parties):
            if peer not in dropped:
                continue
            for i, name in enumerate(parties):
                if name not in dropped:
                    sign = -1 if i < j else 1
                    self._add_pair_mask(
                        total, name, peer, sign, chosen[..., i] & chosen[..., j], info
                    )
        sums = self._decode_sum(total)
        self.cost.add_bytes(AGGREGATOR, tag, total.nbytes)
        return SumMessage(
            sender=AGGREGATOR,
            receiver=receiver,
            round=round,
            batch_id=batch_id,
            sums=torch.from_numpy(sums),
            counts=counts,
        )

    def _mask_context(
        self, receiver: str, round: int, batch_id: int, tag: str, counter: int
    ) -> bytes:
        """HKDF info binding masks to this session, receiver, round, batch, tag and call."""
        name, label = receiver.encode(), tag.encode()
        return b"".join(
            [
                _MASK_INFO,
                self.session_id,
                len(name).to_bytes(4, "big"),
                name,
                len(label).to_bytes(4, "big"),
                label,
                round.to_bytes(8, "big"),
                batch_id.to_bytes(8, "big"),
                counter.to_bytes(8, "big"),
            ]
        )

    def _mask_all(
        self,
        encoded: np.ndarray,
        chosen: np.ndarray,
        parties: Sequence[str],
        info: bytes,
        dropped: frozenset[str],
    ) -> dict[str, np.ndarray]:
        """What each selected survivor sends: its values in every sum it enters plus its pair
        masks, (T, B, d) uint64. Dropped parties' messages never arrive, so are not simulated."""
        masked = {}
        for i, name in enumerate(parties):
            mine = chosen[..., i]
            if name in dropped or not mine.any():
                continue
            value = np.where(mine[..., None], encoded[i][None], np.uint64(0))
            for j, peer in enumerate(parties):
                if j != i:
                    sign = 1 if i < j else -1
                    self._add_pair_mask(value, name, peer, sign, mine & chosen[..., j], info)
            masked[name] = value
        return masked

    def _add_pair_mask(
        self,
        target: np.ndarray,
        owner: str,
        peer: str,
        sign: int,
        shared: np.ndarray,
        info: bytes,
    ) -> None:
        """Add ``sign`` times ``owner``'s mask for ``peer`` to ``target`` where both are
        selected (``shared``, (T, B)): :func:`add_pair_mask` with their pair key."""
        add_pair_mask(target, self._pair_key(owner, peer), sign, shared, info)

    def _pair_key(self, owner: str, peer: str) -> bytes:
        """``owner``'s view of its key with ``peer``: HKDF-SHA256 of their X25519 secret."""
        private = self.party_keys[owner]
        public = self.public_keys[peer]
        cached = self._pair_keys.get((owner, peer))
        if cached is not None and cached[0] is private and cached[1] == public:
            return cached[2]
        key = derive_pair_key(private, public, owner, peer, self.session_id)
        self._pair_keys[(owner, peer)] = (private, public, key)
        return key

    def _decode_sum(self, total: np.ndarray) -> np.ndarray:
        """Signed decode of the ring sum (:func:`decode_ring_sum`)."""
        return decode_ring_sum(total, fraction_bits=self.fraction_bits)

    # -- the same protocol split at the party boundary (SealingScheme) ------------------------

    scheme = "masks"

    def sender(self) -> MaskSender:
        """A fresh contributor half (its own key pair, from this backend's entropy)."""
        return MaskSender(fraction_bits=self.fraction_bits, entropy=self._entropy)

    def adder(self) -> MaskAdder:
        return MaskAdder()

    def receiver(self) -> MaskReceiver:
        return MaskReceiver(fraction_bits=self.fraction_bits)
