#!/usr/bin/env bash
# The twenty-first session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh). No kernel or dispatch code changed this session; these
# check what did change, on real hardware:
#   bash benchmarks/gpu_session21.sh checks  # one GPU: the twentieth session's checks (info --json,
#                                            # conformance of the NVIDIA adapter, whose kernel checks
#                                            # now also read an op's own examples, the pytest-plugin
#                                            # form, the GPU tests of the adapter and the kernels)
#   bash benchmarks/gpu_session21.sh dist    # 2 GPUs: the distributed GPU tests (a stopped step
#                                            # restores BatchNorm's statistics under DDP and FSDP2
#                                            # over NCCL), the collectives, and one accumulation run
#                                            # of bench_train_scaling (k = 4) on the new build
#   bash benchmarks/gpu_session21.sh final   # 2 GPUs, the final build: the distributed GPU tests
#                                            # and collectives again (the restore's review fixes),
#                                            # then bench_harness_vs_do_bench with the old (.whl_old/:
#                                            # 3ade905, an fp32 cache clearer) and new (uint8) builds
set -uo pipefail
phase=${1:?checks, dist or final}
[ "$phase" = checks ] && exec bash "$(dirname "$0")/gpu_session20.sh" checks
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache PYTHONPATH=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed/gpu tests/collectives \
  2>&1 | tee "$OUT/gpu_tests_distributed.log" | tail -8
if [ "$phase" = final ]; then
  cp -r /tmp/site /tmp/old
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
  for build in old new; do
    site=/tmp/site; [ $build = old ] && site=/tmp/old
    PYTHONPATH=$site timeout 200 python3 benchmarks/bench_harness_vs_do_bench.py --trials 3 \
      --out "$OUT/harness_vs_do_bench_$build.json" 2>&1 | tee "$OUT/harness_vs_do_bench_$build.log" | tail -4
  done
  exit 0
fi
timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
  benchmarks/bench_train_scaling.py --phases ddp,fsdp --gradient-accumulation-steps 4 --warmup 2 \
  --steps 6 --out "$OUT/accum_new.json" > "$OUT/accum_new.log" 2>&1
echo "accumulation rc=$?"; grep -E "tokens/s|peak" "$OUT/accum_new.log" | head -4
