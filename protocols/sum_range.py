"""The range every secure sum of a differentially private run is sized for, and the guard that
reports a value outside it as divergence, the same way whatever sums the run.

A secure sum encodes real values in a bounded range (pairwise masks: fixed point in Z_2^64;
Paillier: fixed-point slots of a packed plaintext; CKKS: value * scale below the data prime).
Its range is chosen once, from what is known before training (:func:`sum_range`), and installed
in every party's own halves (:class:`RangedHalf`), so that an honest run never overflows:

- With noise on the representations (``--dp-embeddings SIGMA:CLIP``) every row is clipped to
  L2 norm CLIP (so every coordinate is within CLIP) and gets N(0, (SIGMA CLIP)^2) per
  coordinate. A coordinate is then within ``CLIP (1 + k SIGMA)`` unless its noise draw is
  beyond k standard deviations, with ``k = TAIL_SIGMAS`` (10.28) chosen so that one draw
  exceeds it with probability 2^-80: by the union bound, a party that makes fewer than 2^40
  (1.1e12) noise draws in a run (10 epochs of digits with 128-wide representations make about
  10^7) exceeds it anywhere with probability below 2^-40. That tail is accepted: it is far below
  any other failure of a run, and truncating the noise instead would change the mechanism the
  accountant prices.
- Without it, a representation is not bounded by construction. The run declares
  :data:`REPRESENTATION_BOUND` (2^16 = 65536: a bottom model of standardised inputs gives values
  of a few units; under gradient noise alone they drift, and a Satellite run of
  ``benchmarks/protocol_costs.py`` that still reached 81 % accuracy had passed 4096) and a value
  beyond it is divergence, not an overflow. Masks and CKKS hold it at their default precision
  for up to 4 contributors (masks: 4 x 2^16 x 2^24 is far within 2^62; CKKS: 4 x 2^16 x 2^40
  is the 60-bit prime less two bits; one contributor more and CKKS encodes at 2^39); Paillier's
  32-bit slots hold it with 14 fraction bits instead of 16, whatever the contributors
  (2^16 x 2^15 is one past the largest 32-bit encoded value, 2^31 - 1).

The range holds ``max(REPRESENTATION_BOUND, CLIP (1 + k SIGMA))`` per value and ``contributors``
values per sum; each backend derives its encoding from it (masks and Paillier: fewer fraction
bits; CKKS: ``max_magnitude`` and, when needed, a smaller scale). :class:`DivergenceGuard`, the
last outgoing hook of every party in a private run, checks each representation (finite, within
the range) and each gradient (finite) before it is sent or kept for sealing, and raises one
:class:`~secure_vfl.errors.DivergenceError` naming the step, the party and what to try: the
plain sums and the three secure backends fail at the same point with the same message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist
from typing import Protocol, TypeVar, runtime_checkable

import torch

from secure_vfl.errors import ConfigError, DivergenceError
from secure_vfl.federation.messages import GradientMessage, Message, RepresentationMessage

M = TypeVar("M", bound=Message)

TAIL_BITS = 80
"""One noise draw falls outside the range with probability 2^-TAIL_BITS."""
TAIL_SIGMAS = -NormalDist().inv_cdf(2.0 ** -(TAIL_BITS + 1))
"""k with P(|N(0, 1)| > k) = 2^-80 (10.28): the noise a range allows for, in standard deviations."""
RUN_DRAWS_BITS = 40
"""A party making fewer than 2^40 draws in a run leaves its range with probability < 2^-40."""
REPRESENTATION_BOUND = 65536.0
"""The largest |value| of a representation that is not clipped; beyond it, training diverged."""

ADVICE = (
    "try a smaller SIGMA (or a larger --target-epsilon), a smaller CLIP (the noise's std is "
    "SIGMA x CLIP; gradient rows are ~1/batch), a lower --lr or fewer --epochs"
)
CLIP_ADVICE = ", or --dp-embeddings SIGMA:CLIP, which clips every representation"


@dataclass(frozen=True)
class SumRange:
    """What every secure sum of a run must hold: ``contributors`` values of |value| <=
    ``value_bound`` each. ``clipped`` says whether the bound holds by construction (clipped,
    noised representations, up to the accepted tail) or is the divergence bound."""

    value_bound: float
    contributors: int
    clipped: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.value_bound) and self.value_bound > 0):
            raise ConfigError(
                f"a sum range needs a positive, finite value bound. Found {self.value_bound}."
            )
        if isinstance(self.contributors, bool) or self.contributors < 1:
            raise ConfigError(
                f"a sum range needs at least one contributor. Found {self.contributors!r}."
            )

    @property
    def sum_bound(self) -> float:
        """The largest |sum| the range allows: ``contributors * value_bound``."""
        return self.contributors * self.value_bound

    def bits_within(self, limit: int, *, per_value: bool = False) -> int:
        """The largest integer ``f`` with ``sum_bound * 2^f <= limit`` (``value_bound`` with
        ``per_value``), computed exactly: a floating-point logarithm of a bound just above a
        power of two rounds to that power and gave one bit too many."""
        bound = Fraction(self.value_bound) * (1 if per_value else self.contributors)
        bits = limit.bit_length() - bound.numerator.bit_length() + bound.denominator.bit_length()
        while bound * Fraction(2) ** bits > limit:
            bits -= 1
        while bound * Fraction(2) ** (bits + 1) <= limit:
            bits += 1
        return bits

    def describe(self) -> str:
        """One line for errors and reports: the bound and where it comes from."""
        source = (
            f"the clip bound plus {TAIL_SIGMAS:.1f} sigma of noise"
            if self.clipped
            else "the bound of an unclipped representation"
        )
        return f"|value| <= {self.value_bound:.6g} ({source})"


def noised_bound(noise_multiplier: float, clip: float) -> float:
    """The largest |coordinate| of a row clipped to L2 norm ``clip`` plus N(0, (sigma clip)^2)
    per coordinate, up to the accepted tail: ``clip (1 + TAIL_SIGMAS sigma)``."""
    return clip * (1.0 + TAIL_SIGMAS * noise_multiplier)


def sum_range(noise: Mapping[str, tuple[float, float]], *, contributors: int) -> SumRange:
    """The range of a run with DP ``noise`` (kind -> (SIGMA, CLIP), SIGMA calibrated) whose
    sums have at most ``contributors`` terms: the representation bound, raised to the noised
    clip bound of every mechanism that clips and noises what enters a sum (``embedding``:
    every representation; ``exposure``: the rows a sum cannot hide, under ``--release dp``,
    noised after the guard checked them, so bounded by construction). ``clipped`` says
    whether every value is clipped (embedding noise)."""
    bound = REPRESENTATION_BOUND
    for kind in ("embedding", "exposure"):
        if kind in noise:
            bound = max(bound, noised_bound(*noise[kind]))
    return SumRange(bound, contributors, clipped="embedding" in noise)


@runtime_checkable
class RangedHalf(Protocol):
    """A half of a secure-sum backend whose encoding is sized for a :class:`SumRange`; the
    sender and receiver halves of every backend derive the same encoding from it."""

    def use_range(self, value_range: SumRange) -> None:
        """Size the encoding so that sums of ``value_range`` fit (ConfigError if none can)."""
        ...


class DivergenceGuard:
    """Outgoing hook of a party in a private run (the last one, after its DP noise): refuses a
    representation that is non-finite or outside ``value_range`` and a non-finite gradient,
    before it is sent or kept for sealing, as a :class:`~secure_vfl.errors.DivergenceError`."""

    def __init__(self, value_range: SumRange) -> None:
        self.value_range = value_range

    def on_message(self, message: M) -> M:
        if isinstance(message, RepresentationMessage):
            self._check(message, message.representation, "representation", bounded=True)
        elif isinstance(message, GradientMessage):
            self._check(message, message.gradient, "gradient", bounded=False)
        return message

    def _check(self, message: Message, values: torch.Tensor, what: str, *, bounded: bool) -> None:
        if values.numel() == 0:
            return
        finite = bool(torch.isfinite(values).all())
        largest = float(values.abs().max()) if finite else math.inf
        if finite and (not bounded or largest <= self.value_range.value_bound):
            return
        found = (
            "non-finite values"
            if not finite
            else f"|value| {largest:.6g}, outside the range its sums were sized for, "
            f"{self.value_range.describe()}"
        )
        phase = getattr(message, "phase", "train")
        where = f"at step {message.round}" if phase == "train" else "at prediction"
        raise DivergenceError(
            f"training diverged under the DP noise {where}: {message.sender}'s {what} for "
            f"{message.receiver} has {found}; {ADVICE}"
            f"{'' if self.value_range.clipped else CLIP_ADVICE}.",
            step=message.round if phase == "train" else None,
        )
