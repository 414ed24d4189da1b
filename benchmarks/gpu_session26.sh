#!/usr/bin/env bash
# The twenty-sixth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's start,
# b8d5041). Every result goes to $OUT/raw, packed into $OUT/results.tgz at the end:
#   bash benchmarks/gpu_session26.sh tests  # one GPU: the attention GPU tests of the varlen kernels
#                                           # (the backward now writes every gradient row itself)
#                                           # and of the split-KV kernel (the second review's
#                                           # fixes), then attention_varlen's per-call cost of the
#                                           # session-start and the new build, alternated, pinned
#   bash benchmarks/gpu_session26.sh sweep  # one GPU: the split-KV kernel's slice count and key
#                                           # tile swept at decoding shapes, beside SDPA
#   bash benchmarks/gpu_session26.sh decode  # one GPU, with the slice rule the sweep chose: the
#                                            # split-KV GPU tests, then attention at decoding shapes,
#                                            # every candidate and ops.attention, with the new build
#                                            # and then the session start's
#   bash benchmarks/gpu_session26.sh graph  # one GPU: measured selection timing graph replays
#                                           # (TORCHHAL_SELECTION_TIMING=graph): the adapter and kit
#                                           # tests, the split-KV and graph tests, then the decoding
#                                           # benchmark with graph-timed and eager-timed selection
#   bash benchmarks/gpu_session26.sh capture  # one GPU: a capture whose first op call selects, with
#                                             # the new build's tests and the probe on both builds
#   bash benchmarks/gpu_session26.sh review  # two GPUs, after the review's fixes to graph capture:
#                                            # the adapter, graph and split-KV GPU tests, the kit on
#                                            # both GPUs, the capture probe
#   bash benchmarks/gpu_session26.sh selection  # one GPU: ops.attention's selection at
#                                               # FlashAttention's shapes with graph timing
#   bash benchmarks/gpu_session26.sh selection2  # one GPU: the same from 4k tokens a sequence,
#                                                # graph and eager timing in one run
set -uo pipefail
phase=${1:?tests, sweep, decode, graph, capture, review, selection or selection2}
source "$(dirname "$0")/gpu_setup.sh"
if [ "$phase" = sweep ]; then
  timeout 540 python3 benchmarks/sweep_decode_splits.py --out "$RAW/sweep_decode_splits.json" 2>&1 \
    | tee "$RAW/sweep_decode_splits.log" | tail -12
  pack; exit 0
fi
if [ "$phase" = selection ]; then
  timeout 560 python3 benchmarks/bench_attention_selection.py --rounds 5 --selection-timing graph \
    --out "$RAW/attention_selection_graph.json" 2>&1 | tee "$RAW/attention_selection_graph.log" | tail -3
  pack; exit 0
fi
if [ "$phase" = selection2 ]; then
  for timing in graph eager; do
    timeout 280 python3 benchmarks/bench_attention_selection.py --rounds 5 --seqlens 4096 8192 16384 \
      --selection-timing $timing --out "$RAW/attention_selection_$timing.json" 2>&1 \
      | tee "$RAW/attention_selection_$timing.log" | tail -2
  done
  pack; exit 0
fi
if [ "$phase" = review ]; then
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu/test_nvidia_real.py \
    tests/kernels/gpu/test_cuda_graphs_gpu.py tests/kernels/gpu/test_attention_gpu.py -k "nvidia_real or graph or split_kv" \
    2>&1 | tee "$RAW/gpu_tests_review.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  timeout 150 python3 -m torchhal conformance nvidia --json > "$RAW/conformance_nvidia.json" 2> "$RAW/conformance.err"
  echo "conformance rc=$?"; python3 -c "import json; r = json.load(open('$RAW/conformance_nvidia.json')); \
print(r['summary']); print([c for c in r['checks'] if c['check'] == 'device.graphs'])"
  timeout 120 python3 benchmarks/probe_capture_selection.py 2>&1 | tee "$RAW/probe_capture.log" | tail -1
  pack; exit 0
fi
if [ "$phase" = capture ]; then
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu/test_nvidia_real.py \
    tests/kernels/gpu/test_cuda_graphs_gpu.py 2>&1 | tee "$RAW/gpu_tests_capture.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  install_old_build
  for build in site old; do
    echo "probe $build: $(PYTHONPATH=/tmp/$build timeout 120 python3 benchmarks/probe_capture_selection.py 2>&1 | tail -1)" \
      | tee -a "$RAW/probe_capture.log"
  done
  pack; exit 0
fi
if [ "$phase" = graph ]; then
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/gpu/test_nvidia_real.py \
    tests/kernels/gpu/test_attention_gpu.py tests/kernels/gpu/test_cuda_graphs_gpu.py \
    -k "nvidia_real or split_kv or graph" 2>&1 | tee "$RAW/gpu_tests_graph.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  timeout 120 python3 -m torchhal conformance nvidia --json > "$RAW/conformance_nvidia.json" 2> "$RAW/conformance.err"
  echo "conformance rc=$?"; python3 -c "import json; r = json.load(open('$RAW/conformance_nvidia.json')); \
print({k: v for k, v in r.items() if k != 'checks'}); print([c for c in r['checks'] if c['check'] == 'device.graphs'])"
  for timing in graph eager; do
    timeout 200 python3 benchmarks/bench_attention_decode.py --rounds 3 --selection-timing $timing \
      --out "$RAW/attention_decode_$timing.json" 2>&1 | tee "$RAW/attention_decode_$timing.log" | tail -16
  done
  pack; exit 0
fi
if [ "$phase" = decode ]; then
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_attention_gpu.py \
    -k "split_kv" 2>&1 | tee "$RAW/gpu_tests_decode.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  timeout 250 python3 benchmarks/bench_attention_decode.py --out "$RAW/attention_decode.json" 2>&1 \
    | tee "$RAW/attention_decode.log" | tail -16
  install_old_build  # the session start's build beside it, on the same GPU
  PYTHONPATH=/tmp/old timeout 250 python3 benchmarks/bench_attention_decode.py \
    --out "$RAW/attention_decode_old.json" 2>&1 | tee "$RAW/attention_decode_old.log" | tail -16
  pack; exit 0
fi
timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_attention_gpu.py \
  tests/kernels/gpu/test_cuda_graphs_gpu.py -k "varlen or split_kv or graph or more_heads" 2>&1 \
  | tee "$RAW/gpu_tests.log" | tail -4
echo "gpu tests rc=${PIPESTATUS[0]}"
install_old_build
for run in old_1 new_1 old_2 new_2 old_3 new_3; do
  site=/tmp/${run%_*}; [ "$site" = /tmp/new ] && site=/tmp/site
  PYTHONPATH=$site timeout 120 python3 benchmarks/bench_varlen_check.py --pin 3 --label "$run" \
    --out "$RAW/varlen_$run.json" 2>&1 | tee "$RAW/varlen_$run.log" | tail -3
done
pack
