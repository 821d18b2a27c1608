"""What the benchmark scripts share: a process pool of single-threaded jobs, atomic outputs
(text, JSON and figures), free loopback ports and child processes stopped by their pids."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
"""Where every script writes by default (``--out``), from whatever directory it is run."""


QUICK_NOTE = (
    "**A `--quick` smoke run**: sizes, steps and epochs far too small to measure or reproduce "
    "anything; the figures, checks and targets below are printed to exercise the code, not as "
    "results.\n\n"
)
"""Heads a --quick run's results: a smoke run, not a result."""


def quick_marked(text: str, quick: bool) -> str:
    """A report ``text`` with :data:`QUICK_NOTE` after its title where it comes from a
    ``--quick`` run, so that neither what it prints nor a ``*_quick`` file reads as a result."""
    if not quick:
        return text
    title, _, rest = text.partition("\n\n")
    return f"{title}\n\n{QUICK_NOTE}{rest}"


def medians_of(repeats: int) -> str:
    """How a report's figures were taken over ``repeats`` repeats: ``Medians of 3 repeats``;
    of one (a --quick run's) there is no median, and the report says so."""
    if repeats == 1:
        return "One repeat (each figure is its only measurement, no median)"
    return f"Medians of {repeats} repeats"


def verdict(met: bool, quick: bool, words: tuple[str, str] = ("MET", "MISSED")) -> str:
    """A target's verdict, ``words`` (met, missed), said to be a smoke run's where ``quick``:
    a --quick run's sizes are too small for a verdict to mean anything."""
    said = words[0] if met else words[1]
    return f"{said} (smoke run)" if quick else said


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


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a ``python -m secure_vfl`` child: this checkout first on the path,
    then whatever ``PYTHONPATH`` already held (packages installed beside the interpreter's
    own), one torch thread, and ``extra``."""
    root = str(Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def output_directory(text: str) -> Path:
    """An argparse type for ``--out``: a directory that exists or can be made and written in,
    checked before the measuring starts rather than when its results are written at the end."""
    import argparse

    from secure_vfl.errors import ConfigError
    from secure_vfl.io import check_directory

    path = Path(text)
    try:
        check_directory("--out", path)
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--out ")) from None
    return path


def command_line(script: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run, as committed beside its results."""
    args = " ".join(argv if argv is not None else sys.argv[1:])
    return f"python benchmarks/{script} {args}".rstrip()


def write_outputs(out: Path, stem: str, text: str, payload: dict[str, Any]) -> None:
    """``stem.md`` and ``stem.json`` under ``out``, each written atomically; the JSON carries
    the command that made it (``command``, else the report's first ``Command: `...``` line),
    as the report does. ValueError where neither says it."""
    import re

    from secure_vfl.io import atomic_write_json, atomic_write_text

    if "command" not in payload:
        stated = re.search(r"^Command: `([^`]+)`", text, re.MULTILINE)
        if stated is None:
            raise ValueError(f"{stem}: results without the command that made them")
        payload = {"command": stated[1], **payload}
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"{stem}.md", text)
    atomic_write_json(out / f"{stem}.json", payload)


def save_figure(figure: Any, path: Path, *, dpi: int = 110) -> None:
    """Save a matplotlib ``figure`` to ``path`` atomically (a temporary file, then a rename)."""
    tmp = path.with_suffix(".tmp" + path.suffix)
    figure.savefig(tmp, dpi=dpi)
    os.replace(tmp, path)


class Processes:
    """Child processes started by a benchmark, each recorded by its pid and stopped by it.

    Use as a context manager: whatever is still running when the block ends, passed or failed,
    is killed (SIGKILL) by its pid and reaped.
    """

    def __init__(self, *, cwd: Path, env: dict[str, str] | None = None) -> None:
        self.cwd = cwd
        self.env = env
        self.pids: list[int] = []
        self._started: list[subprocess.Popen[bytes]] = []

    def start(self, args: Sequence[str], *, log: Path) -> subprocess.Popen[bytes]:
        """Start ``args`` with stdout and stderr into ``log``; its pid is recorded at once."""
        with log.open("wb") as output:
            process = subprocess.Popen(
                list(args), stdout=output, stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env
            )
        self._started.append(process)
        self.pids.append(process.pid)
        return process

    def stop_all(self) -> None:
        """Kill every recorded process that is still running, by its pid, and reap it."""
        for process in self._started:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                process.wait(timeout=30)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


class PortServer:
    """A server process started here that prints ``PORT n`` once it listens on 127.0.0.1:n and
    stops when a line arrives on its stdin (killed by its pid if it does not within 10 s)."""

    def __init__(self, args: Sequence[str], *, what: str = "server") -> None:
        import select

        self.process = subprocess.Popen(
            list(args),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "GRPC_VERBOSITY": "NONE"},
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], 120)
        line = self.process.stdout.readline() if ready else ""
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"the {what} process did not start: {line!r}")
        self.address = f"127.0.0.1:{int(line.split()[1])}"

    def cpu_seconds(self) -> float:
        """The process's CPU time so far (every thread, as the kernel counts it)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write("stop\n")
                self.process.stdin.flush()
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)
