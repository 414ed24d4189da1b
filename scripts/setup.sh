#!/usr/bin/env bash
# Creates .venv (if missing) and installs torchhal, the four vendor plugins, the C speedups and,
# with `dev`, the test tools. Needs only Python >= 3.10 and pip. Idempotent.
# torch: an importable torch in the venv is kept; otherwise torch==2.13.0 is installed (a CPU
# build where the machine has one on local disk; install a CUDA/ROCm/XPU build first to use a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
"$python" -c 'import sys; assert sys.version_info >= (3, 10), f"torchhal needs Python >= 3.10, found {sys.version}"'
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
.venv/bin/python -c 'import torch' 2>/dev/null || "${pip[@]}" torch==2.13.0
extras=""
[ "${1:-}" = "dev" ] && extras="[dev]"
# The tests run Triton's interpreter: where torch brought no triton (a CPU build), install the
# GPU hosts' version. A CUDA torch pins its own (torch 2.13 wants 3.7.1); an exact pin here would
# make pip swap that torch for an older one.
if [ -n "$extras" ] && [ "$(uname -s)" = Linux ] && ! .venv/bin/python -c 'import triton' 2>/dev/null; then
  "${pip[@]}" triton==3.6.0
fi
"${pip[@]}" -e ".${extras}"
# The plugins depend on torchhal, which is not on PyPI: install them once it is installed here.
"${pip[@]}" plugins/nvidia plugins/amd plugins/intel plugins/simasic
# The optional C accelerator of the dispatch memo's guards (speedups/README.md), built here with
# this machine's C compiler and Python headers. The test setup (`dev`) tests it, so there a failed
# build fails this script; otherwise torchhal runs without it, and says so here and in
# `torchhal info` (dispatch guards: python).
if ! "${pip[@]}" ./speedups; then
  [ "${1:-}" = "dev" ] && exit 1
  echo "setup: torchhal-speedups did not build (no C compiler or Python headers?): the dispatch" \
    "guards will run in Python, 0.2-1.6 us more per op call (docs/benchmarks.md)" >&2
fi
