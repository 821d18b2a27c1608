"""The README's examples run as written (with fewer epochs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    epsilon = rows["epsilon, worst party (delta 1e-05)"]
    assert epsilon[:2] == ["inf", "inf"] and 0 < float(epsilon[2]) <= 8.0
    assert all(0 <= float(v) <= 100 for v in rows["accuracy, test mcar:0"][::2])


def test_readme_python_snippets_run(capsys) -> None:  # type: ignore[no-untyped-def]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    snippets = [block.split("```", 1)[0] for block in readme.split("```python\n")[1:]]
    assert snippets, "the README should show the Python API"
    for snippet in snippets:
        exec(compile(snippet, "README.md", "exec"), {})
    assert "'accuracy'" in capsys.readouterr().out
