#!/usr/bin/env bash
# The twenty-second session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh). No kernel or dispatch code changed this session; these
# check what did change, on 2 GPUs:
#   bash benchmarks/gpu_session22.sh dist   # the distributed GPU tests (a step stopped after its
#                                           # micro-batches, in fp16 with the scaler and clipping,
#                                           # run again under DDP and FSDP2; FSDP2 in fp16 shards
#                                           # BatchNorm2d apart in fp32), the collectives, which
#                                           # of the torch calls this session uses the image's torch
#                                           # has, and this session's CPU tests on that torch
#   bash benchmarks/gpu_session22.sh final  # the same, then FSDP2 with 4 micro-batches a step
#                                           # (~1B Llama, bf16: the unused-gradient fill runs after
#                                           # each of the first 3) with the session-start build
#                                           # (.whl_old/: ea20c21) and the new one, alternately
set -uo pipefail
phase=${1:?dist or final}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache PYTHONPATH=/tmp/site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
python3 -c "import torch; print('torch', torch.__version__)"
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed/gpu tests/collectives \
  2>&1 | tee "$OUT/gpu_tests_distributed.log" | tail -8
echo "gpu tests rc=${PIPESTATUS[0]}"
python3 - <<'PY' 2>&1 | tee "$OUT/torch_image_calls.log"
import torch
from torch.distributed.fsdp import FSDPModule
from torch._C._distributed_c10d import Reducer
print("FSDPModule.reset_iter_state", hasattr(FSDPModule, "reset_iter_state"))
print("FSDPModule.set_reduce_scatter_unused_params", hasattr(FSDPModule, "set_reduce_scatter_unused_params"))
print("Reducer._reset_state", hasattr(Reducer, "_reset_state"), "_check_reducer_finalized", hasattr(Reducer, "_check_reducer_finalized"))
PY
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_stopped_after_backward.py \
  tests/distributed/test_fsdp_batch_norm.py tests/distributed/test_grad_accumulation.py \
  tests/distributed/test_buffer_watch.py tests/distributed/test_prepare_architectures.py \
  tests/distributed/test_accumulation_memory.py tests/distributed/test_multiprocess.py \
  2>&1 | tee "$OUT/cpu_tests_torch_image.log" | tail -6
echo "cpu tests on the image's torch rc=${PIPESTATUS[0]}"
[ "$phase" = final ] || exit 0
cp -r /tmp/site /tmp/old
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
run=0
for build in old new old new; do
  run=$((run + 1)); site=/tmp/site; [ $build = old ] && site=/tmp/old
  PYTHONPATH=$site timeout 100 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/bench_train_scaling.py --phases fsdp --gradient-accumulation-steps 4 --warmup 2 --steps 6 \
    --out "$OUT/accum_fsdp_${run}_$build.json" > "$OUT/accum_fsdp_${run}_$build.log" 2>&1
  echo "$run $build rc=$? $(grep -E 'tokens/s' "$OUT/accum_fsdp_${run}_$build.log" | tail -1)"
done
