#!/usr/bin/env bash
# The nineteenth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's first
# commit, 4b35406, for the A/B). Two device calls:
#   bash benchmarks/gpu_session19.sh kernels  # one GPU: the changed kernels' GPU tests (targets
#                                             # checked by a device assert, >65,535 heads, norms
#                                             # under CUDA autocast), then old/new alternately:
#                                             # bench_cross_entropy at vocab 128k, bench_attention
#   bash benchmarks/gpu_session19.sh dist     # 2 GPUs: tests/distributed/gpu (DDP and FSDP2 with
#                                             # gradient accumulation) and tests/collectives on
#                                             # nccl, then bench_train_scaling old/new alternately
set -uo pipefail
phase=${1:?kernels or dist}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
cp -r /tmp/site /tmp/old
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache
site_of() { [ "${1%_*}" = old ] && echo /tmp/old || echo /tmp/site; }
if [ "$phase" = kernels ]; then
  PYTHONPATH=/tmp/site timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/kernels/gpu/test_linear_cross_entropy_gpu.py tests/kernels/gpu/test_autocast_gpu.py \
    tests/kernels/gpu/test_attention_gpu.py -k "not shape_sweep" 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  for run in old_1 new_1 old_2 new_2; do
    PYTHONPATH=$(site_of $run) timeout 60 python3 benchmarks/bench_cross_entropy.py --vocabs 128256 \
      --budget-s 1 --out "$OUT/ce_$run.json" > "$OUT/ce_$run.log" 2>&1
    echo "cross_entropy $run rc=$?"; tail -3 "$OUT/ce_$run.log"
  done
  for run in old_1 new_1 old_2 new_2; do
    PYTHONPATH=$(site_of $run) timeout 75 python3 benchmarks/bench_attention.py --seqlens 8192 \
      --head-dims 64 128 --compile-at > "$OUT/attention_$run.log" 2>&1
    echo "attention $run rc=$?"; mv -f "$OUT/bench_attention.json" "$OUT/attention_$run.json" 2>/dev/null
    sed -n '/^fwd/,$p' "$OUT/attention_$run.log" | grep -v '^$'
  done
else
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  PYTHONPATH=/tmp/site timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed/gpu \
    tests/collectives 2>&1 | tee "$OUT/gpu_tests_distributed.log" | tail -8
  for run in old_1 new_1; do
    PYTHONPATH=$(site_of $run) timeout 110 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      benchmarks/bench_train_scaling.py --out "$OUT/scaling_$run.json" > "$OUT/scaling_$run.log" 2>&1
    echo "scaling $run rc=$?"; tail -6 "$OUT/scaling_$run.log"
  done
fi
