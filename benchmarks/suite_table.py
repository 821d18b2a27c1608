"""The attack suite on the methods and tasks it applies to, undefended and under each defense,
over seeds: what each defense buys against each attack and what it costs.

Every (task, seed) runs :func:`attacks.suite.run_suite` in its own worker process; the table
gives each (task, attack, defense) the mean and standard deviation over seeds of the attack's
metric, the main accuracy and the DCS, then VFLAIR's T-DCS and C-DCS per task. Attacks or
defenses that do not apply to a task are listed with the reason.

    python benchmarks/suite_table.py            # the committed configuration (3 seeds)
    python benchmarks/suite_table.py --quick    # one seed, one epoch: a smoke run

A (task, seed) takes minutes; each writes its result to ``results/.attack_suite/`` as it
finishes, and a re-run of the same command skips the finished ones (delete the directory to
start over), so an interrupted run resumes. The table is written once every job is in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _shared import RESULTS, command_line, output_directory, quick_marked, run_jobs, write_outputs

from attacks.base import status_text
from secure_vfl.cli import positive_int

DEFENSES = (
    "dp-gradients:1:0.01",
    "dp-embeddings:1:1",
    "dp-sgd:1:1",
    "secure-agg:masks",
    "gradient-sparsification:0.9",
    "marvell:4",
    "norm-filter",
)
# (label, method, dataset, MethodConfig keywords)
TASKS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    (
        "LASER, digits, no top model",
        "laser",
        "digits",
        {"heads": "active", "top_model": "none", "representation_dim": 10, "epochs": 5},
    ),
    ("LASER, digits", "laser", "digits", {"heads": "active", "epochs": 5}),
    ("Standard VFL, digits", "standard", "digits", {"heads": "active", "epochs": 5}),
    (
        "LASER, German credit",
        "laser",
        "german-credit",
        {"heads": "active", "epochs": 5, "batch_size": 64},
    ),
    (
        "Standard VFL, German credit",
        "standard",
        "german-credit",
        {"heads": "active", "epochs": 5, "batch_size": 64},
    ),
    ("FALSE-VFL-I, digits", "false-vfl-1", "digits", {"epochs": 3}),  # one label party
)


def _job_file(done: str, index: int, seed: int) -> Path:
    return Path(done) / f"task{index}-seed{seed}.json"


def run_task(index: int, seed: int, quick: bool, cache: str, done: str) -> dict[str, Any]:
    """One task at one seed: the whole suite under every defense that applies; the result is
    also written to ``done`` (atomically) so that a re-run skips it."""
    result = _run_task(index, seed, quick, cache)
    from secure_vfl.io import atomic_write_json

    Path(done).mkdir(parents=True, exist_ok=True)
    atomic_write_json(_job_file(done, index, seed), result)
    return result


def _run_task(index: int, seed: int, quick: bool, cache: str) -> dict[str, Any]:
    import torch

    from attacks.defenses import HOOK_DEFENSES
    from attacks.runner import DEFENSES as PRIVACY_DEFENSES
    from attacks.suite import run_suite
    from secure_vfl.errors import ConfigError
    from secure_vfl.experiment import TrainConfig
    from secure_vfl.methods import MethodConfig

    torch.set_num_threads(1)
    label, method, dataset, options = TASKS[index]
    if quick:
        options = {**options, "epochs": 1}
    config = TrainConfig(
        method=method,
        dataset=dataset,
        parties=4,
        seed=seed,
        method_config=MethodConfig(**options),
    )
    known = set(PRIVACY_DEFENSES) | set(HOOK_DEFENSES.names())
    defenses = [d for d in DEFENSES if d.partition(":")[0] in known]
    missing = [d for d in DEFENSES if d not in defenses]
    try:
        report = run_suite(config, defenses=defenses, cache=Path(cache))
    except ConfigError as error:
        return {"task": label, "seed": seed, "error": str(error), "missing": missing}
    return {"task": label, "seed": seed, "report": report.to_json(), "missing": missing}


def _mean_sd(values: Sequence[float]) -> str:
    digits = 2 if max(abs(v) for v in values) > 1 else 3  # percentages with 2 decimals
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.pstdev(values):.{digits}f}"


def render(results: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Attack suite: attacks against defenses, per task (4 parties; the attacker is party-1, "
        "a passive data party, or the label party party-0 for the reconstruction attacks)",
        "",
        f"Command: `{command}`",
        "",
        "Means ± standard deviations over the seeds that scored. `chance` is the attack's level "
        "without signal, where its negative control sits, a mean over seeds where it is the run's "
        "own (the backdoor's: its rate of predicting the target for the probe rows without the "
        "trigger; model completion's: the balanced accuracy of the same completion from an "
        "untrained bottom model); the scoring attacks' AP in the DCS is max(AUC, 1 - AUC); "
        "label inference and model completion are scored by balanced accuracy (chance 1/C).",
        "",
    ]
    for label, *_ in TASKS:
        mine = sorted((r for r in results if r["task"] == label), key=lambda r: r["seed"])
        if not mine:
            continue
        lines += [f"## {label}", ""]
        if all("error" in r for r in mine):
            lines += [f"Not run: {mine[0]['error']}", ""]
            continue
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for result in mine:
            for run in result["report"]["runs"]:
                runs.setdefault((run["attack"], run["defense"]), []).append(run)
        lines += [
            f"Seeds: {', '.join(str(r['seed']) for r in mine)}.",
            "",
            "| attack | defense | metric | value | chance | main accuracy (%) | DCS "
            "| DCS (AP* = chance) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (attack, defense), members in runs.items():
            # a run missing at some seed diverged or failed there (listed below with its seeds)
            short = f" (seeds: {len(members)} of {len(mine)})" if len(members) < len(mine) else ""
            level = statistics.fmean(m["chance"] for m in members)  # per run: backdoor, completion
            lines.append(
                f"| {attack} | {defense}{short} | {members[0]['metric']} | "
                f"{_mean_sd([m['value'] for m in members])} | {level:.3f} | "
                f"{_mean_sd([100 * m['main_accuracy'] for m in members])} | "
                f"{_mean_sd([m['dcs'] for m in members])} | "
                f"{_mean_sd([m['dcs_chance'] for m in members])} |"
            )
        defenses = list(dict.fromkeys(d for (_, d) in runs))
        c_dcs = {
            d: [r["report"]["c_dcs"][d] for r in mine if d in r["report"]["c_dcs"]]
            for d in defenses
        }
        lines += ["", "| defense | C-DCS | C-DCS (AP* = chance) |", "|---|---|---|"]
        for defense in defenses:
            chance = [
                r["report"]["c_dcs_chance"][defense]
                for r in mine
                if defense in r["report"]["c_dcs_chance"]
            ]
            lines.append(f"| {defense} | {_mean_sd(c_dcs[defense])} | {_mean_sd(chance)} |")
        notes: dict[tuple[str, str, str], list[int]] = {}  # (what, status, why) -> its seeds
        for result in mine:
            report = result["report"]
            unscored = report.get("unscored", {})  # absent from reports before it was kept
            for name, why in report["skipped"].items():
                notes.setdefault((name, "skipped", why), []).append(result["seed"])
            for name, why in report["failed"].items():
                status = status_text(unscored[name]) if name in unscored else ""
                notes.setdefault((name, status, why), []).append(result["seed"])
        if notes:
            lines += ["", "Not scored:", ""]
            for (name, status, why), seeds in notes.items():
                at = "" if len(seeds) == len(mine) else f"seed {', '.join(map(str, seeds))}"
                said = "; ".join(part for part in (status, at) if part)
                lines.append(f"- {name}{f' ({said})' if said else ''}: {why}")
        lines.append("")
    missing = results[0]["missing"] if results else []
    if missing:
        lines.append(f"Defenses not built yet: {', '.join(missing)}.")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=positive_int, default=3)
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--quick", action="store_true", help="one seed, one epoch per task")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)
    seeds = 1 if args.quick else args.seeds
    cache = str(args.out / ".undefended")
    done = str(args.out / (".attack_suite_quick" if args.quick else ".attack_suite"))
    jobs = [(i, seed, args.quick, cache, done) for i in range(len(TASKS)) for seed in range(seeds)]
    finished = [
        json.loads(_job_file(done, i, seed).read_text())
        for i, seed, *_ in jobs
        if _job_file(done, i, seed).is_file()
    ]
    pending = [job for job in jobs if not _job_file(done, job[0], job[1]).is_file()]
    if finished:
        print(f"{len(finished)} of {len(jobs)} jobs already done in {done}; running the rest")
    results = finished + run_jobs(run_task, pending, workers=args.workers)
    text = render(results, command_line("suite_table.py", argv))
    text = quick_marked(text, args.quick)
    print(text)
    if not args.quick:
        write_outputs(args.out, "attack_suite", text, {"results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
