#!/usr/bin/env bash
# Builds torchhal's, the plugins' and the speedups' wheels into .whl/ (git-ignored) for the offline
# GPU host (the speedups' one abi3 wheel, cp310+, with this machine's compiler for linux x86_64),
# beside the third-party wheels that ../shared/tools/device-wheels fetched. On the GPU host:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site
# (installed, not on PYTHONPATH from the checkout, so entry points are found as for a user).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -f .whl/torchhal-*.whl .whl/torchhal_*.whl
for project in . plugins/nvidia plugins/amd plugins/intel plugins/simasic speedups; do
  .venv/bin/python -m build --wheel --no-isolation --outdir .whl "$project" >/dev/null
done
ls -1 .whl/torchhal*.whl
