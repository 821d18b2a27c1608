"""The examples, and the README's and docs/' commands, run as written (with fewer epochs)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_prints_both_methods_with_accuracies() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--epochs", "3"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    lines = completed.stdout.splitlines()
    assert lines[0].startswith("digits:")
    assert lines[1].startswith("Standard VFL can train only on the")
    rows = {line.split()[0]: line.split()[1:] for line in lines[3:]}
    assert set(rows) == {"standard", "laser"}
    for values in rows.values():
        assert len(values) == 2
        assert all(0.0 <= float(v.rstrip("%")) <= 100.0 for v in values)


def test_secure_training_demo_compares_plaintext_secure_sums_and_dp() -> None:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "secure_training_demo.py"), "--epochs", "2"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    lines = completed.stdout.splitlines()
    header = "plaintext PSI + secure sums PSI + secure sums + DP"
    assert " ".join(lines[1].split()) == header
    rows = {line[:36].strip(): line[36:].split() for line in lines[2:]}
    assert rows["alignment"] == ["join", "(clear)", "PSI", "PSI"]
    assert rows["sums of representations"] == ["plain", "masks", "masks"]
    assert rows["what a sum cannot hide"] == ["-", "drop", "drop"]
    # DP on the gradients guards the labels: the representations cross without noise (the
    # secure sums hide them; no epsilon bounds them)
    assert rows["epsilon, worst party (delta 1e-05)"] == ["inf", "inf", "inf"]
    guarded = rows["epsilon of what is noised"]
    assert guarded[:2] == ["-", "-"] and 0 < float(guarded[2]) <= 8.0
    assert all(0 <= float(v) <= 100 for v in rows["accuracy, test mcar:0"][::2])
    # the runs' own training time: the whole call counted the first run's imports as well
    assert rows["time (training)"][1::2] == ["s", "s", "s"]


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_documented_python_snippets_run(capsys) -> None:  # type: ignore[no-untyped-def]
    """Every ```python block of the README and of docs/ runs as written."""
    ran = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        for snippet in [block.split("```", 1)[0] for block in text.split("```python\n")[1:]]:
            exec(compile(snippet, str(document.relative_to(ROOT)), "exec"), {})
            ran.append(document.name)
    assert "README.md" in ran, "the README should show the Python API"
    assert len(ran) >= 4, ran
    assert "'accuracy'" in capsys.readouterr().out


def _anchors(document: Path) -> set[str]:
    """The fragment of each heading of a Markdown file, as GitHub makes them."""
    anchors = set()
    for line in document.read_text(encoding="utf-8").splitlines():
        match = re.match(r"#+ (.+)", line)
        if match:
            words = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            anchors.add(words.replace(" ", "-"))
    return anchors


def test_documentation_links_resolve() -> None:
    """Every relative link of the README, docs/ and benchmarks/README.md names a file that
    exists and, with a fragment, a heading of that file."""
    broken, checked = [], 0
    for document in [*DOCUMENTS, ROOT / "benchmarks" / "README.md"]:
        text = document.read_text(encoding="utf-8")
        for link in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", link):
                continue
            checked += 1
            name, _, fragment = link.partition("#")
            target = (document.parent / name).resolve() if name else document
            if not target.exists():
                broken.append(f"{document.name}: {link} (no such file)")
            elif fragment and target.suffix == ".md" and fragment not in _anchors(target):
                broken.append(f"{document.name}: {link} (no such heading)")
    assert checked > 40
    assert not broken, broken


def _run_example(name: str, *args: str, tmp_path: Path) -> list[str]:
    completed = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return completed.stdout.splitlines()


def test_attack_suite_example_prints_the_scores_and_saves_its_plot(tmp_path: Path) -> None:
    lines = _run_example("attack_suite.py", "--epochs", "1", tmp_path=tmp_path)
    runs = [line for line in lines if line.startswith("| norm-scoring |")]
    assert [line.split("|")[3].strip() for line in runs] == [
        "none",
        "dp-gradients:1:0.01",
        "marvell:4",
        "gradient-sparsification:0.9",
    ]
    assert any(line.startswith("| marvell:4 | ") for line in lines)  # its C-DCS row
    assert (tmp_path / "attack_suite.png").read_bytes().startswith(b"\x89PNG")


def test_imputation_example_scores_every_method_per_measurement_and_saves_its_plot(
    tmp_path: Path,
) -> None:
    lines = _run_example("federated_imputation.py", "--rounds", "2", tmp_path=tmp_path)
    assert lines[0].startswith("ozone: 4 sites, 10 measurements")
    methods = {line[:16].strip(): line[16:].split() for line in lines[2:8]}
    assert list(methods) == [
        "mean (local)",
        "kNN (local)",
        "MICE (local)",
        "Fed-Mean",
        "FedHF",
        "FedHF + masks",
    ]
    assert all(0.0 < float(values[0]) < 3.0 for values in methods.values())
    # masks sum what the clear sums: after two rounds the same RMSE to the fourth decimal
    assert abs(float(methods["FedHF"][0]) - float(methods["FedHF + masks"][0])) < 2e-4
    table = lines[lines.index(next(line for line in lines if line.startswith("measurement"))) :]
    rows = [line for line in table[1:] if not line.startswith("plot:")]
    assert len(rows) == 10 and rows[6].startswith("inversion base height (ft)")
    assert all(len(row[34:].split()) == 5 for row in rows)  # four methods, the hidden entries
    assert (tmp_path / "imputation.png").read_bytes().startswith(b"\x89PNG")


def test_privacy_utility_example_prints_the_sweep_and_saves_its_plots(tmp_path: Path) -> None:
    lines = _run_example(
        "privacy_utility_tradeoff.py", "--epochs", "1", "--seeds", "1", tmp_path=tmp_path
    )
    settings = [line.split("|")[2].strip() for line in lines if line.startswith("| ")][1:]
    assert settings == [
        "none",
        "SIGMA=0.3",
        "SIGMA=1",
        "SIGMA=2",
        "SCALE=0.5",
        "SCALE=2",
        "SCALE=8",
    ]
    for plot in ("utility_epsilon.png", "attack_utility.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


@pytest.mark.processes
def test_deploy_localhost_example_trains_four_processes_and_stops_them(tmp_path: Path) -> None:
    """Run as the README says, with no virtual environment activated: where the project has
    its .venv (scripts/setup.sh), the script must use it and never the python on PATH, which
    here fails if called; elsewhere it is given this test's interpreter."""
    demo = tmp_path / "demo"
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    if (ROOT / ".venv" / "bin" / "python").exists():
        decoy = tmp_path / "path"
        decoy.mkdir()
        (decoy / "python").write_text(
            "#!/bin/sh\necho 'the python on PATH was used' >&2\nexit 97\n"
        )
        (decoy / "python").chmod(0o755)
        env["PATH"] = os.pathsep.join([str(decoy), env.get("PATH", "")])
    else:
        env.update(PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    completed = subprocess.run(
        ["bash", str(ROOT / "examples" / "deploy_localhost.sh"), str(demo), "1"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert completed.returncode == 0, completed.stderr
    assert "every party finished" in completed.stdout
    result = json.loads((demo / "run" / "result.json").read_text())
    assert set(result["traffic"]["bytes"]) == {"bank", "shop", "insurer", "telco", "aggregator"}
    for name in ("shop", "insurer", "telco", "aggregator"):
        assert "the run finished" in (demo / f"{name}.log").read_text()
    # Each data party kept its own part; copied beside the manifest, the parts predicted.
    run_id = result["model"]["run_id"]
    for name in ("shop", "insurer", "telco"):
        assert [p.name for p in (demo / f"models-{name}" / name).iterdir()] == [run_id]
    predictions = (demo / "predictions.csv").read_text().splitlines()
    assert predictions[0] == "id,predicted,p_0,p_1" and len(predictions) == 1 + 569
    # Predicted again where the parts live: the same predictions.
    here = pd.read_csv(demo / "predictions.csv", dtype={"id": str})
    there = pd.read_csv(demo / "predictions-deployed.csv", dtype={"id": str})
    assert there["id"].tolist() == here["id"].tolist()
    assert there["predicted"].tolist() == here["predicted"].tolist()
    np.testing.assert_allclose(there[["p_0", "p_1"]], here[["p_0", "p_1"]], rtol=0, atol=1e-6)
    for name in ("shop", "insurer", "telco"):
        assert "predicting with its own part" in (demo / f"{name}-predict.log").read_text()


def test_the_localhost_demo_keeps_an_earlier_demos_files_unless_told(tmp_path: Path) -> None:
    """Run again into the same DIR, it wrote its CSV files over the earlier ones (in place),
    then stopped at `certs init`, which refuses a CA that is there; now it refuses the DIR
    before it writes or starts anything, as the other examples do, unless --overwrite."""
    demo = tmp_path / "demo"
    demo.mkdir()
    (demo / "bank.csv").write_text("precious\n")
    (demo / "run").mkdir()
    script = ["bash", str(ROOT / "examples" / "deploy_localhost.sh")]
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([*script, str(demo), "1"], capture_output=True, text=True, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{demo / 'bank.csv'} {demo / 'run'} exist (an earlier demo's?); expected a new" in (
        done.stderr
    )
    assert "or --overwrite to replace them" in done.stderr and done.stdout == ""
    assert sorted(p.name for p in demo.iterdir()) == ["bank.csv", "run"]
    assert (demo / "bank.csv").read_text() == "precious\n"
    taken = tmp_path / "taken"
    taken.write_text("precious\n")
    done = subprocess.run([*script, str(taken)], capture_output=True, text=True, env=env)
    assert done.returncode == 2 and f"DIR {taken} is a file; expected a directory" in done.stderr
    assert taken.read_text() == "precious\n"


def _described(pids: list[int], demo: Path) -> str:
    """What a failed check shows of processes left running: each one's state and command line,
    and the end of every party's log."""
    lines = []
    for pid in pids:
        proc = Path("/proc") / str(pid)
        try:
            state = next(
                line for line in (proc / "status").read_text().splitlines() if line[:6] == "State:"
            )
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError as error:
            state, command = f"gone ({error.strerror})", ""
        lines.append(f"pid {pid}: {state}: {command}")
    for log in sorted(demo.glob("*.log")):
        lines.append(f"--- {log.name}:\n" + "\n".join(log.read_text().splitlines()[-8:]))
    return "\n".join(lines)


def _serving(directory: Path) -> list[int]:
    """The pids of processes whose command line names ``directory`` (its parties)."""
    found = subprocess.run(["pgrep", "-f", str(directory)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


@pytest.mark.processes
def test_the_localhost_demo_stops_its_parties_when_a_step_fails(tmp_path: Path) -> None:
    """Its parties were started through a shell function, so the EXIT trap killed the subshells
    and left the parties serving (for --wait, 600 s) when training was refused."""
    demo = tmp_path / "demo"
    try:
        done = subprocess.run(
            ["bash", str(ROOT / "examples" / "deploy_localhost.sh"), str(demo), "-1"],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 2 and "--epochs: expected a positive integer" in done.stderr
        assert {log.name for log in demo.glob("*.log")} == {
            f"{name}.log" for name in ("shop", "insurer", "telco", "aggregator")
        }  # every party had been started
        # Killed while importing torch on a loaded machine, a party may take seconds to go;
        # one the trap missed serves for --wait (600 s).
        deadline = time.monotonic() + 60
        while _serving(demo) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _serving(demo)
        assert left == [], _described(left, demo)
    finally:
        for pid in _serving(demo):
            os.kill(pid, signal.SIGKILL)


def test_the_party_files_example_keeps_files_it_did_not_write(tmp_path: Path) -> None:
    # It replaced a user's bank.csv without a word, and an --out that is a file was a traceback.
    script = [sys.executable, str(ROOT / "examples" / "own_party_files.py")]
    (tmp_path / "bank.csv").write_text("precious\n")
    refused = subprocess.run([*script, "--out", str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode == 2 and "bank.csv exist; expected a new --out" in refused.stderr
    assert (tmp_path / "bank.csv").read_text() == "precious\n"
    into_file = subprocess.run(
        [*script, "--out", str(tmp_path / "bank.csv")], capture_output=True, text=True
    )
    assert into_file.returncode == 2 and "is a file; expected a directory" in into_file.stderr
    subprocess.run([*script, "--out", str(tmp_path), "--overwrite"], check=True)
    assert (tmp_path / "bank.csv").read_text().startswith("id,")


def test_the_party_files_example_writes_whole_files_and_refuses_what_it_cannot_write_first(
    tmp_path: Path,
) -> None:
    """It wrote each CSV in place (a hard link of bank.csv was truncated with it, and a kill
    left half a file), and a `new` that is a file, a `new/bank.csv` that is a folder or an
    --out under a file ended in a traceback, the first after writing half the files."""
    script = [sys.executable, str(ROOT / "examples" / "own_party_files.py")]
    (tmp_path / "bank.csv").write_text("precious\n")
    os.link(tmp_path / "bank.csv", tmp_path / "kept.csv")  # e.g. a backup's hard link
    subprocess.run([*script, "--out", str(tmp_path), "--overwrite"], check=True)
    assert (tmp_path / "bank.csv").read_text().startswith("id,")
    assert (tmp_path / "kept.csv").read_text() == "precious\n"  # replaced, not written over
    assert not list(tmp_path.glob(".*.tmp")) and not list(tmp_path.glob("new/.*.tmp"))

    folder = tmp_path / "folder"
    (folder / "new" / "bank.csv").mkdir(parents=True)
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "new").write_text("precious\n")
    for out, said in (
        (folder, r"new/bank\.csv: a regular file \(or a new path\) expected, found a directory"),
        (blocked, r"new is a file; a directory, or a path where one can be made, expected"),
        (tmp_path / "kept.csv" / "sub", r"lies under .*kept\.csv, a file; a directory"),
    ):
        done = subprocess.run(
            [*script, "--out", str(out), "--overwrite"], capture_output=True, text=True
        )
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
        assert re.search(said, done.stderr), done.stderr
    assert sorted(p.name for p in folder.rglob("*")) == ["bank.csv", "new"]  # nothing written
    assert sorted(p.name for p in blocked.iterdir()) == ["new"]
    assert (blocked / "new").read_text() == "precious\n"


def test_every_committed_benchmark_result_carries_the_command_that_made_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Eight JSON results (wire_costs, deploy_costs, ...) had no command; their reports had.
    Each report states its command and each JSON carries one of its report's commands."""
    results = ROOT / "benchmarks" / "results"
    for path in sorted(results.glob("*.json")):
        stated = re.findall(r"^Command: `([^`]+)`", path.with_suffix(".md").read_text(), re.M)
        payload = json.loads(path.read_text())
        assert stated and payload.get("command") in stated, path.name
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from _shared import write_outputs

    write_outputs(tmp_path, "made", "# T\n\nCommand: `python benchmarks/x.py --quick`\n", {"a": 1})
    assert json.loads((tmp_path / "made.json").read_text()) == {
        "command": "python benchmarks/x.py --quick",
        "a": 1,
    }
    with pytest.raises(ValueError, match="without the command that made them"):
        write_outputs(tmp_path, "unsaid", "# T\n", {"a": 1})
    assert not (tmp_path / "unsaid.json").exists()


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("attack_suite.py", ["--epochs", "1", "--out"]),
        ("federated_imputation.py", ["--rounds", "1", "--out"]),
        ("privacy_utility_tradeoff.py", ["--epochs", "1", "--seeds", "1", "--out"]),
        ("secure_training_demo.py", ["--epochs", "1", "--workdir"]),
    ],
)
def test_an_example_refuses_an_output_directory_that_is_a_file_before_its_runs(
    name: str, args: list[str], tmp_path: Path
) -> None:
    # They trained, then ended in a traceback (FileExistsError, OutputError) at their first write.
    taken = tmp_path / "taken"
    taken.write_text("precious\n")
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args, str(taken)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert f"{args[-1]} {taken} is a file; a directory" in done.stderr
    assert done.stdout == ""  # nothing ran
    assert taken.read_text() == "precious\n"


def test_the_secure_training_demo_keeps_an_earlier_demos_files_unless_told(tmp_path: Path) -> None:
    """--workdir replaced the party files, labels and runs an earlier demo left there, silently
    (own_party_files.py refuses them without --overwrite, as this does now)."""
    (tmp_path / "labels.csv").write_text("id,label\nmine,1\n")
    argv = [sys.executable, str(ROOT / "examples" / "secure_training_demo.py")]
    argv += ["--epochs", "1", "--workdir", str(tmp_path)]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"{tmp_path / 'labels.csv'} exist; expected a new --workdir (or --overwrite" in (
        done.stderr
    )
    assert done.stdout == "" and (tmp_path / "labels.csv").read_text() == "id,label\nmine,1\n"


def test_privacy_utility_example_defaults_do_not_diverge() -> None:
    """At its default epochs, gradient DP at SIGMA 3 (clip 0.01) diverged in about 6 runs of
    10 (10 of 16 seeds, fresh noise): a cell of the demo's table lost to divergence more often
    than not. Its strongest SIGMA must train to the end; the noise is made reproducible here
    so that the seeds tested are the same every time."""
    import runpy

    from attacks.sweep import run_sweep
    from protocols.privacy import PrivacySpec

    example = runpy.run_path(str(ROOT / "examples" / "privacy_utility_tradeoff.py"))
    rows = run_sweep(
        example["sweep_config"](example["EPOCHS"]),
        "norm-scoring",
        templates=[t for t in example["TEMPLATES"] if "SIGMA" in t],
        grid={"SIGMA": (max(example["GRID"]["SIGMA"]),)},
        seeds=8,
        workers=2,
        privacy=PrivacySpec(seed=0, insecure_reproducible_noise=True),
    )
    assert [row["failed"] for row in rows] == [None] * 16, [row["failed"] for row in rows]
