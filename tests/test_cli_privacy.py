"""`secure-vfl train` with differential privacy: epsilon per party in the result, flags checked."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from secure_vfl.cli import main

BASE = ["train", "--method", "laser", "--dataset", "digits", "--heads", "active", "--quiet"]


def test_dp_sgd_run_reports_epsilon_per_party(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dp"
    argv = [*BASE, "--epochs", "3", "--dp-sgd", "1.0:0.05", "--dp-gradients", "1.0:0.01"]
    assert main([*argv, "--out", str(out)]) == 0
    privacy = json.loads((out / "result.json").read_text())["privacy"]
    assert set(privacy["epsilon"]) == {f"party-{k}" for k in range(4)}
    assert all(0 < eps < math.inf for eps in privacy["epsilon"].values())
    # party-0 holds the labels: it also pays for the gradients it sends back.
    assert privacy["epsilon"]["party-0"] > privacy["epsilon"]["party-1"]
    assert privacy["releases"]["party-0"]["gradient"] > 0
    assert privacy["noise"]["dp-sgd"] == {"sigma": 1.0, "clip": 0.05}
    assert "epsilon (delta 1e-05): party-0" in capsys.readouterr().out


def test_target_epsilon_calibrates_the_noise_so_no_party_exceeds_it(tmp_path: Path) -> None:
    out = tmp_path / "target"
    argv = [*BASE, "--epochs", "2", "--dp-sgd", "1.0:0.05", "--target-epsilon", "4"]
    assert main([*argv, "--out", str(out)]) == 0
    privacy = json.loads((out / "result.json").read_text())["privacy"]
    spent = privacy["epsilon"].values()
    assert max(spent) <= 4.0 and max(spent) > 3.5
    assert privacy["noise"]["dp-sgd"]["sigma"] != 1.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--target-epsilon", "2"], "--target-epsilon calibrates a mechanism"),
        (["--dp-embeddings", "1.0"], "SIGMA:CLIP"),
        (["--dp-gradients", "-1:1"], "--dp-gradients"),
        (["--delta", "1"], "expected a probability in (0, 1), found '1'"),
    ],
)
def test_bad_privacy_flags_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    try:
        code = main([*BASE, *extra, "--out", str(tmp_path / "r")])
    except SystemExit as exit_info:
        code = exit_info.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_dp_sgd_is_refused_for_combinatorial(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--method", "combinatorial", "--dataset", "digits", "--dp-sgd", "1:0.05"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "--dp-sgd applies to methods with one bottom model per party" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
