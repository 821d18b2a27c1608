"""Differential privacy: clipped Gaussian releases as channel layers, DP-SGD, and their accounting.

Mechanisms and accounting are kept apart (as Opacus keeps its math in ``accountants/``): each
mechanism emits one small immutable :class:`GaussianRelease` event per noisy release, and a
:class:`PrivacyAccountant` prices a party's events as the *guarantees* they give, each against a
named observer, under a stated adjacency and sampling, with Opacus' RDP (Mironov 2017; Mironov
et al. 2019) or PRV (Gopi et al. 2021) accountant. Noise comes from :mod:`protocols.noise`
(AES-128-CTR keyed from the operating system, never from the run's seed).

Mechanisms (the Gaussian mechanism, Dwork & Roth 2014, Thm A.1, on rows clipped to L2 norm C):

- :class:`EmbeddingNoise` clips every row of a data party's representations and adds
  N(0, (sigma C)^2) per coordinate; it protects that party's features from the receiver, and the
  privacy is spent by the sending data party.
- :class:`GradientNoise` does the same to the gradients a head sends back; they carry its labels,
  so it protects them from the data party receiving them, and the privacy is spent by the head
  (label) party. A gradient the label party sends to its own bottom model crosses no boundary
  and is left alone.
- :func:`protocols.dp_sgd.make_private_party` runs DP-SGD (Abadi et al., CCS 2016) on a data
  party's bottom model with Opacus in the split pattern: ``representation.backward(grad)`` yields
  per-sample gradients, which are clipped and noised at each optimiser step. It lives in its own
  module, as does every import of Opacus here (inside the functions that price): a run without
  DP never pays the seconds that importing Opacus takes.

**Joint events.** All releases one party makes about the same records in one step are one
Gaussian mechanism. Release i of a step clips each row to C_i and adds N(0, (sigma_i C_i)^2);
under an adjacency that moves one record's clipped row by at most ``shift * C_i`` (``shift`` = 2
for *replace one record*, i.e. its features and, at the label party, its label; 1 for
*add/remove*), the concatenation of the step's releases, each divided by its noise std, is a
spherical unit Gaussian whose mean moves by at most ``shift * sqrt(sum_i sigma_i^-2)``. Its
effective noise multiplier is therefore ``z = 1 / (shift * sqrt(sum_i sigma_i^-2))``
(:func:`joint_noise_multiplier`). Examples: the label party's gradient messages to K-1 data
parties about one batch (each clipped to C, noise sigma C) have z = sigma / (2 sqrt(K-1)) under
replace-one and sigma / sqrt(K-1) under add/remove; a data party's embedding (sigma_e) and DP-SGD
step (sigma_s) of one batch have z = 1 / (shift sqrt(sigma_e^-2 + sigma_s^-2)). A DP-SGD step's
sum of clipped per-sample gradients moves by shift * C like one row.

**Guarantees, by observer** (:class:`Guarantee`). The parties that *receive* a party's messages
know which rows every step used (the label party plans the batches and asks each data party for
its rows; the data parties see the rows of every gradient), so subsampling hides nothing from
them and gives no amplification. Against them a record r is protected by the composition of the
joint events of the steps that used it: Gaussian mechanisms compose exactly (Dong, Roth & Su
2019, GDP), so the record's privacy is one Gaussian mechanism with ``z_r = 1 / sqrt(S_r)``, where
``S_r = sum over the steps t that used r of sum_i (shift / sigma_i)^2``; the guarantee is that of
the worst record (:meth:`PrivacyAccountant.message_guarantee`). Whoever sees only a party's
trained bottom model, not the batches or messages, is the observer DP-SGD's usual proof is
about: a Poisson-subsampled Gaussian per step under add/remove, with amplification, which holds
because the Poisson sample is drawn from the secure generator (:meth:`model_guarantee`).
Representations sent at prediction time concern the test records they are computed for, priced
per test record as the training messages (:meth:`prediction_guarantee`).

Assumptions stated, not hidden: each release is priced given the state that shaped it (its
sender's models, and what other parties sent); state that is updated without noise (a head, or
a bottom model without DP-SGD) is outside these guarantees. Add/remove prices a record's own row
only, which holds for the rows because a private run divides each batch's loss by the expected
size of its Poisson draw (:func:`~secure_vfl.data.samplers.loss_normaliser`), so no other row
rescales when a record is added; but the receivers see which ids each step used, so replace-one
(the default) is the adjacency that holds against them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch import Tensor

from protocols.noise import NoiseSource
from secure_vfl.errors import ConfigError
from secure_vfl.federation.messages import (
    GradientMessage,
    Message,
    RepresentationMessage,
    RepresentRequest,
)
from secure_vfl.io import plain_number

ReleaseKind = Literal["embedding", "gradient", "dp-sgd", "statistics", "exposure"]
GradSampleMode = Literal["auto", "linear", "hooks"]
AccountantName = Literal["rdp", "prv"]
Adjacency = Literal["replace-one", "add-remove"]

_KINDS: tuple[str, ...] = ("embedding", "gradient", "dp-sgd", "statistics", "exposure")
GRAD_SAMPLE_MODES: tuple[str, ...] = ("auto", "linear", "hooks")
_ACCOUNTANTS: tuple[str, ...] = ("rdp", "prv")  # Opacus' accountants of these names
ADJACENCIES: tuple[str, ...] = ("replace-one", "add-remove")
ROW_SHIFT: Mapping[str, float] = {"replace-one": 2.0, "add-remove": 1.0}
"""How far one record moves its clipped row, in clip norms, under each adjacency."""
ADJACENCY_TEXT: Mapping[str, str] = {
    "replace-one": "replace one record (its features and, at a label holder, its label)",
    "add-remove": "add or remove one record",
}
NEGLIGIBLE_NOISE = 1e-50
"""A noise multiplier below this prices as none at all (epsilon inf). Its epsilon is beyond any
meaning (5.5e100 at 1e-50 for 10 steps at rate 0.01), and further down the accountant's
arithmetic overflows, divides by a square that underflows to 0 (1e-200) or runs without end
(1e-160). Inf is the safe side of that."""
MESSAGE_KINDS: tuple[str, ...] = ("embedding", "gradient", "dp-sgd")
"""The releases composed per step into a party's guarantee against the receivers of its
messages (charged to every row of the step's batch)."""
ROW_KINDS: tuple[str, ...] = ("exposure",)
"""Releases composed into the same guarantee but charged only to the rows they name (a secure
sum's exposed rows: the other rows of the batch went into sums that hide them)."""

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class GaussianRelease:
    """One noisy release: a Gaussian mechanism whose privacy ``party`` spends.

    ``noise_multiplier`` is the noise std over the clip norm; ``sample_rate`` the rate at which
    the release's records were Poisson-sampled (1: not subsampled); ``round`` the training step
    (or statistics exchange) it belongs to; ``phase`` ``"train"`` (training records) or
    ``"predict"`` (test records, of ``split``, whose rows are ``rows``). A release of a
    secure sum's exposed rows (``"exposure"``) names its rows in either phase. ``attempt``
    counts the runs of its step before it: a resumed run takes again the steps after its
    checkpoint, whose releases the killed run had made too (:meth:`PrivacyAccountant.restore`).
    ``discarded``: a DP-SGD step of such a killed run, whose model the resumed run discarded
    (its later messages, computed with that model, were seen all the same).
    """

    party: str
    noise_multiplier: float
    sample_rate: float
    kind: ReleaseKind
    round: int = 0
    phase: str = "train"
    split: str = "train"
    rows: tuple[int, ...] = field(default=(), repr=False)
    attempt: int = 0
    discarded: bool = False

    def __post_init__(self) -> None:
        if not self.party:
            raise ConfigError("A release must name the party that spends it. Found ''.")
        if not (self.noise_multiplier >= 0 and math.isfinite(self.noise_multiplier)):
            raise ConfigError(
                f"`noise_multiplier` must be a finite number >= 0. Found {self.noise_multiplier}."
            )
        if not 0 < self.sample_rate <= 1:
            raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {self.sample_rate}.")
        if self.kind not in _KINDS:
            raise ConfigError(f"`kind` must be one of {', '.join(_KINDS)}. Found {self.kind!r}.")
        if self.phase not in ("train", "predict"):
            raise ConfigError(f"`phase` must be 'train' or 'predict'. Found {self.phase!r}.")
        if type(self.attempt) is not int or self.attempt < 0:
            raise ConfigError(f"`attempt` must be an integer >= 0. Found {self.attempt!r}.")
        if type(self.discarded) is not bool or (self.discarded and self.kind != "dp-sgd"):
            raise ConfigError(
                "`discarded` must be a bool, true only for a DP-SGD step. Found "
                f"{self.discarded!r} for a {self.kind!r} release."
            )


EventCallback = Callable[[GaussianRelease], None]


@dataclass(frozen=True)
class Guarantee:
    """One (epsilon, delta) a party's releases give: what it protects, against whom, under which
    adjacency and sampling, and how it was priced. ``noise_multiplier`` is that of the single
    Gaussian event priced (per record: ``1 / sqrt(S)``; per step: the DP-SGD sigma) and
    ``releases`` the steps (or releases) composed."""

    protects: str
    observer: str
    mechanisms: tuple[str, ...]
    adjacency: str
    sampling: str
    amplification: bool
    accountant: str
    epsilon: float
    delta: float
    noise_multiplier: float
    releases: int

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "mechanisms": list(self.mechanisms)}


def _check_delta(delta: float) -> None:
    if not 0 < delta < 1:
        raise ConfigError(f"`delta` must be in (0, 1). Found {delta}.")


def _check_accountant(accountant: str) -> None:
    if accountant not in _ACCOUNTANTS:
        raise ConfigError(
            f"`accountant` must be one of {', '.join(_ACCOUNTANTS)}. Found {accountant!r}."
        )


def _check_adjacency(adjacency: str) -> None:
    if adjacency not in ADJACENCIES:
        raise ConfigError(
            f"`adjacency` must be one of {', '.join(ADJACENCIES)}. Found {adjacency!r}."
        )


OPTIMAL_ORDER_WARNING = "Optimal order is the (largest|smallest) alpha"
"""What Opacus warns (a pattern) when an RDP bound is best at an end of its grid of orders: the
largest for much noise (a small epsilon), the smallest for little (an epsilon in the hundreds
or more, which protects nothing). The bound is valid either way, looser than a wider grid would
give, never lower."""


PRV_LIMIT = 64.0
"""Where RDP's epsilon exceeds this, PRV is not asked and RDP's (valid, looser) bound is the
price: PRV's grid grows with the privacy loss, and there it took minutes, asked for tens of GiB
or gave inf (sigma 0.3 at rate 0.5 for 1000 steps: 99 s and inf, where RDP gives 904)."""


def price(
    history: Sequence[tuple[float, float, int]], delta: float, *, accountant: AccountantName
) -> float:
    """The epsilon at ``delta`` of (noise multiplier, Poisson rate, steps) runs of subsampled
    Gaussian mechanisms (Opacus' history), composed: 0 with none, inf if one is noiseless (or
    has a multiplier below :data:`NEGLIGIBLE_NOISE`). Under ``"prv"``, RDP's bound where it
    exceeds :data:`PRV_LIMIT`. Never below 0: at a large delta the accountants' conversion
    goes negative (RDP's -0.02 at delta 0.5), and an (epsilon, delta) guarantee holds for any
    larger epsilon."""
    _check_delta(delta)
    _check_accountant(accountant)
    if not history:
        return 0.0
    if any(sigma < NEGLIGIBLE_NOISE for sigma, _, _ in history):
        return math.inf
    rdp = _rdp_epsilon(history, delta)
    if accountant == "rdp" or rdp > PRV_LIMIT:
        return max(rdp, 0.0)
    from protocols._opacus import PRVAccountant

    pricer = PRVAccountant()
    pricer.history = list(history)
    return max(float(pricer.get_epsilon(delta=delta)), 0.0)


@functools.lru_cache(maxsize=1024)
def _rdp_of_one_step(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """Opacus' RDP of one subsampled Gaussian step at its accountant's orders (cached: a run
    prices the same (sigma, rate) for every party and every epoch's prefix)."""
    from protocols._opacus import RDPAccountant, rdp_analysis

    rdp = rdp_analysis.compute_rdp(
        q=sample_rate,
        noise_multiplier=noise_multiplier,
        steps=1,
        orders=RDPAccountant.DEFAULT_ALPHAS,
    )
    rdp.setflags(write=False)
    return rdp


def _rdp_epsilon(history: Sequence[tuple[float, float, int]], delta: float) -> float:
    """What Opacus' ``RDPAccountant.get_epsilon`` gives for ``history``, term for term (its
    ``compute_rdp`` is the one-step RDP times the steps), with the one-step RDP cached."""
    from protocols._opacus import RDPAccountant, rdp_analysis

    rdp = sum([_rdp_of_one_step(sigma, rate) * steps for sigma, rate, steps in history])
    with warnings.catch_warnings():
        # A large (small) multiplier's best order is the grid's last (first): the epsilon is
        # then a valid bound, looser than a wider grid would give (never lower), and what every
        # report of this library states (RDP over Opacus' default orders). Not the user's to
        # act on; a sweep's workers printed it once per run and epoch.
        warnings.filterwarnings("ignore", message=OPTIMAL_ORDER_WARNING)
        epsilon, _ = rdp_analysis.get_privacy_spent(
            orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta
        )
    return float(epsilon)


def release_strength(noise_multiplier: float, *, shift: float) -> float:
    """``(shift / sigma)^2``: one release's share of its record's squared Gaussian privacy
    parameter mu^2 (inf for a noiseless release, or one below :data:`NEGLIGIBLE_NOISE`)."""
    if noise_multiplier < NEGLIGIBLE_NOISE:
        return math.inf
    return (shift / noise_multiplier) ** 2


def joint_noise_multiplier(multipliers: Iterable[float], *, shift: float) -> float:
    """The noise multiplier of releases about the same records taken as one Gaussian
    mechanism: ``1 / (shift * sqrt(sum sigma_i^-2))`` (0 if one is noiseless)."""
    strength = sum(release_strength(sigma, shift=shift) for sigma in multipliers)
    if strength == 0:
        raise ConfigError("a joint event needs at least one release; found none.")
    return 0.0 if math.isinf(strength) else 1 / math.sqrt(strength)


def per_record_epsilon(strength: float, delta: float, *, accountant: AccountantName) -> float:
    """The epsilon of a record whose releases (seen with their sampling known) sum to
    ``strength`` = sum (shift / sigma_i)^2: one Gaussian mechanism with z = 1 / sqrt(strength)."""
    if strength == 0:
        return 0.0
    if math.isinf(strength):
        return math.inf
    return price([(1 / math.sqrt(strength), 1.0, 1)], delta, accountant=accountant)


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    *,
    sample_rate: float,
    steps: int,
    accountant: AccountantName = "rdp",
    releases: str | None = None,
) -> float:
    """The smallest noise multiplier (to Opacus' search tolerance) whose ``steps`` releases at
    ``sample_rate`` spend at most ``target_epsilon`` at ``delta`` (Opacus'
    ``get_noise_multiplier``). ``releases`` says what is calibrated, for errors (default: the
    steps). ConfigError where none reaches the target, or where the target asks for less than
    :data:`NEGLIGIBLE_NOISE`, which the accountant prices as none."""
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ConfigError(f"`target_epsilon` must be a positive number. Found {target_epsilon}.")
    _check_delta(delta)
    if not 0 < sample_rate <= 1:
        raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {sample_rate}.")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"`steps` must be a positive integer. Found {steps!r}.")
    _check_accountant(accountant)
    from protocols._opacus import get_noise_multiplier

    with warnings.catch_warnings():
        # The search probes large multipliers whose best RDP order is the grid's last; the
        # bound it then gives is looser, never lower, so the calibration stays within target.
        warnings.filterwarnings("ignore", message=OPTIMAL_ORDER_WARNING)
        try:
            sigma = get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
                epsilon_tolerance=0.005 * target_epsilon,
            )
        except ValueError as error:  # Opacus: no multiplier it searches reaches the target
            raise ConfigError(
                f"no noise multiplier reaches --target-epsilon {target_epsilon:g} at delta "
                f"{delta:g} over {releases or f'{steps} release(s)'} with the {accountant} "
                f"accountant (Opacus: {error}); expected a larger --target-epsilon or --delta."
            ) from None
    if sigma < NEGLIGIBLE_NOISE:  # priced as no noise: epsilon inf, far beyond the target
        raise ConfigError(
            f"--target-epsilon {target_epsilon:g} asks for a noise multiplier of {sigma:.3g}, "
            f"below {NEGLIGIBLE_NOISE:g}, which the accountant prices as no noise (epsilon "
            "inf); expected a smaller --target-epsilon (or no DP mechanism)."
        )
    return float(sigma)


def calibrate_per_record(
    target_epsilon: float,
    delta: float,
    *,
    releases: float,
    shift: float,
    accountant: AccountantName = "rdp",
) -> float:
    """The noise multiplier sigma, common to ``releases`` releases about one record (seen with
    their sampling known), that keeps the record within ``target_epsilon``: the composed
    Gaussian has z = sigma / (shift sqrt(releases)), so sigma = z* shift sqrt(releases) with z*
    the single Gaussian's calibrated multiplier."""
    if not releases > 0:
        raise ConfigError(f"`releases` must be positive. Found {releases}.")
    single = calibrate_noise(
        target_epsilon,
        delta,
        sample_rate=1.0,
        steps=1,
        accountant=accountant,
        releases=f"{releases:g} releases of a record (composed)",
    )
    return single * shift * math.sqrt(releases)


def _release_json(event: GaussianRelease) -> dict[str, Any]:
    return {**dataclasses.asdict(event), "rows": list(event.rows)}


def _releases(
    events: Sequence[Mapping[str, Any]], source: str, planned: Mapping[str, float] | None = None
) -> list[GaussianRelease]:
    """The releases ``events`` (as :meth:`PrivacyAccountant.to_json` writes them) describe;
    ConfigError, naming the entry, for one that is not a release or, given ``planned`` (the
    run's noise multiplier by kind), not one of the run's."""
    fields = {f.name for f in dataclasses.fields(GaussianRelease)}
    found = []
    for i, event in enumerate(events):
        if not isinstance(event, Mapping) or not set(event) <= fields:
            keys = sorted(event) if isinstance(event, Mapping) else type(event).__name__
            raise ConfigError(
                f"release {i} of {source}: the fields {sorted(fields)} expected, found {keys}."
            )
        release = GaussianRelease(**{**event, "rows": tuple(event.get("rows", ()))})
        if planned is not None:
            sigma = planned.get(release.kind)
            if sigma is None or not math.isclose(release.noise_multiplier, sigma, rel_tol=1e-9):
                expected = "none" if sigma is None else f"noise multiplier {sigma:.10g}"
                raise ConfigError(
                    f"release {i} of {source}: a {release.kind!r} release of this run's "
                    f"{expected} expected, found noise multiplier {release.noise_multiplier:.10g}."
                )
        found.append(release)
    return found


class PrivacyAccountant:
    """Records releases (pass :meth:`on_event` to the mechanisms) and prices them per party as
    :class:`Guarantee` s. A party's guarantees cover its own records only.
    ``accountant`` names Opacus' accountant used for pricing: ``"rdp"`` (default) or ``"prv"``.
    PRV is tighter where it works, but its grid grows with the privacy loss: measured here, a
    noise multiplier of 0.15 (rate 0.01, 1000 steps) took 30 s, 0.1 did not finish in 30 s and
    0.05 asked for 26 GiB, and (0.3, rate 0.5, 1000 steps) gave inf after 99 s where RDP gives
    904. So PRV prices only where RDP's epsilon is at most :data:`PRV_LIMIT` (64); beyond, the
    price is RDP's bound.
    """

    def __init__(
        self, *, accountant: AccountantName = "rdp", planned: Mapping[str, float] | None = None
    ) -> None:
        _check_accountant(accountant)
        self.accountant: AccountantName = accountant
        self.planned = dict(planned) if planned is not None else None
        """The noise multiplier of each kind of release the run plans (None: any), which every
        release :meth:`restore` takes back must have: a checkpoint edited to record more noise
        than was drawn would price the run lower."""
        self.events: list[GaussianRelease] = []
        self.attempt = 0  # what this run's releases are stamped with (restore() raises it)
        self.journal: Callable[[Mapping[str, Any]], None] | None = None
        """Called with each release as JSON once it is recorded, before the message carrying
        it leaves the party: a checkpointed party's release journal
        (:class:`~secure_vfl.checkpoints.ReleaseJournal`), so that a resumed run can price the
        releases a killed run made after its last checkpoint."""

    def on_event(self, event: GaussianRelease) -> None:
        """Record one release (and journal it, when a journal is attached)."""
        if event.attempt != self.attempt:
            event = dataclasses.replace(event, attempt=self.attempt)
        self.events.append(event)
        if self.journal is not None:
            self.journal(_release_json(event))

    def to_json(self) -> list[dict[str, Any]]:
        """Every release recorded, as JSON: what a party's checkpoint keeps, so that a resumed
        run prices exactly the releases the killed one made."""
        return [_release_json(event) for event in self.events]

    def restore(
        self, events: Sequence[Mapping[str, Any]], *, lost: Sequence[Mapping[str, Any]] = ()
    ) -> int:
        """Replace the releases recorded by ``events`` (from :meth:`to_json`, read back from a
        checkpoint), then add those of ``lost`` (the killed run's releases after that
        checkpoint, from its journal). A lost release was seen by its receivers before the
        kill, and the resumed run releases about the same rows again: both are priced. A lost
        DP-SGD step is kept ``discarded``: the messages the killed run sent after it were
        computed with the model it made, so it is priced against their receivers, but not in
        the model guarantee (the resumed run discards that model and takes the step again,
        with fresh noise). Returns how many lost releases were added; ConfigError, naming the
        entry, for one that is not a release."""
        restored = _releases(events, "a checkpoint", self.planned)
        seen = [
            dataclasses.replace(event, discarded=True) if event.kind == "dp-sgd" else event
            for event in _releases(lost, "the journal", self.planned)
        ]
        self.events = restored + seen
        # The steps after the checkpoint are taken again: their releases are new joint events.
        self.attempt = 1 + max((event.attempt for event in self.events), default=-1)
        return len(seen)

    def parties(self) -> list[str]:
        """The parties that have spent privacy, in order of their first release."""
        return list(dict.fromkeys(e.party for e in self.events))

    def releases(self, party: str, *, phase: str = "train") -> dict[str, int]:
        """How many releases of each kind ``party`` made in ``phase``; the DP-SGD steps of a
        killed run's model that was discarded apart, as ``dp-sgd-discarded``."""
        counts: dict[str, int] = {}
        for event in self._events(party, phase=phase):
            kind = f"{event.kind}-discarded" if event.discarded else event.kind
            counts[kind] = counts.get(kind, 0) + 1
        return counts

    def _events(
        self, party: str, *, phase: str, kinds: Sequence[str] = _KINDS
    ) -> list[GaussianRelease]:
        return [e for e in self.events if e.party == party and e.phase == phase and e.kind in kinds]

    def message_guarantee(
        self,
        party: str,
        *,
        schedule: Sequence[np.ndarray],
        records: int,
        adjacency: Adjacency,
        delta: float,
        sampling: str,
    ) -> Guarantee | None:
        """``party``'s guarantee against the receivers of its messages (None if it released
        no embedding, gradient or exposed row): its joint event of every step, composed per
        record over the steps whose batch (``schedule[step]``, rows among ``records``) held it,
        without amplification (the receivers know the batches); the worst record's epsilon.

        The steps' events are charged to every row of their batch, which bounds a record's
        releases even when a message covers only the rows its receiver observes; a release of
        exposed rows (:data:`ROW_KINDS`) is charged to the rows it names, the records it is
        about (the batch's other rows entered sums that hide them).
        """
        _check_adjacency(adjacency)
        kinds = {e.kind for e in self._events(party, phase="train")}
        if not ({"embedding", "gradient", *ROW_KINDS} & set(kinds)):
            return None
        shift = ROW_SHIFT[adjacency]
        steps = self._events(party, phase="train", kinds=(*MESSAGE_KINDS, *ROW_KINDS))
        outside = sorted({e.round for e in steps if not 0 <= e.round < len(schedule)})
        if outside:
            raise ConfigError(
                f"{party} released in training step(s) {outside[:3]} outside the "
                f"{len(schedule)} steps of the schedule."
            )
        per_record = np.zeros(records, dtype=np.float64)
        # The rows of each step's joint event, by (attempt, round): a step a resumed run took
        # again is another event. Its message releases are charged to its whole batch (its
        # 1 / z^2 the sum of theirs), an exposure to the rows it names.
        touched: dict[tuple[int, int], np.ndarray] = {}
        for event in steps:
            if event.kind in MESSAGE_KINDS:
                rows = schedule[event.round]
            else:
                rows = np.asarray(event.rows, dtype=np.int64)
            per_record[rows] += release_strength(event.noise_multiplier, shift=shift)
            key = (event.attempt, event.round)
            touched.setdefault(key, np.zeros(records, dtype=bool))[rows] = True
        worst = float(per_record.max()) if records else 0.0
        uses = np.zeros(records, dtype=np.int64)
        for rows_of_step in touched.values():
            uses += rows_of_step
        return Guarantee(
            protects="its training records",
            observer="the parties receiving its messages, who know which rows each step used",
            mechanisms=tuple(k for k in (*MESSAGE_KINDS, *ROW_KINDS) if k in kinds),
            adjacency=ADJACENCY_TEXT[adjacency],
            sampling=f"{sampling}; the observer knows each sample, so no amplification",
            amplification=False,
            accountant=self._name(),
            epsilon=per_record_epsilon(worst, delta, accountant=self.accountant),
            delta=delta,
            noise_multiplier=_multiplier(worst),
            releases=int(uses.max()) if records else 0,
        )

    def model_guarantee(
        self, party: str, *, sample_rate: float, draws: int, delta: float, sampling: str
    ) -> Guarantee | None:
        """``party``'s DP-SGD guarantee to whoever sees only its trained bottom model (None
        without DP-SGD): ``draws`` Poisson-subsampled Gaussian steps at ``sample_rate``, under
        add/remove, with amplification: valid only if the sample (``sampling`` says how it was
        drawn) is secret from that observer, as the secure generator keeps it."""
        steps = [
            e for e in self._events(party, phase="train", kinds=("dp-sgd",)) if not e.discarded
        ]
        if not steps:
            return None
        multipliers = {e.noise_multiplier for e in steps}
        if len(multipliers) != 1:
            raise ConfigError(
                f"{party}: one DP-SGD noise multiplier expected; found {multipliers}."
            )
        (sigma,) = multipliers
        composed = max(draws, len(steps))
        return Guarantee(
            protects="its training records",
            observer="whoever sees only its trained bottom model, not the batches or messages",
            mechanisms=("dp-sgd",),
            adjacency=ADJACENCY_TEXT["add-remove"],
            sampling=f"{sampling}; the observer does not know the sample",
            amplification=True,
            accountant=self._name(),
            epsilon=price([(sigma, sample_rate, composed)], delta, accountant=self.accountant),
            delta=delta,
            noise_multiplier=sigma,
            releases=composed,
        )

    def prediction_guarantee(
        self, party: str, *, adjacency: Adjacency, delta: float
    ) -> Guarantee | None:
        """``party``'s guarantee for the test records its noisy representations (or exposed
        rows) were computed for at prediction time (None if none were), per record as
        :meth:`message_guarantee`; a record's releases in different test splits (the same rows
        under other masks) add up: the sum of the splits' worst records bounds any record."""
        _check_adjacency(adjacency)
        events = self._events(party, phase="predict", kinds=("embedding", *ROW_KINDS))
        if not events:
            return None
        shift = ROW_SHIFT[adjacency]
        by_split: dict[str, dict[int, float]] = {}
        uses: dict[str, dict[int, int]] = {}
        for event in events:
            strengths = by_split.setdefault(event.split, {})
            counts = uses.setdefault(event.split, {})
            for row in event.rows:
                strengths[row] = strengths.get(row, 0.0) + release_strength(
                    event.noise_multiplier, shift=shift
                )
                counts[row] = counts.get(row, 0) + 1
        worst = sum(max(s.values(), default=0.0) for s in by_split.values())
        return Guarantee(
            protects="the test records it computed representations for",
            observer="the parties receiving its prediction-time representations",
            mechanisms=tuple(
                k for k in ("embedding", *ROW_KINDS) if any(e.kind == k for e in events)
            ),
            adjacency=ADJACENCY_TEXT[adjacency],
            sampling="every test row, in each test split (no subsampling)",
            amplification=False,
            accountant=self._name(),
            epsilon=per_record_epsilon(worst, delta, accountant=self.accountant),
            delta=delta,
            noise_multiplier=_multiplier(worst),
            releases=sum(max(c.values(), default=0) for c in uses.values()),
        )

    def statistics_guarantee(self, party: str, *, delta: float) -> Guarantee | None:
        """A FedHF client's guarantee for the rows behind its statistics (None if it released
        none): every release covers every row once (no subsampling), so a record's strength is
        the sum over the releases, under add/remove (a row's contribution is clipped to C)."""
        events = self._events(party, phase="train", kinds=("statistics",))
        if not events:
            return None
        strength = sum(release_strength(e.noise_multiplier, shift=1.0) for e in events)
        return Guarantee(
            protects="the rows behind its statistics",
            observer=(
                "the server, or any one other client (each sees the released sums; a client "
                "knows its own noise share, and the others' carry the full noise)"
            ),
            mechanisms=("statistics",),
            adjacency=ADJACENCY_TEXT["add-remove"],
            sampling="every row in every release (no subsampling)",
            amplification=False,
            accountant=self._name(),
            epsilon=per_record_epsilon(strength, delta, accountant=self.accountant),
            delta=delta,
            noise_multiplier=_multiplier(strength),
            releases=len(events),
        )

    def _name(self) -> str:
        return f"{self.accountant} (Opacus)"


def _multiplier(strength: float) -> float:
    if strength == 0:
        return math.inf
    return 0.0 if math.isinf(strength) else 1 / math.sqrt(strength)


def parse_noise(text: str) -> tuple[float, float]:
    """Parse the CLI form ``"SIGMA:CLIP"`` (e.g. ``"1.1:1.0"``) into (noise multiplier, clip)."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ConfigError(f"Noise must be given as SIGMA:CLIP, e.g. 1.1:1.0. Found {text!r}.")
    try:
        sigma, clip = plain_number(parts[0]), plain_number(parts[1])
    except ValueError:
        raise ConfigError(
            f"Noise SIGMA:CLIP must be two numbers, e.g. 1.1:1.0. Found {text!r}."
        ) from None
    _check_noise(sigma, clip)
    return sigma, clip


def _check_noise(noise_multiplier: float, clip: float) -> None:
    if not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ConfigError(
            f"the noise multiplier (SIGMA) must be a finite number >= 0. Found {noise_multiplier}."
        )
    if not (clip > 0 and math.isfinite(clip)):
        raise ConfigError(f"the clip norm (CLIP) must be a positive number. Found {clip}.")


def clip_rows(rows: Tensor, clip: float) -> Tensor:
    """Scale every row whose L2 norm exceeds ``clip`` down to norm ``clip``; others unchanged."""
    norms = rows.norm(dim=1, keepdim=True)
    factor = torch.where(norms > clip, clip / norms.clamp(min=1e-12), torch.ones_like(norms))
    return rows * factor


class _RowNoise:
    """Clip each row to ``clip`` and add N(0, (noise_multiplier * clip)^2) per coordinate,
    drawn from ``noise``."""

    def __init__(
        self,
        noise_multiplier: float,
        clip: float,
        *,
        sample_rate: float,
        noise: NoiseSource,
        on_event: EventCallback,
    ) -> None:
        _check_noise(noise_multiplier, clip)
        if not 0 < sample_rate <= 1:
            raise ConfigError(f"`sample_rate` must be in (0, 1]. Found {sample_rate}.")
        self.noise_multiplier = float(noise_multiplier)
        self.clip = float(clip)
        self.sample_rate = float(sample_rate)
        self.noise = noise
        self.on_event = on_event

    def privatise(self, rows: Tensor) -> Tensor:
        """Clipped rows plus Gaussian noise, as a new tensor."""
        clipped = clip_rows(rows, self.clip)
        draws = self.noise.gaussian(tuple(clipped.shape), dtype=clipped.dtype)
        return clipped + draws * (self.noise_multiplier * self.clip)

    def release(self, party: str, kind: ReleaseKind, round: int, **where: Any) -> None:
        self.on_event(
            GaussianRelease(party, self.noise_multiplier, self.sample_rate, kind, round, **where)
        )


class EmbeddingNoise(_RowNoise):
    """Channel layer: Gaussian mechanism on every representation message (protects features).

    One :class:`GaussianRelease` of kind ``"embedding"`` per message, spent by its sender: of
    phase ``"train"`` for training rows, ``"predict"`` (with the split and rows) at prediction,
    whose rows :attr:`requests` (the party's incoming hook) noted from the request. Other
    messages, and a party's message to itself (a label party's own block in a concatenation
    model), pass unchanged; the message passed in is never mutated.

    As :class:`ExposureNoise`, the party backpropagates through its own clipping: the incoming
    hook multiplies the gradient that comes back for a training row it clipped by the clip's
    Jacobian. Without it a clip below the rows' norms (pure clipping, no noise, is enough)
    makes the bottom model grow its representations until the run diverges (Satellite, LASER,
    ``--dp-embeddings 0:1.0``: non-finite at step 67 of 6 epochs).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._asked: dict[tuple[str, str, int, str], tuple[str, Tensor]] = {}
        # The training rows it clipped, by (round, tag) of their representation: the last ones.
        self._clipped: dict[tuple[int, str], tuple[Tensor, Tensor, Tensor]] = {}
        self.requests = _RequestNotes(self._asked, self._clipped)
        """The incoming hook: notes which rows each prediction request asks for, and passes the
        gradient of the training rows it clipped through the clip's Jacobian."""

    def on_message(self, message: M) -> M:
        if not isinstance(message, RepresentationMessage) or message.sender == message.receiver:
            return message
        noisy = dataclasses.replace(message, representation=self.privatise(message.representation))
        asked = self._asked.pop((message.sender, message.phase, message.round, message.tag), None)
        if message.phase == "train":
            self._clipped.clear()
            self._clipped[(message.round, message.tag)] = _clipping(
                message.positions, message.representation, self.clip
            )
            self.release(message.sender, "embedding", message.round)
        elif asked is None:
            raise ConfigError(
                f"{message.sender}: a prediction-time representation (round {message.round}) "
                "whose request this layer never saw; install its `requests` as an incoming hook."
            )
        else:
            split, rows = asked
            self.release(
                message.sender,
                "embedding",
                message.round,
                phase="predict",
                split=split,
                rows=tuple(int(r) for r in rows.tolist()),
            )
        return noisy


class ExposureNoise(_RowNoise):
    """The Gaussian mechanism on the rows of a party's contribution that a secure sum cannot
    hide (``release="dp"``): a sum whose only contributor besides the receiver is this party.

    Installed inside the party (``party.exposure``, and as an incoming hook that notes which
    rows each representation request the party accepted asked for); when a seal request flags
    rows of its contribution as exposed, it clips exactly those rows to ``clip`` and adds
    N(0, (sigma clip)^2) per coordinate (the same clipping and noise as :class:`EmbeddingNoise`)
    and records one :class:`GaussianRelease` of kind ``"exposure"`` naming the records concerned
    (training rows, or test rows with their split), spent by the party: one event per step (a
    step's training contribution is sealed once) for all its exposed rows of the batch.

    The party backpropagates through its own clipping: the gradient that comes back for a
    training row it clipped (norm |h| > C) is multiplied by the clipping's Jacobian,
    ``(C / |h|) (I - u u^T)`` with ``u = h / |h|``. Without it the bottom model is pushed to grow
    the rows whose growth the clip cancels, and their norm drifts until the run diverges.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The last representation request of each (phase, tag): its round, batch, split, rows.
        self._requests: dict[tuple[str, str], RepresentRequest] = {}
        # The rows it clipped in the last training step: (round, tag) -> positions, u, C/|h|.
        self._clipped: dict[tuple[int, str], tuple[Tensor, Tensor, Tensor]] = {}

    def on_message(self, message: M) -> M:
        """Incoming hook: pass the gradient of the rows it clipped through the clipping's
        Jacobian."""
        if isinstance(message, GradientMessage) and message.sender != message.receiver:
            clipped = self._clipped.get((message.round, message.tag))
            if clipped is not None:
                return dataclasses.replace(message, gradient=_through_clip(message, *clipped))
        return message

    def on_accepted(self, message: Message) -> None:
        """Note the rows of each representation request the party acts on (one it refuses
        replaces none)."""
        if isinstance(message, RepresentRequest):
            self._requests[(message.phase, message.tag)] = message

    def release_exposed(
        self, contribution: RepresentationMessage, exposed: Tensor
    ) -> RepresentationMessage:
        request = self._requests.get((contribution.phase, contribution.tag))
        if request is None or (request.round, request.batch_id) != (
            contribution.round,
            contribution.batch_id,
        ):
            raise ConfigError(
                f"{contribution.sender}: exposed rows of a contribution (round "
                f"{contribution.round}, batch {contribution.batch_id}) whose request this "
                "mechanism never saw; install it as an incoming hook too."
            )
        if exposed.shape != (contribution.positions.numel(),) or exposed.dtype != torch.bool:
            raise ConfigError(
                f"one bool flag per row of the contribution ({contribution.positions.numel()}) "
                f"expected; found {exposed.dtype} of shape {tuple(exposed.shape)}."
            )
        values = contribution.representation.clone()
        if contribution.phase == "train":
            self._note_clipping(contribution, exposed)
        values[exposed] = self.privatise(values[exposed])
        where: dict[str, Any] = {"rows": tuple(int(r) for r in request.rows[exposed].tolist())}
        if contribution.phase == "predict":
            where.update(phase="predict", split=request.split)
        self.release(contribution.sender, "exposure", contribution.round, **where)
        return dataclasses.replace(contribution, representation=values)

    def _note_clipping(self, contribution: RepresentationMessage, exposed: Tensor) -> None:
        """Keep, for the gradient of this step, the exposed rows that clipping shrinks."""
        self._clipped = {
            (contribution.round, contribution.tag): _clipping(
                contribution.positions[exposed],
                contribution.representation[exposed],
                self.clip,
            )
        }


def _clipping(positions: Tensor, rows: Tensor, clip: float) -> tuple[Tensor, Tensor, Tensor]:
    """Of ``rows`` (at batch ``positions``), those that clipping to ``clip`` shrinks: their
    positions, unit directions u and scales C / |h|, for :func:`_through_clip`."""
    norms = rows.norm(dim=1)
    shrunk = norms > clip
    return positions[shrunk], rows[shrunk] / norms[shrunk].unsqueeze(1), clip / norms[shrunk]


def _through_clip(
    message: GradientMessage, positions: Tensor, directions: Tensor, scales: Tensor
) -> Tensor:
    """``message``'s gradient with the rows at ``positions`` multiplied by the Jacobian of
    clipping them, ``scale (I - u u^T)`` (u their unit direction)."""
    gradient = message.gradient.clone()
    index = {int(p): i for i, p in enumerate(message.positions.tolist())}
    pairs = [(index[p], j) for j, p in enumerate(positions.tolist()) if p in index]
    if pairs:
        rows, clipped = (torch.tensor(column) for column in zip(*pairs, strict=True))
        g, u = gradient[rows], directions[clipped]
        radial = (u * g).sum(dim=1, keepdim=True)
        gradient[rows] = scales[clipped].unsqueeze(1) * (g - u * radial)
    return gradient


class _RequestNotes:
    """An incoming hook: notes the split and rows of each prediction-time
    :class:`RepresentRequest` the party receives (training rows are priced from the schedule),
    and passes the gradient of the training rows ``clipped`` keeps (by the round and tag of
    their representation) through the clip's Jacobian."""

    def __init__(
        self,
        asked: dict[tuple[str, str, int, str], tuple[str, Tensor]],
        clipped: dict[tuple[int, str], tuple[Tensor, Tensor, Tensor]],
    ) -> None:
        self._asked = asked
        self._clipped = clipped

    def on_message(self, message: M) -> M:
        if isinstance(message, RepresentRequest) and message.phase == "predict":
            key = (message.receiver, message.phase, message.round, message.tag)
            self._asked[key] = (message.split, message.rows)
        elif isinstance(message, GradientMessage):  # its own head's too (the label party's)
            clipped = self._clipped.get((message.round, message.tag))
            if clipped is not None:
                return dataclasses.replace(message, gradient=_through_clip(message, *clipped))
        return message


class GradientNoise(_RowNoise):
    """Channel layer: Gaussian mechanism on every gradient message (protects the head's labels).

    One :class:`GaussianRelease` of kind ``"gradient"`` per message, spent by its sender (the
    label party). A gradient a party sends to itself (the label party's own bottom model)
    crosses no boundary and passes unchanged, unrecorded.
    """

    def on_message(self, message: M) -> M:
        if not isinstance(message, GradientMessage) or message.sender == message.receiver:
            return message
        noisy = dataclasses.replace(message, gradient=self.privatise(message.gradient))
        if message.phase == "train":
            self.release(message.sender, "gradient", message.round)
        return noisy
