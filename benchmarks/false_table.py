"""FALSE-VFL on Fashion-MNIST, run against the paper's Table 13 (its Fashion-MNIST block, trained
under MCAR 0.2) on a CPU budget.

Fashion-MNIST cut into 8 patches of 14x7 pixels (one per party), 1000 labelled training
samples and the rest of the training subset unlabelled, blocks missing MCAR 0.2 in training but
for 200 of the labelled samples, kept fully aligned (the paper's setup); weight decay 1e-4;
accuracy on the paper's seven test patterns (MCAR 0 / 0.2 / 0.5, MAR-1, MAR-2, MNAR 0.7 / 0.9).
FALSE-VFL-I and -II against Vanilla VFL (standard: the labelled complete samples, zeros for
missing blocks at test), LASER-VFL with a single head and PlugVFL, each baseline with and
without SimSiam pretraining of the bottom models on all of a party's training rows.

    python benchmarks/false_table.py              # the committed configuration
    python benchmarks/false_table.py --quick      # a smoke run

Cuts from the paper, for time: a 20k-row training subset (the paper's unlabelled pool is the
full 60k) and a 2k-row test subset, MLP encoders/decoders of width 128 with h 32 and z 16 and
20 epochs per FALSE stage (paper: h 196, z 32, 150-500 epochs), a two-block CNN per party for
the baselines with 40 epochs on the labelled rows and 5 SimSiam epochs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from _shared import (
    QUICK_NOTE,
    RESULTS,
    command_line,
    output_directory,
    run_jobs,
    save_figure,
    verdict,
    write_outputs,
)

from secure_vfl.cli import non_negative_int, positive_int
from secure_vfl.io import counted

PATTERNS = ["mcar:0", "mcar:0.2", "mcar:0.5", "mar1", "mar2", "mnar:0.7", "mnar:0.9"]
PAPER_PATTERNS = ["MCAR0", "MCAR2", "MCAR5", "MAR1", "MAR2", "MNAR7", "MNAR9"]

# The paper's numbers as REFERENCE.md quotes them (its "Tables 13-18" section: the
# Fashion-MNIST block, accuracy %).
PAPER = {
    "Vanilla VFL": [76.7, 71.0, 55.9, 53.2, 54.2, 53.4, 49.2],
    "LASER-VFL": [75.6, 72.5, 65.2, 65.1, 66.0, 64.7, 63.7],
    "PlugVFL": [78.3, 74.3, 65.5, 65.2, 65.8, 63.8, 58.2],
    "FedHSSL": [78.5, 76.1, 66.7, 64.5, 67.0, 65.2, 61.0],
    "FALSE-VFL-I": [82.9, 79.9, 68.4, 65.2, 67.8, 66.8, 65.6],
    "FALSE-VFL-II": [82.5, 79.1, 67.5, 64.7, 67.2, 66.3, 64.9],
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The run's sizes and epochs."""

    train_subset: int = 20_000
    test_subset: int = 2_000
    labeled: int = 1000
    aligned_labeled: int = 200  # of the labelled samples, kept observed by every party
    weight_decay: float = 1e-4
    false_epochs: int = 20
    baseline_epochs: int = 40
    pretrain_epochs: int = 5


# Row label -> (method, SimSiam pretraining on?)
VARIANTS = {
    "FALSE-VFL-I": ("false-vfl-1", False),
    "FALSE-VFL-II": ("false-vfl-2", False),
    "Vanilla VFL": ("standard", False),
    "Vanilla VFL + SimSiam": ("standard", True),
    "LASER-VFL": ("laser", False),
    "LASER-VFL + SimSiam": ("laser", True),
    "PlugVFL": ("plugvfl", False),
    "PlugVFL + SimSiam": ("plugvfl", True),
}


@cache
def _data(plan: Plan, seed: int) -> Any:
    from laser_table import DatasetPlan, subsample

    from secure_vfl.data.datasets import load_dataset
    from secure_vfl.data.missingness import parse_mechanism
    from secure_vfl.data.vertical import make_vertical
    from secure_vfl.experiment import aligned_generator

    rng = np.random.default_rng(seed)
    sizes = DatasetPlan("fashion-mnist", plan.train_subset, plan.test_subset, epochs=1, lr=0.0)
    split = subsample(load_dataset("fashion-mnist", rng=rng), sizes, rng)
    return make_vertical(
        split,
        parties=8,
        train_missing=parse_mechanism("mcar:0.2"),
        test_missing=[parse_mechanism(p) for p in PATTERNS],
        rng=rng,
        aligned=plan.aligned_labeled,
        aligned_rng=aligned_generator(seed),
    )


def run_job(plan: Plan, variant: str, seed: int) -> dict[str, Any]:
    """Train one variant on one seed's data and evaluate it on every pattern (in a worker)."""
    import torch

    from secure_vfl.experiment import TrainConfig, run_training
    from secure_vfl.methods import MethodConfig
    from secure_vfl.methods.false_vfl import FalseVflConfig

    torch.set_num_threads(1)
    method, pretrain = VARIANTS[variant]
    latent = method.startswith("false-vfl")
    config = TrainConfig(
        method=method,
        dataset="fashion-mnist",
        parties=8,
        train_missing="mcar:0.2",
        test_missing=tuple(PATTERNS),
        seed=seed,
        method_config=MethodConfig(
            heads="active",
            labeled=plan.labeled,
            weight_decay=plan.weight_decay,
            epochs=plan.false_epochs if latent else plan.baseline_epochs,
            lr=0.03,
            batch_size=128,
            standard_incomplete="zero",
            pretrain_epochs=plan.pretrain_epochs if pretrain else 0,
        ),
        false_vfl=FalseVflConfig() if latent else None,
        aligned_labeled=plan.aligned_labeled,
    )
    result = run_training(config, data=_data(plan, seed))
    return {
        "variant": variant,
        "seed": seed,
        "accuracy": {k: v["accuracy"] for k, v in result.metrics.items()},
        "wall_time_s": result.wall_time_s,
    }


def table(results: list[dict[str, Any]], *, quick: bool) -> tuple[str, dict[str, Any]]:
    """Markdown tables (ours, mean +- std over seeds, beside the paper) and the target check
    (``quick``: a --quick smoke run's, whose verdict says so)."""
    ours: dict[str, list[float]] = {}
    spread: dict[str, list[float]] = {}
    for variant in VARIANTS:
        runs = [r for r in results if r["variant"] == variant]
        if not runs:
            continue
        per_pattern = [[r["accuracy"][p] for r in runs] for p in PATTERNS]
        ours[variant] = [statistics.mean(v) for v in per_pattern]
        spread[variant] = [statistics.stdev(v) if len(v) > 1 else 0.0 for v in per_pattern]
    header = "| method | " + " | ".join(PAPER_PATTERNS) + " | average |"
    rule = "|---" * (len(PATTERNS) + 2) + "|"
    lines = ["## This run (accuracy %, mean ± sample std over seeds)", "", header, rule]
    for variant, values in ours.items():
        cells = [f"{m:.1f} ± {s:.1f}" for m, s in zip(values, spread[variant], strict=True)]
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {statistics.mean(values):.1f} |")
    lines += ["", "## The paper (REFERENCE.md)", "", header, rule]
    for name, values in PAPER.items():
        cells = [f"{v:.1f}" for v in values]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {statistics.mean(values):.1f} |")
    averages = {v: statistics.mean(vals) for v, vals in ours.items()}
    falses = [(a, v) for v, a in averages.items() if v.startswith("FALSE")]
    bases = [(a, v) for v, a in averages.items() if not v.startswith("FALSE")]
    check: dict[str, Any] = {}
    if not (falses and bases):  # a run of some variants only: no target to check
        lines += ["", "Target not checked: it needs a FALSE-VFL variant and a baseline."]
        return "\n".join(lines), {"ours": ours, "std": spread, "check": check}
    false_best, base_best = max(falses), max(bases)
    check = {
        "best_false": {"variant": false_best[1], "average": false_best[0]},
        "best_baseline": {"variant": base_best[1], "average": base_best[0]},
        "gap": false_best[0] - base_best[0],
        "target_met": false_best[0] > base_best[0],
    }
    lines += [
        "",
        f"Target (best FALSE-VFL variant above the best baseline on the average of the seven "
        f"patterns): {verdict(check['target_met'], quick, ('met', 'MISSED'))} — {false_best[1]} "
        f"{false_best[0]:.1f} vs {base_best[1]} {base_best[0]:.1f} (gap {check['gap']:+.1f}; "
        "the paper's gap in this table, MCAR 0.2 in training, is +3.4 against LASER-VFL, +2.5 "
        "against FedHSSL, which we do not run).",
    ]
    return "\n".join(lines), {"ours": ours, "std": spread, "check": check}


def plot(summary: dict[str, Any], path: Path) -> None:
    """Accuracy per test pattern, one line per method (ours solid, the paper's dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    x = np.arange(len(PATTERNS))
    colours = {}
    for i, (variant, values) in enumerate(summary["ours"].items()):
        colours[variant] = f"C{i}"
        ax.errorbar(
            x, values, yerr=summary["std"][variant], marker="o", label=variant, color=f"C{i}"
        )
    for name, values in PAPER.items():
        if name in ("FALSE-VFL-I", "LASER-VFL"):
            colour = colours.get(name, "grey")
            ax.plot(x, values, linestyle=":", color=colour, label=f"paper: {name}")
    ax.set_xticks(x, PAPER_PATTERNS)
    ax.set_ylabel("test accuracy %")
    ax.set_title("Fashion-MNIST, 8 parties, 1000 labels, trained under MCAR 0.2")
    ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=non_negative_int, default=[0, 1, 2])
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny subsets and epochs, 1 seed")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)

    plan = Plan()
    if args.quick:
        plan = Plan(
            train_subset=1500,
            test_subset=300,
            labeled=300,
            aligned_labeled=60,
            false_epochs=2,
            baseline_epochs=2,
            pretrain_epochs=1,
        )
        args.seeds = args.seeds[:1]
    jobs = [(plan, variant, seed) for variant in args.variants for seed in args.seeds]
    # Slowest first (FALSE-VFL, then pretraining) so the pool's tail is short.
    jobs.sort(key=lambda job: (not job[1].startswith("FALSE"), "SimSiam" not in job[1]))
    start = time.perf_counter()
    results = run_jobs(run_job, jobs, workers=args.workers)
    elapsed = time.perf_counter() - start
    results.sort(key=lambda r: (list(VARIANTS).index(r["variant"]), r["seed"]))

    command = command_line("false_table.py", argv)
    body, summary = table(results, quick=args.quick)
    text = (
        "# FALSE-VFL on Fashion-MNIST, compared with the paper's Table 13 (Fashion-MNIST block)\n\n"
        f"Command: `{command}`  \n"
        f"Seeds {args.seeds}; {len(results)} trainings in {elapsed / 60:.1f} min on this machine "
        f"({counted(args.workers, 'worker')} x 1 thread).\n\n"
        f"Setup: {dataclasses.asdict(plan)}; 8 parties (14x7 patches), trained under MCAR 0.2; "
        f"{plan.aligned_labeled} of the labelled samples kept fully aligned (out of the training "
        "missingness, as the paper's); every optimiser with weight decay "
        f"{plan.weight_decay:g} (the paper's 1e-4); FALSE-VFL: kappa 10, L 50, Adam 3e-3, h 32, "
        "z 16; baselines: SGD lr 0.03 momentum 0.8, batch 128, one label party.\n\n"
        f"{QUICK_NOTE if args.quick else ''}{body}\n"
    )
    stem = "false_table_quick" if args.quick else "false_table"
    write_outputs(args.out, stem, text, {"command": command, "results": results, **summary})
    plot(summary, args.out / f"{stem}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
