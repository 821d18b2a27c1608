"""An empirical DP audit: a lower bound on epsilon from what a party observes in one run.

A DP guarantee is an upper bound proved on paper; an audit runs an attacker against the real
code and turns its success into a *lower* bound that holds with stated confidence. If the lower
bound exceeds the epsilon a run reports, the report (or the code) is wrong.

Method: the one-run audit of Steinke, Nasr and Jagielski ("Privacy auditing with one (1) training
run", NeurIPS 2023, Thm 3.1). m canaries each carry an independent uniform secret bit
S_i in {-1, +1}; the auditor guesses T_i in {-1, 0, +1} (0: abstain) from the mechanism's output,
with r guesses in all, of which W are right. If the mechanism is (eps, delta)-DP with respect to
changing any one S_i, then for every v::

    P[W >= v] <= f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i,
    f(v) = P[Binomial(r, e^eps / (1 + e^eps)) >= v].

The right-hand side is a p-value for the null "the mechanism is (eps, delta)-DP"; the lower
bound is the largest eps the observed W rejects at level 1 - ``confidence``
(:func:`epsilon_lower_bound`). Several guess counts r may be tried on the same scores: each is
tested at level (1 - confidence) / (number of counts) (Bonferroni), so the reported maximum is
still a bound at ``confidence`` (:func:`audit_scores`).

The label audit (:func:`audit_label_dp`): the label party's gradient DP under replace-one-label
adjacency, observed by a data party. Every training row is a canary whose label is one of two
public candidates, chosen by its secret bit (changing the bit replaces one label: exactly the
adjacency the run prices). The curious data party (:class:`~attacks.label_inference.
GradientObserver`, which keeps every gradient it receives with its rows) scores each row by
sum over its gradient rows of g[candidate 0] - g[candidate 1]: a loss gradient with no top model
is negative at the label, so the score is the log-likelihood ratio of the two candidates under
the Gaussian noise, up to a constant. The bound is compared with the label party's reported
epsilon, the worst record's, which bounds every canary's.

Positive control: the same run with the noise removed (clipping only) while claiming the DP
run's epsilon must fail the audit (lower bound above the claim); the negative side is that the
real DP run's lower bound stays at or below its reported epsilon.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

from attacks.label_inference import GradientObserver
from protocols.privacy import PrivacyEngine, PrivacySpec
from secure_vfl.errors import ConfigError
from secure_vfl.experiment import TrainConfig, prepare_data, run_training
from secure_vfl.federation.channel import Channel

EPSILON_STEP = 0.01
"""Resolution of the epsilon grid the lower bound is read from (it is rounded down to it)."""
GUESS_COUNTS = (100, 200, 400, 800, 1400)
"""How many canaries the label audit guesses (the most confident scores), Bonferroni over them."""
EPSILON_GRID_MAX = 40.0
"""The largest epsilon the grid tests; a bound at the ceiling means 'at least this'."""


def one_run_p_value(
    *, canaries: int, guesses: int, correct: int, epsilon: float, delta: float
) -> float:
    """The p-value of ``correct`` right guesses out of ``guesses`` among ``canaries`` under the
    null hypothesis that the mechanism is (epsilon, delta)-DP (Steinke et al. 2023, Thm 3.1)."""
    if not 0 <= correct <= guesses <= canaries:
        raise ConfigError(
            "0 <= correct <= guesses <= canaries expected. "
            f"Found correct={correct}, guesses={guesses}, canaries={canaries}."
        )
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ConfigError(f"`epsilon` must be a finite number >= 0. Found {epsilon}.")
    if not 0 <= delta < 1:
        raise ConfigError(f"`delta` must be in [0, 1). Found {delta}.")
    accuracy = 1 / (1 + math.exp(-epsilon))  # randomized response at epsilon
    # tail[k] = P[Binomial(guesses, accuracy) >= k] for k = 0..correct
    tail = stats.binom.sf(np.arange(correct + 1) - 1, guesses, accuracy)
    base = float(tail[correct])
    if delta == 0 or correct == 0:
        return min(1.0, base)
    steps = np.arange(1, correct + 1)
    slack = float(np.max((tail[correct - steps] - base) / steps))
    return min(1.0, base + 2 * canaries * delta * slack)


def epsilon_lower_bound(
    *, canaries: int, guesses: int, correct: int, delta: float, confidence: float = 0.95
) -> float:
    """The largest epsilon (on a grid of :data:`EPSILON_STEP`) that ``correct`` of ``guesses``
    rejects at level 1 - ``confidence``: with that confidence the mechanism is not
    (epsilon, delta)-DP for any smaller epsilon. 0 when nothing is rejected.

    The grid is scanned upwards and stops at the first epsilon not rejected, so the bound is
    valid even where the p-value is not monotone in epsilon (rejecting a larger epsilon
    without the smaller ones would prove nothing about the smaller ones)."""
    if not 0 < confidence < 1:
        raise ConfigError(f"`confidence` must be in (0, 1). Found {confidence}.")
    level = 1 - confidence
    bound = 0.0
    for epsilon in np.arange(0.0, EPSILON_GRID_MAX + EPSILON_STEP / 2, EPSILON_STEP):
        p = one_run_p_value(
            canaries=canaries,
            guesses=guesses,
            correct=correct,
            epsilon=float(epsilon),
            delta=delta,
        )
        if p > level:
            break
        bound = float(epsilon)
    return bound


def audit_ceiling(
    *, canaries: int, guess_counts: Sequence[int], delta: float, confidence: float = 0.95
) -> float:
    """The largest lower bound :func:`audit_scores` can give with ``canaries``: every guess right
    at the largest count. A claimed epsilon above it cannot be refuted by this many canaries, so
    a positive control must claim less."""
    counts = sorted({c for c in guess_counts if c <= canaries})
    if not counts:
        raise ConfigError(f"guess counts in [1, {canaries}] expected. Found {list(guess_counts)}.")
    per_test = 1 - (1 - confidence) / len(counts)
    return max(
        epsilon_lower_bound(
            canaries=canaries, guesses=c, correct=c, delta=delta, confidence=per_test
        )
        for c in counts
    )


@dataclass(frozen=True)
class AuditResult:
    """One audit: the canaries, the guess count that gave the best bound, its right guesses,
    the lower bound at ``confidence`` and ``delta``, and whether it stays within the claim."""

    canaries: int
    guesses: int
    correct: int
    epsilon_lower: float
    confidence: float
    delta: float
    claimed_epsilon: float

    @property
    def passed(self) -> bool:
        """True when the lower bound does not contradict the claimed epsilon."""
        return self.epsilon_lower <= self.claimed_epsilon

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "passed": self.passed}


def audit_scores(
    scores: np.ndarray,
    bits: np.ndarray,
    *,
    claimed_epsilon: float,
    delta: float,
    guess_counts: Sequence[int],
    confidence: float = 0.95,
) -> AuditResult:
    """Audit canaries whose secret bits are ``bits`` (0/1) from the attacker's ``scores`` (high:
    bit 1): for each r in ``guess_counts``, guess the sign of the r scores of largest magnitude
    and abstain on the rest; each r is tested at level (1 - confidence) / len(guess_counts)
    (Bonferroni), and the best bound is kept."""
    scores = np.asarray(scores, dtype=np.float64)
    bits = np.asarray(bits)
    if scores.shape != bits.shape or scores.ndim != 1:
        raise ConfigError(
            f"one score per canary bit expected. Found {scores.shape} and {bits.shape}."
        )
    if not np.isin(bits, (0, 1)).all():
        raise ConfigError("canary bits must be 0 or 1.")
    counts = sorted(set(guess_counts))
    if not counts or counts[0] < 1 or counts[-1] > scores.size:
        raise ConfigError(
            f"guess counts in [1, {scores.size}] expected. Found {list(guess_counts)}."
        )
    per_test = 1 - (1 - confidence) / len(counts)
    order = np.argsort(-np.abs(scores), kind="stable")
    best: AuditResult | None = None
    for guesses in counts:
        chosen = order[:guesses]
        right = int(((scores[chosen] > 0) == (bits[chosen] == 1)).sum())
        bound = epsilon_lower_bound(
            canaries=scores.size,
            guesses=guesses,
            correct=right,
            delta=delta,
            confidence=per_test,
        )
        if best is None or bound > best.epsilon_lower:
            best = AuditResult(
                canaries=scores.size,
                guesses=guesses,
                correct=right,
                epsilon_lower=bound,
                confidence=confidence,
                delta=delta,
                claimed_epsilon=claimed_epsilon,
            )
    assert best is not None
    return best


@dataclass(frozen=True)
class LabelCanaries:
    """Every training row a canary: its label is ``candidates[bit, row]``, with ``bits`` the
    auditor's secret (uniform, independent) and both candidates public."""

    candidates: np.ndarray  # (2, N) int64
    bits: np.ndarray  # (N,) int64 in {0, 1}

    @classmethod
    def draw(cls, labels: np.ndarray, classes: int, rng: np.random.Generator) -> LabelCanaries:
        """Candidate 0 is the row's own label, candidate 1 another class uniformly at random."""
        if classes < 2:
            raise ConfigError(f"label canaries need at least 2 classes. Found {classes}.")
        other = (labels + rng.integers(1, classes, size=labels.shape)) % classes
        bits = rng.integers(0, 2, size=labels.shape)
        return cls(candidates=np.stack([labels, other]).astype(np.int64), bits=bits)

    @property
    def labels(self) -> np.ndarray:
        """The labels trained on."""
        return self.candidates[self.bits, np.arange(self.bits.size)]

    def scores(self, observer: GradientObserver) -> np.ndarray:
        """Per canary, sum over the gradient rows ``observer`` received for it of
        g[candidate 0] - g[candidate 1] (positive: candidate 1, the label with the negative
        entry); 0 for a row it never received."""
        scores = np.zeros(self.bits.size, dtype=np.float64)
        for observation in observer.observations:
            rows = observation.rows
            positions = np.arange(rows.size)
            gradient = observation.gradient
            difference = (
                gradient[positions, self.candidates[0, rows]]
                - gradient[positions, self.candidates[1, rows]]
            )
            np.add.at(scores, rows, difference)
        return scores


def audit_label_dp(
    config: TrainConfig,
    *,
    gradient_noise: tuple[float, float],
    rng: np.random.Generator,
    observer: str = "party-1",
    claimed_epsilon: float | None = None,
    delta: float = 1e-5,
    guess_counts: Sequence[int] = GUESS_COUNTS,
    confidence: float = 0.95,
    insecure_reproducible_noise: bool = False,
) -> tuple[AuditResult, dict[str, Any]]:
    """Train ``config`` with label canaries under ``--dp-gradients SIGMA:CLIP`` =
    ``gradient_noise``, ``observer`` playing the curious gradient observer, and audit the label
    party's gradient DP from what ``observer`` received. The claim is the label party's
    reported epsilon unless ``claimed_epsilon`` is given (the positive control claims the DP
    run's figure for a run without noise). Returns the audit and the run's privacy report.

    ``config`` must fuse without a top model (``top_model="none"``, representation size the
    number of classes), so the gradients are those of the loss itself; ``rng`` draws the
    canaries (the auditor's secret). The noise is drawn from the secure generator unless
    ``insecure_reproducible_noise`` (tests only: it derives the noise from ``config.seed``)."""
    if config.method_config.top_model != "none":
        raise ConfigError(
            "the label audit reads loss gradients: top_model='none' expected. "
            f"Found {config.method_config.top_model!r}."
        )
    data = prepare_data(config)
    canaries = LabelCanaries.draw(data.train.labels, data.num_classes, rng)
    train = dataclasses.replace(data.train, labels=canaries.labels)
    spec = PrivacySpec(
        dp_gradients=gradient_noise,
        delta=delta,
        seed=config.seed,
        insecure_reproducible_noise=insecure_reproducible_noise,
    )
    channel = Channel()
    result = run_training(
        config,
        data=dataclasses.replace(data, train=train),
        channel=channel,
        privacy=PrivacyEngine(spec),
        roles={observer: "gradient-observer"},
    )
    party = channel.parties[observer]
    if not isinstance(party, GradientObserver):
        raise ConfigError(f"{observer} did not play the gradient observer.")
    privacy = result.privacy or {}
    reported = float(privacy.get("epsilon", {}).get("party-0", math.inf))
    claim = reported if claimed_epsilon is None else claimed_epsilon
    counts = [c for c in guess_counts if c <= canaries.bits.size]
    audit = audit_scores(
        canaries.scores(party),
        canaries.bits,
        claimed_epsilon=claim,
        delta=delta,
        guess_counts=counts,
        confidence=confidence,
    )
    return audit, {"reported_epsilon": reported, "privacy": privacy}
