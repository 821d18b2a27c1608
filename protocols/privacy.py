"""One entry object for privacy composition, in the spirit of Opacus' ``PrivacyEngine``.

A :class:`PrivacySpec` says, in one place, how a training run is protected: the alignment of the
parties' ids (``join`` or ``psi``), the secure-sum backend (``none``, ``masks``, ``paillier``,
``ckks``), Gaussian noise on embeddings and on gradients, DP-SGD of the bottom models, and the
target epsilon that calibrates them. A :class:`PrivacyEngine` built from it gives the run its
secure-sum backend (:meth:`PrivacyEngine.aggregator`) and, once the parties exist,
:meth:`PrivacyEngine.make_private` installs every mechanism *inside the party it protects*:

- embedding noise as an outgoing hook of every data party (so it also noises what the party
  keeps to seal into a secure sum);
- gradient noise as an outgoing hook of every head holder (the gradients carry its labels);
- DP-SGD by wrapping that party's own bottom model and optimiser (Opacus);
- one :class:`~protocols.dp.PrivacyAccountant` per party, held by the party
  (``party.accountant``), recording only that party's releases.

:meth:`PrivacyEngine.report` reads each party's accountant for ``result.json``. The command line,
the examples (through it) and the benchmarks build runs through this object only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from protocols.dp import (
    EmbeddingNoise,
    GradientNoise,
    PrivacyAccountant,
    calibrate_noise,
    make_private_party,
)
from secure_vfl.errors import ConfigError
from secure_vfl.federation.aggregator import Aggregator
from secure_vfl.federation.alignment import Aligner, make_aligner
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty

SecureAgg = Literal["none", "masks", "paillier", "ckks"]
SECURE_AGGS: tuple[str, ...] = ("none", "masks", "paillier", "ckks")
ALIGNMENTS: tuple[str, ...] = ("join", "psi")
MECHANISMS = {"embedding": "--dp-embeddings", "gradient": "--dp-gradients", "dp-sgd": "--dp-sgd"}

Noise = tuple[float, float]


@dataclass(frozen=True, kw_only=True)
class PrivacySpec:
    """How one run is protected. Noise is (SIGMA, CLIP); ``target_epsilon`` replaces every
    given SIGMA by the one that keeps each party within it at ``delta``. ``seed`` seeds the noise
    generators (reproducible noise; see the issue on noise nobody can regenerate)."""

    align: str = "join"
    secure_agg: str = "none"
    dp_embeddings: Noise | None = None
    dp_gradients: Noise | None = None
    dp_sgd: Noise | None = None
    target_epsilon: float | None = None
    delta: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.align not in ALIGNMENTS:
            raise ConfigError(
                f"`align` must be one of {', '.join(ALIGNMENTS)}. Found {self.align!r}."
            )
        if self.secure_agg not in SECURE_AGGS:
            raise ConfigError(
                f"`secure_agg` must be one of {', '.join(SECURE_AGGS)}. Found {self.secure_agg!r}."
            )
        for name, noise in self.noise().items():
            sigma, clip = noise
            if not (sigma >= 0 and math.isfinite(sigma)) or not (clip > 0 and math.isfinite(clip)):
                raise ConfigError(
                    f"{MECHANISMS[name]} needs SIGMA >= 0 and CLIP > 0, both finite. "
                    f"Found {sigma}:{clip}."
                )
        if self.target_epsilon is not None and not self.noise():
            raise ConfigError(
                "--target-epsilon calibrates a mechanism: expected --dp-embeddings, --dp-gradients "
                "or --dp-sgd. Found none."
            )
        if not 0 < self.delta < 1:
            raise ConfigError(f"`delta` must be in (0, 1). Found {self.delta}.")

    def noise(self) -> dict[str, Noise]:
        """The DP mechanisms asked for, by kind."""
        given = {
            "embedding": self.dp_embeddings,
            "gradient": self.dp_gradients,
            "dp-sgd": self.dp_sgd,
        }
        return {kind: noise for kind, noise in given.items() if noise is not None}

    @property
    def secure_sums(self) -> bool:
        return self.secure_agg != "none"


class PrivacyEngine:
    """Installs a :class:`PrivacySpec` into a run: the backend, then each party's mechanisms."""

    def __init__(self, spec: PrivacySpec) -> None:
        self.spec = spec
        self.noise: dict[str, Noise] = spec.noise()
        self.sample_rate: float | None = None
        self._accountants: dict[str, PrivacyAccountant] = {}
        if spec.align == "psi":
            import protocols.psi  # noqa: F401  (registers the `psi` aligner)

    @property
    def private(self) -> bool:
        """Whether any DP mechanism is asked for."""
        return bool(self.noise)

    def aligner(self, channel: Channel | None = None) -> Aligner:
        """The alignment of the parties' ids: the plain join, or PSI between the label party and
        each data party whose messages cross ``channel`` (a fresh in-process one by default)."""
        if self.spec.align == "psi":
            from protocols.psi import PsiAligner

            return PsiAligner(channel=channel)
        return make_aligner(self.spec.align)

    def aggregator(self) -> Aggregator | None:
        """A fresh secure-sum backend (None: the plain default)."""
        if self.spec.secure_agg == "paillier":
            from protocols.paillier import PaillierAggregator

            return PaillierAggregator()
        if self.spec.secure_agg == "ckks":
            from protocols.ckks import CkksAggregator

            return CkksAggregator()
        if self.spec.secure_agg == "masks":
            from protocols.secagg import MaskingAggregator

            return MaskingAggregator()
        return None

    def refuse(self, method: str) -> None:
        """Refuse mechanisms a method cannot host, before anything is built."""
        if not self.private:
            return
        if self.spec.dp_sgd is not None and method == "combinatorial":
            raise ConfigError(
                "--dp-sgd applies to methods with one bottom model per party. "
                "Found --method combinatorial."
            )
        if method.startswith("false-vfl"):
            raise ConfigError(
                f"differential privacy is not available for {method} yet: its latent samples, "
                "log-likelihoods and latent gradients are not noised or priced by the DP "
                "mechanisms, and noise on its (mean, precision) would break the precisions. "
                f"Found {', '.join(MECHANISMS[kind] for kind in self.noise)}."
            )

    def make_private(
        self, parties: list[DataParty], *, sample_rate: float, total_steps: int
    ) -> None:
        """Install every mechanism inside the party it protects, each with its own accountant
        and noise generator; calibrate SIGMA first when a target epsilon is given."""
        if not self.private:
            return
        if not 0 < sample_rate <= 1:
            raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {sample_rate}.")
        self.sample_rate = sample_rate
        if self.spec.target_epsilon is not None:
            # Worst case per party and step: one embedding release, a gradient message from a
            # head holder to each other party (its own bottom's is no release), one DP-SGD step;
            # one SIGMA for all mechanisms keeps every party under E.
            per_step = (
                ("embedding" in self.noise)
                + (len(parties) - 1) * ("gradient" in self.noise)
                + ("dp-sgd" in self.noise)
            )
            sigma = calibrate_noise(
                self.spec.target_epsilon,
                self.spec.delta,
                sample_rate=sample_rate,
                steps=total_steps * per_step,
            )
            self.noise = {kind: (sigma, clip) for kind, (_, clip) in self.noise.items()}
        for k, party in enumerate(parties):
            accountant = PrivacyAccountant()
            party.accountant = accountant
            self._accountants[party.name] = accountant
            if "embedding" in self.noise:
                sigma, clip = self.noise["embedding"]
                party.outgoing.append(
                    EmbeddingNoise(
                        sigma,
                        clip,
                        sample_rate=sample_rate,
                        generator=self._generator(100 + k),
                        on_event=accountant.on_event,
                    )
                )
            if "gradient" in self.noise and party.heads:
                sigma, clip = self.noise["gradient"]
                party.outgoing.append(
                    GradientNoise(
                        sigma,
                        clip,
                        sample_rate=sample_rate,
                        generator=self._generator(200 + k),
                        on_event=accountant.on_event,
                    )
                )
            if "dp-sgd" in self.noise:
                sigma, clip = self.noise["dp-sgd"]
                make_private_party(
                    party,
                    noise_multiplier=sigma,
                    max_grad_norm=clip,
                    sample_rate=sample_rate,
                    on_event=accountant.on_event,
                    generator=self._generator(10 + k),
                )

    def _generator(self, offset: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.spec.seed * 1000 + offset)

    def report(self) -> dict[str, Any] | None:
        """``result.json``'s privacy entry: each party's epsilon from its own accountant, the
        noise used and the releases made (None when no DP mechanism ran)."""
        if not self.private:
            return None
        releases: dict[str, dict[str, int]] = {}
        epsilon: dict[str, float] = {}
        for name, accountant in self._accountants.items():
            if not accountant.events:
                continue
            counts = releases.setdefault(name, {})
            for event in accountant.events:
                counts[event.kind] = counts.get(event.kind, 0) + 1
            epsilon[name] = accountant.epsilon(name, self.spec.delta)
        return {
            "accountant": "rdp",
            "delta": self.spec.delta,
            "sample_rate": self.sample_rate,
            "noise": {kind: {"sigma": s, "clip": c} for kind, (s, c) in self.noise.items()},
            "epsilon": epsilon,
            "releases": releases,
        }
