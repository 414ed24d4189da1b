#!/usr/bin/env bash
# The twenty-third session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's start,
# ea1db4f). No kernel changed; the dispatch memo, the Hugging Face patch and the collectives moved
# into modules of their own, and the ops gained CUDA-graph tests:
#   bash benchmarks/gpu_session23.sh kernels  # the ops captured in CUDA graphs (one op at a time,
#                                             # a graphed training block, reduce-overhead compile),
#                                             # the NVIDIA adapter's GPU tests, the dispatch cost of
#                                             # the session-start and the new build run alternately,
#                                             # and the patched ~1B Llama step (the loss swap)
#   bash benchmarks/gpu_session23.sh dist     # 2 GPUs: the distributed GPU tests and the collectives
#   bash benchmarks/gpu_session23.sh final    # the CUDA-graph tests after the review (the graphed
#                                             # block also pinned to torchhal's Triton kernels), and
#                                             # the dispatch A/B again with every run's JSON kept
#                                             # (the device tool returns at most 8 files)
set -uo pipefail
phase=${1:?kernels, dist or final}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache PYTHONPATH=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$phase" = final ]; then
  export TORCHHAL_CACHE_DIR=/tmp/cache
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_cuda_graphs_gpu.py \
    2>&1 | tee "$OUT/gpu_tests_graphs.log" | tail -4
  echo "graph gpu tests rc=${PIPESTATUS[0]}"
  cp -r /tmp/site /tmp/old
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
  bash benchmarks/dispatch_ab.sh | tee "$OUT/dispatch_ab_table.txt"
  rm -f "$OUT"/dispatch_*.log
  exit 0
fi
if [ "$phase" = dist ]; then
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed/gpu tests/collectives \
    2>&1 | tee "$OUT/gpu_tests_distributed.log" | tail -8
  echo "distributed gpu tests rc=${PIPESTATUS[0]}"
  exit 0
fi
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_cuda_graphs_gpu.py \
  tests/gpu 2>&1 | tee "$OUT/gpu_tests_graphs_and_adapter.log" | tail -12
echo "graph and adapter gpu tests rc=${PIPESTATUS[0]}"
cp -r /tmp/site /tmp/old
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
bash benchmarks/dispatch_ab.sh
timeout 150 python3 benchmarks/bench_llama_patch.py --out "$OUT/llama_patch.json" 2>&1 | tee "$OUT/llama_patch.log" | tail -12
echo "llama patch rc=${PIPESTATUS[0]}"
