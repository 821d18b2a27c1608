"""What a party process spends importing its code before it serves, with DP-SGD and without.

Every party of a deployment is its own process, and each starts by importing torch and
secure-vfl; a run without DP does not import Opacus (only ``protocols.dp_sgd`` does, and only a
party that runs DP-SGD imports that). This measures the CPU time (user + system, as the kernel
counts it for the child) of a fresh interpreter importing torch alone, what a served party
imports (``secure-vfl party serve``: the CLI, the deployment, its privacy and secure-sum
modules, PSI), and the same with DP-SGD; medians of interleaved repeats, so the ratios come from
one run.

    python benchmarks/startup_costs.py             # the committed configuration
    python benchmarks/startup_costs.py --quick     # a smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _shared import RESULTS, command_line, medians_of, output_directory, quick_marked, write_outputs

from secure_vfl.cli import positive_int

ROOT = Path(__file__).resolve().parents[1]
SERVED = (
    "secure_vfl.cli",
    "secure_vfl.deployment",
    "secure_vfl.federation.federation_file",
    "protocols.party_privacy",
    "protocols.privacy",
    "protocols.secagg",
    "protocols.psi.session",
)
CASES: dict[str, tuple[str, ...]] = {
    "torch alone": ("torch",),
    "a served party, no DP": SERVED,
    "a served party with DP-SGD": (*SERVED, "protocols.dp_sgd"),
}


def cpu_seconds(modules: Sequence[str]) -> tuple[float, bool]:
    """CPU seconds of a fresh interpreter that imports ``modules``, and whether it imported
    Opacus."""
    code = f"import sys, {', '.join(modules)}; print('opacus' in sys.modules)"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    spent = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return spent, completed.stdout.strip() == "True"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=5)
    parser.add_argument("--quick", action="store_true", help="1 repeat, nothing written")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    seconds: dict[str, list[float]] = {name: [] for name in CASES}
    opacus: dict[str, bool] = {}
    for _ in range(repeats):  # interleaved: a slower minute of the machine hits every case
        for name, modules in CASES.items():
            spent, imported = cpu_seconds(modules)
            seconds[name].append(spent)
            opacus[name] = imported
    rows: list[dict[str, Any]] = [
        {"case": name, "cpu_s": statistics.median(seconds[name]), "opacus": opacus[name]}
        for name in CASES
    ]
    base = rows[1]["cpu_s"]
    lines = [
        "# What a party process spends importing its code (CPU seconds, fresh interpreter)",
        "",
        f"Command: `{command_line('startup_costs.py', argv)}`",
        "",
        "| imports | CPU (s) | against a served party without DP | imports Opacus |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['case']} | {row['cpu_s']:.2f} | {row['cpu_s'] / base:.2f}x | "
            f"{'yes' if row['opacus'] else 'no'} |"
        )
    lines += [
        "",
        f"{medians_of(repeats)}{', the cases interleaved' if repeats > 1 else ''}, on "
        f"{os.cpu_count()} CPUs. A served party "
        f"imports {', '.join(SERVED)}; with DP-SGD also protocols.dp_sgd (Opacus).",
    ]
    text = "\n".join(lines) + "\n"
    text = quick_marked(text, args.quick)
    print(text)
    if not args.quick:
        write_outputs(args.out, "startup_costs", text, {"rows": rows, "repeats": repeats})
    return 0


if __name__ == "__main__":
    sys.exit(main())
