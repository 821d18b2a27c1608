"""Regression tests of the security review (docs/security-review.md): every X25519 point of low
order or in a non-canonical encoding refused by PSI, secret shuffles and DP noise from a
cryptographic generator, unambiguous and independent mask contexts, and the CKKS error measured
over many draws against the stated bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tenseal as ts
from hypothesis import given, settings
from hypothesis import strategies as st
from randomgen import AESCounter

from protocols.ckks import (
    DEFAULT_COEFF_MOD_BIT_SIZES,
    DEFAULT_POLY_MODULUS_DEGREE,
    HE_STANDARD_MAX_BITS,
    CkksAggregator,
    make_secret_context,
)
from protocols.noise import SecureNoise
from protocols.psi.roles import RequesterSession, ResponderSession, default_rng
from protocols.psi_kernel import fresh_key
from protocols.secagg import add_pair_mask
from secure_vfl.errors import IntegrityError
from secure_vfl.federation.aggregator import sum_context

P = 2**255 - 19
LOW_ORDER_U = (
    0,
    1,
    325606250916557431795983626356110631294008115727848805560023387167927233504,
    39382357235489614581723060781553021112529911719440698176882885853963445705823,
    P - 1,
)
"""Every canonical u-coordinate of small order on Curve25519 or its twist (orders 1, 2, 4, 8)."""
NON_CANONICAL_U = (P, P + 1, P + LOW_ORDER_U[2], 2**255 - 1, 2**256 - 1)
"""Encodings at or above p (the last two with the top bit set), which X25519 never outputs."""


def _sessions() -> tuple[RequesterSession, ResponderSession]:
    mine, theirs = [f"id-{i}" for i in range(12)], [f"id-{i}" for i in range(6, 20)]
    rng = np.random.default_rng(0)
    return (
        RequesterSession(mine, session_id="s", mode="intersection", key=fresh_key(), rng=rng),
        ResponderSession(theirs, session_id="s", mode="intersection", key=fresh_key(), rng=rng),
    )


def _with_point(points: bytes, index: int, u: int) -> bytes:
    encoded = u.to_bytes(32, "little")
    return points[: 32 * index] + encoded + points[32 * (index + 1) :]


@pytest.mark.parametrize("u", LOW_ORDER_U + NON_CANONICAL_U)
def test_every_low_order_or_non_canonical_point_is_refused_by_both_sides(u: int) -> None:
    requester, responder = _sessions()
    [request] = requester.requests()
    reason = "low order" if u < P else "not a canonical u-coordinate"
    with pytest.raises(IntegrityError, match=reason):
        responder.respond(dataclasses.replace(request, points=_with_point(request.points, 3, u)))
    response = responder.respond(request)  # the genuine request still works
    tampered = dataclasses.replace(response, own_points=_with_point(response.own_points, 1, u))
    with pytest.raises(IntegrityError, match=reason):
        requester.receive(tampered)
    result = requester.receive(response)
    assert result is not None and result.size == 6


def test_psi_shuffles_and_dp_noise_come_from_os_keyed_aes_ctr() -> None:
    """Not numpy's PCG64 (its state can be recovered from outputs), whatever seeds it."""
    shuffles = default_rng()
    assert isinstance(shuffles.bit_generator, AESCounter)
    assert isinstance(SecureNoise().numpy_generator().bit_generator, AESCounter)
    assert not np.array_equal(default_rng().permutation(64), default_rng().permutation(64))


_NAMES = st.text(alphabet="ab|\x00-", max_size=6)
_COUNTERS = st.integers(min_value=0, max_value=2**63 - 1)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(
    st.tuples(_NAMES, _NAMES, _COUNTERS, _COUNTERS, _NAMES),
    st.tuples(_NAMES, _NAMES, _COUNTERS, _COUNTERS, _NAMES),
)
def test_two_sums_share_a_mask_context_only_if_they_are_the_same_sum(
    first: tuple[str, str, int, int, str], second: tuple[str, str, int, int, str]
) -> None:
    """(session, receiver, round, batch id, tag) is length-prefixed: separators in names, or
    a name moved to the next field, never make two sums' masks the same."""
    assert (sum_context(*first) == sum_context(*second)) == (first == second)


def test_masks_of_one_pair_differ_in_every_context_field() -> None:
    key = fresh_key()
    shared = np.ones((1, 2), dtype=bool)
    base = ("session", "party-0", 3, 0, "fused")
    variants = [
        base,
        ("session2", *base[1:]),
        (base[0], "party-1", *base[2:]),
        (*base[:2], 4, *base[3:]),
        (*base[:3], 1, base[4]),
        (*base[:4], "other"),
    ]
    masks = []
    for context in variants:
        mask = np.zeros((1, 2, 8), dtype=np.uint64)
        add_pair_mask(mask, key, 1, shared, b"secure-vfl/secagg/mask/v1" + sum_context(*context))
        masks.append(mask.tobytes())
    assert len(set(masks)) == len(variants)


def test_ckks_parameters_are_within_the_he_standard_128_bit_table() -> None:
    assert sum(DEFAULT_COEFF_MOD_BIT_SIZES) <= HE_STANDARD_MAX_BITS[DEFAULT_POLY_MODULUS_DEGREE]
    assert HE_STANDARD_MAX_BITS == {4096: 109, 8192: 218, 16384: 438, 32768: 881}


def test_ckks_error_over_many_draws_stays_below_the_stated_bound() -> None:
    """K = 4 fresh encryptions summed and decrypted, 12 draws of 4096 slots at magnitudes up to
    the limit: the largest error (measured about 2^-26) stays below K * 2^-20."""
    aggregator = CkksAggregator()
    context = make_secret_context()
    rng = np.random.default_rng(4)
    parties, worst = 4, 0.0
    for draw in range(12):
        scale = aggregator.max_magnitude * (0.5 ** (draw % 4 * 4))
        values = rng.uniform(-scale, scale, size=(parties, aggregator.slots))
        total = ts.ckks_vector(context, values[0].tolist())
        for row in values[1:]:
            total = total + ts.ckks_vector(context, row.tolist())
        error = np.abs(np.array(total.decrypt()) - values.sum(axis=0)).max()
        worst = max(worst, float(error))
    assert worst < aggregator.step(parties)
    assert worst > 0  # CKKS is approximate: a zero error would mean nothing was encrypted
