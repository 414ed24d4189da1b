#!/usr/bin/env bash
# The twentieth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh). No kernel or dispatch code changed this session; these
# check what did change, on real hardware:
#   bash benchmarks/gpu_session20.sh checks  # one GPU: info --json (file descriptor 1 kept out of
#                                            # the document), conformance of the NVIDIA adapter (the
#                                            # kit's aligned matmul/cross-entropy cases, the health
#                                            # rule, memory figures), the same checks through the
#                                            # pytest plugin, and the GPU tests of the adapter and
#                                            # the kernels those cases reach
#   bash benchmarks/gpu_session20.sh dist    # 2 GPUs: DDP and FSDP2 with gradient accumulation
#                                            # (micro-batches fetched one at a time), the collectives
#                                            # on nccl (host_all_gather on its gloo side), then
#                                            # bench_train_scaling with 4 micro-batches a step, old
#                                            # (.whl_old/: 3ade905) and new builds alternately
set -uo pipefail
phase=${1:?checks or dist}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache PYTHONPATH=/tmp/site
if [ "$phase" = checks ]; then
  python3 -m torchhal info --json > "$OUT/info.json" 2> "$OUT/info.err"; echo "info rc=$?"
  python3 -c "import json; d=json.load(open('$OUT/info.json')); [print(x['id'], x['name'], x['arch']) for x in d['devices']]"
  timeout 150 python3 -m torchhal conformance nvidia --json > "$OUT/conformance_nvidia.json" 2> "$OUT/conformance.err"
  echo "conformance rc=$?"
  python3 - "$OUT/conformance_nvidia.json" <<'PY'
import collections, json, sys
report = json.load(open(sys.argv[1]))
checks = report["checks"]
print("ok", report["ok"], dict(collections.Counter(c["status"] for c in checks)))
for c in checks:
    if c["status"] == "failed" or c["check"].startswith(("kernel.matmul", "kernel.linear_cross_entropy", "device.")):
        print(f"  {c['status']:<15} {c['check']}: {c['reason'][:150]}")
PY
  timeout 150 python3 -m pytest -q -p torchhal.testing.pytest_plugin --torchhal-adapter nvidia \
    -m torchhal_conformance -p no:cacheprovider 2>&1 | tee "$OUT/conformance_pytest.log" | tail -3
  echo "pytest plugin rc=${PIPESTATUS[0]}"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/plugins/test_nvidia.py \
    tests/kernels/gpu/test_matmul_gpu.py tests/kernels/gpu/test_linear_cross_entropy_gpu.py \
    tests/kernels/gpu/test_norms_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
else
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed/gpu tests/collectives \
    2>&1 | tee "$OUT/gpu_tests_distributed.log" | tail -8
  # old: the session's first commit (3ade905, all k micro-batches fetched before one agreement on
  # the device); new: one at a time, agreeing on the host side (gloo) before each FSDP2 micro-batch
  cp -r /tmp/site /tmp/old
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
  for run in old_1 new_1 old_2 new_2; do
    site=/tmp/site; [ "${run%_*}" = old ] && site=/tmp/old
    PYTHONPATH=$site timeout 75 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      benchmarks/bench_train_scaling.py --phases ddp,fsdp --gradient-accumulation-steps 4 --warmup 2 \
      --steps 6 --out "$OUT/accum_$run.json" > "$OUT/accum_$run.log" 2>&1
    echo "accumulation $run rc=$?"; grep -E "tokens/s|peak" "$OUT/accum_$run.log" | head -4
  done
fi
