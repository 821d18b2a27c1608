"""Where differential privacy's randomness comes from: noise nobody can regenerate.

A DP guarantee holds only if the party receiving a noisy release cannot reproduce the noise and
subtract it. Every mechanism of the privacy layer (embedding and gradient noise, DP-SGD, the
FedHF statistics noise, the Poisson sample of DP training) therefore draws from a
:class:`SecureNoise`: AES-128 in counter mode as a numpy ``BitGenerator``
(``randomgen.AESCounter``, the construction of NIST SP 800-90A's CTR_DRBG, on the CPU's AES
instructions where it has them), keyed directly with 128 bits from the operating system's
entropy (``secrets``), one fresh key per mechanism and party. 128 bits is the security level of
the rest of the privacy layer (X25519, CKKS at the HE standard's 128-bit table; 2048-bit
Paillier is below it). It replaced ChaCha20 (``randomgen.ChaCha``, 20 rounds, 256-bit key),
which is as secure for this use but took 0.17 s per million noise coordinates against 0.05 s
(``docs/security-review.md``; the four normals per coordinate dominate what is left). Nothing
about it depends on the run's seed, so two runs with the same seed draw different noise, while
data splits and initialisation (which come from the seed) stay the same.

Each noise coordinate is the sum of four standard normals, halved, as Opacus' ``secure_mode``
does against floating-point attacks on the Gaussian sampler (Holohan & Braghin 2021, sec. 5.1;
Haney et al. 2022); its distribution is exactly N(0, 1). The normals are drawn in the precision
asked for (float32 for float32 noise, as Opacus draws them in the parameters' dtype; float64
otherwise): a float32 draw takes half the keystream, which is most of DP-SGD's noise cost.

:class:`SeededNoise` regenerates the same noise from a seed: for tests and debugging only. It is
chosen by the explicit ``insecure_reproducible_noise`` option (``--insecure-reproducible-noise``),
which is off by default and recorded in ``result.json``; with it, no DP figure of the run holds
against anyone who knows the seed.
"""

from __future__ import annotations

import secrets
from typing import Protocol

import numpy as np
import torch
from randomgen import AESCounter
from torch import Tensor

_FLOATING_POINT_TERMS = 4
"""Normals summed per coordinate (then divided by their std, 2), as Opacus' secure mode."""


class NoiseSource(Protocol):
    """Standard normal noise for one mechanism of one party."""

    secure: bool
    """Whether the noise comes from a cryptographically secure generator nobody else can
    regenerate (False: reproducible from a seed, for tests only)."""

    def gaussian(self, shape: tuple[int, ...], *, dtype: torch.dtype) -> Tensor:
        """A tensor of independent N(0, 1) draws."""
        ...

    def numpy_generator(self) -> np.random.Generator:
        """The numpy generator behind the noise (e.g. to draw a Poisson sample)."""
        ...


KEY_BITS = 128
"""AES-128's key, drawn from :mod:`secrets` for every generator."""


def secure_generator() -> np.random.Generator:
    """A numpy generator on AES-128-CTR keyed with 128 bits of operating-system entropy."""
    return np.random.Generator(AESCounter(key=secrets.randbits(KEY_BITS), counter=0))


class SecureNoise:
    """Gaussian noise from an AES-CTR stream keyed from ``secrets`` (see the module docstring)."""

    secure = True

    def __init__(self) -> None:
        self._generator = secure_generator()

    def gaussian(self, shape: tuple[int, ...], *, dtype: torch.dtype) -> Tensor:
        precision = np.float32 if dtype == torch.float32 else np.float64
        draws = self._generator.standard_normal((_FLOATING_POINT_TERMS, *shape), dtype=precision)
        summed = draws.sum(axis=0) / precision(np.sqrt(_FLOATING_POINT_TERMS))
        return torch.from_numpy(np.ascontiguousarray(summed)).to(dtype)

    def numpy_generator(self) -> np.random.Generator:
        return self._generator


class SeededNoise:
    """INSECURE: Gaussian noise regenerated from ``seed`` (numpy's PCG64), for tests only."""

    secure = False

    def __init__(self, seed: int | list[int]) -> None:
        self._generator = np.random.default_rng(seed)

    def gaussian(self, shape: tuple[int, ...], *, dtype: torch.dtype) -> Tensor:
        draws = self._generator.standard_normal(shape)
        return torch.from_numpy(np.ascontiguousarray(draws)).to(dtype)

    def numpy_generator(self) -> np.random.Generator:
        return self._generator


def noise_source(insecure_seed: list[int] | None) -> NoiseSource:
    """A fresh :class:`SecureNoise`, or, only when an ``insecure_seed`` is given (the explicit
    insecure option), the :class:`SeededNoise` regenerated from it."""
    if insecure_seed is None:
        return SecureNoise()
    return SeededNoise(insecure_seed)
