#!/usr/bin/env bash
# The quality gate, run by CI and by hand: format, lint, type check, then the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/pytest -q "$@"
