#!/usr/bin/env bash
# The seventeenth session's GPU checks in one device call (wheels: ../shared/tools/device-wheels,
# then benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the commit before
# the session, d2b002b, for the dispatch A/B):
#   1. tests: the NVIDIA adapter on the real GPU (measured selection saves the code versions),
#      CUDA autocast on every path, matmul's and attention's compile and SDPA tests;
#   2. bench_dispatch.py, old and new builds alternately (old new old new), pinned, to price the
#      per-call autocast check the ops gained.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
cp -r /tmp/site /tmp/old
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache
PYTHONPATH=/tmp/site timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/gpu/test_nvidia_real.py tests/kernels/gpu/test_autocast_gpu.py tests/kernels/gpu/test_matmul_gpu.py \
  "tests/kernels/gpu/test_attention_gpu.py::test_compile_with_inductor" \
  "tests/kernels/gpu/test_attention_gpu.py::test_sdpa_backend_candidates" \
  "tests/kernels/gpu/test_attention_gpu.py::test_transposed_layout" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
bash benchmarks/dispatch_ab.sh
