#!/usr/bin/env bash
# The twenty-first session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh). No kernel or dispatch code changed this session; these
# check what did change, on real hardware:
#   bash benchmarks/gpu_session21.sh checks  # one GPU: info --json, conformance of the NVIDIA
#                                            # adapter (the kit's kernel checks now also read an op's
#                                            # own examples), the pytest-plugin form, and the GPU
#                                            # tests of the adapter and the kernels the kit reaches
#   bash benchmarks/gpu_session21.sh dist    # 2 GPUs: the distributed GPU tests (a stopped step
#                                            # restores BatchNorm's statistics under DDP and FSDP2
#                                            # over NCCL), the collectives, and one accumulation run
#                                            # of bench_train_scaling (k = 4) on the new build
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
    if c["status"] != "passed":
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
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/distributed/gpu tests/collectives \
    2>&1 | tee "$OUT/gpu_tests_distributed.log" | tail -8
  timeout 90 python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
    benchmarks/bench_train_scaling.py --phases ddp,fsdp --gradient-accumulation-steps 4 --warmup 2 \
    --steps 6 --out "$OUT/accum_new.json" > "$OUT/accum_new.log" 2>&1
  echo "accumulation rc=$?"; grep -E "tokens/s|peak" "$OUT/accum_new.log" | head -4
fi
