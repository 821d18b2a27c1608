"""DP under secure sums never overflows and never crashes: the sums' range is chosen from the
clip and the noise before training, and a diverging run is reported the same way whatever sums
it (plain, masks, CKKS, Paillier): one DivergenceError naming the step, exit 2 from the CLI."""

from __future__ import annotations

import json
import math
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from aggregator_contract import vector_sum
from conftest import MakeData
from scipy.stats import norm
from test_paillier import paillier_aggregator

import protocols.sum_range
import secure_vfl.experiment
from protocols.ckks import CkksAggregator
from protocols.dp import calibrate_noise
from protocols.privacy import PrivacyEngine, PrivacySpec
from protocols.secagg import MaskingAggregator
from protocols.sum_range import (
    REPRESENTATION_BOUND,
    TAIL_SIGMAS,
    DivergenceGuard,
    SumRange,
    noised_bound,
    sum_range,
)
from secure_vfl.cli import main
from secure_vfl.errors import ConfigError, DivergenceError
from secure_vfl.experiment import TrainConfig, run_training
from secure_vfl.federation.aggregator import SealingScheme
from secure_vfl.federation.messages import GradientMessage, RepresentationMessage
from secure_vfl.methods import MethodConfig
from secure_vfl.methods.base import in_process_parties

BACKENDS = ("none", "masks", "ckks", "paillier")
DIVERGED = (
    r"training diverged under the DP noise at step \d+: party-\d's representation for "
    r"aggregator has \|value\| [0-9.e+]+, outside the range its sums were sized for, "
    r"\|value\| <= 65536 \(the bound of an unclipped representation\); try a smaller SIGMA"
)


class Ranged:
    """A sealing scheme whose every sender and receiver half is sized for ``value_range``, as
    the privacy engine sizes a run's halves."""

    def __init__(self, inner: Any, value_range: SumRange) -> None:
        self.inner, self.value_range, self.scheme = inner, value_range, inner.scheme

    def sender(self) -> Any:
        half = self.inner.sender()
        half.use_range(self.value_range)
        return half

    def adder(self) -> Any:
        return self.inner.adder()

    def receiver(self) -> Any:
        half = self.inner.receiver()
        half.use_range(self.value_range)
        return half


def scheme(name: str) -> Any:
    if name == "masks":
        return MaskingAggregator()
    if name == "ckks":
        return CkksAggregator()
    return paillier_aggregator()


def test_the_tail_allowed_per_draw_is_2_to_the_minus_80() -> None:
    assert 2 * norm.sf(TAIL_SIGMAS) == pytest.approx(2.0**-80, rel=1e-6)
    assert noised_bound(3.0, 0.5) == pytest.approx(0.5 * (1 + 3.0 * TAIL_SIGMAS))


def test_the_range_is_the_representation_bound_unless_clipped_noise_needs_more() -> None:
    assert sum_range({"gradient": (50.0, 0.01)}, contributors=4) == SumRange(65536.0, 4)
    small = sum_range({"embedding": (2.0, 1.0)}, contributors=3)
    assert small == SumRange(REPRESENTATION_BOUND, 3, clipped=True)
    large = sum_range({"embedding": (1e5, 2.0)}, contributors=4)
    assert large.value_bound == pytest.approx(2.0 * (1 + 1e5 * TAIL_SIGMAS))
    assert large.clipped and large.sum_bound == pytest.approx(4 * large.value_bound)
    with pytest.raises(ConfigError, match="at least one contributor"):
        SumRange(1.0, 0)


@pytest.mark.parametrize(("name", "sigma"), [("masks", 1e10), ("ckks", 2e4), ("paillier", 2e4)])
def test_clipped_rows_with_large_noise_sum_once_the_halves_are_sized(
    name: str, sigma: float
) -> None:
    """Clipped rows plus noise whose bound is beyond the backend's default range (masks: 6.9e10
    for 4 parties; CKKS 4096; Paillier 32768): refused by the default halves, summed to float
    precision by halves sized for the noise."""
    value_range = sum_range({"embedding": (sigma, 1.0)}, contributors=4)
    generator = np.random.default_rng(0)
    vectors = {}
    for k in range(4):
        row = np.clip(generator.normal(size=64), -1.0, 1.0) + sigma * generator.normal(size=64)
        row[0] = value_range.value_bound  # the extreme the range allows, from every party
        vectors[f"party-{k}"] = torch.from_numpy(row.astype(np.float32))
    with pytest.raises(DivergenceError, match=r"beyond what they encode"):
        vector_sum(scheme(name), vectors)
    summed = vector_sum(Ranged(scheme(name), value_range), vectors)
    exact = torch.stack([v.double() for v in vectors.values()]).sum(0)
    assert torch.allclose(summed.double(), exact, rtol=1e-6, atol=0.05)


def test_the_precision_kept_at_the_representation_bound_is_the_one_stated() -> None:
    """The module said Paillier keeps 15 fraction bits of 16 at the representation bound and
    every backend its default precision; Paillier's sizing gives 14 (65536 x 2^15 = 2^31 is
    past the largest 32-bit value, 2^31 - 1)."""
    value_range = SumRange(REPRESENTATION_BOUND, 4)
    masks, ckks, paillier = (
        MaskingAggregator().sender(),
        CkksAggregator().sender(),
        paillier_aggregator().sender(),
    )
    for half in (masks, ckks, paillier):
        half.use_range(value_range)
    assert (masks.fraction_bits, ckks.scale_bits) == (24, 40)  # their defaults
    stated = " ".join((protocols.sum_range.__doc__ or "").split())
    kept = re.search(r"Paillier\S* .*?(\d+) fraction bits instead of 16", stated)
    assert kept is not None and int(kept.group(1)) == paillier.fraction_bits == 14


def test_a_range_no_encoding_can_hold_is_refused_when_halves_are_sized() -> None:
    huge = SumRange(2.0**70, 4)
    with pytest.raises(ConfigError, match="pairwise masks cannot hold"):
        MaskingAggregator().sender().use_range(huge)
    with pytest.raises(ConfigError, match="need a scale below 2\\^30"):
        CkksAggregator().receiver().use_range(huge)
    with pytest.raises(ConfigError, match="Paillier slots of 32 value bits"):
        paillier_aggregator().sender().use_range(huge)


def private_run(
    data: Any, backend: str, *, lr: float, max_update_norm: float | None = None, **noise: Any
) -> tuple[Any, PrivacyEngine]:
    """One epoch of LASER (label party active) under ``noise`` through ``backend``;
    reproducible noise, so every backend meets the same draws."""
    config = TrainConfig(
        method="laser",
        dataset="iris",  # names the run; the data is the synthetic split given
        method_config=MethodConfig(
            heads="active",
            epochs=1,
            batch_size=32,
            lr=lr,
            secure_sums=backend != "none",
            max_update_norm=max_update_norm,
        ),
    )
    engine = PrivacyEngine(
        PrivacySpec(secure_agg=backend, insecure_reproducible_noise=True, **noise)
    )
    aggregator = paillier_aggregator() if backend == "paillier" else None
    return run_training(config, data=data, privacy=engine, aggregator=aggregator), engine


@pytest.mark.parametrize("backend", BACKENDS)
def test_divergence_is_reported_alike_by_every_backend(backend: str, make_data: MakeData) -> None:
    data = make_data(n=200, test_missing=("mcar:0",))
    with pytest.raises(DivergenceError, match=DIVERGED) as raised:
        private_run(data, backend, lr=0.5, dp_gradients=(1000.0, 1.0))  # diverges at once
    assert "at step 1: party-1's representation" in str(raised.value)  # the same point


@pytest.mark.parametrize("backend", ["none", "masks"])
def test_clipped_updates_keep_the_same_noise_from_diverging(
    backend: str, make_data: MakeData
) -> None:
    """The run above, whose noisy gradients blow the bottom models up at once, trains when
    every party clips its update's norm (what it steps with, post-processing its gradients)."""
    data = make_data(n=200, test_missing=("mcar:0",))
    result, _ = private_run(data, backend, lr=0.5, max_update_norm=1.0, dp_gradients=(1000.0, 1.0))
    assert result.privacy is not None and math.isfinite(result.epoch_loss[0])
    assert 0 <= result.metrics["mcar:0"]["accuracy"] <= 100


def test_max_update_norm_must_be_a_finite_positive_number() -> None:
    for bad in (0.0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ConfigError, match="`max_update_norm` must be a positive number"):
            MethodConfig(max_update_norm=bad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_embedding_noise_trains_through_every_backend(
    backend: str, make_data: MakeData
) -> None:
    """A noise bound of 1e5, beyond the CKKS and Paillier defaults, trains without overflow
    (before the range was chosen from the noise, CKKS refused a value of 4e4 here)."""
    data = make_data(n=120, test_missing=("mcar:0",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result, engine = private_run(data, backend, lr=0.001, dp_embeddings=(1e4, 1.0))
    # A tiny epsilon's RDP bound is best at Opacus' largest order; the user is not told so.
    assert not [w for w in caught if "Optimal order" in str(w.message)]
    assert result.privacy is not None
    assert engine.value_range is not None and engine.value_range.value_bound > 1e5
    if backend != "none":
        assert result.privacy["sum_range"]["value_bound"] == engine.value_range.value_bound
    else:
        assert result.privacy["sum_range"] is None


def test_the_guard_refuses_non_finite_gradients_and_passes_what_fits() -> None:
    guard = DivergenceGuard(SumRange(10.0, 4))
    header: dict[str, Any] = {"sender": "party-0", "receiver": "party-1", "batch_id": 0}
    fine = RepresentationMessage(
        **header, round=3, positions=torch.arange(2), representation=torch.full((2, 3), 10.0)
    )
    assert guard.on_message(fine) is fine
    gradient = torch.ones(2, 3)
    gradient[1, 2] = math.nan
    with pytest.raises(DivergenceError, match="at step 7: party-0's gradient for party-1 has "):
        guard.on_message(
            GradientMessage(**header, round=7, positions=torch.arange(2), gradient=gradient)
        )
    with pytest.raises(DivergenceError, match=r"at prediction: .* \|value\| 10\.5"):
        guard.on_message(
            RepresentationMessage(
                **header,
                round=0,
                phase="predict",
                positions=torch.arange(2),
                representation=torch.full((2, 3), -10.5),
            )
        )


def cli_train(out: Path, *extra: str) -> int:
    argv = ["train", "--method", "laser", "--heads", "active", "--dataset", "iris"]
    argv += ["--parties", "3", "--epochs", "1", "--seed", "0", "--quiet", "--out", str(out)]
    return main([*argv, *extra])


def test_the_cli_reports_divergence_under_secure_sums_in_one_line_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's command (digits, 4 parties), which stopped with "overflows the fixed-point
    ring ... lower fraction_bits"; reproducible noise so that it diverges every time."""
    argv = ["train", "--method", "laser", "--heads", "active", "--dataset", "digits"]
    argv += ["--parties", "4", "--epochs", "1", "--seed", "0", "--quiet"]
    argv += ["--dp-gradients", "1.0:0.01", "--target-epsilon", "1", "--secure-agg", "masks"]
    argv += ["--insecure-reproducible-noise", "--out", str(tmp_path / "run")]
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("secure-vfl: error: training diverged under the DP noise at step ")
    assert "overflows" not in err and "fraction_bits" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


def plain_config(data: Any, **method: Any) -> TrainConfig:
    """One epoch of LASER on the synthetic ``data``, without DP (``method``: MethodConfig's)."""
    return TrainConfig(
        method="laser",
        dataset=data.name,
        parties=data.train.parties,
        test_missing=("mcar:0",),
        method_config=MethodConfig(epochs=1, **method),
    )


def test_a_plain_run_that_diverges_says_where_and_what_to_try_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make_data: MakeData
) -> None:
    """Without DP nothing guards what a party sends: a run that blows up (here a learning rate
    of 1e8) is stopped by the receiver's codec, and said to have diverged, with the message,
    its sender and round, and what to try (it was the codec's bare refusal)."""
    data = make_data(n=200, test_missing=("mcar:0",))
    config = plain_config(data, lr=1e8, batch_size=32)
    diverged = (
        r"training diverged: \w+ from party-\d \(round \d+\): .*non-finite ones; "
        "try a lower --lr"
    )
    with pytest.raises(DivergenceError, match=diverged):
        run_training(config, data=data)
    argv = ["train", "--method", "laser", "--dataset", "digits", "--parties", "4", "--epochs"]
    argv += ["1", "--lr", "1e8", "--seed", "0", "--quiet", "--out", str(tmp_path / "run")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert re.match(f"secure-vfl: error: {diverged}", err) and len(err.splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("backend", "limit"),
    [
        ("masks", r"\|value\| <= 6\.871947674e\+10 \(24 fraction bits, 4 parties\)"),
        ("ckks", r"\|value\| <= 4096 \(a 40-bit scale\)"),
        ("paillier", r"values in \[-32768, 32768\) at 16 fraction bits"),
    ],
)
def test_a_secure_run_without_dp_that_diverges_says_so_at_the_sealing_party(
    backend: str, limit: str, make_data: MakeData
) -> None:
    """Without DP nothing sizes the sums: a representation past what the backend encodes
    stopped the run with the encoder's ProtocolError ("... lower fraction_bits", "raise
    max_magnitude": no flag sets either), where a plain run says it diverged."""
    data = make_data(n=200, test_missing=("mcar:0",))
    config = plain_config(data, lr=1e3, batch_size=32, heads="active", secure_sums=True)
    engine = PrivacyEngine(PrivacySpec(secure_agg=backend))
    aggregator = paillier_aggregator() if backend == "paillier" else None
    said = (
        rf"training diverged at (step \d+|prediction): party-\d's representation for the "
        rf"{backend} sums of party-0 has .*, beyond what they encode, {limit}; try a lower --lr"
    )
    with pytest.raises(DivergenceError, match=said):
        run_training(config, data=data, privacy=engine, aggregator=aggregator)


def test_a_model_its_last_step_left_non_finite_is_a_divergence_too(
    make_data: MakeData, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training may end on the step that made a model NaN: the test predictions are its first
    use, and they say the run diverged (they had escaped as the codec's bare refusal)."""
    data = make_data(n=120, test_missing=("mcar:0",))
    config = plain_config(data)
    parties: list[Any] = []
    predict = secure_vfl.experiment.predict_tests

    def after_a_last_step_gone_wrong(method: Any, data: Any) -> Any:
        with torch.no_grad():
            for parameter in parties[1].model.parameters():
                parameter.fill_(math.nan)
        return predict(method, data)

    monkeypatch.setattr(secure_vfl.experiment, "predict_tests", after_a_last_step_gone_wrong)
    with pytest.raises(
        DivergenceError,
        match=r"training diverged: representation from party-1 \(phase 'predict'\): .*lower --lr",
    ):
        run_training(config, data=data, on_ready=lambda c: parties.extend(in_process_parties(c)))


def test_a_private_secure_run_that_collapses_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    predict = secure_vfl.experiment.predict_tests

    def constant(method, data):  # type: ignore[no-untyped-def]
        return {name: np.where(p >= 0, 1, -1) for name, p in predict(method, data).items()}

    monkeypatch.setattr(secure_vfl.experiment, "predict_tests", constant)
    noise = ["--dp-embeddings", "1.0:1.0", "--target-epsilon", "4"]
    assert cli_train(tmp_path / "run", "--secure-agg", "masks", *noise) == 0
    assert "collapsed to one class (label 1" in capsys.readouterr().err
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["privacy"]["sum_range"]["contributors"] == 3
    assert any("collapsed to one class" in w for w in result["warnings"])


def test_a_target_epsilon_no_noise_reaches_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"no noise multiplier reaches --target-epsilon 0\.05"):
        calibrate_noise(0.05, 1e-5, sample_rate=1.0, steps=1)


def test_ranged_wrapper_is_a_sealing_scheme() -> None:
    assert isinstance(Ranged(MaskingAggregator(), SumRange(1.0, 2)), SealingScheme)


def test_each_backend_sizes_its_encoding_exactly_for_a_bound_just_above_a_power_of_two() -> None:
    """The bits were floor(headroom - log2(bound)): log2 of a bound just above a power of two
    rounds to that power, so masks, CKKS and Paillier took one bit too many and the range's own
    largest value overflowed the headroom."""
    from fractions import Fraction

    from protocols import ckks, paillier, secagg

    rng = np.random.default_rng(0)
    bounds = [math.nextafter(2.0**k, math.inf) for k in range(-8, 20)]
    bounds += list(rng.uniform(0.01, 1e5, 200))
    for bound in bounds:
        for contributors in (1, 3, 4):
            value_range = SumRange(bound, contributors)
            total = Fraction(bound) * contributors
            bits = secagg.fraction_bits_for(value_range, most=200)
            assert total * 2**bits <= 2**secagg.HEADROOM_BITS < total * 2 ** (bits + 1)
            scale = ckks.scale_bits_for(value_range, headroom_bits=78, most=200)
            assert total * 2**scale <= 2**78 < total * 2 ** (scale + 1)
            value_bits = paillier.fraction_bits_for(value_range, value_bits=48, most=200)
            assert (
                Fraction(bound) * 2**value_bits
                <= 2**47 - 1
                < Fraction(bound) * 2 ** (value_bits + 1)
            )
    assert secagg.fraction_bits_for(SumRange(bounds[12], 1), most=200) == 57  # 16 + 1 ulp
