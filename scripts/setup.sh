#!/usr/bin/env bash
# Installs everything secure-vfl needs on a fresh machine: a virtual environment in .venv with
# the pinned Python packages (torch pinned to its CPU build) and the offline datasets that ship
# in Debian packages (extracted under the data home, see `secure-vfl datasets`).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch first, pinned: an unpinned torch (or one pulled by another package) resolves to CUDA.
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt torch==2.13.0
.venv/bin/pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev,bench,ray]"
.venv/bin/pip check
.venv/bin/secure-vfl datasets install --all
