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
- under ``release="dp"``, the noise on the rows of its contribution that a secure sum cannot
  hide, inside every data party (``party.exposure``, :class:`~protocols.dp.ExposureNoise`);
- one :class:`~protocols.dp.PrivacyAccountant` per party, held by the party
  (``party.accountant``), recording only that party's releases;
- every mechanism with its own noise source (:mod:`protocols.noise`): AES-128-CTR keyed from the
  operating system's entropy, never from the run's seed, unless the spec says
  ``insecure_reproducible_noise``.

A private training run is Poisson-sampled (:meth:`PrivacyEngine.sampler` replaces the method's
sampler by a :class:`~secure_vfl.data.samplers.PoissonSampler` drawn from the secure generator),
and each party's releases are priced as the guarantees of :mod:`protocols.dp`: against the
receivers of its messages (per record, joint events per step, no amplification: they know the
batches) and, with DP-SGD, against whoever sees only its bottom model (Poisson amplification).

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

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from protocols.dp import (
    ADJACENCIES,
    ADJACENCY_TEXT,
    GRAD_SAMPLE_MODES,
    ROW_SHIFT,
    Adjacency,
    EmbeddingNoise,
    ExposureNoise,
    GradientNoise,
    Guarantee,
    PrivacyAccountant,
    calibrate_noise,
    calibrate_per_record,
    make_private_party,
)
from protocols.noise import NoiseSource, noise_source
from protocols.sum_range import (
    RUN_DRAWS_BITS,
    TAIL_SIGMAS,
    DivergenceGuard,
    RangedHalf,
    SumRange,
    sum_range,
)
from secure_vfl.data.samplers import BatchSampler, PoissonSampler, poisson_like
from secure_vfl.errors import ConfigError
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.alignment import Aligner, make_aligner
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty

if TYPE_CHECKING:
    from protocols.dp_statistics import ClientStatisticsNoise
    from secure_vfl.data.imputation import ImputationTask
    from secure_vfl.methods.base import MethodConfig

SecureAgg = Literal["none", "masks", "paillier", "ckks"]
SECURE_AGGS: tuple[str, ...] = ("none", "masks", "paillier", "ckks")
ALIGNMENTS: tuple[str, ...] = ("join", "psi")
_RowLayer = TypeVar("_RowLayer", EmbeddingNoise, GradientNoise, ExposureNoise)

MECHANISMS = {
    "embedding": "--dp-embeddings",
    "gradient": "--dp-gradients",
    "dp-sgd": "--dp-sgd",
    "exposure": "--release dp",
}
RELEASES: tuple[str, ...] = ("drop", "dp")
RELEASE_CLIP = 1.0
"""The CLIP of ``--release dp`` when only ``--target-epsilon`` is given (no --release-noise)."""

Noise = tuple[float, float]


@dataclass(frozen=True, kw_only=True)
class PrivacySpec:
    """How one run is protected. Noise is (SIGMA, CLIP); ``target_epsilon`` replaces every
    given SIGMA by the one that keeps each party's every guarantee within it at ``delta``.
    ``adjacency`` is that of the guarantees against the receivers of messages (``replace-one``
    record, the default, or ``add-remove``). Noise and the Poisson sample come from a secure
    generator; only ``insecure_reproducible_noise`` derives them from ``seed`` (for tests: no
    guarantee holds against anyone who knows the seed).

    Training (``train``) takes ``dp_embeddings``, ``dp_gradients`` and ``dp_sgd``; federated
    imputation (``impute``) takes ``dp_statistics``, whose values are clipped to the ranges
    declared in ``feature_ranges`` (a CSV; default: the observed ranges, which are not private).
    ``grad_sample_mode`` says how DP-SGD gets its per-sample gradients
    (:func:`~protocols.dp.make_private_party`: ``auto``, ``linear`` or Opacus' ``hooks``).

    ``release`` is the policy for what a secure sum cannot hide (a sample's subset whose only
    contributor besides the label party is one party): ``drop`` (never plan it) or ``dp`` (that
    party sends those rows clipped and noised, :class:`~protocols.dp.ExposureNoise`, with
    ``release_noise`` (SIGMA, CLIP), or SIGMA calibrated to ``target_epsilon`` with CLIP
    :data:`RELEASE_CLIP` unless given). The method must plan it too:
    ``MethodConfig(release="dp")``.
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
    adjacency: str = "replace-one"
    insecure_reproducible_noise: bool = False
    seed: int = 0
    grad_sample_mode: str = "auto"
    release: str = "drop"
    release_noise: Noise | None = None

    def __post_init__(self) -> None:
        self._check_release()
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
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ConfigError(
                f"`grad_sample_mode` must be one of {', '.join(GRAD_SAMPLE_MODES)}. "
                f"Found {self.grad_sample_mode!r}."
            )
        if self.adjacency not in ADJACENCIES:
            raise ConfigError(
                f"`adjacency` must be one of {', '.join(ADJACENCIES)}. Found {self.adjacency!r}."
            )
        if self.insecure_reproducible_noise and not self.noise() and self.dp_statistics is None:
            raise ConfigError(
                "--insecure-reproducible-noise makes DP noise reproducible from the seed; "
                "expected a DP mechanism with it. Found none."
            )

    def _check_release(self) -> None:
        if self.release not in RELEASES:
            raise ConfigError(
                f"`release` must be one of {', '.join(RELEASES)}. Found {self.release!r}."
            )
        if self.release == "drop":
            if self.release_noise is not None:
                raise ConfigError(
                    "--release-noise is the noise of --release dp; found it with --release drop."
                )
            return
        if self.secure_agg == "none":
            raise ConfigError(
                "--release dp sends with DP noise what a secure sum cannot hide; expected "
                "--secure-agg masks, paillier or ckks with it. Found --secure-agg none."
            )
        if self.release_noise is None and self.target_epsilon is None:
            raise ConfigError(
                "--release dp needs its noise: expected --release-noise SIGMA:CLIP or "
                "--target-epsilon E. Found neither."
            )

    def noise(self) -> dict[str, Noise]:
        """The DP mechanisms of training asked for, by kind (``exposure``: ``release="dp"``,
        whose SIGMA a target epsilon replaces)."""
        exposure = None
        if self.release == "dp":
            exposure = self.release_noise or (1.0, RELEASE_CLIP)
        given = {
            "embedding": self.dp_embeddings,
            "gradient": self.dp_gradients,
            "dp-sgd": self.dp_sgd,
            "exposure": exposure,
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
        self._sampler: PoissonSampler | None = None
        self._plan: list[dict[str, int]] = []
        self._accountants: dict[str, PrivacyAccountant] = {}
        # each party's number of releases at the end of every epoch (epsilon over epochs)
        self._epoch_releases: list[dict[str, int]] = []
        self._statistics: ClientStatisticsNoise | None = None
        self.value_range: SumRange | None = None
        self._ranges_note = ""
        if spec.align == "psi":
            import protocols.psi  # noqa: F401  (registers the `psi` aligner)

    @property
    def accountants(self) -> dict[str, PrivacyAccountant]:
        """Each party's accountant, by party (read-only use: the parties hold them)."""
        return dict(self._accountants)

    @property
    def poisson(self) -> PoissonSampler | None:
        """The Poisson sampler of a private training run (None before :meth:`sampler`)."""
        return self._sampler

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

    def refuse(self, method: str, *, batching: str = "mixed") -> None:
        """Refuse mechanisms a method (training with ``batching``) cannot host, before
        anything is built."""
        if self.spec.dp_statistics is not None:
            raise ConfigError(
                "--dp-statistics protects the statistics of an imputation run (run_imputation); "
                f"training {method} expected --dp-embeddings, --dp-gradients or --dp-sgd. "
                "Found --dp-statistics."
            )
        if not self.noise:
            return
        if batching != "mixed":
            raise ConfigError(
                "differentially private training samples its batches by Poisson sampling, "
                "which grouped batches (one observed set each) cannot follow; expected "
                f"--batching mixed. Found --batching {batching}."
            )
        if self.spec.dp_sgd is not None and method == "combinatorial":
            raise ConfigError(
                "--dp-sgd applies to methods with one bottom model per party. "
                "Found --method combinatorial."
            )
        if "exposure" in self.noise and method != "laser":
            raise ConfigError(
                "--release dp releases the rows of LASER's subsets that a secure sum cannot "
                f"hide; expected --method laser --heads active. Found --method {method}."
            )
        if method.startswith("false-vfl"):
            raise ConfigError(
                f"differential privacy is not available for {method} yet: its latent samples, "
                "log-likelihoods and latent gradients are not noised or priced by the DP "
                "mechanisms, and noise on its (mean, precision) would break the precisions. "
                f"Found {', '.join(MECHANISMS[kind] for kind in self.noise)}."
            )

    def sampler(self, sampler: BatchSampler, *, n: int, epochs: int) -> BatchSampler:
        """With a DP mechanism of training, the Poisson sampler that replaces the method's
        ``sampler`` (same rows, rate batch_size / rows, same steps per epoch; the whole schedule
        drawn now from the engine's sampling generator); else ``sampler`` unchanged."""
        if not self.noise:
            return sampler
        rng = self._noise_source(1).numpy_generator()
        self._sampler = poisson_like(sampler, n=n, epochs=epochs, rng=rng)
        self.sample_rate = self._sampler.rate
        return self._sampler

    def make_private(
        self, parties: list[DataParty], *, method: str, method_config: MethodConfig
    ) -> None:
        """Install every mechanism inside the party it protects, each with its own accountant
        and noise source; calibrate SIGMA first when a target epsilon is given (after
        :meth:`sampler`, whose schedule the calibration reads)."""
        if not self.noise:
            return
        sampler = self._sampler
        if sampler is None:
            raise ConfigError(
                "a private run trains on the engine's Poisson sampler; expected "
                "PrivacyEngine.sampler(...) before make_private. Found none."
            )
        if ("exposure" in self.noise) != (method_config.release == "dp"):
            raise ConfigError(
                f"the privacy spec's release={self.spec.release!r} and the method's "
                f"release={method_config.release!r} must agree (the method plans the exposed "
                "rows, the parties noise them)."
            )
        self._plan = release_plan(method, method_config, len(parties))
        if self.spec.target_epsilon is not None:
            sigma = self._calibrated_sigma(sampler, self._plan)
            self.noise = {kind: (sigma, clip) for kind, (_, clip) in self.noise.items()}
        for k, party in enumerate(parties):
            accountant = PrivacyAccountant()
            party.accountant = accountant
            self._accountants[party.name] = accountant
            if "embedding" in self.noise:
                layer = self._row_noise("embedding", EmbeddingNoise, 100 + k, accountant)
                party.incoming.append(layer.requests)  # notes the rows each request asks for
                party.outgoing.append(layer)
            if "gradient" in self.noise and party.heads:
                party.outgoing.append(
                    self._row_noise("gradient", GradientNoise, 200 + k, accountant)
                )
            if "exposure" in self.noise:
                exposure = self._row_noise("exposure", ExposureNoise, 400 + k, accountant)
                party.incoming.append(exposure)  # notes the rows each request asks for
                party.exposure = exposure
            if "dp-sgd" in self.noise:
                sigma, clip = self.noise["dp-sgd"]
                make_private_party(
                    party,
                    noise_multiplier=sigma,
                    max_grad_norm=clip,
                    sample_rate=sampler.rate,
                    noise=self._noise_source(10 + k),
                    on_event=accountant.on_event,
                    grad_sample_mode=self.spec.grad_sample_mode,  # type: ignore[arg-type]
                )
        self._guard(parties)

    def _row_noise(
        self, kind: str, layer: type[_RowLayer], stream: int, accountant: PrivacyAccountant
    ) -> _RowLayer:
        """The ``kind`` mechanism as ``layer``, at the engine's Poisson rate, spending
        ``accountant`` and drawing from noise source ``stream`` (which only the insecure
        reproducible option derives from the seed)."""
        assert self._sampler is not None
        sigma, clip = self.noise[kind]
        return layer(
            sigma,
            clip,
            sample_rate=self._sampler.rate,
            noise=self._noise_source(stream),
            on_event=accountant.on_event,
        )

    def _guard(self, parties: list[DataParty]) -> None:
        """Size every party's secure-sum halves for the run's range (the calibrated noise is
        known now, before the first sum) and make a :class:`DivergenceGuard` each party's last
        outgoing hook, so divergence is reported alike under every backend."""
        self.value_range = sum_range(self.noise, contributors=len(parties))
        for party in parties:
            for half in (party.sealer, party.opener):
                if isinstance(half, RangedHalf):
                    half.use_range(self.value_range)
            party.outgoing.append(DivergenceGuard(self.value_range))

    def epoch_end(self) -> None:
        """Note each party's releases so far: one point of the epsilon-over-epochs curve."""
        if self.noise:
            self._epoch_releases.append(
                {name: len(a.events) for name, a in self._accountants.items()}
            )

    def resume(self, *, steps_done: int, epoch_steps: int | None) -> None:
        """A run resumed after ``steps_done`` steps, its parties' accountants holding the
        releases they had made: note each party's releases at the end of every epoch finished
        before, as :meth:`epoch_end` did in the killed run (a training release of step t
        carries round t, and releases are recorded in step order)."""
        if not self.noise or epoch_steps is None:
            return
        self._epoch_releases = [
            {
                name: sum(1 for e in a.events if e.phase == "train" and e.round < end)
                for name, a in self._accountants.items()
            }
            for end in range(epoch_steps, steps_done + 1, epoch_steps)
        ]

    def _epsilon_per_epoch(
        self, sampler: PoissonSampler, adjacency: Adjacency, sampling: str
    ) -> dict[str, list[float]]:
        """Each party's headline epsilon (the largest of its training guarantees, at the spec's
        delta) after every epoch, from its own releases up to that epoch, priced as the final
        figure is (DP-SGD composed over the draws made so far)."""
        curves: dict[str, list[float]] = {}
        for name, accountant in self._accountants.items():
            curve = []
            for releases in self._epoch_releases:
                prefix = PrivacyAccountant(accountant=accountant.accountant)
                prefix.events = accountant.events[: releases[name]]
                draws = sum(1 for e in prefix.events if e.party == name and e.kind == "dp-sgd")
                held = self._training_guarantees(
                    prefix, name, sampler, adjacency, sampling, draws=draws
                )
                if held:
                    curve.append(max(g.epsilon for g in held))
            if curve:
                curves[name] = curve
        return curves

    def _training_guarantees(
        self,
        accountant: PrivacyAccountant,
        name: str,
        sampler: PoissonSampler,
        adjacency: Adjacency,
        sampling: str,
        *,
        draws: int,
    ) -> list[Guarantee]:
        """``name``'s guarantees from ``accountant``'s training releases: against the receivers
        of its messages, and (DP-SGD over ``draws`` draws) against an observer of its model."""
        delta = self.spec.delta
        found = [
            accountant.message_guarantee(
                name,
                schedule=sampler.schedule,
                records=sampler.n,
                adjacency=adjacency,
                delta=delta,
                sampling=sampling,
            ),
            accountant.model_guarantee(
                name, sample_rate=sampler.rate, draws=draws, delta=delta, sampling=sampling
            ),
        ]
        return [g for g in found if g is not None]

    def _calibrated_sigma(self, sampler: PoissonSampler, plan: list[dict[str, int]]) -> float:
        """One SIGMA for every mechanism that keeps each party's every guarantee within the
        target: against the receivers, its planned releases per step times the most steps any
        record is used in (the schedule is drawn already), composed per record; with DP-SGD,
        also the Poisson-amplified steps against the model's observer."""
        target, delta = self.spec.target_epsilon, self.spec.delta
        assert target is not None
        shift = ROW_SHIFT[self.spec.adjacency]
        uses = int(sampler.uses().max())
        sigma = 0.0
        for releases in plan:
            per_step = sum(releases[kind] for kind in self.noise)
            sends = sum(
                releases[kind]
                for kind in ("embedding", "gradient", "exposure")
                if kind in self.noise
            )
            if sends and uses:
                sigma = max(
                    sigma,
                    calibrate_per_record(target, delta, releases=uses * per_step, shift=shift),
                )
        if "dp-sgd" in self.noise:
            sigma = max(
                sigma,
                calibrate_noise(target, delta, sample_rate=sampler.rate, steps=sampler.draws),
            )
        return sigma

    def _noise_source(self, stream: int) -> NoiseSource:
        """A fresh secure noise source; only under ``insecure_reproducible_noise``, one
        regenerated from (seed, ``stream``)."""
        insecure = self.spec.insecure_reproducible_noise
        return noise_source([self.spec.seed, stream] if insecure else None)

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
            noise=lambda k: self._noise_source(300 + k),
        )
        return self._statistics

    def report(self) -> dict[str, Any] | None:
        """``result.json``'s privacy entry (None when no DP mechanism ran): each party's
        guarantees from its own accountant (what each protects, against whom, under which
        adjacency, sampling and accountant, and its epsilon), its headline ``epsilon`` (the
        largest of them), the noise, the sampling and the releases made."""
        if self._statistics is not None:
            return self._statistics_report(self._statistics)
        if not self.noise:
            return None
        sampler = self._sampler
        assert sampler is not None
        adjacency: Adjacency = self.spec.adjacency  # type: ignore[assignment]
        delta = self.spec.delta
        sampling = (
            f"Poisson, rate {sampler.rate:.6g}, {sampler.draws} draws "
            f"({sampler.steps_per_epoch} per epoch), drawn from {self._source_text()}"
        )
        guarantees: dict[str, list[Guarantee]] = {}
        for name, accountant in self._accountants.items():
            predicted = accountant.prediction_guarantee(name, adjacency=adjacency, delta=delta)
            held = self._training_guarantees(
                accountant, name, sampler, adjacency, sampling, draws=sampler.draws
            ) + ([predicted] if predicted is not None else [])
            if held:
                guarantees[name] = held
        epsilon = {name: max(g.epsilon for g in held) for name, held in guarantees.items()}
        target = self.spec.target_epsilon
        return {
            **self._source_entry(),
            "accountant": "rdp",
            "delta": delta,
            "adjacency": ADJACENCY_TEXT[adjacency],
            "sampling": {
                "kind": "poisson",
                "rate": sampler.rate,
                "draws": sampler.draws,
                "steps": len(sampler.schedule),
                "most_steps_per_record": int(sampler.uses().max()),
                "drawn_from": self._source_text(),
            },
            "sample_rate": sampler.rate,
            "noise": {kind: {"sigma": s, "clip": c} for kind, (s, c) in self.noise.items()},
            "epsilon": epsilon,
            "epsilon_per_epoch": self._epsilon_per_epoch(sampler, adjacency, sampling),
            "guarantees": {n: [g.to_json() for g in held] for n, held in guarantees.items()},
            "releases": {
                name: {
                    **accountant.releases(name),
                    **{
                        f"predict-{kind}": count
                        for kind, count in accountant.releases(name, phase="predict").items()
                    },
                }
                for name, accountant in self._accountants.items()
                if accountant.events
            },
            "releases_per_step_planned": {
                name: {kind: plan[kind] for kind in self.noise}
                for name, plan in zip(self._accountants, self._plan, strict=True)
            },
            "not_noised": self._not_noised(),
            "release": self.release_entry(),
            "sum_range": self._range_entry(),
            "target_epsilon": target,
            "within_target": None
            if target is None
            else all(e <= target * (1 + 1e-9) for e in epsilon.values()),
        }

    def _range_entry(self) -> dict[str, Any] | None:
        """What the run's sums were sized for (None without secure sums)."""
        if self.value_range is None or not self.spec.secure_sums:
            return None
        return {
            "value_bound": self.value_range.value_bound,
            "contributors": self.value_range.contributors,
            "clipped": self.value_range.clipped,
            "tail": (
                f"a noise draw beyond {TAIL_SIGMAS:.2f} sigma (probability 2^-80 each; below "
                f"2^-40 for a run of < 2^{RUN_DRAWS_BITS} draws per party) would overflow"
            ),
        }

    def release_entry(self) -> dict[str, Any]:
        """What the run did with what a secure sum cannot hide, for ``result.json``."""
        if self.spec.release == "drop":
            return {
                "policy": "drop",
                "what": "a sample's subset whose only contributor besides the label party is "
                "one party is never planned (trained on or predicted from)",
            }
        sigma, clip = self.noise["exposure"]
        return {
            "policy": "dp",
            "what": "a sample's subset whose only contributor besides the label party is one "
            "party is planned; that party sends the row clipped to CLIP with N(0, (SIGMA "
            "CLIP)^2) noise per coordinate, priced by its accountant per record",
            "sigma": sigma,
            "clip": clip,
            "exposed_releases": {
                name: {
                    "train": accountant.releases(name).get("exposure", 0),
                    "predict": accountant.releases(name, phase="predict").get("exposure", 0),
                    "train_rows": sum(
                        len(e.rows)
                        for e in accountant.events
                        if e.kind == "exposure" and e.phase == "train"
                    ),
                }
                for name, accountant in self._accountants.items()
            },
        }

    def _not_noised(self) -> list[str]:
        """What crosses a party boundary in the clear, so that no guarantee covers it."""
        found = []
        if "embedding" not in self.noise:
            found.append(
                "representations: sent without noise, so no guarantee covers a party's "
                "features against their receiver (the aggregator or the label party)"
            )
        if "gradient" not in self.noise:
            found.append(
                "gradients: sent without noise, so no guarantee covers the labels against the "
                "data parties receiving them"
            )
        return found

    def _source_text(self) -> str:
        if self.spec.insecure_reproducible_noise:
            return f"numpy PCG64 seeded from the run's seed {self.spec.seed} (INSECURE)"
        return "AES-128-CTR keyed with 128 bits of operating-system entropy"

    def _source_entry(self) -> dict[str, Any]:
        return {
            "noise_source": self._source_text(),
            "insecure_reproducible_noise": self.spec.insecure_reproducible_noise,
        }

    def _statistics_report(self, statistics: ClientStatisticsNoise) -> dict[str, Any]:
        """The privacy entry of an imputation run: each client's guarantee from its own
        accountant, the statistics noise and the public terms it was released under."""
        delta = self.spec.delta
        guarantees = {
            name: guarantee
            for name, accountant in statistics.accountants.items()
            if (guarantee := accountant.statistics_guarantee(name, delta=delta)) is not None
        }
        return {
            **self._source_entry(),
            "accountant": "rdp",
            "delta": delta,
            "adjacency": ADJACENCY_TEXT["add-remove"],
            "sampling": {"kind": "none", "rate": 1.0},
            "sample_rate": 1.0,
            "noise": {
                "statistics": {"sigma": statistics.noise_multiplier, "clip": statistics.clip}
            },
            "noise_shares": statistics.shares,
            "standard_bound": statistics.standard_bound,
            "ranges": self._ranges_note,
            "epsilon": {name: g.epsilon for name, g in guarantees.items()},
            "guarantees": {name: [g.to_json()] for name, g in guarantees.items()},
            "releases": {
                name: {"statistics": len(statistics.accountants[name].events)}
                for name in guarantees
            },
            "target_epsilon": self.spec.target_epsilon,
        }


def release_plan(method: str, config: MethodConfig, parties: int) -> list[dict[str, int]]:
    """Per party, the most releases of each kind it makes in one training step of ``method``:
    what the target epsilon is calibrated for (the report's guarantees count the releases
    actually made). A representation to the aggregator or another party is one embedding
    release per request; a head sends one gradient message per other party and task chunk
    (``vectorised=False`` chunks a step's tasks by size); DP-SGD steps once per step; under
    ``release="dp"`` a LASER data party other than the label party makes one exposed-row
    release per step (its contribution is sealed once). ConfigError for a method whose
    messages are not planned here.
    """
    chunks = 1 if config.vectorised else parties
    subsets = [
        subset
        for size in range(1, parties + 1)
        for subset in itertools.combinations(range(parties), size)
    ]
    plan = []
    for k in range(parties):
        exposure = 0
        if method == "combinatorial":
            embedding = sum(1 for subset in subsets if k in subset)
            gradient = sum(len(subset) - 1 for subset in subsets if subset[0] == k)
        elif method == "laser":
            embedding = 1
            holds_head = config.heads == "all" or k == 0
            gradient = (parties - 1) * chunks if holds_head else 0
            # its exposed rows of a step are sealed once (the label party's never are)
            exposure = int(config.release == "dp" and k != 0)
        elif method in ("local", "ensemble"):
            embedding, gradient = 1, 0
        elif method in ("standard", "plugvfl"):
            embedding, gradient = 1, (parties - 1 if k == 0 else 0)
        else:
            raise ConfigError(
                f"differential privacy plans the releases of laser, local, ensemble, standard, "
                f"plugvfl and combinatorial; found --method {method}."
            )
        plan.append(
            {"embedding": embedding, "gradient": gradient, "dp-sgd": 1, "exposure": exposure}
        )
    return plan
