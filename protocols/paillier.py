"""Secure sums under the receiver's Paillier key (Paillier, EUROCRYPT 1999), many values per
ciphertext.

Three roles, with real ``phe`` ciphertexts, split at the party boundary (:class:`PaillierSender`,
:class:`PaillierAdder`, :class:`PaillierReceiver`, each inside its own party, made by
:class:`PaillierAggregator`, the public key announced as a message): the receiver (the head or
label party, the imputation coordinator) owns a key pair and publishes the public key; every
contributing party packs its
fixed-point values into plaintexts and encrypts them under that key; the aggregator multiplies
ciphertexts (adds plaintexts) without ever holding the private key; the receiver decrypts and
unpacks the sums. Ciphertexts are standard ``phe`` ones (g = n + 1, exponent 0): a stock
``PaillierPrivateKey.raw_decrypt`` of a summed ciphertext gives the packed integer.

Packing layout (:class:`PackingLayout`). A value x is encoded as the integer e = round(x * 2^f)
with -2^(v-1) <= e < 2^(v-1) (anything else is refused) and sent as u = e + 2^(v-1), so
0 <= u < 2^v. Slot i of a plaintext holds bits [i*w, (i+1)*w) with w = v + ceil(log2 K) + 1 for
K parties, and a plaintext holds s = floor((bits(n) - 1) / w) slots, in (task, row, column) order.
A party puts u in the slots of the sums it enters and 0 elsewhere, so the slot of sum (t, b, j)
adds up to sum_{k in S_tb} u_k = sum_k e_k + |S_tb| * 2^(v-1), and the receiver, who knows
|S_tb| (the public ``counts``), subtracts the offset.

No overflow: every slot sum is at most |S_tb| * (2^v - 1) <= K * (2^v - 1) < 2^(v + ceil(log2 K))
= 2^(w-1), so no slot carries into the next one and the top bit of each slot stays 0; the whole
plaintext is below 2^(s*w) <= 2^(bits(n)-1) < n, so nothing wraps modulo n either. The receiver
checks both facts on every decryption: a slot sum outside [0, |S_tb| * (2^v - 1)] or a set bit
above the last slot raises :class:`IntegrityError`. A wrong private key decrypts to an integer
that is uniform modulo n, which fails these checks with overwhelming probability.

Obfuscators. Encryption is c = (1 + n*m) * r^n mod n^2; the costly part, r^n mod n^2, does not
depend on the message, so each sender keeps an :class:`ObfuscatorPool` of them computed ahead of
time (offline, e.g. while the previous batch trains) and the hot path is one multiplication
modulo n^2 per ciphertext. Every obfuscator is used once; an empty pool is refilled on demand.

Promises (semi-honest parties, non-colluding aggregator): the aggregator and the network see only
ciphertexts; the receiver learns only sums over >= 2 contributors (a sum over one is refused).
Paillier is malleable, so integrity is not promised: a ciphertext replaced by garbage is detected
with overwhelming probability by the range checks above, but a ciphertext shifted homomorphically
by a valid small amount silently shifts the sum.
"""

from __future__ import annotations

import math
import random
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gmpy2
import numpy as np
from phe import paillier

from protocols.secagg import decode_fixed_point, encode_fixed_point
from secure_vfl.errors import ConfigError, IntegrityError, OutOfRangeError, ProtocolError
from secure_vfl.federation.aggregator import SKIPPED, check_payload, check_skipped, entered_items

if TYPE_CHECKING:
    from protocols.sum_range import SumRange
    from secure_vfl.federation.aggregator import SumMembers

DEFAULT_KEY_BITS = 2048
MIN_KEY_BITS = 1024
"""The smallest modulus taken (about 80-bit security), for the tests' speed; every run of the
CLI makes :data:`DEFAULT_KEY_BITS` ones."""
SMALL_PRIMES = tuple(int(p) for p in range(3, 1000, 2) if gmpy2.is_prime(p))
"""The odd primes below 1000: no honest modulus, a product of two key_bits/2-bit primes, has
one as a factor."""
DEFAULT_VALUE_BITS = 32
DEFAULT_FRACTION_BITS = 16
DEFAULT_POOL_SIZE = 64

KeyPair = tuple[paillier.PaillierPublicKey, paillier.PaillierPrivateKey]
KeyGenerator = Callable[[int], KeyPair]


def generate_key_pair(key_bits: int) -> KeyPair:
    """A fresh ``phe`` key pair with a ``key_bits`` modulus (primes from the OS's CSPRNG)."""
    public_key, private_key = paillier.generate_paillier_keypair(n_length=key_bits)
    return public_key, private_key


@dataclass(frozen=True)
class PackingLayout:
    """Where values sit in a plaintext: ``slots`` slots of ``slot_bits`` bits, lowest first.

    ``value_bits`` (v) bound one offset-encoded value, ``fraction_bits`` (f) its fixed-point
    scale; ``slot_bits`` = v + ceil(log2 K) + 1 leaves room to add K of them without a carry.
    """

    value_bits: int
    fraction_bits: int
    slot_bits: int
    slots: int

    @classmethod
    def for_sum(
        cls, *, key_bits: int, value_bits: int, fraction_bits: int, parties: int
    ) -> PackingLayout:
        """The layout for sums of up to ``parties`` values under a ``key_bits``-bit modulus."""
        slot_bits = value_bits + math.ceil(math.log2(max(parties, 1))) + 1
        if slot_bits > 64:
            raise ProtocolError(
                f"a packed slot must fit 64 bits: {value_bits} value bits plus headroom for "
                f"{parties} parties need {slot_bits}; lower value_bits or the number of parties."
            )
        slots = (key_bits - 1) // slot_bits
        if slots < 1:
            raise ProtocolError(
                f"a {key_bits}-bit modulus holds no {slot_bits}-bit slot; use a larger key."
            )
        return cls(value_bits, fraction_bits, slot_bits, slots)

    @property
    def offset(self) -> int:
        """2^(v-1): added to every encoded value so that slots hold non-negative integers."""
        return 1 << (self.value_bits - 1)

    def ciphertexts(self, values: int) -> int:
        """How many plaintexts ``values`` slots take."""
        return -(-values // self.slots)

    def pack(self, slots: np.ndarray) -> list[int]:
        """Pack a flat uint64 array of slot values (each < 2^slot_bits) into plaintext ints."""
        count = self.ciphertexts(slots.size)
        padded = np.zeros(count * self.slots, dtype="<u8")
        padded[: slots.size] = slots
        bits = np.unpackbits(padded.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
        rows = bits[:, : self.slot_bits].reshape(count, self.slots * self.slot_bits)
        packed = np.packbits(rows, axis=1, bitorder="little")
        return [int.from_bytes(row.tobytes(), "little") for row in packed]

    def unpack(self, plaintexts: Sequence[int], values: int, *, key_bits: int) -> np.ndarray:
        """The first ``values`` slot values of ``plaintexts`` as uint64; refuse set bits beyond
        the last slot (a plaintext that no honest sum produces)."""
        width = (key_bits + 7) // 8
        raw = np.frombuffer(
            b"".join(int(p).to_bytes(width, "little") for p in plaintexts), dtype=np.uint8
        ).reshape(len(plaintexts), width)
        bits = np.unpackbits(raw, axis=1, bitorder="little")
        used = self.slots * self.slot_bits
        if bool(bits[:, used:].any()):
            raise IntegrityError(
                f"a decrypted sum has bits set above its {self.slots} packed slots (all zero "
                "expected): the ciphertext was tampered with or decrypted with the wrong key."
            )
        slots = bits[:, :used].reshape(-1, self.slot_bits)
        wide = np.zeros((slots.shape[0], 64), dtype=np.uint8)
        wide[:, : self.slot_bits] = slots
        return np.packbits(wide, axis=1, bitorder="little").view("<u8").reshape(-1)[:values]


class ObfuscatorPool:
    """A sender's stock of r^n mod n^2 for one public key, each drawn once.

    ``rng`` supplies r uniform in [1, n) (default the OS's CSPRNG; inject a seeded
    ``random.Random`` only in tests). ``generated`` counts every obfuscator computed.
    """

    def __init__(self, public_key: paillier.PaillierPublicKey, rng: random.Random) -> None:
        self.public_key = public_key
        self._rng = rng
        self._n = gmpy2.mpz(public_key.n)
        self._nsquare = gmpy2.mpz(public_key.nsquare)
        self._stock: list[gmpy2.mpz] = []
        self.generated = 0

    def __len__(self) -> int:
        return len(self._stock)

    def fill(self, count: int) -> None:
        """Compute obfuscators until at least ``count`` are in stock (the expensive step)."""
        while len(self._stock) < count:
            r = gmpy2.mpz(self._rng.randrange(1, self.public_key.n))
            self._stock.append(gmpy2.powmod(r, self._n, self._nsquare))
            self.generated += 1

    def draw(self, count: int) -> list[gmpy2.mpz]:
        """Take ``count`` obfuscators out of the pool, refilling it first if it runs short."""
        self.fill(count)
        drawn, self._stock = self._stock[:count], self._stock[count:]
        return drawn

    def encrypt(self, plaintexts: Sequence[int]) -> list[paillier.EncryptedNumber]:
        """Paillier encryptions of ``plaintexts`` (each in [0, n)): (1 + n*m) * r^n mod n^2."""
        out = []
        for plaintext, obfuscator in zip(plaintexts, self.draw(len(plaintexts)), strict=True):
            nude = (self._n * plaintext + 1) % self._nsquare
            ciphertext = int(gmpy2.mul(nude, obfuscator) % self._nsquare)
            out.append(paillier.EncryptedNumber(self.public_key, ciphertext, 0))
        return out


class PaillierAggregator:
    """Secure sums by packed Paillier encryption under the receiver's key: a
    :class:`SealingScheme`, the factory of the halves each party makes for itself.

    ``key_bits`` sizes each receiver's modulus (2048 by default, which the CLI always uses;
    1024, the least taken, only for tests' speed: about 80-bit security). ``value_bits``
    and ``fraction_bits`` fix the encoding: values must lie in
    [-2^(v-1-f), 2^(v-1-f)) (+-32768 by default) and are rounded to a step of 2^-f.
    ``key_generator`` makes a receiver's key pair (default :func:`generate_key_pair`; inject a
    cached one in tests), ``rng`` draws the senders' obfuscators' r, ``pool_size`` is how many
    obfuscators :meth:`PaillierSender.prepare` stocks by default.
    """

    scheme = "paillier"

    def __init__(
        self,
        *,
        key_bits: int = DEFAULT_KEY_BITS,
        value_bits: int = DEFAULT_VALUE_BITS,
        fraction_bits: int = DEFAULT_FRACTION_BITS,
        key_generator: KeyGenerator = generate_key_pair,
        rng: random.Random | None = None,
        pool_size: int = DEFAULT_POOL_SIZE,
    ) -> None:
        for name, value, low, high in [
            ("key_bits", key_bits, MIN_KEY_BITS, 8192),
            ("value_bits", value_bits, 8, 56),
            ("fraction_bits", fraction_bits, 0, value_bits - 2),
            ("pool_size", pool_size, 0, 10**6),
        ]:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"`{name}` must be an integer. Found {value!r}.")
            if not low <= value <= high:
                raise ConfigError(f"`{name}` must be in [{low}, {high}]. Found {value}.")
        self.key_bits = key_bits
        self.value_bits = value_bits
        self.fraction_bits = fraction_bits
        self.pool_size = pool_size
        self._key_generator = key_generator
        self._rng = rng if rng is not None else secrets.SystemRandom()

    def limit(self) -> float:
        """Largest magnitude a value may have: 2^(v-1-f) minus one step."""
        return float((1 << (self.value_bits - 1)) - 1) / float(1 << self.fraction_bits)

    def step(self, parties: int) -> float:
        """Largest distance between a secure sum of ``parties`` values and their float sum."""
        return parties * 2.0 ** -(self.fraction_bits + 1)

    def layout(self, parties: int) -> PackingLayout:
        """The packing layout of a sum over up to ``parties`` contributors under this key size."""
        return PackingLayout.for_sum(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            fraction_bits=self.fraction_bits,
            parties=parties,
        )

    def sender(self) -> PaillierSender:
        """A fresh contributor half (its own obfuscator pools, drawn from this backend's rng)."""
        return PaillierSender(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            fraction_bits=self.fraction_bits,
            rng=self._rng,
            pool_size=self.pool_size,
        )

    def adder(self) -> PaillierAdder:
        return PaillierAdder(key_bits=self.key_bits, value_bits=self.value_bits)

    def receiver(self) -> PaillierReceiver:
        """A fresh receiver half: its own key pair, made by this backend's key generator."""
        return PaillierReceiver(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            fraction_bits=self.fraction_bits,
            key_generator=self._key_generator,
        )


def fraction_bits_for(value_range: SumRange, *, value_bits: int, most: int) -> int:
    """The most fraction bits, up to ``most``, at which every ``|value| <=
    value_range.value_bound`` fits ``value_bits`` (``bound * 2^f <= 2^(v-1) - 1``); the
    packing's slots already leave room for the contributors. ConfigError if none fit."""
    room = value_range.bits_within((1 << (value_bits - 1)) - 1, per_value=True)
    if room < 0:
        raise ConfigError(
            f"Paillier slots of {value_bits} value bits cannot hold values of "
            f"{value_range.describe()}; expected a smaller clip or noise."
        )
    return min(most, room)


def encode_values(
    dense: np.ndarray, *, value_bits: int, fraction_bits: int, parties: int
) -> np.ndarray:
    """round(x * 2^f) as int64; refuse any outside [-2^(v-1), 2^(v-1)) or not finite: x
    rounded to a step of 2^-f in [-2^(v-1-f), 2^(v-1-f)), stated exactly in the refusal."""
    scaled = np.rint(np.asarray(dense, dtype=np.float64) * float(1 << fraction_bits))
    half = float(1 << (value_bits - 1))
    outside = ~np.isfinite(scaled) | (scaled < -half) | (scaled >= half)
    if bool(outside.any()):
        refused = np.asarray(dense, dtype=np.float64)[outside]
        worst = float(refused[np.argmax(np.abs(refused))])
        bound = 1 << (value_bits - 1 - fraction_bits)
        raise OutOfRangeError(
            f"a value of {worst:.6g} is outside the Paillier fixed-point range: with "
            f"{value_bits} value bits and {fraction_bits} fraction bits every value must be "
            f"finite and, rounded to a step of 2^-{fraction_bits}, in [-{bound}, {bound}); "
            "clip the values or lower fraction_bits.",
            found=f"a value of {worst:.6g}",
            limit=f"values in [-{bound}, {bound}) at {fraction_bits} fraction bits",
        )
    encoded = encode_fixed_point(dense, fraction_bits=fraction_bits, parties=parties)
    return encoded.view(np.int64)


def open_slots(
    plaintexts: Sequence[int],
    layout: PackingLayout,
    counts: np.ndarray,
    shape: tuple[int, int, int],
    *,
    key_bits: int,
) -> np.ndarray:
    """The receiver's part after decryption: unpack, check each slot's range, remove the
    offsets, decode to float32 (T, B, d)."""
    tasks, batch, width = shape
    slots = layout.unpack(plaintexts, tasks * batch * width, key_bits=key_bits)
    sums = slots.astype(np.int64).reshape(shape)
    contributors = counts.astype(np.int64)[..., None]
    if bool(((sums < 0) | (sums > contributors * ((1 << layout.value_bits) - 1))).any()):
        raise IntegrityError(
            "a decrypted slot sum is outside [0, contributors * (2^v - 1)] (every honest sum "
            "is inside): the ciphertext was tampered with or decrypted with the wrong key."
        )
    signed = sums - contributors * layout.offset
    return decode_fixed_point(signed, fraction_bits=layout.fraction_bits).astype(np.float32)


def _modulus_bytes(key_bits: int) -> int:
    return (key_bits + 7) // 8


def _ciphertext_bytes(key_bits: int) -> int:
    """Bytes of one ciphertext on the wire: an integer below n^2, big-endian, fixed width."""
    return (2 * key_bits + 7) // 8


def read_public_key(key: bytes, *, key_bits: int, who: str) -> paillier.PaillierPublicKey:
    """A receiver's announced modulus (big-endian, fixed width) as a public key; refuse one of
    the wrong size, an even one, one with a prime factor below 1000, a prime or a perfect
    power: no product of two distinct large primes is any of those, and whoever factors the
    modulus (the aggregation server too) decrypts every share sealed under it."""
    if len(key) != _modulus_bytes(key_bits):
        raise ProtocolError(
            f"a Paillier modulus of {_modulus_bytes(key_bits)} bytes expected from {who}, "
            f"found {len(key)}."
        )
    n = int.from_bytes(key, "big")
    if n.bit_length() != key_bits or n % 2 == 0:
        raise ProtocolError(
            f"an odd {key_bits}-bit Paillier modulus expected from {who}, found "
            f"{'an even' if n % 2 == 0 else 'a'} {n.bit_length()}-bit integer."
        )
    factor = next((p for p in SMALL_PRIMES if n % p == 0), None)
    if factor is not None:
        raise ProtocolError(
            f"a Paillier modulus with no prime factor below 1000 expected from {who}, found one "
            f"divisible by {factor}."
        )
    prime = bool(gmpy2.is_prime(n))
    if prime or gmpy2.is_power(n):
        raise ProtocolError(
            f"a Paillier modulus of two distinct primes expected from {who}, found "
            f"{'a prime' if prime else 'a perfect power'}."
        )
    return paillier.PaillierPublicKey(n)


def _read_ciphertexts(
    payload: tuple[bytes, ...],
    *,
    key_bits: int,
    nsquare: int,
    count: int,
    who: str,
    entered: np.ndarray | None = None,
) -> list[int | None]:
    """Sealed items as integers in [1, n^2), None for an empty one (:data:`SKIPPED`), which
    must be exactly those ``entered`` (items,) leaves out (None: none may be); refuse the
    wrong count, size or range."""
    check_payload(payload, count=count, size=None, who=who)
    check_skipped(payload, np.ones(count, dtype=bool) if entered is None else entered, who)
    full = tuple(item for item in payload if item != SKIPPED)
    check_payload(full, count=len(full), size=_ciphertext_bytes(key_bits), who=who)
    values = [None if item == SKIPPED else int.from_bytes(item, "big") for item in payload]
    if any(v is not None and not 0 < v < nsquare for v in values):
        raise IntegrityError(f"{who}: a ciphertext outside [1, n^2) (not a Paillier ciphertext).")
    return values


def _entered(
    selection: Mapping[str, np.ndarray] | None, name: str, width: int, layout: PackingLayout
) -> np.ndarray | None:
    """Which items ``name``'s share fills, from its (T, B) selection (None: every item)."""
    if selection is None:
        return None
    return entered_items(selection[name], width, layout.slots)


def _write_ciphertexts(values: Sequence[int | None], key_bits: int) -> tuple[bytes, ...]:
    width = _ciphertext_bytes(key_bits)
    return tuple(SKIPPED if v is None else int(v).to_bytes(width, "big") for v in values)


class PaillierSender:
    """A contributor's half: encrypts its packed values under each receiver's announced public
    key, with its own obfuscator pools (r from ``rng``)."""

    def __init__(
        self,
        *,
        key_bits: int,
        value_bits: int,
        fraction_bits: int,
        rng: random.Random,
        pool_size: int,
    ) -> None:
        self.key_bits, self.value_bits, self.fraction_bits = key_bits, value_bits, fraction_bits
        self._most_fraction_bits = fraction_bits
        self.pool_size = pool_size
        self._rng = rng
        self._pools: dict[str, ObfuscatorPool] = {}
        self.seconds = 0.0
        self.max_key_bytes = _modulus_bytes(key_bits)

    def public_key(self) -> None:
        return None

    def use_range(self, value_range: SumRange) -> None:
        """Encode with as many fraction bits (up to the configured ones) as values of
        ``value_range`` leave room for; the receiver derives the same."""
        self.fraction_bits = fraction_bits_for(
            value_range, value_bits=self.value_bits, most=self._most_fraction_bits
        )

    def learn(self, peer: str, role: str, key: bytes) -> None:
        if role == "receiver":
            public = read_public_key(key, key_bits=self.key_bits, who=peer)
            self._pools[peer] = ObfuscatorPool(public, self._rng)

    def prepare(self, receiver: str, obfuscators: int | None = None) -> None:
        """The offline phase: stock the pool for ``receiver`` (``pool_size`` by default)."""
        self.pool(receiver).fill(self.pool_size if obfuscators is None else obfuscators)

    def pool(self, receiver: str) -> ObfuscatorPool:
        """Its obfuscator pool for ``receiver``'s announced public key."""
        pool = self._pools.get(receiver)
        if pool is None:
            raise ProtocolError(
                f"no Paillier public key of {receiver} was announced: the key set-up must come "
                "before the first secure sum."
            )
        return pool

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
        start = time.perf_counter()
        pool = self.pool(receiver)
        layout = PackingLayout.for_sum(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            fraction_bits=self.fraction_bits,
            parties=len(parties),
        )
        encoded = encode_values(
            values,
            value_bits=self.value_bits,
            fraction_bits=self.fraction_bits,
            parties=len(parties),
        )
        mine = selection[..., column]
        offset_values = (encoded + layout.offset).astype(np.uint64)
        slots = np.where(mine[..., None], offset_values[None], np.uint64(0))
        # A plaintext of slots it enters no sum with is not encrypted (SKIPPED): the public
        # selection says which, not the values.
        entered = entered_items(mine, values.shape[1], layout.slots)
        packed = layout.pack(slots.reshape(-1))
        ciphertexts = iter(pool.encrypt([p for p, e in zip(packed, entered, strict=True) if e]))
        sealed = _write_ciphertexts(
            [next(ciphertexts).ciphertext(be_secure=False) if e else None for e in entered],
            self.key_bits,
        )
        self.seconds += time.perf_counter() - start
        return sealed


class PaillierAdder:
    """The aggregator's half: multiplies ciphertexts modulo n^2 with only the public key."""

    def __init__(self, *, key_bits: int, value_bits: int) -> None:
        self.key_bits, self.value_bits = key_bits, value_bits
        self._publics: dict[str, paillier.PaillierPublicKey] = {}
        self.seconds = 0.0
        self.max_key_bytes = _modulus_bytes(key_bits)

    def learn(self, peer: str, role: str, key: bytes) -> None:
        if role == "receiver":
            self._publics[peer] = read_public_key(key, key_bits=self.key_bits, who=peer)

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
        public, layout, count = self._sealed_for(receiver, shape, parties)
        nsquare = gmpy2.mpz(public.nsquare)
        if not payloads:
            return ()
        # An empty item (a sender's plaintext of slots it enters no sum with) adds nothing; an
        # item nobody filled comes back empty.
        totals: list[Any] = [None] * count
        for name, payload in payloads.items():
            values = _read_ciphertexts(
                payload,
                key_bits=self.key_bits,
                nsquare=public.nsquare,
                count=count,
                who=f"Paillier share from {name}",
                entered=_entered(selection, name, shape[2], layout),
            )
            for i, value in enumerate(values):
                if value is not None:
                    total = totals[i]
                    totals[i] = (
                        gmpy2.mpz(value) if total is None else gmpy2.mul(total, value) % nsquare
                    )
        self.seconds += time.perf_counter() - start
        return _write_ciphertexts(totals, self.key_bits)

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
        public, layout, count = self._sealed_for(receiver, shape, parties)
        _read_ciphertexts(
            payload,
            key_bits=self.key_bits,
            nsquare=public.nsquare,
            count=count,
            who=f"Paillier share from {sender}",
            entered=_entered(
                None if selection is None else {sender: selection}, sender, shape[2], layout
            ),
        )
        self.seconds += time.perf_counter() - start

    def _sealed_for(
        self, receiver: str, shape: tuple[int, int, int], parties: int
    ) -> tuple[paillier.PaillierPublicKey, PackingLayout, int]:
        """``receiver``'s public key, the packing of sums of ``parties`` and how many
        ciphertexts seal (T, B, d) of them."""
        public = self._publics.get(receiver)
        if public is None:
            raise ProtocolError(f"no Paillier public key of {receiver} was announced.")
        layout = PackingLayout.for_sum(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            fraction_bits=0,
            parties=parties,
        )
        return public, layout, layout.ciphertexts(shape[0] * shape[1] * shape[2])


class PaillierReceiver:
    """The receiver's half: its own key pair (from ``key_generator``); announces the modulus
    and decrypts the summed ciphertexts."""

    def __init__(
        self,
        *,
        key_bits: int,
        value_bits: int,
        fraction_bits: int,
        key_generator: KeyGenerator,
    ) -> None:
        self.key_bits, self.value_bits, self.fraction_bits = key_bits, value_bits, fraction_bits
        self._most_fraction_bits = fraction_bits
        public, private = key_generator(key_bits)
        if public.n.bit_length() != key_bits:
            raise ConfigError(
                f"the key generator must give a {key_bits}-bit modulus, found "
                f"{public.n.bit_length()} bits."
            )
        self._public, self._private = public, private
        self.seconds = 0.0
        self.max_key_bytes = _modulus_bytes(key_bits)

    def public_key(self) -> bytes:
        return int(self._public.n).to_bytes(_modulus_bytes(self.key_bits), "big")

    def use_range(self, value_range: SumRange) -> None:
        """Decode with the fraction bits the senders derive from ``value_range``."""
        self.fraction_bits = fraction_bits_for(
            value_range, value_bits=self.value_bits, most=self._most_fraction_bits
        )

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """Paillier needs no contributor key."""

    def open(self, payload: tuple[bytes, ...], *, members: SumMembers, width: int) -> np.ndarray:
        start = time.perf_counter()
        counts = members.counts
        shape = (*counts.shape, width)
        layout = PackingLayout.for_sum(
            key_bits=self.key_bits,
            value_bits=self.value_bits,
            fraction_bits=self.fraction_bits,
            parties=len(members.parties),
        )
        values = shape[0] * shape[1] * shape[2]
        if not payload and not counts.any():  # nobody contributed to any sum: nothing sealed
            sums = np.zeros(shape, dtype=np.float32)
        else:
            ciphertexts = _read_ciphertexts(
                payload,
                key_bits=self.key_bits,
                nsquare=self._public.nsquare,
                count=layout.ciphertexts(values),
                who="the Paillier sum",
                entered=entered_items(counts > 0, width, layout.slots),
            )
            # An item nobody filled came back empty: its slots sum to 0 over 0 contributors.
            plaintexts = [0 if c is None else self._private.raw_decrypt(c) for c in ciphertexts]
            sums = open_slots(plaintexts, layout, counts, shape, key_bits=self.key_bits)
        self.seconds += time.perf_counter() - start
        return sums
