"""The benchmarks still run: each one's smoke mode (``--quick``), in a process of its own as a
user runs it, writing only under a temporary ``--out``. No test ran them, and an API change
could break one unnoticed until its next measurement. The gRPC and deployment benchmarks (they
start party processes) and the slow ones are left to their own runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "dp_audit.py",
    "wire_costs.py",
    "startup_costs.py",
    "psi_costs.py",
    "release_frontier.py",
    "false_table.py",
    "fedhf_table.py",
    "laser_table.py",
]


@pytest.mark.parametrize("script", QUICK)
def test_a_benchmark_runs_its_quick_mode(script: str, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "|" in done.stdout  # its table
    assert "Traceback" not in done.stderr
    written = {path.name for path in out.rglob("*")} if out.exists() else set()
    assert not [name for name in written if name.endswith(".tmp")], written  # atomic writes
    assert not (ROOT / "benchmarks" / "results" / f"{Path(script).stem}_quick.md").exists()
