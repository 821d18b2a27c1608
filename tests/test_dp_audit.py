"""The empirical DP audit: its estimator on mechanisms whose epsilon is known exactly (the lower
bound stays below it and approaches it with enough canaries), and the label audit's positive
control (a run without noise fails against a DP run's claim) and negative side."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

from attacks.dp_audit import (
    audit_ceiling,
    audit_label_dp,
    audit_scores,
    epsilon_lower_bound,
    one_run_p_value,
)
from secure_vfl.errors import ConfigError, RunWarning
from secure_vfl.experiment import TrainConfig
from secure_vfl.methods import MethodConfig


def _randomized_response(epsilon: float, m: int, rng: np.random.Generator) -> tuple[int, int]:
    """(m guesses, right ones) of the guesser that reads back epsilon-DP randomized response."""
    bits = rng.integers(0, 2, m)
    keep = rng.random(m) < 1 / (1 + math.exp(-epsilon))
    reported = np.where(keep, bits, 1 - bits)
    return m, int((reported == bits).sum())


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """The exact epsilon at ``delta`` of the Gaussian mechanism with sensitivity / sigma = mu
    (Balle & Wang 2018, Thm 8)."""

    def excess(epsilon: float) -> float:
        return (
            stats.norm.cdf(mu / 2 - epsilon / mu)
            - math.exp(epsilon) * stats.norm.cdf(-mu / 2 - epsilon / mu)
            - delta
        )

    return float(optimize.brentq(excess, 0.0, 100.0))


def test_p_value_without_delta_is_the_binomial_tail() -> None:
    p = one_run_p_value(canaries=50, guesses=40, correct=30, epsilon=1.0, delta=0.0)
    assert p == pytest.approx(stats.binom.sf(29, 40, 1 / (1 + math.exp(-1.0))))
    with_delta = one_run_p_value(canaries=50, guesses=40, correct=30, epsilon=1.0, delta=1e-3)
    assert with_delta > p


@pytest.mark.parametrize(
    "kwargs",
    [
        {"canaries": 10, "guesses": 11, "correct": 5, "epsilon": 1.0, "delta": 0.0},
        {"canaries": 10, "guesses": 5, "correct": 6, "epsilon": 1.0, "delta": 0.0},
        {"canaries": 10, "guesses": 5, "correct": 3, "epsilon": -1.0, "delta": 0.0},
        {"canaries": 10, "guesses": 5, "correct": 3, "epsilon": 1.0, "delta": 1.0},
    ],
)
def test_p_value_refuses_impossible_counts(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        one_run_p_value(**kwargs)  # type: ignore[arg-type]


def test_bound_below_randomized_response_epsilon_and_approaches_it() -> None:
    rng = np.random.default_rng(0)
    bounds = {}
    for m in (1_000, 100_000):
        guesses, right = _randomized_response(1.0, m, rng)
        bounds[m] = epsilon_lower_bound(canaries=m, guesses=guesses, correct=right, delta=0.0)
    assert bounds[1_000] < bounds[100_000] < 1.0
    assert bounds[100_000] >= 0.95


def test_bound_exceeds_randomized_response_epsilon_rarely() -> None:
    """The 95 % bound is above the true epsilon in at most about 5 % of seeded trials."""
    rng = np.random.default_rng(1)
    above = 0
    trials = 200
    for _ in range(trials):
        guesses, right = _randomized_response(1.0, 400, rng)
        above += epsilon_lower_bound(canaries=400, guesses=guesses, correct=right, delta=0.0) > 1
    assert above / trials <= 0.09  # 5 % expected; Binomial(200, 0.05) exceeds 18 w.p. < 1 %


def test_bound_below_gaussian_mechanism_epsilon_and_approaches_it() -> None:
    """Canary bits through the Gaussian mechanism (mean +-mu/2, unit noise), a guesser that
    abstains on the least confident outputs; delta 1e-5. With delta > 0 one run's bound stays
    near half the exact epsilon (the 2 m delta term grows with the canaries; Steinke et al.
    report the same gap), so the approach is checked with randomized response above."""
    mu, delta = 1.0, 1e-5
    exact = _gaussian_epsilon(mu, delta)
    rng = np.random.default_rng(2)
    bounds = []
    for m in (2_000, 100_000):
        bits = rng.integers(0, 2, m)
        outputs = (bits - 0.5) * mu + rng.standard_normal(m)
        result = audit_scores(
            outputs,
            bits,
            claimed_epsilon=exact,
            delta=delta,
            guess_counts=[m // 1000, m // 100, m // 20, m // 4],
        )
        assert result.passed
        bounds.append(result.epsilon_lower)
    assert bounds[0] < bounds[1] < exact
    assert bounds[1] > 0.4 * exact


def test_audit_scores_counts_abstentions_and_right_guesses() -> None:
    scores = np.array([5.0, -4.0, 0.1, -0.2, 3.0])
    bits = np.array([1, 0, 0, 0, 0])
    result = audit_scores(scores, bits, claimed_epsilon=1.0, delta=0.0, guess_counts=[2, 3])
    assert result.canaries == 5
    assert (result.guesses, result.correct) in {(2, 2), (3, 2)}
    with pytest.raises(ConfigError, match="guess counts"):
        audit_scores(scores, bits, claimed_epsilon=1.0, delta=0.0, guess_counts=[6])
    with pytest.raises(ConfigError, match="one score per canary"):
        audit_scores(scores[:4], bits, claimed_epsilon=1.0, delta=0.0, guess_counts=[2])


def test_ceiling_grows_with_canaries() -> None:
    small = audit_ceiling(canaries=200, guess_counts=[100, 200], delta=1e-5)
    large = audit_ceiling(canaries=2_000, guess_counts=[100, 2_000], delta=1e-5)
    assert 0 < small < large


def _tiny_run() -> TrainConfig:
    return TrainConfig(
        method="laser",
        dataset="digits",
        parties=2,
        seed=0,
        method_config=MethodConfig(
            heads="active", top_model="none", representation_dim=10, epochs=2, lr=0.003
        ),
    )


def test_label_audit_positive_control_fails_without_noise() -> None:
    """Clipping only, claiming epsilon 2: party-1 reads the canaries' labels, and the audit
    refutes the claim."""
    with pytest.warns(RunWarning, match=r"epsilon is inf for party-0 \(--dp-gradients SIGMA 0"):
        audit, report = audit_label_dp(
            _tiny_run(),
            gradient_noise=(0.0, 0.002),
            rng=np.random.default_rng(3),
            claimed_epsilon=2.0,
        )
    assert report["reported_epsilon"] == math.inf
    assert audit.correct >= 0.99 * audit.guesses
    assert audit.epsilon_lower > 4.0  # 5.06
    assert not audit.passed


def test_label_audit_passes_a_dp_run() -> None:
    """The same run under gradient DP (SIGMA 20, reproducible noise so the test is fixed): the
    lower bound stays at or below the label party's reported epsilon, which a run without
    noise would refute (the ceiling is above it)."""
    audit, report = audit_label_dp(
        _tiny_run(),
        gradient_noise=(20.0, 0.002),
        rng=np.random.default_rng(3),
        insecure_reproducible_noise=True,
    )
    assert math.isfinite(report["reported_epsilon"])
    assert audit.claimed_epsilon == report["reported_epsilon"]
    assert audit_ceiling(canaries=audit.canaries, guess_counts=[1400], delta=1e-5) > (
        audit.claimed_epsilon
    )
    assert audit.passed


def test_label_audit_refuses_a_top_model() -> None:
    config = TrainConfig(method="laser", dataset="digits", parties=2)
    with pytest.raises(ConfigError, match="top_model='none'"):
        audit_label_dp(config, gradient_noise=(1.0, 0.01), rng=np.random.default_rng(0))


def test_label_canaries_are_drawn_from_every_class_of_the_dataset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The classes were the highest training label + 1: with the top class absent from
    training, no canary took it, though the model predicts it."""
    import dataclasses

    import attacks.dp_audit as dp_audit

    prepare = dp_audit.prepare_data

    def without_top_class(config: TrainConfig) -> object:
        data = prepare(config)
        labels = data.train.labels.copy()
        labels[labels == data.num_classes - 1] = 0
        return dataclasses.replace(data, train=dataclasses.replace(data.train, labels=labels))

    trained: list[np.ndarray] = []

    class Stop(Exception):
        pass

    def run_training(config: TrainConfig, *, data: object, **_: object) -> None:
        trained.append(data.train.labels)  # type: ignore[attr-defined]
        raise Stop

    monkeypatch.setattr(dp_audit, "prepare_data", without_top_class)
    monkeypatch.setattr(dp_audit, "run_training", run_training)
    with pytest.raises(Stop):
        audit_label_dp(_tiny_run(), gradient_noise=(1.0, 0.01), rng=np.random.default_rng(0))
    (canaries,) = trained
    assert int(canaries.max()) == 9
