"""How LASER-VFL and its baselines scale with the number of parties, and what vectorising buys.

Three measurements in one run, each configuration in a fresh process (so peak memory is its own;
a ``--quick`` smoke run runs them all in one process and shows no memory):

1. epoch time and peak training memory (RSS above the process's footprint before the model is
   built) for every method at K = 2, 4, 6, 8 parties (Combinatorial only up to K = 6: it trains
   2^K - 1 predictors);
2. the median training-step time of LASER with ``grouped`` and ``mixed`` batches;
3. the median step time of LASER's vectorised task forward against a looped one (one aggregator
   call and one head evaluation per (head, subset size)), and the speed-up.

    python benchmarks/laser_speed.py            # the committed configuration
    python benchmarks/laser_speed.py --quick    # a smoke run: 2 parties, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, Literal

import numpy as np
from _shared import RESULTS, command_line, output_directory, quick_marked, write_outputs

from secure_vfl.cli import parties_count

METHODS = ["local", "standard", "ensemble", "plugvfl", "laser", "combinatorial"]


@dataclasses.dataclass(frozen=True)
class Job:
    kind: str  # "epoch" or "steps"
    method: str
    parties: int
    batching: Literal["grouped", "mixed"] = "grouped"
    vectorised: bool = True
    epochs: int = 3
    steps: int = 200
    dataset: str = "satellite"
    p_miss: float = 0.1


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(job: Job) -> dict[str, Any]:
    """Measure one configuration (runs in its own process)."""
    from secure_vfl.experiment import TrainConfig, build_method, prepare_data
    from secure_vfl.methods import MethodConfig

    config = TrainConfig(
        method=job.method,
        dataset=job.dataset,
        parties=job.parties,
        train_missing=f"mcar:{job.p_miss:g}",
        test_missing=("mcar:0",),
        seed=0,
        method_config=MethodConfig(
            epochs=job.epochs, batching=job.batching, vectorised=job.vectorised
        ),
    )
    data = prepare_data(config)
    before = _rss_mib()
    method = build_method(config, data)
    import torch

    out: dict[str, Any] = dataclasses.asdict(job)
    out["threads"] = torch.get_num_threads()  # torch's default in this process
    if job.kind == "epoch":
        times: list[float] = []
        last = [time.perf_counter()]
        steps = len(method.sampler)

        def on_step(step: int, loss: float) -> None:
            if step % steps == 0:
                now = time.perf_counter()
                times.append(now - last[0])
                last[0] = now

        method.fit(on_step=on_step)
        out["epoch_s"] = statistics.median(times)
        out["peak_mib"] = _rss_mib() - before
        return out
    step = method.train_step
    sampler = method.sampler
    rng = np.random.default_rng(0)
    durations: list[float] = []
    round = 0
    while len(durations) < job.steps + 10:
        for batch_id, rows in enumerate(sampler.epoch(rng)):
            start = time.perf_counter()
            step(rows, round, batch_id)
            durations.append(time.perf_counter() - start)
            round += 1
            if len(durations) >= job.steps + 10:
                break
    out["step_ms"] = 1000 * statistics.median(durations[10:])
    return out


def plan(parties: list[int] | None, *, quick: bool) -> list[Job]:
    """The configurations of a run: every method's epochs at each of ``parties`` (None: 2, 4,
    6 and 8; Combinatorial up to 6), then LASER's steps at 4 and 8 parties in both batching
    modes, vectorised and looped. ``quick``: a smoke run of the same kinds of configuration:
    1 epoch, 20 steps, and 2 parties for both tables unless ``parties`` says otherwise."""
    step_parties: tuple[int, ...]
    if quick:
        epochs, steps, step_parties = 1, 20, (2,)
        parties = [2] if parties is None else parties
    else:
        epochs, steps, step_parties = 3, 200, (4, 8)
        parties = [2, 4, 6, 8] if parties is None else parties
    jobs = [
        Job("epoch", method, k, epochs=epochs)
        for k in parties
        for method in METHODS
        if method != "combinatorial" or k <= 6
    ]
    jobs += [
        Job("steps", "laser", k, batching=batching, vectorised=vectorised, steps=steps)
        for k in step_parties
        for batching in ("grouped", "mixed")
        for vectorised in (True, False)
    ]
    return jobs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--parties",
        nargs="+",
        type=parties_count,
        help="the numbers of parties of the epoch-time table (default: 2 4 6 8; --quick: 2)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: 1 epoch, 20 steps, 2 parties (not a result)",
    )
    parser.add_argument("--out", type=output_directory, default=RESULTS)
    args = parser.parse_args(argv)

    from tqdm import tqdm

    jobs = plan(args.parties, quick=args.quick)
    epochs, steps = jobs[0].epochs, jobs[-1].steps
    args.parties = list(dict.fromkeys(job.parties for job in jobs if job.kind == "epoch"))
    step_parties = list(dict.fromkeys(job.parties for job in jobs if job.kind == "steps"))
    # Each configuration in a fresh process of its own, but a smoke run's all in one (most of
    # a fresh one's time is the interpreter's start; its peak memory is then not shown).
    context = get_context("spawn")
    fresh = None if args.quick else 1
    with ProcessPoolExecutor(1, mp_context=context, max_tasks_per_child=fresh) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        results = [
            future.result() for future in tqdm(futures, desc="configurations", unit="config")
        ]
    if args.quick:  # a process's peak, not this configuration's
        results = [{k: v for k, v in r.items() if k != "peak_mib"} for r in results]

    command = command_line("laser_speed.py", argv)
    lines = [
        "# LASER-VFL speed and memory",
        "",
        f"Command: `{command}`  ",
        "Satellite (4435 training rows), train p_miss 0.1, batch 128, torch threads: "
        f"{', '.join(str(t) for t in sorted({r['threads'] for r in results}))} (torch's default "
        "in each run's process). "
        + (
            f"Epoch time is the median over {epochs} epochs"
            if epochs > 1
            else "Epoch time is that of the one epoch (no median)"
        )
        + "; peak memory is the "
        "process's maximum RSS growth once data is loaded"
        + (" (not shown: a smoke run's configurations share one process)." if args.quick else "."),
        "",
        "## Epoch time (s) and peak training memory (MiB) by number of parties",
        "",
        "| method | " + " | ".join(f"K={k}" for k in args.parties) + " |",
        "|---|" + "---|" * len(args.parties),
    ]
    epoch_rows = {(r["method"], r["parties"]): r for r in results if r["kind"] == "epoch"}
    for method in METHODS:
        cells = []
        for k in args.parties:
            r = epoch_rows.get((method, k))
            if r is None:
                cells.append("–")
            else:
                memory = "–" if args.quick else f"{r['peak_mib']:.0f} MiB"
                cells.append(f"{r['epoch_s']:.2f} s / {memory}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    step_rows = {
        (r["parties"], r["batching"], r["vectorised"]): r["step_ms"]
        for r in results
        if r["kind"] == "steps"
    }
    lines += [
        "",
        "## LASER step time (ms, median of "
        f"{steps} steps): batching modes and vectorised vs looped task forward",
        "",
        "| K | batching | vectorised | looped | speed-up |",
        "|---|---|---|---|---|",
    ]
    for k in step_parties:
        for batching in ("grouped", "mixed"):
            fast, slow = step_rows[(k, batching, True)], step_rows[(k, batching, False)]
            lines.append(f"| {k} | {batching} | {fast:.2f} | {slow:.2f} | {slow / fast:.2f}x |")
    text = "\n".join(lines) + "\n"
    text = quick_marked(text, args.quick)
    stem = "laser_speed_quick" if args.quick else "laser_speed"
    write_outputs(args.out, stem, text, {"command": command, "results": results})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
