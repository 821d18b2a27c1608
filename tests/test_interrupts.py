"""A command stopped by Ctrl-C (SIGINT) or SIGTERM sent to its own process only, as `timeout`,
`kill`, systemd or a batch scheduler do: it exits promptly with 130 or 143 and one line, stops
a sweep's worker processes, and leaves nothing half-written behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from secure_vfl.checkpoints import written_steps
from secure_vfl.deployment import FAILED_END_SECONDS

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.processes  # real processes and signals: one at a time
EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}
WORDS = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated"}


def _start(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "secure_vfl", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: the signal reaches it alone, not the tests
    )


def _children(pid: int) -> set[int]:
    """The live child processes of ``pid`` (Linux /proc)."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(p) for p in (task / "children").read_text().split()}
        except OSError:
            continue
    return found


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended


def _wait_for(condition: object, process: subprocess.Popen[str], what: str) -> None:
    deadline = time.monotonic() + 240
    while not condition():  # type: ignore[operator]
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{what} never happened: {process.communicate()[1]}")
        time.sleep(0.05)


def _stop_all(process: subprocess.Popen[str], workers: set[int]) -> None:
    """Whatever the test found, nothing it started keeps running."""
    for pid in [process.pid, *workers]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    process.wait(timeout=60)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_sweep_stopped_by_a_signal_to_its_own_process_stops_its_workers_and_exits(
    tmp_path: Path, signum: signal.Signals
) -> None:
    argv = ["sweep", "--attack", "direct-label-inference", "--method", "laser", "--dataset"]
    argv += ["digits", "--heads", "active", "--epochs", "50", "--workers", "2", "--seeds", "2"]
    argv += ["--defense", "dp-gradients:SIGMA:0.01", "--grid", "SIGMA=0.5,1", "--quiet"]
    argv += ["--top-model", "none", "--representation-dim", "10", "--out", "sweep"]
    process = _start(argv, tmp_path)
    workers: set[int] = set()
    try:
        _wait_for(lambda: len(_children(process.pid)) >= 2, process, "two workers")
        time.sleep(3)  # the workers are inside their runs
        workers = _children(process.pid)
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)  # it used to hang here, joining its workers
        assert process.returncode == EXIT[signum], err
        assert f"secure-vfl: {WORDS[signum]}; what it had written stays" in err, err
        assert "Traceback" not in err, err
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in workers), "a worker outlived the sweep"
        assert not (tmp_path / "sweep" / "sweep.json").exists()
    finally:
        _stop_all(process, workers)


def test_a_train_terminated_mid_run_leaves_no_temporary_and_its_checkpoints_ask_for_resume(
    tmp_path: Path,
) -> None:
    argv = ["train", "--method", "laser", "--dataset", "breast-cancer", "--epochs", "30"]
    argv += ["--batch-size", "32", "--checkpoint-every", "1", "--quiet", "--out", "run"]
    process = _start(argv, tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    try:
        _wait_for(lambda: written_steps(checkpoints, "party-0"), process, "a checkpoint")
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 143, err
        assert "secure-vfl: terminated;" in err and "Traceback" not in err, err
    finally:
        _stop_all(process, set())
    left = [p for p in (tmp_path / "run").rglob("*") if ".tmp" in p.name]
    assert not left, f"temporaries left behind: {left}"
    assert not (tmp_path / "run" / "result.json").exists()
    # Run again without --resume: the killed run's checkpoints are not thrown away.
    again = _start(argv, tmp_path)
    _, err = again.communicate(timeout=120)
    assert again.returncode == 2, err
    assert "holds the checkpoints of an earlier run" in err and "expected --resume run" in err
    assert written_steps(checkpoints, "party-0")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_served_party_stopped_by_a_signal_says_so_in_one_line(
    tmp_path: Path, signum: signal.Signals
) -> None:
    """SIGTERM killed `party serve` where it stood, without a word (Ctrl-C said it)."""
    from test_deploy import write_federation, write_party_files

    from protocols import tls
    from secure_vfl.federation.network import free_loopback_ports

    write_party_files(tmp_path)
    tls.make_federation(tmp_path / "certs", ["bank", "shop", "insurer", "telco", "aggregator"])
    federation = write_federation(tmp_path, tmp_path / "certs", free_loopback_ports(5))
    process = _start(
        ["party", "serve", "--federation", str(federation), "--name", "shop"], tmp_path
    )
    try:
        time.sleep(4)  # it serves, waiting for the label party
        assert process.poll() is None, process.communicate()[1]
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
        assert process.returncode == EXIT[signum], err
        assert f"secure-vfl: {WORDS[signum]}; what it had written stays" in err, err
        assert "Traceback" not in err, err
    finally:
        _stop_all(process, set())


def test_ctrl_c_at_the_label_party_with_a_hung_party_ends_without_waiting_out_its_deadline(
    tmp_path: Path, processes: Any
) -> None:
    """With a data party hung (stopped), Ctrl-C at the label party printed nothing for the
    whole --deadline (60 s) while it told that party the run was over; then, with two hung, it
    waited FAILED_END_SECONDS for each in turn. The ends now go to every party at once."""
    from test_deploy import write_federation, write_party_files

    from protocols import tls
    from secure_vfl.federation.network import free_loopback_ports

    write_party_files(tmp_path)
    tls.make_federation(tmp_path / "certs", ["bank", "shop", "insurer", "telco", "aggregator"])
    federation = write_federation(tmp_path, tmp_path / "certs", free_loopback_ports(5))
    servers = {
        n: processes.serve(federation, n) for n in ("shop", "insurer", "telco", "aggregator")
    }
    argv = ["train", "--federation", str(federation), "--name", "bank", "--method", "laser"]
    label = _start([*argv, "--epochs", "200", "--batch-size", "16", "--quiet"], tmp_path)
    try:
        _wait_for(lambda: "training" in processes.log("telco"), label, "training at telco")
        time.sleep(1)
        for hung in ("telco", "insurer"):
            os.kill(servers[hung].pid, signal.SIGSTOP)
        time.sleep(1)
        start = time.monotonic()
        label.send_signal(signal.SIGINT)
        _, err = label.communicate(timeout=120)
        took = time.monotonic() - start
        assert label.returncode == 130, err
        assert "could not end the run at telco" in err, err
        assert "could not end the run at insurer" in err, err
        # One wait for both, not one each (2 x FAILED_END_SECONDS = 10 s before).
        assert took < 2 * FAILED_END_SECONDS, f"{took:.1f} s to stop after Ctrl-C: {err}"
        # The parties that answered learn it was stopped, not that it failed.
        assert servers["shop"].wait(timeout=60) == 1
        assert "the label party's operator stopped the run" in processes.log("shop")
    finally:
        for hung in ("telco", "insurer"):
            os.kill(servers[hung].pid, signal.SIGCONT)
        _stop_all(label, set())
