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
Each party's mechanisms, accountant and pricing are one
:class:`~protocols.party_privacy.PartyPrivacy`, built from its share of the plan
(:class:`~protocols.party_privacy.PartyPlan`). In a deployment the label party's engine draws
the plan before any party is set up (:meth:`PrivacyEngine.plan_parties`), each data party
builds its own half in its own process from its share, and the figures it reports at the end
are added (:meth:`PrivacyEngine.take_reports`): the same code prices every party either way.

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

import dataclasses
import itertools
import json
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from protocols.dp import (
    ADJACENCIES,
    ADJACENCY_TEXT,
    GRAD_SAMPLE_MODES,
    NEGLIGIBLE_NOISE,
    ROW_SHIFT,
    PrivacyAccountant,
    calibrate_noise,
    calibrate_per_record,
)
from protocols.noise import NoiseSource, noise_source
from protocols.party_privacy import PartyPlan, PartyPrivacy, read_entry, sampling_text
from protocols.sum_range import ADVICE, RUN_DRAWS_BITS, TAIL_SIGMAS, SumRange, sum_range
from secure_vfl import checks
from secure_vfl.data.samplers import BatchSampler, PoissonSampler, poisson_like, poisson_terms
from secure_vfl.errors import ConfigError, ProtocolError, RunWarning
from secure_vfl.experiment import DIVERGENCE_ADVICE
from secure_vfl.federation.aggregator import SumBackend
from secure_vfl.federation.alignment import Aligner, make_aligner
from secure_vfl.federation.channel import Channel
from secure_vfl.federation.parties import DataParty

if TYPE_CHECKING:
    from protocols.dp_statistics import ClientStatisticsNoise, StatisticsPlan
    from secure_vfl.data.imputation import ImputationTask
    from secure_vfl.experiment import TrainConfig
    from secure_vfl.methods.base import MethodConfig

SecureAgg = Literal["none", "masks", "paillier", "ckks"]
SECURE_AGGS: tuple[str, ...] = ("none", "masks", "paillier", "ckks")
ALIGNMENTS: tuple[str, ...] = ("join", "psi")

MECHANISMS = {
    "embedding": "--dp-embeddings",
    "gradient": "--dp-gradients",
    "dp-sgd": "--dp-sgd",
    "exposure": "--release dp",
}
FIELDS = {
    "embedding": "`dp_embeddings` (--dp-embeddings)",
    "gradient": "`dp_gradients` (--dp-gradients)",
    "dp-sgd": "`dp_sgd` (--dp-sgd)",
    "exposure": "`release_noise` (--release-noise)",
}
"""Each mechanism's :class:`PrivacySpec` field and command-line flag, as its refusals name it."""
RELEASES: tuple[str, ...] = ("drop", "dp")
RELEASE_CLIP = 1.0
"""The CLIP of ``--release dp`` when only ``--target-epsilon`` is given (no --release-noise)."""

Noise = tuple[float, float]
STATISTICS = "`dp_statistics` (--dp-statistics)"


IDLE_REPRODUCIBLE_NOISE = (
    "--insecure-reproducible-noise makes DP noise reproducible from the seed; expected a DP "
    "mechanism with it. Found none."
)
"""The refusal of ``insecure_reproducible_noise`` with no mechanism to make reproducible: by
:class:`PrivacyEngine`, which installs a whole run's spec (a spec alone may be a template that
an attack's defenses add DP or secure sums to; so is ``release="dp"`` without secure sums)."""


SCOPE = (
    "each epsilon prices a release given the model state that shaped it: the heads, and bottom "
    "models without DP-SGD, train on values in the clear, and what they learn from one record "
    "and show in later releases about other records is not covered; see docs/privacy.md"
)
"""What a training run's guarantees leave out, in its report and summary: they are conditional
on the un-noised state, which an empirical audit (``benchmarks/dp_audit.py``) probes."""


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
    (:func:`~protocols.dp_sgd.make_private_party`: ``auto``, ``linear`` or Opacus' ``hooks``).

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
        self._check_types()
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
                    f"{FIELDS[name]} needs SIGMA >= 0 and CLIP > 0, both finite. "
                    f"Found {sigma}:{clip}."
                )
        if self.dp_statistics is not None:
            sigma, clip = self.dp_statistics
            if not (sigma > 0 and math.isfinite(sigma)) or not (clip > 0 and math.isfinite(clip)):
                raise ConfigError(
                    f"{STATISTICS} needs SIGMA > 0 and CLIP > 0, both finite. Found {sigma}:{clip}."
                )
            if self.noise():
                raise ConfigError(
                    f"{STATISTICS} protects imputation statistics, the other mechanisms "
                    "training; expected one kind, found both "
                    f"({', '.join(FIELDS[kind] for kind in self.noise())})."
                )
        elif self.feature_ranges is not None:
            raise ConfigError(
                f"`feature_ranges` (--feature-ranges) bounds the values of {STATISTICS}; "
                f"expected {STATISTICS} with it. Found none."
            )
        if self.target_epsilon is not None and not self.noise() and self.dp_statistics is None:
            raise ConfigError(
                "`target_epsilon` (--target-epsilon) calibrates a mechanism: for training, "
                f"expected {FIELDS['embedding']}, {FIELDS['gradient']} or {FIELDS['dp-sgd']}; "
                f"for imputation, expected {STATISTICS} with it. Found none."
            )
        if self.grad_sample_mode not in GRAD_SAMPLE_MODES:
            raise ConfigError(
                f"`grad_sample_mode` must be one of {', '.join(GRAD_SAMPLE_MODES)}. "
                f"Found {self.grad_sample_mode!r}."
            )
        if self.adjacency not in ADJACENCIES:
            raise ConfigError(
                f"`adjacency` must be one of {', '.join(ADJACENCIES)}. Found {self.adjacency!r}."
            )

    def _check_types(self) -> None:
        """Each field of its type (ConfigError naming it), numbers stored as Python's own."""
        values: dict[str, object] = {}
        for name in ("dp_embeddings", "dp_gradients", "dp_sgd", "dp_statistics", "release_noise"):
            noise = getattr(self, name)
            if noise is None:
                continue
            if not (
                isinstance(noise, tuple | list)
                and len(noise) == 2
                and all(isinstance(x, Real) and not isinstance(x, bool) for x in noise)
            ):
                raise ConfigError(
                    f"`{name}` must be a (SIGMA, CLIP) pair of numbers. Found {noise!r}."
                )
            values[name] = (float(noise[0]), float(noise[1]))  # their ranges: checked below
        if self.target_epsilon is not None:
            values["target_epsilon"] = checks.real(
                "target_epsilon", self.target_epsilon, low=0, low_open=True
            )
        if self.feature_ranges is not None:
            values["feature_ranges"] = checks.path("feature_ranges", self.feature_ranges)
        values["delta"] = checks.real(
            "delta", self.delta, low=0, high=1, low_open=True, high_open=True
        )
        values["seed"] = checks.seed("seed", self.seed)
        values["insecure_reproducible_noise"] = checks.flag(
            "insecure_reproducible_noise", self.insecure_reproducible_noise
        )
        for name in ("align", "secure_agg", "adjacency", "grad_sample_mode", "release"):
            checks.text(name, getattr(self, name))
        checks.store(self, values)

    def _check_release(self) -> None:
        if self.release not in RELEASES:
            raise ConfigError(
                f"`release` must be one of {', '.join(RELEASES)}. Found {self.release!r}."
            )
        if self.release == "drop":
            if self.release_noise is not None:
                raise ConfigError(
                    f"{FIELDS['exposure']} is the noise of `release` 'dp' (--release dp); found "
                    "it with 'drop' (--release drop, the default)."
                )
            return
        if self.release_noise is None and self.target_epsilon is None:
            raise ConfigError(
                "`release` 'dp' (--release dp) needs its noise: expected "
                f"{FIELDS['exposure']} or `target_epsilon` (--target-epsilon). Found neither."
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

    def to_json(self) -> dict[str, Any]:
        """Every field as chosen, as JSON (tuples as lists, anything else not JSON's own as
        its text): ``result.json``'s ``config.privacy``."""
        return dict(json.loads(json.dumps(dataclasses.asdict(self), default=str)))


class PrivacyEngine:
    """Installs a :class:`PrivacySpec` into a run: the backend, then each party's mechanisms."""

    def __init__(self, spec: PrivacySpec) -> None:
        self.spec = checks.instance("spec", spec, PrivacySpec)
        self.noise: dict[str, Noise] = spec.noise()
        if spec.insecure_reproducible_noise and not self.noise and spec.dp_statistics is None:
            raise ConfigError(IDLE_REPRODUCIBLE_NOISE)
        if spec.release == "dp" and spec.secure_agg == "none":
            raise ConfigError(
                "--release dp sends with DP noise what a secure sum cannot hide; expected "
                "--secure-agg masks, paillier or ckks with it. Found --secure-agg none."
            )
        self.sample_rate: float | None = None
        self._sampler: PoissonSampler | None = None
        self._ahead = False  # the sample was drawn by plan_parties, before the run
        self._names: list[str] = []
        self._plan: dict[str, dict[str, int]] = {}  # each party's releases per step, planned
        self._parties: dict[str, PartyPlan] = {}  # each party's share of the plan
        self._halves: dict[str, PartyPrivacy] = {}  # the parties hosted here, installed
        self._reported: dict[str, dict[str, Any]] = {}  # what the others reported (deployed)
        self._statistics: ClientStatisticsNoise | None = None  # in one process
        self._deployed_statistics: StatisticsPlan | None = None  # a deployment's plan
        self._statistics_reported: dict[str, dict[str, Any]] = {}  # its clients' reports
        self._statistics_clients: list[str] = []  # the clients it was planned for
        self._statistics_records: int | None = None  # every client's training rows
        self.value_range: SumRange | None = None
        self._resumed_at = 0  # the step a resumed run goes on from (make_private)
        self._ranges_note = ""
        if spec.align == "psi":
            import protocols.psi  # noqa: F401  (registers the `psi` aligner)

    @property
    def accountants(self) -> dict[str, PrivacyAccountant]:
        """Each hosted party's accountant, by party (read-only use: the parties hold them)."""
        return {name: half.accountant for name, half in self._halves.items()}

    @property
    def poisson(self) -> PoissonSampler | None:
        """The Poisson sampler of a private training run (None before :meth:`sampler`)."""
        return self._sampler

    @property
    def private(self) -> bool:
        """Whether any DP mechanism is asked for (of training or of imputation statistics)."""
        return bool(self.noise) or self.spec.dp_statistics is not None

    def aligner(
        self, channel: Channel | None = None, *, progress: Callable[[int], object] | None = None
    ) -> Aligner:
        """The alignment of the parties' ids: the plain join, or PSI between the label party and
        each data party whose messages cross ``channel`` (a fresh in-process one by default);
        ``progress`` is told the points PSI masks as it goes (a progress bar's update)."""
        if self.spec.align == "psi":
            from protocols.psi import PsiAligner

            return PsiAligner(channel=channel, progress=progress)
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

    def refuse(self, config: TrainConfig) -> None:
        """Refuse, before anything is built, a training run whose ``config`` disagrees with the
        spec (on the alignment, or on secure sums: its method plans only sums a secure backend
        can hide, ``MethodConfig.secure_sums``, exactly when the spec names one) or whose
        method cannot host the mechanisms asked for."""
        method, batching = config.method, config.method_config.batching
        if config.align != self.spec.align:
            raise ConfigError(
                f"the privacy spec aligns the ids by {self.spec.align!r}, the training config by "
                f"{config.align!r}; expected the same alignment in both "
                "(PrivacySpec(align=...) and TrainConfig(align=...))."
            )
        secure_sums = config.method_config.secure_sums
        if secure_sums is not self.spec.secure_sums:
            raise ConfigError(
                f"PrivacySpec(secure_agg={self.spec.secure_agg!r}) expected with "
                f"MethodConfig(secure_sums={secure_sums}): a method plans only sums a secure "
                "backend can hide exactly when the spec names one (masks, paillier or ckks). "
                "Found them disagreeing."
            )
        if (config.method_config.release == "dp") != (self.spec.release == "dp"):
            raise ConfigError(  # else the method plans rows that no party can noise, or none
                f"the privacy spec's release={self.spec.release!r} and the method's "
                f"release={config.method_config.release!r} must agree (the method plans the "
                "exposed rows, the parties noise them): PrivacySpec(release=...) and "
                "MethodConfig(release=...), as --release sets both."
            )
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
        pretrain_epochs = config.method_config.pretrain_epochs
        if self.spec.dp_sgd is not None and pretrain_epochs > 0:
            raise ConfigError(  # else the model guarantee priced a model trained in the clear
                "--dp-sgd prices a party's bottom model for whoever sees it, and "
                "--pretrain-epochs first trains that model on the party's own training rows "
                "(SimSiam) without noise, which no epsilon bounds; expected --pretrain-epochs 0 "
                f"with --dp-sgd. Found --pretrain-epochs {pretrain_epochs}."
            )
        if self.spec.dp_gradients is not None and method in ("local", "ensemble"):
            raise ConfigError(
                "--dp-gradients noises the gradients a head sends to other parties; "
                f"{method} sends none (each party trains its own head on its own block). "
                "Expected --dp-embeddings or --dp-sgd. Found --dp-gradients."
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

    def sampler(
        self,
        sampler: BatchSampler,
        *,
        n: int,
        epochs: int,
    ) -> BatchSampler:
        """With a DP mechanism of training, the Poisson sampler that replaces the method's
        ``sampler`` (same rows, rate batch_size / rows, same steps per epoch; the whole schedule
        drawn now from the engine's sampling generator, or before, by :meth:`plan_parties`);
        else ``sampler`` unchanged."""
        if not self.noise:
            return sampler
        if self._ahead:  # drawn before the parties were set up (a deployment)
            self._check_drawn(sampler, n=n, epochs=epochs)
            assert self._sampler is not None
            return self._sampler
        rng = self._noise_source(1).numpy_generator()
        self._sampler = poisson_like(sampler, n=n, epochs=epochs, rng=rng)
        self.sample_rate = self._sampler.rate
        return self._sampler

    def _check_drawn(self, sampler: BatchSampler, *, n: int, epochs: int) -> None:
        """ConfigError unless the sample drawn before stands for ``sampler``'s batches."""
        drawn = self._sampler
        assert drawn is not None
        rows, rate, steps = poisson_terms(sampler)
        if not (
            np.array_equal(rows, drawn.rows)
            and (rate, steps, n, epochs)
            == (drawn.rate, drawn.steps_per_epoch, drawn.n, len(drawn.epochs))
        ):
            raise ConfigError(
                "the privacy plan's Poisson sample was drawn for other batches than the method "
                f"trains on: rate {drawn.rate:g}, {drawn.steps_per_epoch} steps per epoch "
                f"planned; found rate {rate:g}, {steps} steps per epoch."
            )

    def plan_parties(
        self,
        sampler: BatchSampler,
        *,
        n: int,
        epochs: int,
        method: str,
        method_config: MethodConfig,
        names: Sequence[str],
        predictions: int,
        resumed: Callable[[PoissonSampler], None] | None = None,
    ) -> dict[str, dict[str, Any] | None]:
        """A deployed label party's plan, before it sets the other parties up: the Poisson
        sample drawn for the method's ``sampler`` (its training set of ``n`` rows), SIGMA
        calibrated, and each party of ``names`` but the first (the label party, hosted here)
        given its :class:`~protocols.party_privacy.PartyPlan` as JSON for its ``setup`` (None
        each without DP). The run then trains on that sample (:meth:`sampler`). A resumed run
        passes ``resumed``, which puts the killed run's sample into the one drawn, so that SIGMA
        is calibrated to the schedule the run trains on, as the killed run's was."""
        if not self.noise:
            return {name: None for name in names[1:]}
        self.sampler(sampler, n=n, epochs=epochs)
        if resumed is not None:
            assert self._sampler is not None
            resumed(self._sampler)
        self._ahead = True
        self._decide(method, method_config, names, predictions)
        return {name: self._parties[name].to_json() for name in names[1:]}

    def make_private(
        self,
        parties: list[DataParty],
        *,
        method: str,
        method_config: MethodConfig,
        predictions: int,
        resumed_at: int = 0,
    ) -> None:
        """Install every mechanism inside the party it protects, each with its own accountant
        and noise source (:class:`~protocols.party_privacy.PartyPrivacy`); calibrate SIGMA
        first when a target epsilon is given (after :meth:`sampler`, whose schedule the
        calibration reads), unless :meth:`plan_parties` did. ``resumed_at``: the step a
        resumed run goes on from (:meth:`_noise_source`)."""
        self._resumed_at = resumed_at
        if not self.noise:
            return
        sampler = self._sampler
        if sampler is None:
            raise ConfigError(
                "a private run trains on the engine's Poisson sampler; expected "
                "PrivacyEngine.sampler(...) before make_private. Found none."
            )
        if not self._ahead:
            self._decide(method, method_config, [party.name for party in parties], predictions)
        for party in parties:
            if party.name not in self._parties:
                raise ConfigError(
                    f"{party.name} is not a party of the privacy plan ({', '.join(self._names)})."
                )
            half = PartyPrivacy(
                party.name,
                self._parties[party.name],
                noise=self._party_noise(self._names.index(party.name)),
                schedule=lambda: sampler.schedule,
                sampling=sampling_text(
                    sampler.rate, sampler.draws, sampler.steps_per_epoch, self._source_text()
                ),
                source=self._source_text(),
            )
            half.install(party)
            self._halves[party.name] = half

    def _decide(
        self, method: str, method_config: MethodConfig, names: Sequence[str], predictions: int
    ) -> None:
        """The plan of the parties ``names`` (the label party first): their releases per step,
        SIGMA (calibrated to a target epsilon, over the training steps and the ``predictions``
        test splits the run predicts), the sums' range, and each party's share."""
        if isinstance(predictions, bool) or not isinstance(predictions, int) or predictions < 0:
            raise ConfigError(f"`predictions` must be an integer >= 0. Found {predictions!r}.")
        sampler = self._sampler
        assert sampler is not None
        if ("exposure" in self.noise) != (method_config.release == "dp"):
            raise ConfigError(
                f"the privacy spec's release={self.spec.release!r} and the method's "
                f"release={method_config.release!r} must agree (the method plans the exposed "
                "rows, the parties noise them)."
            )
        plan = release_plan(method, method_config, len(names))
        if self.spec.target_epsilon is not None:
            sigma = self._calibrated_sigma(sampler, plan, predictions)
            self.noise = {kind: (sigma, clip) for kind, (_, clip) in self.noise.items()}
        self.value_range = sum_range(self.noise, contributors=len(names))
        self._names = list(names)
        self._plan = dict(zip(names, plan, strict=True))
        ends = tuple(int(end) for end in np.cumsum([len(epoch) for epoch in sampler.epochs]))
        self._parties = {
            name: PartyPlan(
                noise={
                    kind: noise
                    for kind, noise in self.noise.items()
                    if kind != "gradient" or releases["gradient"] > 0
                },
                sample_rate=sampler.rate,
                draws=sampler.draws,
                epoch_ends=ends,
                records=sampler.n,
                delta=self.spec.delta,
                adjacency=self.spec.adjacency,
                grad_sample_mode=self.spec.grad_sample_mode,
                value_range=self.value_range,
            )
            for name, releases in self._plan.items()
        }

    def take_reports(self, reports: Mapping[str, Any]) -> None:
        """What each deployed data party reported about its own releases at the end of the run
        (:meth:`~protocols.party_privacy.PartyPrivacy.entry`, by party), checked
        (ProtocolError), for :meth:`report`. A planned party that reports nothing (lost mid-run)
        is listed as unreported."""
        for name, entry in reports.items():
            if name not in self._parties or name in self._halves:
                if entry is None:
                    continue
                raise ProtocolError(
                    f"report from {name}: a privacy entry from a party the plan did not send one."
                )
            if entry is None:
                raise ProtocolError(
                    f"report from {name}: its privacy entry expected (it was sent a privacy plan); "
                    "found none."
                )
            self._reported[name] = read_entry(name, entry, delta=self.spec.delta)

    def _calibrated_sigma(
        self, sampler: PoissonSampler, plan: list[dict[str, int]], predictions: int
    ) -> float:
        """One SIGMA for every mechanism that keeps each party's every guarantee within the
        target: against the receivers, its planned releases per step times the most steps any
        record is used in (the schedule is drawn already), composed per record; for the test
        records, with embedding DP, one release per test split (``predictions``) and one more
        per split where its exposed rows are released (``release="dp"``); with DP-SGD, also the
        Poisson-amplified steps against the model's observer."""
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
        per_split = sum(
            kind in self.noise and any(releases[kind] for releases in plan)
            for kind in ("embedding", "exposure")
        )
        if per_split and predictions:
            sigma = max(
                sigma,
                calibrate_per_record(target, delta, releases=predictions * per_split, shift=shift),
            )
        if "dp-sgd" in self.noise:
            sigma = max(
                sigma,
                calibrate_noise(target, delta, sample_rate=sampler.rate, steps=sampler.draws),
            )
        return sigma

    def _party_noise(self, k: int) -> Callable[[int], NoiseSource]:
        """Party ``k``'s noise sources by mechanism stream (:func:`_noise_source`)."""
        return lambda stream: self._noise_source(stream + k)

    def _noise_source(self, stream: int) -> NoiseSource:
        """A fresh secure noise source; only under ``insecure_reproducible_noise``, one
        regenerated from (seed, ``stream``), and in a run resumed at step t > 0 from (seed,
        ``stream``, t): no checkpoint keeps a stream's state, and restarted from the seed it
        drew again the noise of the killed run's first steps."""
        if not self.spec.insecure_reproducible_noise:
            return noise_source(None)
        return noise_source(
            [self.spec.seed, stream, *([self._resumed_at] if self._resumed_at else [])]
        )

    def statistics_mechanisms(self, task: ImputationTask) -> ClientStatisticsNoise | None:
        """The factory of each client's own statistics mechanism for ``task`` (None without
        ``dp_statistics``), which the imputation federation installs inside every client;
        ConfigError if the spec asks for a mechanism of training, which would protect nothing.

        SIGMA is calibrated to the target epsilon over the three releases (sample rate 1: the
        statistics cover every row); the noise is shared among the clients only under secure
        sums (the server then sees nothing but the sum), else every client adds all of it;
        values are clipped to the declared ranges, or to the observed ones (not private).
        """
        if not self._statistics_asked():
            return None
        from protocols.dp_statistics import (
            ClientStatisticsNoise,
            observed_ranges,
            read_feature_ranges,
        )

        sigma, clip = self._statistics_noise()
        if self.spec.feature_ranges is not None:
            ranges = read_feature_ranges(self.spec.feature_ranges, task.features)
            self._ranges_note = f"declared in {self.spec.feature_ranges}"
        else:
            ranges = observed_ranges(task.train)
            self._ranges_note = (
                "observed training ranges (an experiment's stand-in for declared ranges; not "
                "private: pass --feature-ranges)"
            )
        self._statistics_records = sum(client.values.shape[0] for client in task.train)
        self._statistics = ClientStatisticsNoise(
            sigma,
            clip,
            ranges=ranges,
            shares=len(task.train) if self.spec.secure_sums else 1,
            noise=lambda k: self._noise_source(300 + k),
        )
        return self._statistics

    def statistics_plan(
        self, features: Sequence[str], clients: Sequence[str], *, records: int | None = None
    ) -> StatisticsPlan | None:
        """The plan from which every client of a deployed imputation makes its own statistics
        mechanism in its own process (None without ``dp_statistics``): the SIGMA and CLIP of
        :meth:`statistics_mechanisms`, the noise shared among the ``clients`` (their names)
        under secure sums, and the ranges declared in ``feature_ranges`` for ``features``;
        ``records``: the clients' training rows (each told the coordinator its count), what
        the report weighs delta against.
        ConfigError without declared ranges (observed ones would take every client's extreme
        values, which are not private) or with reproducible noise (noise anyone with the seed
        can remove)."""
        if not self._statistics_asked():
            return None
        from protocols.dp_statistics import StatisticsPlan, read_feature_ranges

        if self.spec.feature_ranges is None:
            raise ConfigError(
                "a deployed imputation clips the clients' values to declared ranges: expected "
                "--feature-ranges CSV with --dp-statistics (observed ranges would take every "
                "client's extreme values, which are not private). Found none."
            )
        if self.spec.insecure_reproducible_noise:
            raise ConfigError(
                "--insecure-reproducible-noise is refused in a deployment: each client draws "
                "its noise from its own operating-system entropy."
            )
        sigma, clip = self._statistics_noise()
        self._ranges_note = f"declared in {self.spec.feature_ranges}"
        self._statistics_clients = list(clients)
        self._statistics_records = records
        self._deployed_statistics = StatisticsPlan(
            noise_multiplier=sigma,
            clip=clip,
            shares=len(clients) if self.spec.secure_sums else 1,
            ranges=read_feature_ranges(self.spec.feature_ranges, features),
            delta=self.spec.delta,
        )
        return self._deployed_statistics

    def take_statistics_reports(self, reports: Mapping[str, Any]) -> None:
        """What each client of a deployed imputation reported about its own releases at the
        end of the run (:meth:`~protocols.dp_statistics.ServedStatistics.entry`, by client),
        checked (ProtocolError), for :meth:`report`. A client lost mid-run reports nothing and
        is listed as unreported."""
        from protocols.dp_statistics import read_statistics_entry

        for name, entry in reports.items():
            if entry is None:
                raise ProtocolError(
                    f"report from {name}: its privacy entry expected (it was sent a statistics "
                    "plan); found none."
                )
            self._statistics_reported[name] = read_statistics_entry(
                name, entry, delta=self.spec.delta
            )

    def _statistics_asked(self) -> bool:
        """Whether the statistics are protected (ConfigError if the spec also asks for a
        mechanism of training, which an imputation run would not apply)."""
        if self.noise:
            found = ", ".join(MECHANISMS[kind] for kind in self.noise)
            raise ConfigError(
                "an imputation run releases statistics, protected by --dp-statistics; "
                f"expected no mechanism of training. Found {found}."
            )
        return self.spec.dp_statistics is not None

    def _statistics_noise(self) -> Noise:
        """(SIGMA, CLIP) of the statistics: SIGMA as given, or calibrated to the target epsilon
        over the three releases (sample rate 1: the statistics cover every row)."""
        from protocols.dp_statistics import STATISTICS_RELEASES

        assert self.spec.dp_statistics is not None
        sigma, clip = self.spec.dp_statistics
        if self.spec.target_epsilon is not None:
            sigma = calibrate_noise(
                self.spec.target_epsilon,
                self.spec.delta,
                sample_rate=1.0,
                steps=STATISTICS_RELEASES,
            )
        return sigma, clip

    def settings(self) -> dict[str, Any]:
        """The protection chosen (:meth:`PrivacySpec.to_json`)."""
        return self.spec.to_json()

    def divergence_advice(self) -> str:
        """What to try when training diverged: under DP noise, the noise and clipping first."""
        return ADVICE if self.noise else DIVERGENCE_ADVICE

    def report(self) -> dict[str, Any] | None:
        """``result.json``'s privacy entry (None when no DP mechanism ran): each party's
        guarantees from its own accountant (what each protects, against whom, under which
        adjacency, sampling and accountant, and its epsilon), its headline ``epsilon`` (the
        largest of them, over what it noised), ``unguarded`` (by party, what it sends without
        noise, :meth:`_unguarded`: no epsilon bounds that, so the run's worst party is at inf
        while any is listed), the noise, the sampling and the releases made; the target and
        ``within_target`` are of the guarantees priced. ``accounted_by`` says whose
        accountant each party's figures come from: in a deployment every data party's are what
        it reported about itself (:meth:`take_reports`)."""
        if self._statistics is not None or self._deployed_statistics is not None:
            return self._statistics_report()
        if not self.noise:
            return None
        sampler = self._sampler
        assert sampler is not None
        entries = self._entries()
        guarantees = {n: e["guarantees"] for n, e in entries.items() if e["guarantees"]}
        epsilon = {n: max(g["epsilon"] for g in held) for n, held in guarantees.items()}
        target = self.spec.target_epsilon
        entry = {
            **self._source_entry(),
            "accountant": "rdp",
            "delta": self.spec.delta,
            "adjacency": ADJACENCY_TEXT[self.spec.adjacency],
            "sampling": {
                "kind": "poisson",
                "records": sampler.n,
                "rate": sampler.rate,
                "draws": sampler.draws,
                "steps": len(sampler.schedule),
                "most_steps_per_record": int(sampler.uses().max()),
                "drawn_from": self._source_text(),
            },
            "sample_rate": sampler.rate,
            "noise": {kind: {"sigma": s, "clip": c} for kind, (s, c) in self.noise.items()},
            "epsilon": epsilon,
            "unguarded": self._unguarded(),
            "scope": SCOPE,
            "epsilon_per_epoch": {
                n: e["epsilon_per_epoch"] for n, e in entries.items() if e["epsilon_per_epoch"]
            },
            "guarantees": guarantees,
            "releases": {n: e["releases"] for n, e in entries.items() if e["releases"]},
            "releases_per_step_planned": {
                name: {kind: plan[kind] for kind in self.noise} for name, plan in self._plan.items()
            },
            "accounted_by": self._accounted_by(),
            "not_noised": self._not_noised(),
            "release": self.release_entry(),
            "sum_range": self._range_entry(),
            "target_epsilon": target,
            "within_target": None
            if target is None
            else all(e <= target * (1 + 1e-9) for e in epsilon.values()),
        }
        _warn_of_weak_guarantees(
            entry, {MECHANISMS[kind]: s for kind, (s, _) in self.noise.items()}
        )
        return entry

    def _entries(self) -> dict[str, dict[str, Any]]:
        """Each party's priced releases (its own half here, or what it reported), in the
        plan's order of parties."""
        priced = {name: half.entry() for name, half in self._halves.items()}
        priced.update(self._reported)
        return {name: priced[name] for name in self._names if name in priced}

    def _accounted_by(self) -> dict[str, str]:
        """Whose accountant each planned party's figures come from."""
        found = {}
        for name in self._names:
            if name in self._halves:
                found[name] = "its own accountant, in this process"
            elif name in self._reported:
                found[name] = (
                    "its own accountant in its own process: the figures it reported about "
                    "itself at the end of the run"
                )
            else:
                found[name] = (
                    "none: it reported nothing (lost mid-run; see faults), so no figure of it "
                    "is listed"
                )
        return found

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
            "exposed_releases": {name: e["exposed"] for name, e in self._entries().items()},
        }

    def _unguarded(self) -> dict[str, list[str]]:
        """By party, what its plan sends every step that no noise covers (its representations,
        or its gradients back to the data parties): crossing in the clear, it has no epsilon.
        A secure sum may hide it from the receiver, but not by DP; the label party's own
        representation under secure sums goes sealed into the sums only it opens."""
        names = {"embedding": "representations", "gradient": "gradients"}
        found = {}
        for name, plan in self._plan.items():
            clear = [names[k] for k in names if plan.get(k) and k not in self.noise]
            if self.spec.secure_sums and name == self._names[0] and "representations" in clear:
                clear.remove("representations")  # sealed for itself alone: nobody sees it
            if clear:
                found[name] = clear
        return found

    def _not_noised(self) -> list[str]:
        """What crosses a party boundary in the clear, so that no guarantee covers it (of what
        the method sends: local and ensemble send no gradient)."""
        sent = {kind for plan in self._plan.values() for kind, count in plan.items() if count}
        sent = sent if self._plan else {"embedding", "gradient"}
        found = []
        if "embedding" not in self.noise and "embedding" in sent:
            found.append(
                "representations: sent without noise, so no guarantee covers a party's "
                "features against their receiver (the aggregator or the label party)"
            )
        if "gradient" not in self.noise and "gradient" in sent:
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

    def _statistics_report(self) -> dict[str, Any]:
        """The privacy entry of an imputation run: each client's guarantee from its own
        accountant (in this process, or as a deployed client reported it from its own), the
        statistics noise and the public terms it was released under."""
        delta = self.spec.delta
        terms: ClientStatisticsNoise | StatisticsPlan
        if self._statistics is not None:
            terms = self._statistics
            guarantees = {
                name: guarantee.to_json()
                for name, accountant in terms.accountants.items()
                if (guarantee := accountant.statistics_guarantee(name, delta=delta)) is not None
            }
            releases = {name: len(a.events) for name, a in terms.accountants.items()}
        else:
            assert self._deployed_statistics is not None
            terms = self._deployed_statistics
            reported = self._statistics_reported
            guarantees = {
                name: e["guarantees"][0] for name, e in reported.items() if e["guarantees"]
            }
            releases = {name: e["releases"]["statistics"] for name, e in reported.items()}
        entry = {
            **self._source_entry(),
            "accountant": "rdp",
            "delta": delta,
            "adjacency": ADJACENCY_TEXT["add-remove"],
            "sampling": {
                "kind": "none",
                "rate": 1.0,
                # every client's training rows: what delta is weighed against
                **({"records": n} if (n := self._statistics_records) else {}),
            },
            "sample_rate": 1.0,
            "noise": {"statistics": {"sigma": terms.noise_multiplier, "clip": terms.clip}},
            "noise_shares": terms.shares,
            "standard_bound": terms.standard_bound,
            "ranges": self._ranges_note,
            "epsilon": {name: g["epsilon"] for name, g in guarantees.items()},
            "guarantees": {name: [g] for name, g in guarantees.items()},
            "releases": {name: {"statistics": releases[name]} for name in guarantees},
            "target_epsilon": self.spec.target_epsilon,
        }
        _warn_of_weak_guarantees(entry, {"--dp-statistics": terms.noise_multiplier})
        if self._statistics is None:
            entry["accounted_by"] = {
                name: (
                    "its own accountant in its own process: the figures it reported about "
                    "itself at the end of the run"
                    if name in self._statistics_reported
                    else "none: it reported nothing (lost mid-run; see faults), so no figure of "
                    "it is listed"
                )
                for name in self._statistics_clients
            }
        return entry


def _warn_of_weak_guarantees(entry: Mapping[str, Any], sigmas: Mapping[str, float]) -> None:
    """RunWarnings for a privacy report whose figures protect nothing: a party with epsilon inf
    (a noise multiplier of 0, or below :data:`~protocols.dp.NEGLIGIBLE_NOISE`, adds no noise),
    noise reproducible from the seed, an imputation's clipping ranges observed in the data (not
    private), and a delta not below 1/n for n training records (a mechanism that publishes a
    few records outright meets such a guarantee). ``sigmas``: each mechanism's noise multiplier
    by the flag that sets it."""
    unbounded = sorted(name for name, epsilon in entry["epsilon"].items() if math.isinf(epsilon))
    if unbounded:
        silent = [
            f"{flag} SIGMA {sigma:g}" for flag, sigma in sigmas.items() if sigma < NEGLIGIBLE_NOISE
        ]
        cause = f" ({', '.join(silent)}: no noise)" if silent else ""
        warnings.warn(
            f"epsilon is inf for {', '.join(unbounded)}{cause}: the run holds no differential "
            "privacy guarantee; expected a noise multiplier SIGMA > 0 (or --target-epsilon).",
            RunWarning,
            stacklevel=3,
        )
    if entry.get("insecure_reproducible_noise"):
        warnings.warn(
            "--insecure-reproducible-noise: the noise is reproducible from the seed; these "
            "epsilons do not hold against anyone who knows it.",
            RunWarning,
            stacklevel=3,
        )
    ranges = entry.get("ranges")
    if isinstance(ranges, str) and "not private" in ranges:  # an imputation's observed ranges
        warnings.warn(f"the feature ranges are the {ranges}.", RunWarning, stacklevel=3)
    records = entry["sampling"].get("records")
    if records and entry["delta"] >= 1 / records:
        warnings.warn(
            f"delta {entry['delta']:g} is not below 1/n = 1/{records} (n: the training records): "
            "at such a delta a mechanism that publishes a few records outright meets the "
            "guarantee; choose --delta well below 1/n.",
            RunWarning,
            stacklevel=3,
        )


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
        elif method in ("standard", "plugvfl"):  # the label party's own stays inside it
            embedding, gradient = (0, parties - 1) if k == 0 else (1, 0)
        else:
            raise ConfigError(
                f"differential privacy plans the releases of laser, local, ensemble, standard, "
                f"plugvfl and combinatorial; found --method {method}."
            )
        plan.append(
            {"embedding": embedding, "gradient": gradient, "dp-sgd": 1, "exposure": exposure}
        )
    return plan
