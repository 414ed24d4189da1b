#!/usr/bin/env bash
# Distributed benchmarks on a 2-GPU host (through the device tool; wheels from
# benchmarks/build_device_wheels.sh): all-reduce bus bandwidth HAL vs raw, DDP/FSDP2 scaling of a
# ~1B Llama, recovery time from a killed rank; and the GPU tests of the distributed package.
# NVLink multicast stays off (the host's rule). Usage: bash benchmarks/gpu_distributed.sh [tests|allreduce|training|recovery|all]
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TORCHHAL_CACHE_DIR=$OUT/cache TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
run="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
what=${1:-all}  # tests | allreduce | training | recovery | all (all runs past one device call's 10 minutes)
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed/gpu tests/collectives 2>&1 | tee "$OUT/gpu_tests_distributed.log" | tail -8
fi
if [ "$what" = allreduce ] || [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 100 $run benchmarks/bench_allreduce.py --out "$OUT/allreduce.json" 2>&1 | tail -25
fi
if [ "$what" = training ] || [ "$what" = all ]; then
  timeout 300 $run benchmarks/bench_train_scaling.py --out "$OUT/scaling.json" 2>&1 | tail -25
fi
if [ "$what" = recovery ] || [ "$what" = training ] || [ "$what" = all ]; then
  timeout 240 python3 benchmarks/bench_recovery.py --fault kill --out "$OUT/recovery_kill.json" 2>&1 | tee "$OUT/recovery_kill.log" | tail -20
fi
