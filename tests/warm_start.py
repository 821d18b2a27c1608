"""Party processes that start warm: forked from a server that has already imported secure-vfl.

A deployment test starts four or five party processes, and a fresh interpreter spends about
four CPU seconds importing torch and secure-vfl before it serves (benchmarks/startup_costs.py);
on two cores that is most of a short test. Here every party process is forked, by
multiprocessing's fork server, from one interpreter that imported those modules once per test
session. Each is still a process of its own: its own pid and memory, its own sockets on
loopback, gRPC with mutual TLS to the others, killed by its pid. What it runs is the command
line's ``main`` with the test's arguments, working directory, environment and log file, and it
exits as a fresh interpreter would: the same exit status, after its threads and exit handlers.

A test that changes what an interpreter does at start (a ``sitecustomize`` that injects a fault)
starts a fresh one instead (``Processes.start(before=...)``).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

# What a served party and a label party import before they serve or train (forked children
# share them); nothing the tests check the absence of (Opacus, TenSEAL) is imported here.
PRELOAD = [
    "torch",
    "secure_vfl.cli",
    "secure_vfl.deployment",
    "secure_vfl.experiment",
    "secure_vfl.federation.federation_file",
    "protocols.party_privacy",
    "protocols.privacy",
    "protocols.secagg",
    "protocols.psi.session",
]

_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(PRELOAD)


def _run(argv: Sequence[str], cwd: str, environment: Mapping[str, str], log: str) -> None:
    """The child: ``secure-vfl ARGV`` in ``cwd`` with ``environment``, its output to ``log``."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    threads = environment.get("OMP_NUM_THREADS")
    if threads:  # a fresh interpreter's OpenMP would read it at start; this one started earlier
        import torch

        torch.set_num_threads(int(threads))
    descriptor = os.open(log, os.O_WRONLY | os.O_APPEND)  # made empty by the parent
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    # As an interpreter opens them on a file: stdout block-buffered, stderr line-buffered.
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the process's own stdout
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.argv = [sys.executable, *argv]
    from secure_vfl.cli import main

    code = main(list(argv))
    # As an interpreter exits: wait for the threads that are not daemons, run the exit handlers.
    for thread in threading.enumerate():
        if thread is not threading.current_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


class WarmProcess:
    """The part of ``subprocess.Popen`` the tests use, for a forked party process."""

    def __init__(self, argv: Sequence[str], cwd: Path, environment: Mapping[str, str], log: Path):
        log.write_bytes(b"")  # there before the call returns, as with Popen's output file
        self._process = _CONTEXT.Process(
            target=_run, args=(list(argv), str(cwd), dict(environment), str(log)), daemon=False
        )
        self._process.start()
        self.args = list(argv)

    @property
    def pid(self) -> int:
        pid = self._process.pid
        assert pid is not None
        return pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code
