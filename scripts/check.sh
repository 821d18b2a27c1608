#!/usr/bin/env bash
# The quality gate, run by CI and by hand: format, lint, type check, then the whole test suite.
# `bash scripts/check.sh ARGS` runs pytest on ARGS instead of the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
if [ "$#" -gt 0 ]; then
  exec .venv/bin/pytest -q "$@"
fi
# First the tests that start no processes, on every core (pytest-xdist; one torch thread per
# worker). Then, one at a time as before, those marked `processes` (party and peer processes,
# loopback endpoints, deadlines; tests/conftest.py): other tests beside them would compete with
# their deadlines for the CPU. Their party processes are forked from one that has imported
# secure-vfl (tests/warm_start.py), which halves this phase. Either run fails on a failing test and on collecting none (5).
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} .venv/bin/pytest -q -n auto -m "not processes"
.venv/bin/pytest -q -m processes
