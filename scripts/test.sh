#!/usr/bin/env bash
# The whole test suite: set up with the dev tools, lint, type-check torchhal, run pytest (and the
# registry's tests once more with the Python guards).
# Tests marked `gpu` skip (with the reason) where no NVIDIA GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
status=0
.venv/bin/python -m pytest --durations=15 "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing, since a suite that ran nothing proves nothing" >&2
  exit 1
fi
# The dispatch memo's guards ran in C above (torchhal_speedups); the registry and autograd tests
# again with the Python reference guards, which serve where the speedups are not installed.
TORCHHAL_PURE_PYTHON_GUARDS=1 .venv/bin/python -m pytest -q tests/core/test_registry.py \
  tests/kernels/test_autograd.py || status=$?
exit "$status"
