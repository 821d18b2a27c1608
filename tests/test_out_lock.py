"""A command that writes a run's folder (`train`, `attack`, `sweep`, `attack --suite`,
`impute`) holds that folder's lock until it ends: a second command given the same `--out`
meanwhile is refused before any work. Two such runs used to each replace the other's files,
and the later one won without `--overwrite` (neither found a finished run when it started)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from secure_vfl.cli import main
from secure_vfl.errors import ConfigError
from secure_vfl.io import LOCK_FILE, lock_directory

TRAIN = ["train", "--method", "laser", "--dataset", "breast-cancer", "--epochs", "1", "--quiet"]
COMMANDS = {
    "train": TRAIN,
    "attack": [
        *["attack", "--attack", "norm-scoring", "--method", "standard"],
        *["--dataset", "breast-cancer", "--heads", "active", "--epochs", "1"],
    ],
    "sweep": [
        *["sweep", "--attack", "norm-scoring", "--method", "standard", "--dataset"],
        *["breast-cancer", "--heads", "active", "--epochs", "1", "--defense", "marvell:1"],
    ],
    "suite": ["attack", "--suite", "all", "--method", "standard", "--dataset", "breast-cancer"],
    "impute": ["impute", "--method", "mean", "--dataset", "airquality"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_folder_another_process_writes_in_is_refused_before_any_work(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    holder = subprocess.Popen(  # another process, holding the lock as a running command does
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from secure_vfl.io import lock_directory; "
            f"lock_directory(Path({str(out)!r}), '--out'); print('held', flush=True); "
            "sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        assert main([*COMMANDS[command], "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"process {holder.pid} is writing there" in err, err
        assert [path.name for path in out.iterdir()] == [LOCK_FILE]  # nothing of the run
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_the_lock_is_released_when_the_command_ends_and_its_file_goes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert main([*TRAIN, "--out", str(out)]) == 0
    assert (out / "result.json").exists() and not (out / LOCK_FILE).exists()
    lock_directory(out, "--out")()  # free again: this process takes and releases it
    assert main([*TRAIN, "--out", str(out), "--overwrite"]) == 0
    # a failed command releases it too, before removing the folder it made and left empty
    (tmp_path / "store.db").write_text("not a results store")  # refused after the lock
    assert (
        main([*TRAIN, "--out", str(tmp_path / "new"), "--store", str(tmp_path / "store.db")]) == 2
    )
    assert "store.db" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_a_lock_file_left_by_a_killed_command_does_not_stop_the_next(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / LOCK_FILE).write_text("999999999\n")  # its process is gone; the system's lock too
    assert main([*TRAIN, "--out", str(out)]) == 0
    assert not (out / LOCK_FILE).exists()


def test_a_held_lock_is_refused_within_one_process_too_and_taken_once_released(
    tmp_path: Path,
) -> None:
    release = lock_directory(tmp_path, "--out")
    try:
        with pytest.raises(ConfigError, match=f"process {os.getpid()} is writing there"):
            lock_directory(tmp_path, "--out")
    finally:
        release()
    assert not (tmp_path / LOCK_FILE).exists()
    lock_directory(tmp_path, "--out")()


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_file_that_is_a_link_is_refused_and_what_it_names_is_untouched(
    tmp_path: Path, link: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A symbolic link at the lock's name had the file it names truncated to a process id (as
    root, any file), even when the command was then refused."""
    precious = tmp_path / "notes.txt"
    precious.write_text("precious")
    out = tmp_path / "run"
    out.mkdir()
    if link == "symbolic":
        (out / LOCK_FILE).symlink_to(precious)
    else:
        os.link(precious, out / LOCK_FILE)
    assert main([*TRAIN, "--out", str(out)]) == 2
    assert "a lock file of its own" in capsys.readouterr().err
    assert precious.read_text() == "precious" and not (out / "result.json").exists()
