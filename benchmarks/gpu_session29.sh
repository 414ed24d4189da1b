#!/usr/bin/env bash
# The twenty-ninth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's start,
# 829ab07). Every result goes to $OUT/raw, packed into $OUT/results.tgz at the end:
#   bash benchmarks/gpu_session29.sh host  # one GPU: is the norm backwards' slow mode host time?
#                                          # probe_backward_host.py unpinned (twice), pinned to one
#                                          # CPU, and pinned there beside a busy loop
#   bash benchmarks/gpu_session29.sh norms  # one GPU: bench_norms, three processes, every op and
#                                           # shape, now with each backward's host and kernel times
#   bash benchmarks/gpu_session29.sh final  # one GPU: the conformance kit on the H100 (its new memory
#                                           # accounting and matmul cases), the GPU tests of the
#                                           # session's changes (registry, split-KV decoding, the
#                                           # NVIDIA plugin's SDPA candidates), the SDPA head-dim probe
set -uo pipefail
phase=${1:?host}
source "$(dirname "$0")/gpu_setup.sh"
if [ "$phase" = host ]; then
  cd benchmarks
  for run in free_1 contended pinned free_2; do
    case $run in
      pinned) flags="--cpu 3" ;;
      contended) flags="--cpu 3 --contend" ;;
      *) flags="" ;;
    esac
    timeout 130 python3 probe_backward_host.py $flags --out "$RAW/host_$run.json" > "$RAW/host_$run.log" 2>&1
    echo "$run rc=$?"; tail -28 "$RAW/host_$run.log"
  done
  cd ..; pack; exit 0
fi
if [ "$phase" = norms ]; then
  cd benchmarks
  for run in 1 2 3; do
    timeout 170 python3 bench_norms.py --shapes 4096x2048 32768x4096 16384x8192 8192x16384 --budget-s 200 \
      --out "$RAW/bench_norms_$run.json" > "$RAW/bench_norms_$run.log" 2>&1
    echo "run $run rc=$?"
  done
  tail -42 "$RAW/bench_norms_1.log"
  python3 compare_norm_runs.py $(for r in 1 2 3; do echo "new=$RAW/bench_norms_$r.json"; done) 2>&1 | tail -40
  cd ..; pack; exit 0
fi
if [ "$phase" = final ]; then
  timeout 150 python3 -m torchhal conformance nvidia --json > "$RAW/conformance_nvidia.json" 2> "$RAW/conformance_nvidia.err"
  echo "conformance rc=$?"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['summary']); [print(' ', c['check'], c['status'], c['reason'][:150]) for c in r['checks'] if c['status']!='passed']" "$RAW/conformance_nvidia.json"
  timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/plugins/test_nvidia.py tests/gpu \
    tests/kernels/gpu/test_attention_gpu.py tests/kernels/gpu/test_norms_gpu.py -k "not shape_sweep" 2>&1 \
    | tee "$RAW/gpu_tests_final.log" | tail -6
  echo "gpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
echo "unknown phase $phase" >&2; exit 2
