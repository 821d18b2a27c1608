"""`train --checkpoint-every N` and `train --resume DIR`: a `secure-vfl train` process killed
with SIGKILL after a checkpoint resumes to exactly the result of an uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

import pytest
import torch
from test_cli_own_data import train_argv, write_case

from secure_vfl import tensor_file
from secure_vfl.checkpoints import written_steps
from secure_vfl.cli import main

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.processes  # kills a process after its checkpoint: one at a time
RUN = [
    "train",
    "--method",
    "laser",
    "--dataset",
    "breast-cancer",
    "--epochs",
    "10",
    "--batch-size",
    "32",
    "--quiet",
]


def _result(out: Path) -> dict[str, Any]:
    return dict(json.loads((out / "result.json").read_text()))


def _models(out: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the saved model, by party, file and name."""
    found = {}
    for path in sorted((out / "model").glob("*/*.safetensors")):
        state = tensor_file.loads(path.read_bytes(), str(path))
        for name, value in state.items():
            found[f"{path.parent.name}/{path.name}/{name}"] = value
    return found


def _kill_after_a_checkpoint(out: Path) -> None:
    """Start `secure-vfl train` with checkpoints and SIGKILL it once one is committed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    argv = [*RUN, "--checkpoint-every", "20", "--out", str(out)]
    process = subprocess.Popen(
        [sys.executable, "-m", "secure_vfl", *argv],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not written_steps(out / "checkpoints", "party-0"):
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"no checkpoint before the run ended: {process.stderr}")
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (out / "result.json").exists()


def test_a_train_process_killed_after_a_checkpoint_resumes_to_the_uninterrupted_result(
    tmp_path: Path, one_thread: None
) -> None:
    killed = tmp_path / "killed"
    _kill_after_a_checkpoint(killed)
    resumed_from = written_steps(killed / "checkpoints", "party-0")[-1]
    assert main([*RUN, "--out", str(killed), "--resume", str(killed)]) == 0
    whole = tmp_path / "whole"
    assert main([*RUN, "--out", str(whole)]) == 0
    resumed, expected = _result(killed), _result(whole)
    assert resumed["checkpoints"]["resumed_from_step"] == resumed_from > 0
    assert resumed["epoch_loss"] == expected["epoch_loss"]
    assert resumed["metrics"] == expected["metrics"]
    found, wanted = _models(killed), _models(whole)
    assert found.keys() == wanted.keys() and found
    assert all(torch.equal(found[name], wanted[name]) for name in wanted)


def test_resume_without_out_finishes_in_the_killed_runs_own_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # where the default --out (runs/...) would go
    run = tmp_path / "run"
    argv = [*RUN, "--epochs", "1", "--checkpoint-every", "5"]
    assert main([*argv, "--out", str(run)]) == 0
    assert main([*argv, "--resume", str(run), "--overwrite"]) == 0
    assert _result(run)["checkpoints"]["resumed_from_step"] > 0
    assert not (tmp_path / "runs").exists()


def _checkpointed_run(tmp_path: Path) -> tuple[Path, Path]:
    """A one-epoch run that checkpoints into its own directory; the --out to resume into."""
    checkpoints = tmp_path / "checkpoints"
    argv = [*RUN, "--epochs", "1", "--checkpoint-every", "5", "--checkpoint-dir", str(checkpoints)]
    assert main([*argv, "--out", str(tmp_path / "first")]) == 0
    return tmp_path / "resumed", checkpoints


def test_resume_with_another_flag_is_refused_in_one_line_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, checkpoints = _checkpointed_run(tmp_path)
    capsys.readouterr()
    argv = [*RUN, "--epochs", "1", "--lr", "0.1", "--out", str(out), "--resume", str(checkpoints)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "`method_config.lr` (--lr) differs (checkpoint: 0.03, this run: 0.1)" in err
    assert not (out / "result.json").exists()


def test_a_refused_resume_names_the_flag_of_a_setting_stored_under_another_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The flag was looked up by the setting's name: `train_missing`, `test_missing` and
    `privacy.adjacency` were refused without the flags that set them."""
    checkpoints = tmp_path / "checkpoints"
    argv = [*RUN, "--epochs", "1", "--batching", "mixed", "--dp-embeddings", "1.0:1.0"]
    argv += ["--checkpoint-every", "5", "--checkpoint-dir", str(checkpoints)]
    assert main([*argv, "--out", str(tmp_path / "first")]) == 0
    resumed = [*argv, "--out", str(tmp_path / "resumed"), "--resume", str(checkpoints)]
    for flags, differs in [
        (["--missing-train", "mcar:0.2"], "`train_missing` (--missing-train or --p-miss-train)"),
        (["--p-miss-test", "0.3"], "`test_missing` (--missing-test or --p-miss-test)"),
        (["--dp-adjacency", "add-remove"], "`privacy.adjacency` (--dp-adjacency)"),
    ]:
        capsys.readouterr()
        assert main([*resumed, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{differs} differs (checkpoint: " in err, err


def test_a_resume_takes_the_same_files_given_by_relative_or_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The files' paths were compared as given: a run given pf/labels.csv was refused a resume
    given /tmp/.../pf/labels.csv (`label_file` differs), though the files were the same."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pf").mkdir()
    files = write_case(tmp_path / "pf")
    checkpoints = ["--checkpoint-every", "2", "--checkpoint-dir"]
    relative = [path.relative_to(tmp_path) for path in files]
    assert main(train_argv(*relative, Path("first"), *checkpoints, "kept")) == 0
    kept = str(tmp_path / "kept")
    assert main(train_argv(*files, tmp_path / "resumed", *checkpoints, kept, "--resume", kept)) == 0
    assert _result(tmp_path / "resumed")["checkpoints"]["resumed_from_step"] > 0


def test_a_tampered_checkpoint_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, checkpoints = _checkpointed_run(tmp_path)
    step = written_steps(checkpoints, "party-1")[-1]
    tensors = checkpoints / "party-1" / f"step-{step:08d}" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:-100])
    capsys.readouterr()
    assert main([*RUN, "--epochs", "1", "--out", str(out), "--resume", str(checkpoints)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "party-1" in err and "truncated" in err


def test_checkpoint_flags_that_cannot_apply_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main([*RUN, "--checkpoint-dir", str(tmp_path / "c"), "--out", str(out)]) == 2
    assert "--checkpoint-dir goes with --checkpoint-every" in capsys.readouterr().err
    assert main([*RUN, "--out", str(out), "--resume", str(tmp_path / "none")]) == 2
    # it said "a checkpoint of the label party party-0 expected under .../none/party-0"
    assert "--resume " + str(tmp_path / "none") + ": the --out of a killed run (or its " in (
        capsys.readouterr().err
    )
    a_file = tmp_path / "file.csv"
    a_file.write_text("id\n")
    assert main([*RUN, "--out", str(out), "--resume", str(a_file)]) == 2
    assert "checkpoints directory) expected; found a file." in capsys.readouterr().err
    # a --checkpoint-dir that is a file, or under one, or that the system will not make
    # (/proc/xyz, even to root) failed at the first checkpoint, after training began
    for directory, said in [
        (a_file, f"--checkpoint-dir {a_file} is a file; a directory, or a path where one"),
        (a_file / "sub", f"--checkpoint-dir {a_file / 'sub'} lies under {a_file}, a file;"),
        (Path("/proc/xyz"), "--checkpoint-dir /proc/xyz: a directory"),
    ]:
        argv = [*RUN, "--checkpoint-every", "2", "--checkpoint-dir", str(directory)]
        with patch("secure_vfl.experiment.run_training", side_effect=AssertionError("trained")):
            assert main([*argv, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() or not (out / "result.json").exists()


def test_a_killed_runs_checkpoints_are_kept_and_a_finished_run_is_not_resumed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh run into the --out of a killed one used to replace its checkpoints unasked;
    --resume of a finished run got the generic 'result.json exists'; a resumed run's summary
    did not say it resumed."""
    run = tmp_path / "run"
    argv = [*RUN, "--epochs", "1", "--checkpoint-every", "5", "--out", str(run)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main([*argv, "--resume", str(run)]) == 2
    assert "holds a finished run" in capsys.readouterr().err
    # A finished run without checkpoints (the usual kind) was sent looking for the label
    # party's checkpoint under a folder that no run writes.
    plain = tmp_path / "plain"
    assert main([*RUN, "--epochs", "1", "--out", str(plain)]) == 0
    capsys.readouterr()
    resumed = [*RUN, "--epochs", "1", "--resume", str(plain), "--out", str(tmp_path / "more")]
    assert main(resumed) == 2
    assert (
        f"--resume {plain}: it holds a finished run without checkpoints "
        f"({plain / 'result.json'}): nothing to resume." in capsys.readouterr().err
    )
    (run / "result.json").unlink()  # what a killed run leaves: its checkpoints, no result
    shutil.rmtree(run / "model")
    steps = written_steps(run / "checkpoints", "party-0")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"holds the checkpoints of an earlier run (its last of step {steps[-1]})" in err
    assert f"expected --resume {run} to go on from them, or --overwrite" in err
    assert written_steps(run / "checkpoints", "party-0") == steps
    assert main([*argv, "--resume", str(run)]) == 0
    said = capsys.readouterr().out
    assert (
        f"resumed from the checkpoints of step {steps[-1]} in" in said and "wrote none" not in said
    )
    (run / "result.json").unlink()
    shutil.rmtree(run / "model")
    assert main([*RUN, "--epochs", "1", "--out", str(run), "--resume", str(run)]) == 0
    assert "(and wrote none: no --checkpoint-every)" in capsys.readouterr().out
    assert main([*argv, "--overwrite"]) == 0  # a fresh run, asked for


def test_a_fresh_run_without_checkpoints_into_a_killed_runs_out_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --checkpoint-every a fresh run into a killed run's --out went ahead and left
    the killed run's checkpoints beside its result (`--resume` then: "a finished run"), and
    --overwrite kept them too; --resume DIR/checkpoints without --out finished in runs/...."""
    run = tmp_path / "run"
    checkpointed = [*RUN, "--epochs", "1", "--checkpoint-every", "5", "--out", str(run)]
    assert main(checkpointed) == 0
    (run / "result.json").unlink()  # what a killed run leaves: its checkpoints, no result
    shutil.rmtree(run / "model")
    steps = written_steps(run / "checkpoints", "party-0")
    capsys.readouterr()
    plain = [*RUN, "--epochs", "1", "--out", str(run)]
    assert main(plain) == 2
    assert f"expected --resume {run} to go on from them, or --overwrite" in capsys.readouterr().err
    assert written_steps(run / "checkpoints", "party-0") == steps
    monkeypatch.chdir(tmp_path)  # where the default --out (runs/...) would go
    assert main([*RUN, "--epochs", "1", "--resume", str(run / "checkpoints")]) == 0
    assert (run / "result.json").exists() and not (tmp_path / "runs").exists()
    (run / "result.json").unlink()
    shutil.rmtree(run / "model")
    assert main([*plain, "--overwrite"]) == 0
    assert (run / "result.json").exists() and not (run / "checkpoints").exists()


def test_a_checkpoint_directory_another_command_writes_in_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Only --out was locked: two runs resuming one killed run into two --out folders wrote
    into its checkpoints at once, each removing the other's older steps, and one failed
    ("party-1's checkpoint of step 8 expected; found none"). The directory a run writes its
    checkpoints into is now held as --out is (the test holds it as another command would)."""
    from secure_vfl.io import LOCK_FILE, lock_directory

    checkpoints = tmp_path / "checkpoints"
    argv = [*RUN, "--checkpoint-every", "2", "--checkpoint-dir", str(checkpoints)]
    release = lock_directory(checkpoints, "--checkpoint-dir")
    try:
        with patch("secure_vfl.experiment.run_training", side_effect=AssertionError("trained")):
            assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    finally:
        release()
    err = capsys.readouterr().err
    assert f"--checkpoint-dir {checkpoints}: a folder no other command writes in expected" in err
    assert f"process {os.getpid()} is writing there" in err
    # Free, it is held while the run trains (and let go after); inside --out, whose lock
    # holds its checkpoints too, none is taken there.
    out = tmp_path / "inside"
    held: list[bool] = []

    def trained(*_: Any, **__: Any) -> None:
        held.append((checkpoints / LOCK_FILE).exists())
        held.append((out / "checkpoints" / LOCK_FILE).exists())
        raise KeyboardInterrupt

    with patch("secure_vfl.experiment.run_training", side_effect=trained):
        main([*argv, "--out", str(tmp_path / "run")])
        main([*RUN, "--checkpoint-every", "2", "--out", str(out)])
    assert held == [True, False, False, False]
    assert not (checkpoints / LOCK_FILE).exists()
    # A resume without --checkpoint-every writes there too (a DP run's journals): held too.
    assert main([*RUN, "--epochs", "1", *argv[len(RUN) :], "--out", str(tmp_path / "r")]) == 0
    release = lock_directory(checkpoints, "--checkpoint-dir")
    try:
        resume = [*RUN, "--epochs", "1", "--resume", str(checkpoints)]
        assert main([*resume, "--out", str(tmp_path / "again")]) == 2
    finally:
        release()
    assert "a folder no other command writes in expected" in capsys.readouterr().err


def test_a_file_where_the_default_checkpoints_go_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --checkpoint-dir the refusal named the flag all the same."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("")
    with patch("secure_vfl.experiment.run_training", side_effect=AssertionError("trained")):
        assert main([*RUN, "--checkpoint-every", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'checkpoints'} (where the run's checkpoints go): a directory expected" in err
    assert "--checkpoint-dir" not in err
