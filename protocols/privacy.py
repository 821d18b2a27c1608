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

For federated imputation the spec also says how the graph statistics are released
(``dp_statistics``, ``feature_ranges``): :meth:`PrivacyEngine.statistics_mechanisms` gives the
factory of each client's own :class:`~protocols.dp_statistics.StatisticsNoise` (its own noise
generator and accountant), which the imputation federation installs inside each client as it
builds it.

:meth:`PrivacyEngine.report` reads each party's accountant for ``result.json``. A run takes the
engine as one object, ``run_training(config, privacy=engine)`` or ``run_imputation(config,
privacy=engine)`` (the core's ``PrivacyLayer`` and ``ImputationPrivacyLayer``); each refuses
the mechanisms of the other kind of run. The command line, the examples (through it) and the
benchmarks build runs through this object only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from protocols.dp import (
    EmbeddingNoise,
    GradientNoise,
    PrivacyAccountant,
    calibrate_noise,
    make_private_party,
)
from secure_vfl.errors import ConfigError
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.alignment import Aligner, make_aligner
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty

if TYPE_CHECKING:
    from protocols.dp_statistics import ClientStatisticsNoise
    from secure_vfl.data.imputation import ImputationTask

SecureAgg = Literal["none", "masks", "paillier", "ckks"]
SECURE_AGGS: tuple[str, ...] = ("none", "masks", "paillier", "ckks")
ALIGNMENTS: tuple[str, ...] = ("join", "psi")
MECHANISMS = {"embedding": "--dp-embeddings", "gradient": "--dp-gradients", "dp-sgd": "--dp-sgd"}

Noise = tuple[float, float]


@dataclass(frozen=True, kw_only=True)
class PrivacySpec:
    """How one run is protected. Noise is (SIGMA, CLIP); ``target_epsilon`` replaces every
    given SIGMA by the one that keeps each party within it at ``delta``. ``seed`` seeds the noise
    generators (reproducible noise; see the issue on noise nobody can regenerate).

    Training (``train``) takes ``dp_embeddings``, ``dp_gradients`` and ``dp_sgd``; federated
    imputation (``impute``) takes ``dp_statistics``, whose values are clipped to the ranges
    declared in ``feature_ranges`` (a CSV; default: the observed ranges, which are not private).
    """

    align: str = "join"
    secure_agg: str = "none"
    dp_embeddings: Noise | None = None
    dp_gradients: Noise | None = None
    dp_sgd: Noise | None = None
    dp_statistics: Noise | None = None
    feature_ranges: Path | None = None
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
        if self.dp_statistics is not None:
            sigma, clip = self.dp_statistics
            if not (sigma > 0 and math.isfinite(sigma)) or not (clip > 0 and math.isfinite(clip)):
                raise ConfigError(
                    f"--dp-statistics needs SIGMA > 0 and CLIP > 0, both finite. "
                    f"Found {sigma}:{clip}."
                )
            if self.noise():
                raise ConfigError(
                    "--dp-statistics protects imputation statistics, the other mechanisms "
                    f"training; expected one kind, found both ({', '.join(self.noise())})."
                )
        elif self.feature_ranges is not None:
            raise ConfigError(
                "--feature-ranges bounds the values of --dp-statistics; expected "
                "--dp-statistics SIGMA:CLIP with it. Found none."
            )
        if self.target_epsilon is not None and not self.noise() and self.dp_statistics is None:
            raise ConfigError(
                "--target-epsilon calibrates a mechanism: for train, expected --dp-embeddings, "
                "--dp-gradients or --dp-sgd; for impute, expected --dp-statistics SIGMA:CLIP "
                "with it. Found none."
            )
        if not 0 < self.delta < 1:
            raise ConfigError(f"`delta` must be in (0, 1). Found {self.delta}.")

    def noise(self) -> dict[str, Noise]:
        """The DP mechanisms of training asked for, by kind."""
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
        # each party's number of releases at the end of every epoch (epsilon over epochs)
        self._epoch_releases: list[dict[str, int]] = []
        self._statistics: ClientStatisticsNoise | None = None
        self._ranges_note = ""
        if spec.align == "psi":
            import protocols.psi  # noqa: F401  (registers the `psi` aligner)

    @property
    def private(self) -> bool:
        """Whether any DP mechanism is asked for (of training or of imputation statistics)."""
        return bool(self.noise) or self.spec.dp_statistics is not None

    def aligner(self, channel: Channel | None = None) -> Aligner:
        """The alignment of the parties' ids: the plain join, or PSI between the label party and
        each data party whose messages cross ``channel`` (a fresh in-process one by default)."""
        if self.spec.align == "psi":
            from protocols.psi import PsiAligner

            return PsiAligner(channel=channel)
        return make_aligner(self.spec.align)

    def aggregator(self) -> SumBackend | None:
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
        if self.spec.dp_statistics is not None:
            raise ConfigError(
                "--dp-statistics protects the statistics of an imputation run (run_imputation); "
                f"training {method} expected --dp-embeddings, --dp-gradients or --dp-sgd. "
                "Found --dp-statistics."
            )
        if not self.noise:
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
        if not self.noise:
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

    def epoch_end(self) -> None:
        """Note each party's releases so far: one point of the epsilon-over-epochs curve."""
        if self.noise:
            self._epoch_releases.append(
                {name: len(a.events) for name, a in self._accountants.items()}
            )

    def _epsilon_per_epoch(self, parties: list[str]) -> dict[str, list[float]]:
        """Each party's epsilon (at the spec's delta) after every epoch, from its own releases
        up to that epoch, priced by the same accountant as the final figure."""
        curves: dict[str, list[float]] = {}
        for name in parties:
            accountant = self._accountants[name]
            curve = []
            for releases in self._epoch_releases:
                prefix = PrivacyAccountant(accountant=accountant.accountant)
                prefix.events = accountant.events[: releases[name]]
                curve.append(prefix.epsilon(name, self.spec.delta))
            curves[name] = curve
        return curves

    def _generator(self, offset: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.spec.seed * 1000 + offset)

    def statistics_mechanisms(self, task: ImputationTask) -> ClientStatisticsNoise | None:
        """The factory of each client's own statistics mechanism for ``task`` (None without
        ``dp_statistics``), which the imputation federation installs inside every client;
        ConfigError if the spec asks for a mechanism of training, which would protect nothing.

        SIGMA is calibrated to the target epsilon over the three releases (sample rate 1: the
        statistics cover every row); the noise is shared among the clients only under secure
        sums (the server then sees nothing but the sum), else every client adds all of it;
        values are clipped to the declared ranges, or to the observed ones (not private).
        """
        if self.noise:
            found = ", ".join(MECHANISMS[kind] for kind in self.noise)
            raise ConfigError(
                "an imputation run releases statistics, protected by --dp-statistics; "
                f"expected no mechanism of training. Found {found}."
            )
        if self.spec.dp_statistics is None:
            return None
        from protocols.dp_statistics import (
            STATISTICS_RELEASES,
            ClientStatisticsNoise,
            observed_ranges,
            read_feature_ranges,
        )

        sigma, clip = self.spec.dp_statistics
        if self.spec.target_epsilon is not None:
            sigma = calibrate_noise(
                self.spec.target_epsilon,
                self.spec.delta,
                sample_rate=1.0,
                steps=STATISTICS_RELEASES,
            )
        if self.spec.feature_ranges is not None:
            ranges = read_feature_ranges(self.spec.feature_ranges, task.features)
            self._ranges_note = f"declared in {self.spec.feature_ranges}"
        else:
            ranges = observed_ranges(task.train)
            self._ranges_note = (
                "observed training ranges (an experiment's stand-in for declared ranges; not "
                "private: pass --feature-ranges)"
            )
        self._statistics = ClientStatisticsNoise(
            sigma,
            clip,
            ranges=ranges,
            shares=len(task.train) if self.spec.secure_sums else 1,
            seed=self.spec.seed * 1000 + 300,
        )
        return self._statistics

    def report(self) -> dict[str, Any] | None:
        """``result.json``'s privacy entry: each party's epsilon from its own accountant, the
        noise used and the releases made (None when no DP mechanism ran)."""
        if self._statistics is not None:
            return self._statistics_report(self._statistics)
        if not self.noise:
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
            "epsilon_per_epoch": self._epsilon_per_epoch(list(epsilon)),
            "releases": releases,
        }

    def _statistics_report(self, statistics: ClientStatisticsNoise) -> dict[str, Any]:
        """The privacy entry of an imputation run: each client's epsilon from its own
        accountant, the statistics noise and the public terms it was released under."""
        accountants = {n: a for n, a in statistics.accountants.items() if a.events}
        return {
            "accountant": "rdp",
            "delta": self.spec.delta,
            "sample_rate": 1.0,
            "noise": {
                "statistics": {"sigma": statistics.noise_multiplier, "clip": statistics.clip}
            },
            "noise_shares": statistics.shares,
            "standard_bound": statistics.standard_bound,
            "ranges": self._ranges_note,
            "epsilon": {n: a.epsilon(n, self.spec.delta) for n, a in accountants.items()},
            "releases": {n: {"statistics": len(a.events)} for n, a in accountants.items()},
        }
