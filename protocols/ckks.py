"""Secure sums under the receiver's CKKS key (Cheon, Kim, Kim and Song, ASIACRYPT 2017), packed.

Three roles, with real TenSEAL ciphertexts, split at the party boundary (:class:`CkksSender`,
:class:`CkksAdder`, :class:`CkksReceiver`, each inside its own party, made by
:class:`CkksAggregator`, the public context announced as a message): the receiver (the head or
label party, the imputation coordinator) makes a CKKS context holding the secret key and
publishes it *without* the secret
key, serialized to bytes (``save_secret_key=False``); every sender loads those bytes, so what it
holds really cannot decrypt. Each contributing party packs all its values into as few CKKS
vectors as possible (``N/2`` slots each, in (task, row, column) order, its value in the slots of
the sums it enters and 0 elsewhere), encrypts them with the public key and sends the serialized
ciphertexts; the aggregator, which holds only the public context, adds them slot-wise; the
receiver decrypts. Division by the number of contributors (a mean) happens after decryption, at
the receiver, with the public ``counts``: no homomorphic multiplication is ever needed.

Parameters (:data:`DEFAULT_COEFF_MOD_BIT_SIZES`). Additions consume no multiplicative depth, so
the modulus chain needs no rescaling prime: N = 8192 with coefficient moduli [60, 60] (one 60-bit
data prime plus the special prime SEAL keeps for key switching) and scale 2^40. That is 120 bits
in all, within the 218 bits the HE standard allows for 128-bit security at N = 8192, and half
the ciphertext size of the usual [60, 40, 60] (about 128 KiB per ciphertext instead of 230 KiB).
A slot holds value * 2^40 below the 60-bit data prime: |sum| < 2^18 with two bits to spare,
hence the magnitude limit below.

Error bound. CKKS is approximate: encoding rounds to 1/2^40 per coefficient and fresh encryption
adds noise of a few hundred units (std 3.2 times ~sqrt(N) terms), which after decoding is far
below 2^-20 per slot for these parameters (about 2^-26 measured, whatever the magnitude, since
the noise is absolute). A sum of K ciphertexts adds the K errors, so every secure sum is within
``K * 2^-20`` of the exact sum of its float32 inputs (:meth:`CkksAggregator.step`), before the
final rounding to float32. Values must be finite with |value| <= ``max_magnitude`` (4096 by
default) and ``parties * max_magnitude <= 2^18``, so no slot sum reaches the data prime.
Encoding and decoding also round, in double precision, relative to the magnitude (about
|sum| * 2^-52 measured): a longer chain of data primes would hold larger sums, but they would
miss the bound (a sum of 4 x 1e10 by 1e-3), so every chain holds what one 60-bit data prime
does (:func:`headroom_bits`): |sum| * scale below 2^58, |sum| <= 2^28 at the smallest scale.

Promises (semi-honest parties, non-colluding aggregator): the aggregator and the network see only
ciphertexts under the receiver's key; the receiver learns only sums over >= 2 contributors (a
sum over one is refused before any state changes); each (receiver, round, batch id, tag) context
is served once. CKKS gives **no integrity**: ciphertexts are malleable and carry no MAC. A
ciphertext whose bytes no longer parse, or sealed at a scale no sender of the run uses, is
refused on arrival at the aggregator (:class:`IntegrityError`), and a decrypted sum
outside what honest inputs can produce (|sum| > contributors * max_magnitude + bound, or a
nonzero slot nobody entered) is refused too, which catches garbage and the wrong secret key with
overwhelming probability; but a valid ciphertext of a small shift added in transit moves the
sum silently.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
import tenseal as ts

from secure_vfl.errors import ConfigError, IntegrityError, OutOfRangeError, ProtocolError
from secure_vfl.federation.aggregator import SKIPPED, check_skipped, entered_items

if TYPE_CHECKING:
    from protocols.sum_range import SumRange
    from secure_vfl.federation.aggregator import SumMembers

DEFAULT_POLY_MODULUS_DEGREE = 8192
DEFAULT_COEFF_MOD_BIT_SIZES = (60, 60)
DEFAULT_SCALE_BITS = 40
DEFAULT_MAX_MAGNITUDE = 4096.0
ERROR_BITS = 20  # stated per-ciphertext, per-slot error: 2^-20
MIN_SCALE_BITS = 30
HE_STANDARD_MAX_BITS = {4096: 109, 8192: 218, 16384: 438, 32768: 881}  # 128-bit security
PRECISE_DATA_BITS = 60
"""The most data-prime bits a slot sum may use: double-precision encoding and decoding stay
within the stated error bound only for |sum| * scale below 2^(60 - 2) (module docstring)."""


def headroom_bits(coeff_mod_bit_sizes: Sequence[int]) -> int:
    """The bits a slot sum times the scale stays below: the data primes' (all but the last,
    special prime), at most :data:`PRECISE_DATA_BITS`, less two spare bits."""
    return min(sum(coeff_mod_bit_sizes[:-1]), PRECISE_DATA_BITS) - 2


def make_secret_context(
    poly_modulus_degree: int = DEFAULT_POLY_MODULUS_DEGREE,
    coeff_mod_bit_sizes: Sequence[int] = DEFAULT_COEFF_MOD_BIT_SIZES,
    scale_bits: int = DEFAULT_SCALE_BITS,
) -> ts.Context:
    """A receiver's fresh CKKS context with its secret key (no Galois keys: nothing rotates)."""
    context = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree=poly_modulus_degree,
        coeff_mod_bit_sizes=list(coeff_mod_bit_sizes),
    )
    context.global_scale = float(2**scale_bits)
    return context


def public_context_bytes(context: ts.Context) -> bytes:
    """What the receiver publishes: the context serialized without secret, relin or Galois keys."""
    return bytes(
        context.serialize(
            save_public_key=True,
            save_secret_key=False,
            save_galois_keys=False,
            save_relin_keys=False,
        )
    )


def public_context_max_bytes(poly_modulus_degree: int, coeff_mod_bit_sizes: Sequence[int]) -> int:
    """The most bytes a published context of these parameters takes: its public key is two
    polynomials of N coefficients of 8 bytes per coefficient-modulus prime (256 KiB at the
    defaults; measured 256.2 KiB), plus 64 KiB for the parameters and the serialization's
    framing."""
    return 2 * poly_modulus_degree * 8 * len(coeff_mod_bit_sizes) + 64 * 1024


def scale_text(scale: float) -> str:
    """``scale`` as 2^s when it is a power of two, else as a number."""
    bits = math.log2(scale) if math.isfinite(scale) and scale > 0 else None
    return f"2^{int(bits)}" if bits is not None and bits.is_integer() else f"{scale:.6g}"


def ciphertext_scale(vector: ts.CKKSVector) -> float:
    """The scale ``vector`` was sealed at (tenseal's own ``CKKSVector.scale()`` does not reach
    it)."""
    return float(vector.data.ciphertext()[0].scale)


def load_public_context(
    published: bytes, *, modulus: tuple[int, Sequence[int]] | None = None, who: str = "a receiver"
) -> ts.Context:
    """A sender's (or the aggregator's) context, loaded from the bytes receiver ``who`` published;
    refuse one that carries a secret key (the receiver would have leaked it) or evaluation keys
    (Galois, relinearization: nothing here needs them, and they take megabytes), one of another
    scheme (BFV) or without its public key, and, given ``modulus`` (N and the bit sizes of the
    coefficient modulus' primes), one of other parameters: each would fail only at the next sum,
    having replaced the good one. SEAL shows its primes' count and their product's bit length
    (not each size): a product of k primes of b_i bits has between sum(b_i) - k + 1 and sum(b_i)
    bits."""
    try:
        context = ts.context_from(published)
    except (ValueError, RuntimeError) as error:
        raise IntegrityError(
            f"the CKKS context published by {who} does not load: {error}."
        ) from error
    if context.has_secret_key() or not context.is_public():
        raise ProtocolError(
            f"a published CKKS context from {who} must not hold the secret key; publish it "
            "serialized with save_secret_key=False."
        )
    evaluation = [
        name
        for name, held in (
            ("Galois", context.has_galois_keys()),
            ("relinearization", context.has_relin_keys()),
        )
        if held
    ]
    if evaluation:
        raise ProtocolError(
            f"a published CKKS context without evaluation keys expected from {who} (secure sums "
            f"only add ciphertexts), found {' and '.join(evaluation)} keys; publish it "
            "serialized with save_galois_keys=False and save_relin_keys=False."
        )
    key_data = context.data.seal_context().key_context_data()
    scheme = key_data.parms().scheme()
    if scheme != ts.SCHEME_TYPE.CKKS.value:  # the wrapped enum is the C++ one
        raise ProtocolError(f"a CKKS context expected from {who}, found a {scheme.name} one.")
    if not context.has_public_key():
        raise ProtocolError(
            f"a published CKKS context with its public key expected from {who}, found one "
            "without (serialized with save_public_key=False): nothing encrypts under it."
        )
    if modulus is not None:
        degree, sizes = modulus[0], list(modulus[1])
        found = key_data.parms().poly_modulus_degree()
        primes, bits = key_data.chain_index() + 1, key_data.total_coeff_modulus_bit_count()
        if (found, primes) != (degree, len(sizes)) or not (
            sum(sizes) - len(sizes) < bits <= sum(sizes)
        ):
            raise ProtocolError(
                f"a published CKKS context of N = {degree} with {len(sizes)} coefficient-modulus "
                f"primes of {sizes} bits expected from {who} (this run's), found N = {found} "
                f"with {primes} primes of {bits} bits in all."
            )
    return context


class CkksAggregator:
    """Secure sums by packed CKKS encryption under the receiver's key: a
    :class:`SealingScheme`, the factory of the halves each party makes for itself.

    ``poly_modulus_degree``, ``coeff_mod_bit_sizes`` and ``scale_bits`` fix the CKKS parameters
    (defaults N = 8192, [60, 60], 2^40; see the module docstring for why); ``max_magnitude``
    bounds every value (4096 by default).
    """

    scheme = "ckks"

    def __init__(
        self,
        *,
        poly_modulus_degree: int = DEFAULT_POLY_MODULUS_DEGREE,
        coeff_mod_bit_sizes: Sequence[int] = DEFAULT_COEFF_MOD_BIT_SIZES,
        scale_bits: int = DEFAULT_SCALE_BITS,
        max_magnitude: float = DEFAULT_MAX_MAGNITUDE,
    ) -> None:
        if poly_modulus_degree not in HE_STANDARD_MAX_BITS:
            raise ConfigError(
                f"`poly_modulus_degree` must be one of {sorted(HE_STANDARD_MAX_BITS)}. "
                f"Found {poly_modulus_degree!r}."
            )
        bits = list(coeff_mod_bit_sizes)
        if len(bits) < 2 or not all(isinstance(b, int) and 20 <= b <= 60 for b in bits):
            raise ConfigError(
                "`coeff_mod_bit_sizes` must list >= 2 integers in [20, 60] (data primes, then "
                f"the special prime). Found {bits!r}."
            )
        if sum(bits) > HE_STANDARD_MAX_BITS[poly_modulus_degree]:
            raise ConfigError(
                f"`coeff_mod_bit_sizes` total {sum(bits)} bits, above the "
                f"{HE_STANDARD_MAX_BITS[poly_modulus_degree]} bits that keep 128-bit security "
                f"at N = {poly_modulus_degree} (HE standard)."
            )
        if isinstance(scale_bits, bool) or not isinstance(scale_bits, int):
            raise ConfigError(f"`scale_bits` must be an integer. Found {scale_bits!r}.")
        data_bits, headroom = sum(bits[:-1]), headroom_bits(bits)
        if not 30 <= scale_bits <= headroom - 2:
            raise ConfigError(
                f"`scale_bits` must be in [30, {headroom - 2}] for {data_bits} data-prime bits. "
                f"Found {scale_bits}."
            )
        if not (np.isfinite(max_magnitude) and max_magnitude > 0):
            raise ConfigError(
                f"`max_magnitude` must be positive and finite. Found {max_magnitude}."
            )
        self.poly_modulus_degree = poly_modulus_degree
        self.coeff_mod_bit_sizes = tuple(bits)
        self.scale_bits = scale_bits
        self.max_magnitude = float(max_magnitude)
        # |slot sum| * 2^scale must stay below 2^headroom (headroom_bits).
        self.sum_limit = float(2 ** (headroom - scale_bits))

    @property
    def slots(self) -> int:
        """Values per CKKS vector: N / 2."""
        return self.poly_modulus_degree // 2

    def step(self, parties: int) -> float:
        """The stated bound on |secure sum - exact sum| of ``parties`` values: K * 2^-20 at
        the default scale 2^40 or above, 2^(40 - s) times that at a smaller scale 2^s (the
        encryption noise is absolute: decoded at a smaller scale, it is that much larger)."""
        return parties * 2.0 ** (max(DEFAULT_SCALE_BITS - self.scale_bits, 0) - ERROR_BITS)

    def sender(self) -> CkksSender:
        return CkksSender(
            slots=self.slots,
            modulus_bits=tuple(self.coeff_mod_bit_sizes),
            max_magnitude=self.max_magnitude,
            sum_limit=self.sum_limit,
            scale_bits=self.scale_bits,
        )

    def adder(self) -> CkksAdder:
        return CkksAdder(
            slots=self.slots,
            modulus_bits=tuple(self.coeff_mod_bit_sizes),
            scale_bits=self.scale_bits,
        )

    def receiver(self) -> CkksReceiver:
        """A fresh receiver half: its own secret context."""
        return CkksReceiver(
            poly_modulus_degree=self.poly_modulus_degree,
            coeff_mod_bit_sizes=self.coeff_mod_bit_sizes,
            scale_bits=self.scale_bits,
            max_magnitude=self.max_magnitude,
            bound=self.step,
        )


def scale_bits_for(value_range: SumRange, *, headroom_bits: int, most: int) -> int:
    """The largest scale, up to 2^``most``, at which a slot sum of ``value_range`` stays below
    2^``headroom_bits`` (the data prime less two spare bits): ``K * bound * 2^scale <=
    2^headroom``. A smaller scale trades precision for range: the encryption noise is absolute,
    so the error bound grows by 2^(most - scale). ConfigError below 2^30."""
    room = value_range.bits_within(2**headroom_bits)
    if room < MIN_SCALE_BITS:
        raise ConfigError(
            f"CKKS sums of {value_range.contributors} values of {value_range.describe()} "
            f"need a scale below 2^{MIN_SCALE_BITS} with {headroom_bits + 2} data-prime bits; "
            "expected a smaller clip or noise."
        )
    return min(most, room)


def check_range(
    values: np.ndarray, parties: int, *, max_magnitude: float, sum_limit: float, scale_bits: int
) -> None:
    """Refuse non-finite values, |value| > max_magnitude, or more parties than the data prime
    leaves room for at that magnitude."""
    if parties * max_magnitude > sum_limit:
        raise ProtocolError(
            f"{parties} parties of |value| <= {max_magnitude:.6g} could sum beyond "
            f"{sum_limit:.6g}, the most a {scale_bits}-bit scale leaves in the data prime; "
            "lower max_magnitude or scale_bits."
        )
    outside = ~np.isfinite(values) | (np.abs(values) > max_magnitude)
    if bool(outside.any()):
        largest = float(np.abs(values[outside]).max())
        raise OutOfRangeError(
            f"a value of magnitude {largest:.10g} is outside the CKKS range: every |value| "
            f"must be finite and <= {max_magnitude:.10g} for the stated error bound; "
            "clip the values or raise max_magnitude.",
            found=f"|value| {largest:.10g}" if math.isfinite(largest) else "non-finite values",
            limit=f"|value| <= {max_magnitude:.10g} (a {scale_bits}-bit scale)",
        )


def load_vector(context: ts.Context, data: bytes, who: str) -> ts.CKKSVector:
    """Deserialize one ciphertext; bytes that do not parse are an :class:`IntegrityError`."""
    try:
        return ts.ckks_vector_from(context, data)
    except (ValueError, RuntimeError, TypeError) as error:
        raise IntegrityError(
            f"a CKKS ciphertext {who} does not deserialize ({error}): it was corrupted or "
            "tampered with in transit."
        ) from error


def add_ciphertexts(
    public: ts.Context,
    arrived: Mapping[str, Sequence[bytes]],
    values: int,
    slots: int,
    entered: Mapping[str, np.ndarray] | None = None,
    scale_bits: tuple[int, int] | None = None,
) -> list[bytes]:
    """Slot-wise homomorphic sums of every contributor's ciphertexts of ``values`` values,
    ``slots`` to a ciphertext (public context only). A contributor leaves empty
    (:data:`~secure_vfl.federation.aggregator.SKIPPED`) exactly the ciphertexts its selection
    puts none of its values in: ``entered[name]`` (ciphertexts,) bool, from the public
    selection (:func:`~secure_vfl.federation.aggregator.entered_items`; None: every ciphertext
    is entered). An empty one adds nothing, and a chunk nobody entered sums to an empty one.
    An empty ciphertext where it entered (its term would be missing from sums that count it), a
    full one where it did not (it would add to sums it is not in), a ciphertext of another size
    or of a scale outside ``scale_bits`` (:func:`check_ciphertexts`), and one of another scale
    than the first contributor's are IntegrityErrors naming its sender."""
    count = -(-values // slots)
    for name, sent in arrived.items():
        if len(sent) != count:
            raise IntegrityError(f"{count} ciphertexts expected from {name}, found {len(sent)}.")
    if not arrived:
        return []
    everywhere = np.ones(count, dtype=bool)
    for name, sent in arrived.items():
        filled = everywhere if entered is None else entered[name]
        check_skipped(sent, filled, f"CKKS share from {name}")
    totals: list[bytes] = []
    for i in range(count):
        total: ts.CKKSVector | None = None
        for name, sent in arrived.items():
            if sent[i] == SKIPPED:
                continue
            vector = _load_values(
                public, sent, i, values=values, slots=slots, name=name, scale_bits=scale_bits
            )
            if total is None:
                total = vector
                continue
            try:
                total = total + vector
            except (ValueError, RuntimeError) as error:  # another scale or context
                raise IntegrityError(
                    f"CKKS ciphertext {i} from {name} does not add to the others' ({error}): "
                    "sealed under other parameters, or tampered with."
                ) from None
        totals.append(SKIPPED if total is None else bytes(total.serialize()))
    return totals


def check_ciphertexts(
    public: ts.Context,
    sent: Sequence[bytes],
    values: int,
    slots: int,
    name: str,
    entered: np.ndarray | None = None,
    scale_bits: tuple[int, int] | None = None,
) -> None:
    """Refuse (IntegrityError) ``name``'s ciphertexts unless they are as many as seal
    ``values`` values, ``slots`` to a ciphertext, empty exactly where ``entered`` (ciphertexts,)
    says its selection puts none of its values (None: nowhere), and each other deserializes to
    its share of them, sealed at a scale 2^s with s in ``scale_bits`` (least, most), the
    scales this run's senders may use (None: not checked)."""
    count = -(-values // slots)
    if len(sent) != count:
        raise IntegrityError(f"{count} ciphertexts expected from {name}, found {len(sent)}.")
    filled = np.ones(count, dtype=bool) if entered is None else entered
    check_skipped(sent, filled, f"CKKS share from {name}")
    for i in range(count):
        if sent[i] != SKIPPED:
            _load_values(
                public, sent, i, values=values, slots=slots, name=name, scale_bits=scale_bits
            )


def _load_values(
    public: ts.Context,
    sent: Sequence[bytes],
    i: int,
    *,
    values: int,
    slots: int,
    name: str,
    scale_bits: tuple[int, int] | None,
) -> ts.CKKSVector:
    """Ciphertext ``i`` of ``sent``; IntegrityError unless it holds the values it must, sealed
    at 2^s with s in ``scale_bits`` (None: not checked)."""
    size = min(slots, values - i * slots)
    vector = load_vector(public, sent[i], f"from {name}")
    if vector.size() != size:
        raise IntegrityError(
            f"CKKS ciphertext {i} from {name}: {size} values expected, found {vector.size()}."
        )
    if scale_bits is not None:
        least, most = scale_bits
        scale = ciphertext_scale(vector)
        if scale not in {float(2**bits) for bits in range(least, most + 1)}:
            raise IntegrityError(
                f"CKKS ciphertext {i} from {name}: sealed at a scale of 2^s with s in "
                f"[{least}, {most}] expected (the scales this run's senders use), found "
                f"{scale_text(scale)}."
            )
    return vector


def open_sums(
    secret: ts.Context,
    summed: Sequence[bytes],
    counts: np.ndarray,
    shape: tuple[int, int, int],
    *,
    slots: int,
    max_magnitude: float,
    bound: Callable[[int], float],
) -> np.ndarray:
    """The receiver's part: decrypt with the secret context, check every slot against what
    honest inputs can give (|sum| <= contributors * max_magnitude + bound), reshape, and set
    the sums nobody entered to exactly 0."""
    tasks, batch, width = shape
    if not summed and not counts.any():  # nobody contributed to any sum: nothing sealed
        return np.zeros(shape, dtype=np.float32)
    total = tasks * batch * width
    expected = -(-total // slots)
    if len(summed) != expected:
        raise IntegrityError(
            f"a CKKS sum of {total} values in {expected} ciphertext(s) expected, found "
            f"{len(summed)}."
        )
    # A chunk of slots no contributor entered came back empty: its sums are 0, and every sum
    # with a slot in it must have no contributor (else the aggregator dropped a chunk).
    entered = np.repeat(counts.reshape(-1) > 0, width)
    chunks = []
    for i, ciphertext in enumerate(summed):
        size = min(slots, total - i * slots)
        if ciphertext == SKIPPED:
            if entered[i * slots : i * slots + size].any():
                raise IntegrityError(
                    f"CKKS sum ciphertext {i} came back empty, but its sums have contributors: "
                    "the aggregator dropped it."
                )
            chunks.append(np.zeros(size))
        else:
            chunks.append(np.asarray(load_vector(secret, ciphertext, "of the sum").decrypt()))
    decrypted = np.concatenate(chunks)
    if decrypted.size < total:
        raise IntegrityError(
            f"a CKKS sum of {total} values expected, found {decrypted.size} slots."
        )
    sums, padding = decrypted[:total], decrypted[total:]
    parties = int(counts.max()) if counts.size else 0
    step = bound(max(parties, 1))
    limit = np.repeat(counts.reshape(-1).astype(np.float64), width) * max_magnitude
    if (
        not bool(np.isfinite(decrypted).all())
        or bool((np.abs(sums) > limit + step).any())
        or bool((np.abs(padding) > step).any())
    ):
        raise IntegrityError(
            "a decrypted CKKS sum is outside contributors * max_magnitude + the error bound "
            "(every honest sum is inside): the ciphertext was tampered with or decrypted "
            "with the wrong key."
        )
    # A sum nobody entered is exactly 0 (counts are public): drop its encryption noise.
    opened = np.where(counts[..., None] > 0, sums.reshape(shape), 0.0)
    return opened.astype(np.float32)


class CkksSender:
    """A contributor's half: encrypts its packed values under each receiver's published public
    context (which cannot decrypt)."""

    def __init__(
        self,
        *,
        slots: int,
        modulus_bits: tuple[int, ...],
        max_magnitude: float,
        sum_limit: float,
        scale_bits: int,
    ) -> None:
        self.slots, self.modulus_bits = slots, modulus_bits
        self.max_magnitude, self.sum_limit, self.scale_bits = max_magnitude, sum_limit, scale_bits
        self._headroom_bits = scale_bits + round(math.log2(sum_limit))
        self._most_scale_bits = scale_bits
        self._publics: dict[str, ts.Context] = {}
        self.seconds = 0.0
        self.max_key_bytes = public_context_max_bytes(2 * slots, modulus_bits)

    def public_key(self) -> None:
        return None

    def use_range(self, value_range: SumRange) -> None:
        """Accept values up to ``value_range``'s bound, encoded at the largest scale (up to the
        configured one) whose slot sums stay below the data prime; the receiver derives the
        same."""
        self.scale_bits = scale_bits_for(
            value_range, headroom_bits=self._headroom_bits, most=self._most_scale_bits
        )
        self.sum_limit = float(2 ** (self._headroom_bits - self.scale_bits))
        self.max_magnitude = value_range.value_bound

    def learn(self, peer: str, role: str, key: bytes) -> None:
        if role == "receiver":
            self._publics[peer] = load_public_context(
                key, modulus=(2 * self.slots, self.modulus_bits), who=peer
            )

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
        public = self._publics.get(receiver)
        if public is None:
            raise ProtocolError(
                f"no CKKS public context of {receiver} was announced: the key set-up must come "
                "before the first secure sum."
            )
        dense = np.asarray(values, dtype=np.float64)
        check_range(
            dense,
            len(parties),
            max_magnitude=self.max_magnitude,
            sum_limit=self.sum_limit,
            scale_bits=self.scale_bits,
        )
        mine = selection[..., column]
        slots = np.where(mine[..., None], dense[None], 0.0).reshape(-1)
        # A chunk of slots that enters no sum is not encrypted (SKIPPED): the selection, which
        # the aggregator and the receiver know, says so, not the values.
        entered = entered_items(mine, dense.shape[1], self.slots)
        sealed = tuple(
            bytes(
                ts.ckks_vector(
                    public,
                    slots[i * self.slots : (i + 1) * self.slots].tolist(),
                    scale=float(2**self.scale_bits),
                ).serialize()
            )
            if filled
            else SKIPPED
            for i, filled in enumerate(entered)
        )
        self.seconds += time.perf_counter() - start
        return sealed


class CkksAdder:
    """The aggregator's half: adds ciphertexts with only each receiver's public context.
    ``scale_bits`` is the run's configured scale: a sender seals at it, or at a smaller one
    (down to 2^:data:`MIN_SCALE_BITS`) that a DP run's range leaves room for
    (:func:`scale_bits_for`), so a ciphertext at any other scale is refused on arrival."""

    def __init__(self, *, slots: int, modulus_bits: tuple[int, ...], scale_bits: int) -> None:
        self.slots, self.modulus_bits = slots, modulus_bits
        self.scale_bits = (MIN_SCALE_BITS, scale_bits)
        self._publics: dict[str, ts.Context] = {}
        self.seconds = 0.0
        self.max_key_bytes = public_context_max_bytes(2 * slots, modulus_bits)

    def learn(self, peer: str, role: str, key: bytes) -> None:
        if role == "receiver":
            self._publics[peer] = load_public_context(
                key, modulus=(2 * self.slots, self.modulus_bits), who=peer
            )

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
        public = self._publics.get(receiver)
        if public is None:
            raise ProtocolError(f"no CKKS public context of {receiver} was announced.")
        entered = None
        if selection is not None:
            entered = {
                name: entered_items(selection[name], shape[2], self.slots) for name in payloads
            }
        values = shape[0] * shape[1] * shape[2]
        summed = tuple(
            add_ciphertexts(public, payloads, values, self.slots, entered, self.scale_bits)
        )
        self.seconds += time.perf_counter() - start
        return summed

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
        public = self._publics.get(receiver)
        if public is None:
            raise ProtocolError(f"no CKKS public context of {receiver} was announced.")
        entered = None if selection is None else entered_items(selection, shape[2], self.slots)
        values = shape[0] * shape[1] * shape[2]
        check_ciphertexts(public, payload, values, self.slots, sender, entered, self.scale_bits)
        self.seconds += time.perf_counter() - start


class CkksReceiver:
    """The receiver's half: its own secret context; publishes the public one and decrypts."""

    def __init__(
        self,
        *,
        poly_modulus_degree: int,
        coeff_mod_bit_sizes: Sequence[int],
        scale_bits: int,
        max_magnitude: float,
        bound: Callable[[int], float],
    ) -> None:
        self._secret = make_secret_context(poly_modulus_degree, coeff_mod_bit_sizes, scale_bits)
        self.slots = poly_modulus_degree // 2
        self._published = public_context_bytes(self._secret)
        self.max_magnitude = max_magnitude
        self.scale_bits = scale_bits
        self._headroom_bits = headroom_bits(coeff_mod_bit_sizes)
        self._most_scale_bits = scale_bits
        self._stated_bound = bound
        self._bound = bound
        self.seconds = 0.0
        self.max_key_bytes = public_context_max_bytes(poly_modulus_degree, coeff_mod_bit_sizes)

    def public_key(self) -> bytes:
        return self._published

    def use_range(self, value_range: SumRange) -> None:
        """Check sums against ``value_range``'s bound, at the scale the senders derive from it,
        with the error bound grown by 2^(configured scale - scale)."""
        self.scale_bits = scale_bits_for(
            value_range, headroom_bits=self._headroom_bits, most=self._most_scale_bits
        )
        self.max_magnitude = value_range.value_bound
        growth = 2.0 ** (self._most_scale_bits - self.scale_bits)
        stated = self._stated_bound
        self._bound = lambda parties: stated(parties) * growth

    def learn(self, peer: str, role: str, key: bytes) -> None:
        """CKKS needs no contributor key."""

    def open(self, payload: tuple[bytes, ...], *, members: SumMembers, width: int) -> np.ndarray:
        start = time.perf_counter()
        counts = members.counts
        sums = open_sums(
            self._secret,
            payload,
            counts,
            (*counts.shape, width),
            slots=self.slots,
            max_magnitude=self.max_magnitude,
            bound=self._bound,
        )
        self.seconds += time.perf_counter() - start
        return sums
