"""The benchmarks still run: each one's smoke mode (``--quick``), in a process of its own as a
user runs it, writing only under a temporary ``--out``. No test ran them, and an API change
could break one unnoticed until its next measurement. The gRPC and deployment benchmarks (they
start party processes) and the slow ones are left to their own runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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
    "laser_speed.py",
]


@pytest.fixture(scope="module", params=QUICK)
def quick_run(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A script's ``--quick`` run (run once for every test of it) and its ``--out``."""
    work = tmp_path_factory.mktemp(Path(request.param).stem)
    out = work / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / request.param), "--quick", "--out", str(out)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    return done, out


def test_a_benchmark_runs_its_quick_mode(
    quick_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    done, out = quick_run
    script = Path(done.args[1]).name
    assert done.returncode == 0, done.stderr[-2000:]
    assert "|" in done.stdout  # its table
    assert "Traceback" not in done.stderr
    written = {path.name for path in out.rglob("*")} if out.exists() else set()
    assert not [name for name in written if name.endswith(".tmp")], written  # atomic writes
    assert not (ROOT / "benchmarks" / "results" / f"{Path(script).stem}_quick.md").exists()


def test_a_quick_run_says_it_is_a_smoke_run(
    quick_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """dp_audit's, psi_costs' and release_frontier's --quick reports (written as *_quick beside
    the committed results) and wire_costs' and startup_costs' printed ones read as results:
    "All as expected", a target missed, a verdict from one epoch."""
    done, out = quick_run
    assert done.returncode == 0, done.stderr[-2000:]
    assert "**A `--quick` smoke run**" in done.stdout
    for report in out.glob("*.md"):
        assert "**A `--quick` smoke run**" in report.read_text(), report.name


def test_every_benchmark_help_gives_its_description_whole() -> None:
    """false_table's, grpc_floor's and suite_table's --help stopped their description mid-
    sentence ("... (Fashion-MNIST block, trained"): the first line of a docstring whose first
    sentence runs over two."""
    scripts = sorted(str(path) for path in (ROOT / "benchmarks").glob("[a-z]*.py"))
    shown = subprocess.run(
        [sys.executable, "-c", _HELP_OF_EACH, str(ROOT / "benchmarks"), *scripts],
        env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "100"},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    helps = json.loads(shown.stdout)
    assert len(helps) == len(scripts) >= 16
    cut = {}
    for script, text in helps.items():
        description = text.split("\n\n")[1]  # after the usage lines, before the options
        if not description.rstrip().endswith("."):
            cut[Path(script).name] = description
    assert not cut, cut


_HELP_OF_EACH = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
helps = {}
for script in sys.argv[2:]:
    sys.argv = [script, "--help"]
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), contextlib.suppress(SystemExit):
        runpy.run_path(script, run_name="__main__")
    helps[script] = shown.getvalue()
print(json.dumps(helps))
"""


@pytest.mark.parametrize("script", ["deploy_costs.py", "deploy_cpu.py"])
def test_write_site_refuses_a_directory_that_exists(script: str, tmp_path: Path) -> None:
    """--write-site DIR (a new directory) given one that exists, or a file, ended in a
    FileExistsError traceback."""
    taken = tmp_path / "site"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine\n")
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    for target in (taken, afile):
        done = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), "--write-site", str(target)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert done.returncode == 2, done.stderr[-2000:]
        assert "Traceback" not in done.stderr
        assert f"--write-site {target}: a new directory expected" in done.stderr
    assert [path.name for path in taken.iterdir()] == ["notes.txt"]
    assert afile.read_text() == "mine\n"


@pytest.mark.parametrize(("short", "long"), [("2", "2"), ("3", "2")])
def test_checkpoint_costs_refuses_a_long_run_no_longer_than_the_short_one(
    short: str, long: str, tmp_path: Path
) -> None:
    """Its per-epoch costs are the long runs less the short ones: --short 2 --long 2 divided by
    zero after two trainings (a traceback), --short 3 --long 2 reported negative epochs."""
    script = str(ROOT / "benchmarks" / "checkpoint_costs.py")
    done = subprocess.run(
        [sys.executable, script, "--short", short, "--long", long, "--out", str(tmp_path / "out")],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 2, (done.stdout[-1000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert f"--short < --long expected; found {short} and {long}" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("only", ["dp", "training"])
@pytest.mark.parametrize("kept", ["{broken", "[]", '{"command": "python benchmarks/x.py"}'])
def test_protocol_costs_only_one_section_refuses_kept_results_it_cannot_use(
    kept: str, only: str, tmp_path: Path
) -> None:
    """--only dp (or training) keeps the other sections of the results' JSON: one that does not
    parse ended in a JSONDecodeError traceback, one without those sections in a traceback after
    the DP runs."""
    (tmp_path / "protocol_costs.json").write_text(kept)
    script = str(ROOT / "benchmarks" / "protocol_costs.py")
    done = subprocess.run(
        [sys.executable, script, "--only", only, "--out", str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"--only {only} keeps the other sections of {tmp_path / 'protocol_costs.json'}" in (
        done.stderr
    )
    assert (tmp_path / "protocol_costs.json").read_text() == kept


def test_laser_speed_quick_is_a_smoke_run_of_every_configuration_kind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """laser_speed --quick ran all 31 configurations of the full run (each a fresh interpreter
    importing torch: over 5 minutes on 2 cores) where the other benchmarks' smoke runs take a
    minute or less. It must keep every method, both batchings and both task forwards, in few
    configurations (run in one process), and leave the full run's as they are."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import laser_speed

    def kinds(jobs: list[laser_speed.Job]) -> set[tuple[str, str, str, bool]]:
        return {(job.kind, job.method, job.batching, job.vectorised) for job in jobs}

    full = laser_speed.plan(None, quick=False)
    quick = laser_speed.plan(None, quick=True)
    assert len(full) == 31
    assert {job.parties for job in full} == {2, 4, 6, 8}
    assert {(job.epochs, job.steps) for job in full} == {(3, 200)}
    assert len(quick) <= 10
    assert kinds(quick) == kinds(full)
    assert laser_speed.plan([3], quick=True)[0].parties == 3  # --parties still chooses


def test_protocol_costs_stocks_the_paillier_pools_a_training_step_draws(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its Paillier training step is timed with every party's obfuscator pool stocked offline,
    but it stocked one task's worth (rows x width) while a step under the secure planner seals
    every task of the batch: about two thirds of each step's obfuscators were computed inside
    the timed step (26 s a step where 0.8 s had been committed), and left out of the offline
    time."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import numpy as np
    from protocol_costs import stock_pools

    from protocols.paillier import PaillierAggregator
    from secure_vfl.experiment import TrainConfig, build_method, prepare_data
    from secure_vfl.methods import MethodConfig
    from secure_vfl.methods.base import in_process_parties

    config = TrainConfig(
        method="laser",
        dataset="digits",
        parties=4,
        train_missing="mcar:0.2",
        test_missing=("mcar:0",),
        method_config=MethodConfig(
            heads="active", secure_sums=True, batch_size=8, representation_dim=8
        ),
    )
    aggregator = PaillierAggregator(key_bits=1024)
    method = build_method(config, prepare_data(config), aggregator=aggregator)
    pools = [party.sealer.pool("party-0") for party in in_process_parties(method.fed.channel)]
    for step, batch in enumerate(list(method.sampler.epoch(np.random.default_rng(0)))[:3]):
        stock_pools(method, aggregator, batch)
        stocked = [pool.generated for pool in pools]
        method.train_step(batch, step, 0)
        assert [pool.generated for pool in pools] == stocked  # none computed in the step
        assert not any(len(pool) for pool in pools)  # and none left over


def test_protocol_costs_quick_is_a_smoke_run_of_every_section(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """protocol_costs --quick took over 5 minutes on 2 cores, most of it Paillier-2048
    obfuscators for the issue's 256 x 64 sum and for 128-row, 128-wide training steps, where
    the other benchmarks' smoke runs take a minute or less. Its Paillier work (values sealed,
    each sum and step) must be a small fraction of the full run's, its PSI and DP runs few,
    and the full run's sizes as committed."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import math

    from protocol_costs import SHAPES, RunSizes, run_sizes

    def sealed(size: RunSizes) -> int:
        sums = sum(math.prod(shape) for shape in size.shapes) * max(2, size.repeats // 3)
        return sums + size.batch_size * size.width * (size.steps + 1)

    full, quick = run_sizes(quick=False), run_sizes(quick=True)
    assert full == RunSizes(
        7, SHAPES, 10, 3, (10_000, 2000), (10_000, 100_000, 1_000_000), 3, 5, 7, 128, 128
    )
    assert 100 * sealed(quick) <= sealed(full)
    assert quick.shapes and quick.steps >= 2 and quick.repeats >= 2  # a median of each
    assert max(quick.psi_sizes) <= 1000 and quick.psi_repeats == 1 and quick.dp_repeats == 1


@pytest.mark.parametrize(
    "epochs",
    [(0.35, 0.30, 0.42), (0.35, 0.41, 0.38), (-0.02, 0.4, 0.5), (0.35, 0.4, -0.1)],
)
def test_checkpoint_costs_shows_no_impossible_cost(
    epochs: tuple[float, float, float], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch's costs are differences of two runs' wall times, and in a --quick run (1 and 2
    epochs) the runs' noise can exceed them: it printed a negative epoch, negative ratios and
    extras, a journal line or a checkpoint of negative milliseconds. What cannot be a time or
    a cost is not shown, and the report says why; what can is."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import re

    from checkpoint_costs import cost_lines

    rows = {
        config: {"epoch_s": epoch, "journaled": 0.0 if config == "none" else 140.0}
        for config, epoch in zip(["none", "journal", "every 10"], epochs, strict=True)
    }
    text = "\n".join(cost_lines(rows))
    assert not re.search(r"(?<![|\w])-\d", text), text  # no negative figure
    assert "not shown" in text.lower()
    for config, epoch in zip(rows, epochs, strict=True):  # a positive epoch is shown
        if epoch > 0:
            assert f"| {config} | {epoch:.3f} |" in text


def test_checkpoint_costs_without_journaled_releases_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A journal run that journaled nothing divided by zero (a traceback after every run)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from checkpoint_costs import cost_lines

    rows = {
        "none": {"epoch_s": 0.35, "journaled": 0.0},
        "journal": {"epoch_s": 0.41, "journaled": 0.0},
        "every 10": {"epoch_s": 0.49, "journaled": 0.0},
    }
    text = "\n".join(cost_lines(rows))
    assert "no release was journaled" in text


def test_deploy_cpu_shows_no_cpu_figure_that_cannot_be(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-step CPU is a difference of two runs' CPU times, whole processes (start and
    evaluation included), over one epoch's steps in a --quick run: their noise made one
    single-threaded process use 2.9 cores of 2 (32.5 ms of CPU in an 11.1 ms step), with the
    lower bound built on it. A figure no machine of that many cores can show is not shown, and
    the report says why; the others are."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    import re

    from deploy_cpu import _table

    def row(sums: str, mode: str, wall: float, by: dict[str, float]) -> dict[str, object]:
        return {"sums": sums, "mode": mode, "repeats": 1, "wall": wall, "cpu": sum(by.values()),
                "cpu_by_process": by}  # fmt: skip

    rows = [
        row("plain", "in-process", 0.0111, {"bank": 0.0325}),
        row("plain", "grpc+mtls", 0.0237, {"bank": 0.02, "shop": 0.01, "aggregator": 0.0133}),
        row("masks", "in-process", 0.0127, {"bank": 0.0136}),
        row("masks", "grpc+mtls", -0.002, {"bank": 0.012, "shop": -0.001}),
    ]
    rows[1]["bound"] = 0.0433 / 2 / 0.0111
    rows[3]["bound"] = 0.011 / 2 / 0.0127
    text = _table(rows, ["--quick"], (1, 2))
    table = {line.split(" | ")[0] + " " + line.split(" | ")[1]: line for line in text.splitlines()
             if line.startswith("| plain |") or line.startswith("| masks |")}  # fmt: skip
    assert "2.93" not in text and "32.5" not in table["| plain in-process"]
    assert "| 11.1 |" in table["| plain in-process"]  # its wall time stands
    assert "| 23.7 | 43.3 | 1.83 |" in table["| plain grpc+mtls"]  # nothing impossible here
    assert table["| plain grpc+mtls"].endswith("| 1.95x |")  # on the in-process wall, which is
    assert table["| masks grpc+mtls"].endswith("| – |")  # on an impossible CPU: none
    assert not re.search(r"(?<![|\w])-\d", text), text  # no negative time
    assert "| 12.7 | 13.6 | 1.07 |" in table["| masks in-process"]
    assert "not shown" in text.lower()


def test_protocol_costs_reports_one_epoch_and_one_run_in_the_singular(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --quick run (1 epoch, 1 run per protection) read "1 epochs", "1 rounds of one run"
    and "1 of 1 runs diverged"."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import re

    from protocol_costs import dp_lines

    row = {"protection": "none", "seconds": 2.0, "step_s": 0.01, "accuracy": 80.0,
           "max_epsilon": None, "diverged": []}  # fmt: skip
    diverged = {**row, "protection": "dp-sgd", "diverged": ["DivergenceError at step 3"]}
    dp = {"epochs": 1, "repeats": 1, "load_average_before": [0.5] * 3,
          "load_average_after": [0.6] * 3, "rows": [row, diverged], "all_diverged": {}}  # fmt: skip
    text = "\n".join(dp_lines(dp, "protocol_costs.py --quick"))
    assert "on Satellite, 1 epoch\n" in text and "One thread; 1 round of one run" in text
    assert "dp-sgd: 1 of 1 run diverged" in text
    assert not re.search(r"\b1 (epochs|rounds|runs)\b", text), text


def test_deploy_costs_quick_calls_one_repeat_no_median_and_its_verdicts_a_smoke_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A --quick run (1 epoch, 1 repeat) said "Medians of 1 repeats" and printed its targets
    MET or MISSED in the committed report's words, far below the note that it is a smoke
    run."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from deploy_costs import _table

    def row(sums: str, mode: str, epoch: float, vs_in_process: float) -> dict[str, object]:
        return {"sums": sums, "mode": mode, "epoch_seconds": epoch, "command_seconds": 7.0,
                "train_bytes_per_epoch": 2**25, "bytes_per_step": 7e5, "steps_per_epoch": 41,
                "vs_in_process": vs_in_process, "vs_grpc": 1.1, "same_metrics": True,
                "repeats": 1}  # fmt: skip

    rows = [row(sums, mode, epoch, ratio) for sums in ("plain", "masks")
            for mode, epoch, ratio in (("in-process", 0.5, 1.0), ("grpc+mtls", 1.0, 2.0),
                                       ("grpc", 0.9, 1.8))]  # fmt: skip
    load = ((1.0, 1.0, 1.0), (1.0, 1.0, 1.0))
    quick = _table(rows, ["--quick"], load, 1, quick=True)
    assert "Medians of 1 repeat" not in quick and "One repeat" in quick
    verdicts = [line for line in quick.splitlines() if line.startswith("| deployed (mTLS)")]
    assert verdicts and all(line.endswith("(smoke run) |") for line in verdicts), verdicts
    full = _table([{**r, "repeats": 3} for r in rows], [], load, 3, quick=False)
    assert "Medians of 3 repeats" in full and "smoke run" not in full


def test_every_quick_verdict_says_it_is_a_smoke_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """wire_costs' "Target ...: met/MISSED", false_table's and psi_costs' target lines,
    release_frontier's "**yes/no**" and dp_audit's "All as expected: **yes**" read, in a
    --quick run, as the committed report's verdicts, the smoke-run note far above them. Each
    through its real --quick path where that is cheap (the measurements stubbed), and each
    full run's verdict as before."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import dp_audit
    import false_table
    import psi_costs
    import release_frontier
    import wire_costs

    def measured(heads: str, *, steps: int, repeats: int) -> dict[str, Any]:
        return {"heads": heads, "steps": steps, "repeats": repeats, "codec_share": 0.05,
                "step_ms": 10.0, "codec_ms_per_step": 0.5, "messages_per_step": 8.0,
                "bytes_per_step": 4096.0, "back_to_back_codec_ms_per_step": 0.3,
                "back_to_back_share": 0.03, "copies_step_ms": 10.0, "copies_ms_per_step": 0.2,
                "copies_share": 0.02, "msgspec_step_ms": 10.0, "msgspec_ms_per_step": 0.3,
                "msgspec_share": 0.03,
                "kinds": [{"kind": "loss", "messages_per_step": 8.0, "us_per_message": 60.0,
                           "back_to_back_us_per_message": 30.0,
                           "share_of_codec": 1.0}]}  # fmt: skip

    monkeypatch.setattr(wire_costs, "measure", measured)
    assert wire_costs.main(["--quick", "--out", str(tmp_path / "wire")]) == 0
    assert "of a step: met (smoke run)." in capsys.readouterr().out

    def trained(job: Any, jobs: Any, *, workers: int) -> list[dict[str, Any]]:
        return [{"dataset": plan.dataset, "setting": "aligned", "policy": policy,
                 "target_epsilon": epsilon, "diverged": None, "noise": None,
                 "accuracy": {t: 90.0 for t in plan.test_missing},
                 "epsilon": {"party-0": epsilon} if epsilon else {}}
                for plan, policy, epsilon, *_ in jobs]  # fmt: skip

    monkeypatch.setattr(release_frontier, "run_jobs", trained)
    monkeypatch.setattr(release_frontier, "plot", lambda *args: None)
    assert release_frontier.main(["--quick", "--out", str(tmp_path / "frontier")]) == 0
    assert "on every test missingness: **yes (smoke run)**." in capsys.readouterr().out

    def audited(args: Any) -> list[dict[str, Any]]:
        return [{"seed": 0, "kind": "dp", "sigma": 2.0, "claimed_epsilon": 3.0,
                 "claim_from_sigma": 2.0, "guesses": 100, "correct": 60, "epsilon_lower": 0.5,
                 "passed": True, "canaries": 1438}]  # fmt: skip

    monkeypatch.setattr(dp_audit, "run", audited)
    assert dp_audit.main(["--quick", "--out", str(tmp_path / "audit")]) == 0
    assert "All as expected: **yes (smoke run)**." in capsys.readouterr().out

    results = [{"variant": variant, "seed": 0, "accuracy": dict.fromkeys(false_table.PATTERNS, a)}
               for variant, a in (("FALSE-VFL-I", 70.0), ("Vanilla VFL", 60.0))]  # fmt: skip
    assert "): met (smoke run) — FALSE-VFL-I" in false_table.table(results, quick=True)[0]
    assert "): met — FALSE-VFL-I" in false_table.table(results, quick=False)[0]

    rows = [{"ids": psi_costs.TARGET_SIZE, "mode": "intersection", "ratio": 0.7,
             "ours_cores_busy": 2.0, "cpu_ratio": 1.1}]  # fmt: skip
    assert "**missed (smoke run)**, 0.70x" in psi_costs.target_line(rows, quick=True)
    assert "**missed**, 0.70x" in psi_costs.target_line(rows, quick=False)


def test_a_quick_run_calls_no_single_measurement_a_median(
    quick_run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    """laser_speed --quick said "the median over 1 epoch", startup_costs "Medians of 1
    interleaved repeats" and psi_costs "medians over 1 repeat": one value is no median."""
    import re

    done, _ = quick_run
    said = re.findall(r"\bmedians? (?:over|of) 1 [\w ]*", done.stdout, flags=re.IGNORECASE)
    assert not said, said


def test_protocol_costs_calls_one_dp_run_no_median(monkeypatch: pytest.MonkeyPatch) -> None:
    """The DP section of a --quick run (one run per protection) gave each protection's "median
    wall time of a whole run": the time of its one run."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from protocol_costs import dp_lines

    row = {"protection": "none", "seconds": 2.0, "step_s": 0.01, "accuracy": 80.0,
           "max_epsilon": None, "diverged": []}  # fmt: skip
    dp = {"epochs": 1, "repeats": 1, "load_average_before": [0.5] * 3,
          "load_average_after": [0.6] * 3, "rows": [row], "all_diverged": {}}  # fmt: skip
    quick = "\n".join(dp_lines(dp, "protocol_costs.py --quick"))
    assert "median wall time" not in quick and "no median" in quick, quick
    assert "step: median time of a training step" in quick  # over the run's steps
    full = "\n".join(dp_lines({**dp, "repeats": 3}, "protocol_costs.py"))
    assert "Run: median wall time of a whole run" in full and "no median" not in full


def test_the_suite_tables_not_scored_list_says_which_diverged_and_which_do_not_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its "Not scored" list put a skipped attack, a run whose training diverged and a defense
    that does not apply alike, only the why telling them apart; it says which each is, and
    reads a report written before the suite kept ``unscored``."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import suite_table

    label = suite_table.TASKS[0][0]
    run = {
        "attack": "a",
        "defense": "none",
        "metric": "auc",
        "value": 0.9,
        "chance": 0.5,
        "main_accuracy": 0.8,
        "dcs": 0.7,
        "dcs_chance": 0.6,
    }

    def report(seed: int, unscored: dict[str, Any] | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "runs": [run],
            "skipped": {"b": "needs a head"},
            "failed": {"a / dp": "training diverged", "a / marvell": "binary labels only"},
            "c_dcs": {"none": 0.7},
            "c_dcs_chance": {"none": 0.6},
        }
        if unscored is not None:
            body["unscored"] = unscored
        return {"task": label, "seed": seed, "report": body, "missing": []}

    outcomes = {
        "a / dp": {"status": "diverged", "step": 3},
        "a / marvell": {"status": "not applicable", "step": None},
    }
    text = suite_table.render([report(0, outcomes), report(1, outcomes)], "cmd")
    assert "- b (skipped): needs a head" in text
    assert "- a / dp (diverged at step 3): training diverged" in text
    assert "- a / marvell (not applicable): binary labels only" in text
    old = suite_table.render([report(0, None)], "cmd")  # a report of before: no status known
    assert "- a / dp: training diverged" in old
