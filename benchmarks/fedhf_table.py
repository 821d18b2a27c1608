"""Reproduce the pattern of FedHF-Impute's Table II on the offline datasets.

Every imputation method runs on every dataset for three seeds: the rows are dealt to K = 4
clients, each keeping a random 60 % of the features, and scored by one protocol (a fixed-seed
20 % of each client's observed-and-available test entries hidden; RMSE in standardised space).
Writes a Markdown table (mean +- std over seeds and clients) beside the paper's Table II, the raw
results as JSON and a convergence plot of the federated methods' validation RMSE.

    python benchmarks/fedhf_table.py            # the committed configuration
    python benchmarks/fedhf_table.py --quick    # a smoke run (1 seed, 3 rounds)
"""

from __future__ import annotations

import argparse
import sys
import time
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

METHODS = ["mean", "knn", "mice", "dae", "fed-mean", "fed-dae", "fedhf"]
FEDERATED_BASELINES = ["fed-mean", "fed-dae"]
DATASETS = ["airquality", "ozone", "chorizon"]  # by number of features: 4, 10, 99

PAPER_TABLE = """\
Paper, Table II (RMSE, standardised; their datasets, which are not available offline here):

| method | AirQuality (13 f.) | PhysioNet (42 f.) | SECOM (590 f.) |
|---|---|---|---|
| MICE (per client) | 0.6756 | 1.1821 | 1.1231 |
| Fed-Mean | 0.9902 | 0.9927 | 1.1762 |
| Fed-DAE | 0.7726 | 0.9718 | 4.0519 |
| VFL-KNN-Impute | 0.9889 | 0.9662 | 1.1231 |
| Fed-FeatGen | 0.8233 | 0.9339 | 2.2202 |
| FedHF-Impute | 0.7074 | 0.9363 | 0.8205 |

(MICE and the paper's federated rows but Fed-Transformer. Its 26.9 % on SECOM is the gain over
VFL-KNN-Impute's 1.1231; on PhysioNet Fed-FeatGen's 0.9339 is ahead of FedHF-Impute's. Our
`airquality` is R's 4-feature New York air quality data, not the paper's 13-feature AirQuality.)

The public FedHF-Impute code on LA Ozone (REFERENCE.md, seeds 0-2): column mean 1.053, Fed-Mean
1.050, kNN 0.796, MICE 0.713, FedHF-Impute (batch 16, 30 rounds) 0.799.
"""


def run_job(method: str, dataset: str, seed: int, rounds: int) -> dict[str, Any]:
    """One method on one dataset and seed (in a worker process with one torch thread)."""
    import torch

    from secure_vfl.experiment import ImputeRunConfig, run_imputation
    from secure_vfl.methods.imputation import ImputeConfig

    torch.set_num_threads(1)
    config = ImputeRunConfig(
        method=method,
        dataset=dataset,
        clients=4,
        availability=0.6,
        seed=seed,
        impute_config=ImputeConfig(rounds=rounds),
    )
    result, _ = run_imputation(config)
    return {
        "method": method,
        "dataset": dataset,
        "seed": seed,
        "rmse": result.rmse,
        "rmse_per_client": result.rmse_per_client,
        "validation_curve": result.validation_curve,
        "wall_time_s": result.wall_time_s,
    }


def summarise(results: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """Markdown table (mean +- std over seeds and clients) and the pattern checks."""

    def per_client(method: str, dataset: str) -> list[float]:
        return [
            v
            for r in results
            if r["method"] == method and r["dataset"] == dataset
            for v in r["rmse_per_client"].values()
            if np.isfinite(v)
        ]

    datasets = [d for d in DATASETS if any(r["dataset"] == d for r in results)]
    lines = [
        "| method | " + " | ".join(datasets) + " |",
        "|---|" + "---|" * len(datasets),
    ]
    for method in METHODS:
        cells = []
        for dataset in datasets:
            values = per_client(method, dataset)
            cells.append(f"{np.mean(values):.3f} ± {np.std(values):.3f}" if values else "–")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    checks: dict[str, Any] = {}  # by dataset: its checks, or why none were made
    for dataset in datasets:
        baselines = {
            m: float(np.mean(per_client(m, dataset)))
            for m in FEDERATED_BASELINES
            if per_client(m, dataset)
        }
        if not (per_client("fedhf", dataset) and baselines):  # some methods run only
            checks[dataset] = "not made (they need fedhf and a federated baseline)"
            continue
        fedhf = float(np.mean(per_client("fedhf", dataset)))
        best = min(baselines.values())
        checks[dataset] = {
            "fedhf_below_fed_mean_and_fed_dae": bool(fedhf < best),
            "relative_gain_over_best_federated_baseline_%": round(100 * (best - fedhf) / best, 1),
        }
    lines += ["", "Pattern checks (FedHF-Impute against the federated baselines):"]
    lines += [f"- {name}: {value}" for name, value in checks.items()]
    return "\n".join(lines), checks


def plot(results: list[dict[str, Any]], path: Path) -> None:
    """Validation RMSE per round of the federated methods, mean over seeds, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = [d for d in DATASETS if any(r["dataset"] == d for r in results)]
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.5 * len(datasets), 3.4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        for method in METHODS:
            curves = [
                r["validation_curve"]
                for r in results
                if r["method"] == method and r["dataset"] == dataset and r["validation_curve"]
            ]
            if not curves:
                continue
            length = min(len(c) for c in curves)
            mean = np.mean([c[:length] for c in curves], axis=0)
            ax.plot(
                range(1, length + 1),
                mean,
                label=method,
                linewidth=2.5 if method == "fedhf" else 1.2,
            )
        ax.set_title(dataset)
        ax.set_xlabel("round")
        ax.set_ylabel("validation RMSE (std units)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--datasets", nargs="+", default=DATASETS, choices=DATASETS)
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--seeds", nargs="+", type=non_negative_int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=positive_int, default=30)
    parser.add_argument("--workers", type=positive_int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 seed, 3 rounds")
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)

    if args.quick:
        args.seeds, args.rounds = args.seeds[:1], 3
    jobs = [(m, d, s, args.rounds) for d in args.datasets for m in args.methods for s in args.seeds]
    jobs.sort(key=lambda job: (job[1] != "chorizon", job[0] not in ("fedhf", "fed-dae", "dae")))
    start = time.perf_counter()
    results = run_jobs(run_job, jobs, workers=args.workers)
    elapsed = time.perf_counter() - start
    results.sort(
        key=lambda r: (DATASETS.index(r["dataset"]), METHODS.index(r["method"]), r["seed"])
    )

    command = command_line("fedhf_table.py", argv)
    table, checks = summarise(results)
    text = (
        "# FedHF-Impute on offline datasets, compared with the paper's Table II\n\n"
        f"{QUICK_NOTE if args.quick else ''}"
        f"Command: `{command}`  \n"
        f"Seeds {args.seeds}; {len(results)} runs in {elapsed / 60:.1f} min "
        f"({counted(args.workers, 'worker')} x 1 thread). K = 4 clients, each keeping a random "
        "60 % of the features; "
        f"{args.rounds} FedAvg rounds of 2 local epochs, batch 16. RMSE in standardised space on "
        "a fixed-seed 20 % of each client's observed-and-available test entries; mean ± population "
        "std (numpy's, ddof 0) over seeds and clients.\n\n"
        f"{table}\n\n{PAPER_TABLE}"
    )
    stem = "fedhf_table_quick" if args.quick else "fedhf_table"
    write_outputs(args.out, stem, text, {"command": command, "results": results, "checks": checks})
    plot(results, args.out / f"{stem}.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
