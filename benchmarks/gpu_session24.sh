#!/usr/bin/env bash
# The twenty-fourth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's start,
# 4d60814). Every result goes to $OUT/raw, packed into $OUT/results.tgz at the end (the device
# tool returns at most 8 files):
#   bash benchmarks/gpu_session24.sh one   # one GPU: the new GPU tests (checkpointing on the
#                                          # device's autograd thread, attention_varlen's device
#                                          # check, CUDA graphs, the target check), the varlen
#                                          # per-call cost and the dispatch cost of the session-start
#                                          # and the new build run alternately, activation
#                                          # checkpointing on a patched ~1B Llama
#   bash benchmarks/gpu_session24.sh varlen  # one GPU, after the check learnt to skip offsets it
#                                            # has seen: the varlen and graph tests, and the varlen
#                                            # per-call cost A/B again
#   bash benchmarks/gpu_session24.sh dist  # 2 GPUs: the example with activation checkpointing
#                                          # under torchrun, DDP and FSDP2 over NCCL
# (The varlen A/B of phase `one` did not run: the benchmark passed `causal` by position. It was
# run pinned, as phase `varlen` runs it, before and after the check's memo.)
set -uo pipefail
phase=${1:?one, varlen or dist}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=/tmp/cache PYTHONPATH=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
RAW=$OUT/raw; mkdir -p "$RAW"
pack() { tar czf "$OUT/results.tgz" -C "$OUT" raw && rm -rf "$RAW"; }
varlen_ab() {
  for run in old_1 new_1 old_2 new_2 old_3 new_3; do
    site=/tmp/${run%_*}; [ "$site" = /tmp/new ] && site=/tmp/site
    PYTHONPATH=$site timeout 120 python3 benchmarks/bench_varlen_check.py --pin 3 --label "$run" \
      --out "$RAW/varlen_$run.json" 2>&1 | tee "$RAW/varlen_$run.log" | tail -3
  done
}
old_site() {
  cp -r /tmp/site /tmp/old
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
}
if [ "$phase" = varlen ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/gpu/test_cuda_graphs_gpu.py \
    tests/kernels/gpu/test_attention_gpu.py -k "graph or varlen" 2>&1 | tee "$RAW/gpu_tests_varlen_graphs.log" | tail -3
  old_site; varlen_ab; pack; exit 0
fi
if [ "$phase" = dist ]; then
  timeout 400 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/distributed/gpu -k checkpointed \
    2>&1 | tee "$RAW/gpu_tests_distributed.log" | tail -6
  echo "distributed gpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_checkpointing_gpu.py \
  tests/kernels/gpu/test_cuda_graphs_gpu.py "tests/kernels/gpu/test_attention_gpu.py" \
  tests/kernels/gpu/test_linear_cross_entropy_gpu.py -k "checkpoint or graph or captured or varlen or assert or target" \
  2>&1 | tee "$RAW/gpu_tests.log" | tail -8
echo "gpu tests rc=${PIPESTATUS[0]}"
old_site
varlen_ab
OUT=$RAW bash benchmarks/dispatch_ab.sh | tee "$OUT/dispatch_ab_table.txt"
timeout 300 python3 benchmarks/bench_activation_checkpointing.py --steps 6 --out "$RAW/activation_checkpointing.json" \
  2>&1 | tee "$RAW/activation_checkpointing.log" | tail -6
echo "activation checkpointing rc=${PIPESTATUS[0]}"
pack
