"""What the benchmark scripts share: a process pool of single-threaded jobs and atomic outputs."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any


def run_jobs(
    job: Callable[..., dict[str, Any]], jobs: Sequence[tuple[Any, ...]], *, workers: int
) -> list[dict[str, Any]]:
    """Run ``job(*args)`` for every args tuple in ``workers`` fresh processes, with a progress bar.

    Results come back in completion order. Each worker should set its own torch thread count.
    """
    from tqdm import tqdm

    with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(job, *args) for args in jobs]
        return [
            future.result()
            for future in tqdm(as_completed(futures), total=len(futures), desc="runs", unit="run")
        ]


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run, as committed beside its results."""
    args = " ".join(argv if argv is not None else sys.argv[1:])
    return f"python benchmarks/{script} {args}".rstrip()


def write_outputs(out: Path, stem: str, text: str, payload: dict[str, Any]) -> None:
    """``stem.md`` and ``stem.json`` under ``out``, each written atomically."""
    from secure_vfl.io import atomic_write_json, atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{stem}.md", text)
    atomic_write_json(out / f"{stem}.json", payload)
