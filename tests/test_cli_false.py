"""`secure-vfl train --method false-vfl-*`: a small run end to end, and the flags it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from secure_vfl.cli import main

SMALL = ["--dataset", "digits", "--labeled", "200", "--p-miss-train", "0.2", "--quiet"]
SMALL += ["--epochs", "8", "--batch-size", "64", "--kappa", "4", "--inference-samples", "16"]
TESTS = ["--missing-test", "mcar:0", "--missing-test", "mar1", "--missing-test", "mnar:0.7"]


@pytest.mark.parametrize(("method", "secure"), [("false-vfl-1", "none"), ("false-vfl-2", "masks")])
def test_false_vfl_trains_end_to_end_on_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], method: str, secure: str
) -> None:
    out = tmp_path / method
    argv = ["train", "--method", method, *SMALL, *TESTS, "--secure-agg", secure]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["false_vfl"]["kappa"] == 4
    assert result["config"]["false_vfl"]["inference_samples"] == 16
    assert result["config"]["method_config"]["labeled"] == 200
    assert set(result["metrics"]) == {"mcar:0", "mar1", "mnar:0.7"}
    assert result["metrics"]["mcar:0"]["accuracy"] > 40.0  # chance is 10 %
    # Both stages are counted: 23 stage-1 steps (1437 rows) and 4 stage-2 steps per epoch.
    assert result["traffic"]["train_steps"] == 8 * (23 + 4)
    assert "200 labelled" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--method", "laser", "--kappa", "5"], "--kappa applies to --method false-vfl-1"),
        (
            ["--method", "laser", "--kappa", "5", "--inference-samples", "9"],
            "--kappa and --inference-samples apply to --method false-vfl-1",
        ),
        (  # it was recorded in result.json and did nothing
            ["--method", "false-vfl-1", "--representation-dim", "7"],
            "--representation-dim applies to the split networks; false-vfl-1's latent sizes",
        ),
        (["--method", "false-vfl-1", "--lr", "0.1"], "false-vfl-1 trains with its own Adam rates"),
        (
            ["--method", "laser", "--standard-incomplete", "zero"],
            "--standard-incomplete applies to --method standard",
        ),
        (
            ["--method", "plugvfl", "--standard-incomplete", "zero"],
            "Found --method plugvfl",
        ),
        (
            ["--method", "false-vfl-1", "--dp-gradients", "1:0.01", "--dp-sgd", "1:0.05"],
            "mechanisms, and noise on its (mean, precision) would break the precisions. Found "
            "--dp-gradients, --dp-sgd.",
        ),
    ],
)
def test_flags_that_do_not_apply_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    out = tmp_path / "r"
    assert main(["train", "--dataset", "digits", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()
