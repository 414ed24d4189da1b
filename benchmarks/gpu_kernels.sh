#!/usr/bin/env bash
# Kernel GPU tests and benchmarks on the GPU host (through the device tool; wheels from
# benchmarks/build_device_wheels.sh). Usage: bash benchmarks/gpu_kernels.sh [PART ...]
# PART: norms | attention | ce | warps | ce-memory | all (default all); several run in one call.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
for what in "${@:-all}"; do
  tests=(); benches=()
  case $what in
    norms) tests=(tests/kernels/gpu/test_norms_gpu.py tests/kernels/gpu/test_activations_gpu.py tests/kernels/gpu/test_rope_gpu.py); benches=(bench_norms bench_harness_vs_do_bench) ;;
    attention) tests=(tests/kernels/gpu/test_attention_gpu.py); benches=(bench_attention bench_dispatch) ;;
    ce) tests=(tests/kernels/gpu/test_linear_cross_entropy_gpu.py); benches=(bench_cross_entropy) ;;
    warps) benches=(sweep_row_warps) ;;
    ce-memory) benches=(profile_lce_memory) ;;
    all) tests=(tests/kernels/gpu); benches=(bench_norms bench_attention bench_cross_entropy bench_harness_vs_do_bench) ;;
    *) echo "unknown part $what"; exit 2 ;;
  esac
  if [ ${#tests[@]} -gt 0 ]; then
    # a fresh machine compiles every kernel specialisation on first use: all of tests/kernels/gpu
    # took more than 280 s there (docs/benchmarks.md, sixth session), so on a cold machine run
    # the tests and the benchmarks in separate device calls (each call has 600 s)
    timeout 540 python3 -m pytest -q -m gpu -p no:cacheprovider -x "${tests[@]}" 2>&1 | tee "$OUT/gpu_tests_$what.log" | tail -15
  fi
  for b in "${benches[@]}"; do
    out=(); grep -q '"--out"' "benchmarks/$b.py" && out=(--out "$OUT/$b.json")  # the others write under $OUT
    timeout 240 python3 "benchmarks/$b.py" "${out[@]}" 2>&1 | tee "$OUT/$b.log" | tail -40
  done
done
