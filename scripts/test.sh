#!/usr/bin/env bash
# The whole test suite: set up with the dev tools, lint, type-check hal_core, run pytest.
# Tests marked `gpu` skip (with the reason) where no NVIDIA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing, since a suite that ran nothing proves nothing" >&2
  exit 1
fi
exit "$status"
