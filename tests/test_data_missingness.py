"""Missingness mechanisms: rates, the FALSE-VFL MAR/MNAR rules on crafted inputs, parsing."""

from __future__ import annotations

import numpy as np
import pytest

from secure_vfl.data.missingness import (
    Mechanism,
    beta_rates,
    dirichlet_rates,
    drop_unobserved,
    mar1,
    mar2,
    mcar,
    mnar_mean_sign,
    parse_mechanism,
)
from secure_vfl.errors import ConfigError


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def blocks_with_variance(n: int, variances: list[float], width: int = 4) -> list[np.ndarray]:
    """Blocks whose every row has exactly the given within-block variance (values ±sqrt(v))."""
    signs = np.tile([1.0, -1.0], width // 2)
    return [np.tile(np.sqrt(v) * signs, (n, 1)).astype(np.float32) for v in variances]


def test_mcar_single_rate_matches_request():
    mask = mcar(20000, 4, 0.3, rng=rng())
    assert mask.dtype == np.bool_ and mask.shape == (20000, 4)
    np.testing.assert_allclose(1 - mask.mean(axis=0), 0.3, atol=0.01)


def test_mcar_per_party_rates_match_request():
    rates = [0.1, 0.2, 0.3, 0.4]
    mask = mcar(20000, 4, rates, rng=rng(1))
    np.testing.assert_allclose(1 - mask.mean(axis=0), rates, atol=0.01)


def test_mcar_zero_rate_observes_everything():
    assert mcar(1000, 3, 0.0, rng=rng()).all()


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.1])
def test_mcar_refuses_rates_outside_unit_interval(bad):
    with pytest.raises(ConfigError, match=rf"`p` must be in \[0, 1\)\. Found {bad}"):
        mcar(10, 2, bad, rng=rng())


def test_mcar_refuses_wrong_number_of_rates():
    with pytest.raises(ConfigError, match="one rate per party"):
        mcar(10, 3, [0.1, 0.2], rng=rng())


def test_mcar_draws_are_independent_between_calls():
    generator = rng(2)
    first = mcar(20000, 4, 0.3, rng=generator)
    second = mcar(20000, 4, 0.3, rng=generator)
    both_missing = (~first & ~second).mean()
    assert abs(both_missing - 0.09) < 0.01  # p^2 under independence, 0.3 if equal


def test_beta_rates_have_beta_2_2_mean_and_stay_below_one():
    rates = beta_rates(5000, rng=rng())
    assert rates.shape == (5000,)
    assert np.all((rates >= 0) & (rates < 1))
    assert abs(rates.mean() - 0.5) < 0.02
    assert abs(rates.var() - 0.05) < 0.005  # Beta(2,2) variance = 1/20


@pytest.mark.parametrize("alpha", [10.0, 1.0, 0.1])
def test_dirichlet_rates_average_the_mean_rate(alpha):
    generator = rng(3)
    for _ in range(50):
        rates = dirichlet_rates(8, alpha, mean_rate=0.2, rng=generator)
        assert np.all((rates >= 0) & (rates < 1))
        assert rates.mean() == pytest.approx(0.2)


def test_dirichlet_alpha_inf_is_uniform():
    np.testing.assert_array_equal(dirichlet_rates(8, float("inf"), rng=rng()), np.full(8, 0.2))


def test_dirichlet_small_alpha_is_more_heterogeneous():
    spread = {
        alpha: np.mean([dirichlet_rates(8, alpha, rng=rng(s)).std() for s in range(100)])
        for alpha in (0.1, 10.0)
    }
    assert spread[0.1] > 3 * spread[10.0]


def test_dirichlet_mask_has_mean_missing_rate():
    blocks = [np.zeros((20000, 2), np.float32)] * 8
    mask = parse_mechanism("dirichlet:1").sample(blocks, rng=rng(4))
    assert abs((1 - mask.mean()) - 0.2) < 0.01


def test_mar1_constant_blocks_visit_everything():
    blocks = blocks_with_variance(500, [0.0, 0.0, 0.0, 0.0])
    assert mar1(blocks, rng=rng()).all()


def test_mar1_huge_variance_stops_after_first_block():
    blocks = blocks_with_variance(4000, [100.0] * 4)
    mask = mar1(blocks, rng=rng())
    np.testing.assert_array_equal(mask.sum(axis=1), 1)
    np.testing.assert_allclose(mask.mean(axis=0), 0.25, atol=0.03)  # random first piece


def test_mar1_threshold_drops_by_decrement_after_each_piece():
    # v = 1.0 is below T = 1.1 but above T - 0.15 = 0.95: every sample stops at its second piece.
    mask = mar1(blocks_with_variance(1000, [1.0] * 4), rng=rng())
    np.testing.assert_array_equal(mask.sum(axis=1), 2)
    # v = 0.9 needs T = 0.8, the third piece.
    mask = mar1(blocks_with_variance(1000, [0.9] * 4), rng=rng())
    np.testing.assert_array_equal(mask.sum(axis=1), 3)


def test_mar1_informative_block_is_always_observed_and_ends_the_visit():
    blocks = blocks_with_variance(6000, [0.0, 0.0, 50.0, 0.0])
    mask = mar1(blocks, rng=rng(5))
    assert mask[:, 2].all()
    counts = mask.sum(axis=1)
    np.testing.assert_allclose(np.bincount(counts)[1:] / counts.size, 0.25, atol=0.03)


def test_mar1_variance_is_per_sample():
    blocks = blocks_with_variance(2, [100.0, 100.0])
    blocks = [b.copy() for b in blocks]
    for block in blocks:
        block[1] = 0.0  # second sample: constant pieces
    mask = mar1(blocks, rng=rng())
    assert mask[0].sum() == 1 and mask[1].all()


def test_mar2_constant_blocks_visit_everything():
    assert mar2(blocks_with_variance(300, [0.0] * 5), rng=rng()).all()


def test_mar2_large_excess_spends_budget_at_once():
    # v - T = 2.0 - 0.5 > budget 0.7: stop after the first piece.
    mask = mar2(blocks_with_variance(1000, [2.0] * 4), rng=rng())
    np.testing.assert_array_equal(mask.sum(axis=1), 1)


def test_mar2_accumulates_moderate_pieces():
    # v = 0.8: excess 0.3 (budget 0.4 left), then T = 0.35, excess 0.45 -> budget <= 0: stop at 2.
    mask = mar2(blocks_with_variance(1000, [0.8] * 4), rng=rng())
    np.testing.assert_array_equal(mask.sum(axis=1), 2)


def test_mar2_budget_exactly_spent_stops():
    # excess 2.25 - 0.5 == budget: B <= 0 stops (Algorithm 3, line 7); values chosen exact.
    mask = mar2(blocks_with_variance(100, [2.25] * 3), rng=rng(), budget=1.75)
    np.testing.assert_array_equal(mask.sum(axis=1), 1)


def test_mnar_p1_drops_exactly_negative_mean_blocks():
    data = rng(6).normal(size=(3000, 3, 5)).astype(np.float32)
    blocks = [data[:, k] for k in range(3)]
    negative = np.stack([b.mean(axis=1) < 0 for b in blocks], axis=1)
    np.testing.assert_array_equal(mnar_mean_sign(blocks, 1.0, rng=rng()), ~negative)
    np.testing.assert_array_equal(mnar_mean_sign(blocks, 0.0, rng=rng()), negative)


def test_mnar_rates_follow_mean_sign():
    data = rng(7).normal(size=(20000, 2, 4)).astype(np.float32)
    blocks = [data[:, k] for k in range(2)]
    negative = np.stack([b.mean(axis=1) < 0 for b in blocks], axis=1)
    mask = mnar_mean_sign(blocks, 0.7, rng=rng())
    assert abs((~mask[negative]).mean() - 0.7) < 0.015
    assert abs((~mask[~negative]).mean() - 0.3) < 0.015


def test_drop_unobserved_keeps_rows_with_a_block_and_counts_the_rest():
    mask = np.array([[True, False], [False, False], [False, True], [False, False]])
    keep, dropped = drop_unobserved(mask)
    np.testing.assert_array_equal(keep, [0, 2])
    assert dropped == 2


@pytest.mark.parametrize(
    ("text", "label"),
    [
        ("mcar:0.2", "mcar:0.2"),
        ("MCAR:0.20", "mcar:0.2"),
        ("mcar:0.1,0.2,0.3,0.4", "mcar:0.1,0.2,0.3,0.4"),
        ("mcar:0", "mcar:0"),
        ("mcar:-0", "mcar:0"),  # was mcar:-0: a second zero-missingness split, another name
        ("mnar:-0.0", "mnar:0"),
        ("beta", "beta"),
        ("dirichlet:inf", "dirichlet:inf"),
        ("dirichlet:0.1", "dirichlet:0.1"),
        ("dirichlet:1,0.3", "dirichlet:1,0.3"),
        ("mar1", "mar1"),
        ("mar2", "mar2"),
        ("mar2:0.5,0.5,0.15", "mar2:0.5,0.5,0.15"),
        ("mnar:0.7", "mnar:0.7"),
    ],
)
def test_parse_mechanism_gives_canonical_label(text, label):
    mechanism = parse_mechanism(text)
    assert mechanism.label == label
    assert parse_mechanism(mechanism.label) == mechanism


def test_parse_mechanism_fills_paper_defaults():
    assert parse_mechanism("mar1").params == (1.1, 0.15)
    assert parse_mechanism("mar2").params == (0.5, 0.7, 0.15)
    assert parse_mechanism("dirichlet:10").params == (10.0, 0.2)
    assert Mechanism("mar1") == parse_mechanism("mar1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("foo:0.2", "unknown missingness mechanism"),
        ("mcar", "needs a parameter"),
        ("mcar:", "empty parameter list"),
        ("mcar:abc", "must be numbers"),
        ("mcar:1.5", r"must be in \[0, 1\)\. Found 1.5"),
        ("mnar:1.2", r"must be in \[0, 1\]\. Found 1.2"),
        ("mar2:1,2", "takes 3 parameters"),
        ("dirichlet:0", "`alpha` must be > 0"),
    ],
)
def test_parse_mechanism_refuses_bad_text_and_names_accepted_forms(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_mechanism(text)


@pytest.mark.parametrize("text", ["beta:inf,2", "beta:nan,2", "mar1:nan,0.15", "mar2:0.5,inf,0.15"])
def test_non_finite_beta_and_mar_parameters_are_refused_naming_the_mechanism(text):
    """beta:inf,2 and beta:nan,2 drew NaN rates, refused only when sampled as "`p` must be in
    [0, 1). Found nan."; a NaN or infinite MAR threshold or budget never ended a visit, so every
    block was observed under the mechanism's name (warned as mcar:0, blaming one-column blocks).
    """
    name = text.partition(":")[0]
    with pytest.raises(ConfigError, match=f"'{name}' parameters must be finite numbers"):
        parse_mechanism(text)
    if name == "beta":
        with pytest.raises(ConfigError, match="must be finite and > 0"):
            beta_rates(4, rng=rng(), a=float(text.split(":")[1].split(",")[0]))


def test_parse_errors_list_the_accepted_forms():
    with pytest.raises(ConfigError, match="dirichlet:ALPHA"):
        parse_mechanism("mcr:0.2")


@pytest.mark.parametrize(
    ("text", "asks_for_none"),
    [
        ("mcar:0", True),
        ("mcar:0,0,0", True),
        ("dirichlet:inf,0", True),
        ("mcar:0,0.1", False),
        ("dirichlet:1", False),
        ("beta", False),
        ("mar1", False),
        ("mar2", False),
        ("mnar:0", False),
    ],
)
def test_only_zero_rates_ask_for_no_missing_block(text, asks_for_none):
    assert parse_mechanism(text).asks_for_none is asks_for_none


def test_mechanism_sample_shapes_and_per_party_mismatch():
    blocks = [np.zeros((50, 3), np.float32)] * 4
    for text in ("mcar:0.2", "beta", "dirichlet:1", "mar1", "mar2", "mnar:0.7"):
        mask = parse_mechanism(text).sample(blocks, rng=rng())
        assert mask.shape == (50, 4) and mask.dtype == np.bool_
    with pytest.raises(ConfigError, match=r"one rate per party \(4\)"):
        parse_mechanism("mcar:0.1,0.2").sample(blocks, rng=rng())


def test_mechanism_sampling_is_reproducible_from_the_seed():
    blocks = [rng(8).normal(size=(200, 3)).astype(np.float32) for _ in range(4)]
    for text in ("mcar:0.3", "beta", "mar2", "mnar:0.9"):
        mechanism = parse_mechanism(text)
        first = mechanism.sample(blocks, rng=rng(9))
        np.testing.assert_array_equal(first, mechanism.sample(blocks, rng=rng(9)))
