#!/usr/bin/env bash
# The thirtieth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh). Every result goes to $OUT/raw, packed into $OUT/results.tgz:
#   bash benchmarks/gpu_session30.sh norms  # one GPU: bench_norms, two processes, every op and shape,
#                                           # forwards now with their host and kernel times too
#   bash benchmarks/gpu_session30.sh final  # one GPU: the conformance kit, the GPU tests (plugin,
#                                           # real GPU, every kernel file but attention's shape
#                                           # sweep, prepare on a GPU)
#   bash benchmarks/gpu_session30.sh ckpt   # one GPU: the checkpoint tests on torch 2.11, prepare's
#                                           # GPU tests after memory-hungry kernel tests
set -uo pipefail
phase=${1:?norms}
source "$(dirname "$0")/gpu_setup.sh"
if [ "$phase" = norms ]; then
  cd benchmarks
  for run in 1 2; do
    timeout 200 python3 bench_norms.py --shapes 4096x2048 32768x4096 16384x8192 8192x16384 --budget-s 200 \
      --out "$RAW/bench_norms_$run.json" > "$RAW/bench_norms_$run.log" 2>&1
    echo "run $run rc=$?"
  done
  tail -42 "$RAW/bench_norms_1.log"
  tail -42 "$RAW/bench_norms_2.log" | grep -E "forward" 
  cd ..; pack; exit 0
fi
if [ "$phase" = final ]; then
  timeout 150 python3 -m torchhal conformance nvidia --json > "$RAW/conformance_nvidia.json" 2> "$RAW/conformance_nvidia.err"
  echo "conformance rc=$?"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['summary']); [print(' ', c['check'], c['status'], c['reason'][:150]) for c in r['checks'] if c['status']!='passed']" "$RAW/conformance_nvidia.json"
  timeout 440 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/plugins/test_nvidia.py tests/gpu \
    tests/kernels/gpu tests/distributed/gpu/test_prepare_gpu.py -k "not shape_sweep" 2>&1 \
    | tee "$RAW/gpu_tests_final.log" | tail -8
  echo "gpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
if [ "$phase" = ckpt ]; then
  # torch 2.11's DCP for the checkpoint changes (gloo, host tensors), then prepare's GPU tests after
  # memory-hungry kernel tests (the out-of-memory move failed to fail after them, on an H200)
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_checkpoint_resume_state.py \
    tests/distributed/test_checkpoint_ranks_fail_together.py tests/distributed/test_prepare_refuses_first.py \
    tests/distributed/test_checkpoint_integrity.py tests/distributed/test_checkpoint.py \
    tests/distributed/test_checkpoint_reshard.py tests/distributed/test_resume.py 2>&1 \
    | tee "$RAW/ckpt_tests.log" | tail -4
  echo "checkpoint tests rc=${PIPESTATUS[0]}"
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_linear_cross_entropy_gpu.py \
    tests/kernels/gpu/test_matmul_gpu.py tests/distributed/gpu/test_prepare_gpu.py 2>&1 \
    | tee "$RAW/prepare_gpu.log" | tail -4
  echo "prepare gpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
echo "unknown phase $phase" >&2; exit 2
