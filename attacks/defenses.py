"""Defenses that are not the privacy layer's mechanisms: hooks a party installs on what it sends.

The privacy layer's mechanisms (DP on embeddings and gradients, DP-SGD, secure sums) are chosen
by :class:`protocols.privacy.PrivacySpec`; the defenses here are installed by the auditor inside
the party they protect, once the parties exist (:meth:`HookDefense.install`), as outgoing hooks
of every head holder (the parties whose gradients carry labels):

- ``gradient-sparsification:FRACTION`` (used against label inference by Fu et al., USENIX
  Security 2022, and in VFLAIR): each gradient row keeps only its largest-magnitude entries,
  the smallest ``FRACTION`` of them set to zero.
- ``marvell:SCALE`` (Li et al., "Label leakage and protection in two-party split learning",
  ICLR 2022), for binary tasks: each gradient row gets Gaussian noise whose covariance depends
  on its label, chosen per batch to minimise the symmetrised KL divergence between the two
  classes' perturbed gradient distributions under a noise power budget ``SCALE * ||g1 - g0||^2``
  (g1, g0: the batch's mean gradients of the two classes). We restrict the covariances to
  ``u_y`` along ``g1 - g0`` and a common ``v`` orthogonal to it, the form of the paper's optimum,
  so that the KL sum is ``(u1/u0 + u0/u1 + |g1 - g0|^2 (1/u0 + 1/u1)) / 2 - 1`` and the budget
  ``p u1 + (1 - p) u0 + (d - 1) v <= P``; a common ``v`` adds nothing to the KL, so the
  budget goes to ``u0, u1``, found by a one-dimensional search on the budget line. Its noise
  comes from :class:`protocols.noise.SecureNoise` (AES-128-CTR keyed from the operating system),
  as the privacy layer's does.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import Tensor

from protocols.noise import NoiseSource, SecureNoise
from secure_vfl import checks
from secure_vfl.errors import ConfigError, DivergenceError, RunWarning
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.messages import GradientMessage, RepresentRequest
from secure_vfl.federation.parties import DataParty
from secure_vfl.io import plain_number
from secure_vfl.registry import Registry


class HookDefense(Protocol):
    """A defense installed inside the parties it protects once they exist. One that cannot
    protect some runs also has ``check(config)``, which refuses them (ConfigError) before any
    work."""

    spec: str

    def install(self, channel: Channel) -> None:
        """Add the defense's hooks to the parties of ``channel`` that it protects."""
        ...


def _head_holders(channel: Channel) -> list[DataParty]:
    holders = [p for p in channel.parties.values() if isinstance(p, DataParty) and p.heads]
    if not holders:
        raise ConfigError("no party holds a head: there are no gradients to protect.")
    return holders


class _Sparsifier:
    """An outgoing hook: each gradient row keeps its largest ``1 - fraction`` entries."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self._warned = False

    def on_message(self, message: Any) -> Any:
        if not isinstance(message, GradientMessage) or message.gradient.numel() == 0:
            return message
        gradient = message.gradient
        width = gradient.shape[1]
        drop = math.floor(self.fraction * width)
        if drop == 0:
            if self.fraction > 0 and not self._warned:  # 0 asks for nothing: a sweep's origin
                self._warned = True
                warnings.warn(
                    f"gradient-sparsification:{self.fraction:g} zeroes none of the {width} "
                    f"entries of each gradient row (floor({self.fraction:g} x {width}) = 0): the "
                    f"run is undefended; expected FRACTION >= 1/{width} to zero one.",
                    RunWarning,
                    stacklevel=2,
                )
            return message
        threshold = gradient.abs().kthvalue(drop, dim=1, keepdim=True).values
        kept = torch.where(gradient.abs() > threshold, gradient, torch.zeros_like(gradient))
        return _replace_gradient(message, kept)


def _replace_gradient(message: GradientMessage, gradient: Tensor) -> GradientMessage:
    import dataclasses

    return dataclasses.replace(message, gradient=gradient.contiguous())


class GradientSparsification:
    """``gradient-sparsification:FRACTION``: FRACTION in [0, 1) of each row's entries zeroed."""

    def __init__(self, fraction: float) -> None:
        if not 0 <= fraction < 1:
            raise ConfigError(
                f"gradient-sparsification:FRACTION with FRACTION in [0, 1). Found {fraction}."
            )
        self.spec = f"gradient-sparsification:{fraction:g}"
        self.fraction = fraction

    def install(self, channel: Channel) -> None:
        for party in _head_holders(channel):
            party.outgoing.append(_Sparsifier(self.fraction))


def marvell_variances(gap: float, positive: float, budget: float) -> tuple[float, float]:
    """The noise variances (u0, u1) along the class-mean difference that minimise the
    symmetrised KL ``u1/u0 + u0/u1 + gap * (1/u0 + 1/u1)`` subject to ``positive * u1 +
    (1 - positive) * u0 = budget`` (``gap`` = |g1 - g0|^2, ``positive`` = the share of class 1)."""
    if budget <= 0 or gap <= 0:
        return 0.0, 0.0
    p = min(max(positive, 1e-6), 1 - 1e-6)
    # u1 = (budget - (1 - p) u0) / p with u0 in (0, budget / (1 - p)): golden-section search
    low, high = 0.0, budget / (1 - p)

    def kl(u0: float) -> float:
        u1 = (budget - (1 - p) * u0) / p
        if u0 <= 0 or u1 <= 0:
            return math.inf
        return u1 / u0 + u0 / u1 + gap * (1 / u0 + 1 / u1)

    ratio = (math.sqrt(5) - 1) / 2
    a, b = low, high
    for _ in range(100):
        c, d = b - ratio * (b - a), a + ratio * (b - a)
        if kl(c) < kl(d):
            b = d
        else:
            a = c
    u0 = (a + b) / 2
    return u0, (budget - (1 - p) * u0) / p


class _Marvell:
    """An outgoing hook of the label party: remembers which rows each request asked for, and
    noises each gradient row with the label-dependent covariance of its batch."""

    def __init__(self, labels: Tensor, scale: float, noise: NoiseSource) -> None:
        self.labels = labels
        self.scale = scale
        self.noise = noise
        self._rows: dict[tuple[int, str, str], tuple[Tensor, Tensor]] = {}

    def on_message(self, message: Any) -> Any:
        if isinstance(message, RepresentRequest):
            if message.phase == "train" and message.split == "train":
                self._rows = {k: v for k, v in self._rows.items() if k[0] >= message.round}
                key = (message.round, message.receiver, message.tag)
                self._rows[key] = (message.positions, message.rows)
            return message
        if not isinstance(message, GradientMessage) or message.gradient.numel() == 0:
            return message
        asked = self._rows.get((message.round, message.receiver, message.tag))
        if asked is None:
            return message  # not a training batch this hook saw planned
        positions, rows = asked
        labels = self.labels[rows[torch.searchsorted(positions, message.positions)]]
        return _replace_gradient(message, self.perturb(message.gradient, labels))

    def perturb(self, gradient: Tensor, labels: Tensor) -> Tensor:
        positive = labels == 1
        if bool(positive.all()) or not bool(positive.any()):
            return gradient  # one class in the batch: nothing to separate
        difference = gradient[positive].mean(dim=0) - gradient[~positive].mean(dim=0)
        gap = float(difference.square().sum())
        if gap == 0:
            return gradient
        u0, u1 = marvell_variances(gap, float(positive.float().mean()), self.scale * gap)
        widest = math.sqrt(max(u0, u1))
        if not widest <= checks.FLOAT32_MAX:
            raise DivergenceError(
                f"marvell:{self.scale:g}: its noise std {widest:.3g} for a "
                f"gradient class gap of {math.sqrt(gap):.3g} overflows float32; try a smaller "
                "SCALE."
            )
        direction = difference / math.sqrt(gap)
        std = torch.where(positive, math.sqrt(u1), math.sqrt(u0)).to(gradient.dtype)
        draws = self.noise.gaussian((len(labels),), dtype=gradient.dtype)
        noise = (draws * std).unsqueeze(1)
        return gradient + noise * direction


class Marvell:
    """``marvell:SCALE``: label-dependent Gaussian noise on binary tasks, power budget SCALE
    times the squared distance of the class means of each batch."""

    def __init__(self, scale: float) -> None:
        if not (scale > 0 and math.isfinite(scale)):
            raise ConfigError(f"marvell:SCALE with SCALE > 0. Found {scale}.")
        self.spec = f"marvell:{scale:g}"
        self.scale = scale

    def install(self, channel: Channel) -> None:
        for party in _head_holders(channel):
            labels = next(iter(party.heads.values())).all_labels("train")
            if labels.numel() and int(labels.max()) > 1:
                raise ConfigError(
                    f"marvell protects binary tasks; found {int(labels.max()) + 1} classes."
                )
            party.outgoing.append(_Marvell(labels, self.scale, SecureNoise()))


HOOK_DEFENSES: Registry[Callable[[float], HookDefense]] = Registry("defense")
HOOK_DEFENSES.register("gradient-sparsification", GradientSparsification)
HOOK_DEFENSES.register("marvell", Marvell)


HOOK_DEFAULTS = {"norm-filter": 4.0}  # the defenses whose parameter may be left out


def parse_hook_defense(text: str) -> HookDefense:
    """``NAME:PARAM`` of a registered hook defense (``NAME`` alone where it has a default
    parameter); ConfigError for a bad parameter."""
    name, sep, param = text.partition(":")
    factory = HOOK_DEFENSES.get(name)
    if not sep and name in HOOK_DEFAULTS:
        return factory(HOOK_DEFAULTS[name])
    try:
        value = plain_number(param)
    except ValueError:
        raise ConfigError(f"{name}:NUMBER expected. Found {text!r}.") from None
    return factory(value)
