"""What checkpoints cost a DP training run in one process: the release journal and the writes.

A LASER run (Satellite, 4 parties, ``--heads active``, batch 128, seed 0, one torch thread)
with ``--dp-embeddings 1.0:1.0`` (every data party's representation of every step is a DP
release its accountant prices), from the command line, three ways:

- ``none``: no checkpoints;
- ``journal``: ``--checkpoint-every`` larger than the run, so no checkpoint is written but every
  DP party journals each release (``releases.jsonl``: a JSON line appended and fsynced before
  the message carrying it leaves; the rows each step asked for are noted without an fsync);
- ``every 10``: the journal and a checkpoint of every party every 10 steps (written into a fresh
  directory, every file fsynced, then renamed).

Each runs for ``--short`` and ``--long`` epochs; the difference of the two ``wall_time_s``
over the difference in training steps is the time of one training step (the start, the data
preparation and the evaluation cancel out). Beside it, one journal line timed alone
(:class:`secure_vfl.checkpoints.ReleaseJournal`: ``append``, fsynced, and ``note``) in the
directory the runs write to.

    python benchmarks/checkpoint_costs.py            # the committed configuration
    python benchmarks/checkpoint_costs.py --quick    # a smoke run: 1 and 2 epochs, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _shared import (
    RESULTS,
    child_env,
    command_line,
    medians_of,
    output_directory,
    quick_marked,
    write_outputs,
)

from secure_vfl.cli import positive_int

BASE = [
    "--method", "laser", "--dataset", "satellite", "--parties", "4", "--heads", "active",
    "--batch-size", "128", "--seed", "0", "--dp-embeddings", "1.0:1.0",
    "--insecure-reproducible-noise", "--quiet",
]  # fmt: skip
PARTIES = 4
CONFIGS: dict[str, list[str]] = {
    "none": [],
    "journal": ["--checkpoint-every", str(10**9)],
    "every 10": ["--checkpoint-every", "10"],
}
RUN_SECONDS = 900.0


def run_once(config: str, epochs: int, out: Path) -> dict[str, Any]:
    """One command-line run: its wall time and the releases its parties journaled."""
    env = child_env()
    args = [sys.executable, "-m", "secure_vfl", "train", *BASE, *CONFIGS[config]]
    args += ["--epochs", str(epochs), "--out", str(out)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=RUN_SECONDS)
    if done.returncode != 0:
        raise RuntimeError(f"{config}, {epochs} epochs: exit {done.returncode}\n{done.stderr}")
    result = json.loads((out / "result.json").read_text())
    journals = list((out / "checkpoints").glob("*/releases.jsonl"))
    return {
        "wall_s": float(result["wall_time_s"]),
        "journaled": sum(len(path.read_text().splitlines()) for path in journals),
    }


def measure(config: str, short: int, long: int, work: Path) -> dict[str, float]:
    """One epoch's wall time and journal lines: the long run less the short one, per epoch."""
    runs = [run_once(config, epochs, work / f"{config}-{epochs}") for epochs in (short, long)]
    epochs = long - short
    return {
        "epoch_s": (runs[1]["wall_s"] - runs[0]["wall_s"]) / epochs,
        "journaled": (runs[1]["journaled"] - runs[0]["journaled"]) / epochs,
    }


def journal_line_ms(directory: Path, repeats: int) -> dict[str, float]:
    """Median time of one fsynced journal line and of one note, in ``directory``."""
    from secure_vfl.checkpoints import ReleaseJournal

    journal = ReleaseJournal(directory, "party-1", "0" * 32)
    journal.path.parent.mkdir(parents=True, exist_ok=True)
    journal.start([])
    release = {"kind": "embedding", "round": 0, "sigma": 1.0, "clip": 1.0, "rate": 0.02}
    note = list(range(128))
    timings: dict[str, list[float]] = {"append": [], "note": []}
    for _ in range(repeats):
        for name, call in (("append", lambda: journal.append(release)),
                           ("note", lambda: journal.note("rows", note))):  # fmt: skip
            start = time.perf_counter()
            call()
            timings[name].append(1000 * (time.perf_counter() - start))
    return {name: statistics.median(values) for name, values in timings.items()}


def cost_lines(rows: dict[str, dict[str, float]]) -> list[str]:
    """The table of each configuration's epoch and what the journal and the checkpoints cost,
    from ``rows`` (per configuration: ``epoch_s``, ``journaled``). Each is a difference of two
    runs' wall times, which the runs' noise can exceed (a --quick run's are one epoch apart):
    an epoch of no time or less, or a cost below zero, is not shown ("–"), and a line says why.
    """
    base = rows["none"]["epoch_s"]
    releases = rows["journal"]["journaled"]
    steps = releases / PARTIES  # every party releases its representation once a step
    hidden = False

    def shown(value: float, form: str, *, valid: bool) -> str:
        nonlocal hidden
        hidden |= not valid
        return format(value, form) if valid else "–"

    lines = [
        "| checkpoints | epoch (s) | vs none | extra per epoch (ms) | releases journaled / epoch |",
        "|---|---|---|---|---|",
    ]
    for config, row in rows.items():
        epoch = row["epoch_s"]
        costs = 0 < base <= epoch  # checkpoints cannot make an epoch faster
        lines.append(
            f"| {config} | {shown(epoch, '.3f', valid=epoch > 0)} | "
            f"{shown(epoch / base if base else 0.0, '.3f', valid=costs)}x | "
            f"{shown(1000 * (epoch - base), '.0f', valid=costs)} | "
            f"{row['journaled']:.0f} |"
        )
    journal, written = rows["journal"]["epoch_s"], rows["every 10"]["epoch_s"]
    if releases > 0:
        per_release = shown(1000 * (journal - base) / releases, ".2f", valid=0 < base <= journal)
        each = shown(1000 * (written - journal) / (steps / 10), ".0f", valid=0 < journal <= written)
        lines += [
            "",
            f"The journal: {per_release} ms per release ({releases:.0f} releases in "
            f"{steps:.0f} steps an epoch). The checkpoints themselves (every party's, every 10 "
            f"steps, beyond the journal): {each} ms each.",
        ]
    else:
        lines += ["", "The journal: no release was journaled, so no cost per release is given."]
    if hidden:
        lines += [
            "",
            "Not shown (–): a difference of the long and short runs that no epoch or cost can "
            "be (an epoch of no time or less, a cost below zero, an epoch faster than without "
            "checkpoints): the runs' noise exceeded what they differ by. More epochs between "
            "--short and --long, or more --repeats, measure it.",
        ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--short", type=positive_int, default=1, help="epochs of the short runs")
    parser.add_argument("--long", type=positive_int, default=6, help="epochs of the long runs")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 and 2 epochs, 1 repeat")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)
    short, long, repeats = (1, 2, 1) if args.quick else (args.short, args.long, args.repeats)
    if not short < long:  # an epoch's cost is the long runs less the short ones
        parser.error(f"--short < --long expected; found {short} and {long}.")
    load_before = os.getloadavg()[0]
    samples: dict[str, list[dict[str, float]]] = {config: [] for config in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="checkpoint-costs-") as tmp:
        for repeat in range(repeats):  # the configurations in turn, within each repeat
            for config in CONFIGS:
                work = Path(tmp) / f"r{repeat}"
                work.mkdir(exist_ok=True)
                samples[config].append(measure(config, short, long, work))
        line = journal_line_ms(Path(tmp) / "journal", 200)
    load = (load_before, os.getloadavg()[0])
    rows = {
        config: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
        for config, runs in samples.items()
    }
    lines = [
        "# What checkpoints cost a DP training run in one process",
        "",
        f"Command: `{command_line('checkpoint_costs.py', argv)}`",
        "",
        "LASER on Satellite, 4 parties, `--heads active`, batch 128, seed 0, "
        "`--dp-embeddings 1.0:1.0` (every party's representation of every step a DP release), "
        "one torch thread, from the command line. An epoch's time is the difference of "
        f"`wall_time_s` between {long}- and {short}-epoch runs, per epoch (start, data and "
        "evaluation cancel out).",
        "",
        *cost_lines(rows),
    ]
    lines += [
        "",
        f"One journal line alone, in the directory the runs wrote to (median of 200): a release "
        f"(appended and fsynced) {line['append']:.3f} ms, a note (appended) {line['note']:.3f} "
        "ms (a deployed party notes the rows each step asked it for).",
        "",
        f"{medians_of(repeats)}; within each repeat the configurations ran in turn. Load "
        f"average (1 min) {load[0]:.1f} before and {load[1]:.1f} after, on {os.cpu_count()} "
        "CPUs. The fsync's cost is the file system's: on a disk that flushes its cache for real "
        "it can be milliseconds.",
    ]
    text = "\n".join(lines) + "\n"
    text = quick_marked(text, args.quick)
    print(text)
    if not args.quick:
        payload = {"rows": rows, "journal_line_ms": line, "repeats": repeats, "load": load}
        write_outputs(args.out, "checkpoint_costs", text, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
