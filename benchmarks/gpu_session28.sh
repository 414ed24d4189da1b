#!/usr/bin/env bash
# The twenty-eighth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's start,
# 6a37dee). Every result goes to $OUT/raw, packed into $OUT/results.tgz at the end:
#   bash benchmarks/gpu_session28.sh tests  # one GPU: prepare's failure on a GPU (a real out-of-memory
#                                           # move), the fused cross-entropy's GPU tests (a masked
#                                           # vocabulary among them), the old build's masked case,
#                                           # then the fused loss at vocab 128256, old and new builds
#                                           # alternated (the online sum's shift added a select)
#   bash benchmarks/gpu_session28.sh norms  # one GPU: the norm GPU tests (constant rows among them),
#                                           # then layer_norm's forward and backward, old and new
#                                           # builds interleaved (ab_norms.sh: the mean of x - x[0])
#   bash benchmarks/gpu_session28.sh final  # one GPU: the GPU tests of the session's later changes
#                                           # (prepare's world of one, causal attention with a scale
#                                           # <= 0, the masked vocabulary, constant rows), the NVIDIA
#                                           # plugin's tests, and what torch's SDPA kernels give there
set -uo pipefail
phase=${1:?tests, norms or final}
source "$(dirname "$0")/gpu_setup.sh"
if [ "$phase" = tests ]; then
  timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/distributed/gpu/test_prepare_gpu.py \
    tests/kernels/gpu/test_linear_cross_entropy_gpu.py 2>&1 | tee "$RAW/gpu_tests.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  install_old_build  # the session start's kernels: the masked case should fail
  PYTHONPATH=/tmp/old timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/kernels/gpu/test_linear_cross_entropy_gpu.py -k masked 2>&1 | tee "$RAW/gpu_tests_old.log" | tail -3
  for run in old_1 new_1 old_2 new_2; do
    site=/tmp/${run%_*}; [ "$site" = /tmp/new ] && site=/tmp/site
    PYTHONPATH=$site timeout 75 python3 benchmarks/bench_cross_entropy.py --vocabs 128256 --budget-s 1 \
      --out "$RAW/lce_$run.json" > "$RAW/lce_$run.log" 2>&1
    echo "$run rc=$?"; tail -4 "$RAW/lce_$run.log"
  done
  pack; exit 0
fi
if [ "$phase" = norms ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_norms_gpu.py \
    2>&1 | tee "$RAW/gpu_tests_norms.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  OUT=$RAW ROUNDS=3 timeout 380 bash benchmarks/ab_norms.sh --ops layer_norm 2>&1 | tail -30
  pack; exit 0
fi
if [ "$phase" = final ]; then
  timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/distributed/gpu/test_prepare_gpu.py \
    tests/kernels/gpu/test_attention_gpu.py tests/kernels/gpu/test_linear_cross_entropy_gpu.py \
    tests/kernels/gpu/test_norms_gpu.py tests/plugins/test_nvidia.py -k "not shape_sweep" 2>&1 \
    | tee "$RAW/gpu_tests_final.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  timeout 60 python3 benchmarks/probe_sdpa_causal_scale.py 2>&1 | tee "$RAW/probe_sdpa_causal_scale.log"
  pack; exit 0
fi
echo "unknown phase $phase" >&2; exit 2
