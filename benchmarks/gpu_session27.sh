#!/usr/bin/env bash
# The twenty-seventh session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's start,
# 1732923). Every result goes to $OUT/raw, packed into $OUT/results.tgz at the end:
#   bash benchmarks/gpu_session27.sh host   # one GPU: where an eager attention call at a decoding
#                                           # shape spends its host time, layer by layer
#   bash benchmarks/gpu_session27.sh tests  # one GPU: the attention, RoPE, activation and CUDA-graph
#                                           # GPU tests but the shape sweep (host-side launch
#                                           # arithmetic, one partials buffer)
#   bash benchmarks/gpu_session27.sh sweep  # one GPU: the attention shape sweep's fp16 half
#   bash benchmarks/gpu_session27.sh ckpt   # one GPU: the activation-checkpointing GPU tests, new
#                                           # build, then the keyword-dropout ones on the old one
#   bash benchmarks/gpu_session27.sh ab     # one GPU: the host time of the session start's build
#                                           # and the new one (sdpa, ops, bound), alternated, the new
#                                           # build's inner layers, then attention at decoding shapes
#                                           # with eager-timed selection, both builds
set -uo pipefail
phase=${1:?host, tests, sweep, ckpt or ab}
source "$(dirname "$0")/gpu_setup.sh"
if [ "$phase" = host ]; then
  for cache in 1024 8192; do
    timeout 200 python3 benchmarks/profile_attention_host.py --cache $cache --out "$RAW/host_$cache.json" \
      --profile-out "$RAW/host_profile_$cache.txt" > "$RAW/host_$cache.log" 2>&1
    echo "cache $cache rc=$?"; tail -2 "$RAW/host_$cache.log"
  done
  pack; exit 0
fi
if [ "$phase" = sweep ]; then  # the shape sweep's fp16 half (its bf16 rows up to 2048x2048 d80 ran in `tests`' first call)
  timeout 560 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_attention_gpu.py \
    -k "shape_sweep and dtype1" 2>&1 | tee "$RAW/gpu_tests_sweep_fp16.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
if [ "$phase" = ckpt ]; then  # a checkpointed block's dropout with its tensor inside a keyword tuple
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_checkpointing_gpu.py \
    2>&1 | tee "$RAW/gpu_tests_checkpointing.log" | tail -3
  echo "gpu tests rc=${PIPESTATUS[0]}"
  install_old_build  # the session start's build: its nested case should fail
  PYTHONPATH=/tmp/old timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rs \
    tests/kernels/gpu/test_checkpointing_gpu.py -k keyword 2>&1 | tee "$RAW/gpu_tests_checkpointing_old.log" | tail -3
  pack; exit 0
fi
if [ "$phase" = tests ]; then
  # -k: the FlashAttention shape sweep (480 tests) alone outlasts a call; its first 226 passed on
  # these wheels (session27-2026-11-27/tests_sweep_part.log)
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_attention_gpu.py \
    tests/kernels/gpu/test_rope_gpu.py tests/kernels/gpu/test_activations_gpu.py \
    tests/kernels/gpu/test_cuda_graphs_gpu.py -k "not shape_sweep" 2>&1 | tee "$RAW/gpu_tests.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
  pack; exit 0
fi
install_old_build
for run in old_1 new_1 old_2 new_2; do
  site=/tmp/${run%_*}; [ "$site" = /tmp/new ] && site=/tmp/site
  PYTHONPATH=$site timeout 100 python3 benchmarks/profile_attention_host.py --outer --out "$RAW/host_$run.json" \
    --profile-out "$RAW/host_profile_$run.txt" > "$RAW/host_$run.log" 2>&1
  echo "$run rc=$?"; tail -2 "$RAW/host_$run.log"
done
timeout 100 python3 benchmarks/profile_attention_host.py --rounds 5 --out "$RAW/host_layers_new.json" \
  > "$RAW/host_layers_new.log" 2>&1
echo "layers rc=$?"; tail -2 "$RAW/host_layers_new.log"
for build in site old; do
  PYTHONPATH=/tmp/$build timeout 170 python3 benchmarks/bench_attention_decode.py --rounds 3 \
    --selection-timing eager --out "$RAW/attention_decode_eager_$build.json" 2>&1 \
    | tee "$RAW/attention_decode_eager_$build.log" | tail -15
done
pack
