"""Reproduce the pattern of LASER-VFL's Table 1: six methods under missing blocks, K = 4.

For each dataset, method, training p_miss in {0, 0.1, 0.5} and seed, one model is trained and
evaluated on test p_miss 0, 0.1 and 0.5 (MCAR per block, masks drawn independently of training).
Writes a Markdown table (mean +- std over seeds), the raw results as JSON and a plot.

    python benchmarks/laser_table.py                      # the committed configuration
    python benchmarks/laser_table.py --quick              # a minute-long smoke run

Jobs run in ``--workers`` processes with one torch thread each (small models use one core well).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
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
    write_outputs,
)

from secure_vfl.cli import non_negative_int, positive_int
from secure_vfl.io import counted

METHODS = ["local", "standard", "ensemble", "combinatorial", "plugvfl", "laser"]
P_MISS = [0.0, 0.1, 0.5]


@dataclasses.dataclass(frozen=True)
class DatasetPlan:
    """How one dataset is run: subset sizes and training hyper-parameters."""

    name: str
    train_subset: int | None
    test_subset: int | None
    epochs: int
    lr: float
    batch_size: int = 128


PLANS = {
    # Fashion-MNIST quadrants (K = 4) with a small CNN per party, on a training subset.
    "fashion-mnist": DatasetPlan("fashion-mnist", 10_000, 2_000, epochs=10, lr=0.03),
    # Satellite (Statlog split), 4 blocks of 9 features, the reference's HAPT MLP recipe.
    "satellite": DatasetPlan("satellite", None, None, epochs=50, lr=0.03),
}


def subsample(split: Any, plan: DatasetPlan, rng: np.random.Generator) -> Any:
    """A seeded random subset of the train and test rows (all rows when the plan says None)."""
    from secure_vfl.data.datasets import DatasetSplit, LabeledArrays

    def take(arrays: LabeledArrays, size: int | None) -> LabeledArrays:
        if size is None or size >= len(arrays):
            return arrays
        rows = np.sort(rng.choice(len(arrays), size=size, replace=False))
        return LabeledArrays(arrays.x[rows], arrays.y[rows])

    return DatasetSplit(
        name=split.name,
        kind=split.kind,
        train=take(split.train, plan.train_subset),
        test=take(split.test, plan.test_subset),
        num_classes=split.num_classes,
        feature_names=split.feature_names,
    )


@cache
def _data(plan: DatasetPlan, p_train: float, seed: int) -> Any:
    from secure_vfl.data.datasets import load_dataset
    from secure_vfl.data.missingness import parse_mechanism
    from secure_vfl.data.vertical import make_vertical

    rng = np.random.default_rng(seed)
    split = subsample(load_dataset(plan.name, rng=rng), plan, rng)
    return make_vertical(
        split,
        parties=4,
        train_missing=parse_mechanism(f"mcar:{p_train:g}"),
        test_missing=[parse_mechanism(f"mcar:{p:g}") for p in P_MISS],
        rng=rng,
    )


def run_job(plan: DatasetPlan, method: str, p_train: float, seed: int) -> dict[str, Any]:
    """Train one model and evaluate it on every test p_miss (in a worker process)."""
    import torch

    from secure_vfl.experiment import TrainConfig, run_training
    from secure_vfl.methods import MethodConfig

    torch.set_num_threads(1)
    config = TrainConfig(
        method=method,
        dataset=plan.name,
        parties=4,
        train_missing=f"mcar:{p_train:g}",
        test_missing=tuple(f"mcar:{p:g}" for p in P_MISS),
        seed=seed,
        method_config=MethodConfig(
            epochs=plan.epochs, lr=plan.lr, batch_size=plan.batch_size, batching="grouped"
        ),
    )
    result = run_training(config, data=_data(plan, p_train, seed))
    return {
        "dataset": plan.name,
        "method": method,
        "p_train": p_train,
        "seed": seed,
        "accuracy": {k: v["accuracy"] for k, v in result.metrics.items()},
        "f1": {k: v["f1"] for k, v in result.metrics.items()},
        "wall_time_s": result.wall_time_s,
    }


def cell(values: list[float]) -> str:
    return f"{np.mean(values):.1f} ± {np.std(values):.1f}"


def tables(results: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown tables per dataset and the pattern checks the issue asks for."""
    grouped: dict[tuple[str, str, float, float], list[float]] = defaultdict(list)
    for r in results:
        for p_test in P_MISS:
            grouped[(r["dataset"], r["method"], r["p_train"], p_test)].append(
                r["accuracy"][f"mcar:{p_test:g}"]
            )
    lines: list[str] = []
    checks: dict[str, Any] = {}
    for dataset in dict.fromkeys(r["dataset"] for r in results):
        header = " | ".join(f"{a:g} / {b:g}" for a in P_MISS for b in P_MISS)
        lines += [
            f"### {dataset} (accuracy %, mean ± population std over seeds, "
            "train p_miss / test p_miss)",
            "",
            f"| method | {header} |",
            "|---|" + "---|" * len(P_MISS) ** 2,
        ]
        for method in METHODS:
            cells = [
                cell(grouped[(dataset, method, a, b)])
                if grouped.get((dataset, method, a, b))
                else "–"
                for a in P_MISS
                for b in P_MISS
            ]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")

        def mean(method: str, a: float, b: float, ds: str = dataset) -> float:
            return float(np.mean(grouped[(ds, method, a, b)]))

        def std(method: str, a: float, b: float, ds: str = dataset) -> float:
            return float(np.std(grouped[(ds, method, a, b)]))

        ran = [
            m
            for m in METHODS
            if all(grouped.get((dataset, m, a, b)) for a in P_MISS for b in P_MISS)
        ]
        baselines = [m for m in ran if m != "laser"]
        if not ({"laser", "standard"} <= set(ran) and baselines):  # a run of some methods only
            lines += ["Pattern checks: not made (they need laser, standard and a baseline).", ""]
            continue
        laser_full = mean("laser", 0.0, 0.0)
        standard_full = mean("standard", 0.0, 0.0)
        tolerance = max(std("laser", 0.0, 0.0), std("standard", 0.0, 0.0))
        best_baseline = max((mean(m, 0.5, 0.5), m) for m in baselines)
        checks[dataset] = {
            "laser_within_one_std_of_standard_or_above_at_0_0": bool(
                laser_full >= standard_full - tolerance
            ),
            "standard_collapses_at_test_0.5": bool(
                mean("standard", 0.0, 0.5) < mean("standard", 0.0, 0.0) - 20
            ),
            "laser_above_every_baseline_at_0.5_0.5": bool(
                mean("laser", 0.5, 0.5) > best_baseline[0]
            ),
            "best_baseline_at_0.5_0.5": f"{best_baseline[1]} {best_baseline[0]:.1f}",
            "laser_at_0.5_0.5": f"{mean('laser', 0.5, 0.5):.1f}",
        }
        lines.append("Pattern checks:")
        lines += [f"- {name}: {value}" for name, value in checks[dataset].items()]
        lines.append("")
    return "\n".join(lines), checks


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """One panel per (dataset, training p_miss): accuracy against test p_miss per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    fig, axes = plt.subplots(
        len(datasets), len(P_MISS), figsize=(4 * len(P_MISS), 3.2 * len(datasets)), squeeze=False
    )
    for i, dataset in enumerate(datasets):
        for j, p_train in enumerate(P_MISS):
            ax = axes[i][j]
            for method in METHODS:
                runs = [
                    r
                    for r in results
                    if r["dataset"] == dataset and r["method"] == method and r["p_train"] == p_train
                ]
                if not runs:
                    continue
                means = [np.mean([r["accuracy"][f"mcar:{p:g}"] for r in runs]) for p in P_MISS]
                stds = [np.std([r["accuracy"][f"mcar:{p:g}"] for r in runs]) for p in P_MISS]
                ax.errorbar(
                    P_MISS,
                    means,
                    yerr=stds,
                    marker="o",
                    capsize=3,
                    label=method,
                    linewidth=2.5 if method == "laser" else 1.2,
                )
            ax.set_title(f"{dataset}, train p_miss {p_train:g}")
            ax.set_xlabel("test p_miss")
            ax.set_ylabel("accuracy %")
            ax.set_xticks(P_MISS)
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--datasets", nargs="+", default=list(PLANS), choices=list(PLANS))
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=non_negative_int, default=[0, 1, 2])
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny subsets, 2 epochs, 1 seed")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)

    plans = [PLANS[name] for name in args.datasets]
    if args.quick:
        plans = [
            dataclasses.replace(p, train_subset=1000, test_subset=500, epochs=2) for p in plans
        ]
        args.seeds = args.seeds[:1]
    jobs = [
        (plan, method, p_train, seed)
        for plan in plans
        for method in args.methods
        for p_train in P_MISS
        for seed in args.seeds
    ]
    # Slowest jobs first so the pool's tail is short.
    jobs.sort(key=lambda job: (job[1] != "combinatorial", job[0].name != "fashion-mnist"))
    start = time.perf_counter()
    results = run_jobs(run_job, jobs, workers=args.workers)
    elapsed = time.perf_counter() - start
    results.sort(key=lambda r: (r["dataset"], METHODS.index(r["method"]), r["p_train"], r["seed"]))

    command = command_line("laser_table.py", argv)
    body, checks = tables(results)
    setup = "\n".join(
        f"- {p.name}: train subset {p.train_subset or 'all'}, test subset "
        f"{p.test_subset or 'all'}, {p.epochs} epochs, SGD lr {p.lr} momentum 0.8, batch "
        f"{p.batch_size}, grouped batches"
        for p in plans
    )
    text = (
        "# LASER-VFL Table 1 pattern, reproduced\n\n"
        f"Command: `{command}`  \n"
        f"Seeds {args.seeds}; {len(results)} trainings in {elapsed / 60:.1f} min on this machine "
        f"({counted(args.workers, 'worker')} x 1 thread).\n\n{setup}\n\n"
        f"{QUICK_NOTE if args.quick else ''}{body}"
    )
    stem = "laser_table_quick" if args.quick else "laser_table"
    write_outputs(args.out, stem, text, {"command": command, "results": results, "checks": checks})
    plot(results, args.out / f"{stem}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
