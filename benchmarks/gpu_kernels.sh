#!/usr/bin/env bash
# Kernel GPU tests and benchmarks on the GPU host (through the device tool; wheels from
# benchmarks/build_device_wheels.sh). Usage: bash benchmarks/gpu_kernels.sh [norms|attention|ce|all]
set -uo pipefail
what=${1:-all}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
tests=(); benches=()
case $what in
  norms) tests=(tests/kernels/gpu/test_norms_gpu.py tests/kernels/gpu/test_activations_gpu.py tests/kernels/gpu/test_rope_gpu.py); benches=(bench_norms) ;;
  attention) tests=(tests/kernels/gpu/test_attention_gpu.py); benches=(bench_attention) ;;
  ce) tests=(tests/kernels/gpu/test_linear_cross_entropy_gpu.py); benches=(bench_cross_entropy) ;;
  all) tests=(tests/kernels/gpu); benches=(bench_norms bench_attention bench_cross_entropy) ;;
esac
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -x "${tests[@]}" 2>&1 | tee "$OUT/gpu_tests_$what.log" | tail -15
for b in "${benches[@]}"; do
  timeout 240 python3 "benchmarks/$b.py" 2>&1 | tee "$OUT/$b.log" | tail -60
done
[ "$what" = attention ] || [ "$what" = ce ] || timeout 90 python3 benchmarks/bench_harness_vs_do_bench.py --out "$OUT/harness_vs_do_bench.json" 2>&1 | tee "$OUT/harness_vs_do_bench.log" | tail -15
if [ "$what" = attention ]; then
  python3 benchmarks/bench_dispatch.py --out "$OUT/dispatch.json" 2>&1 | tail -6
fi
