#!/usr/bin/env bash
# The twenty-fifth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel of the session's start,
# e173f38). Every result goes to $OUT/raw, packed into $OUT/results.tgz at the end (the device
# tool returns at most 8 files):
#   bash benchmarks/gpu_session25.sh one   # one GPU: the varlen, CUDA graph and device-assert GPU
#                                          # tests (attention_varlen's validation now memoised off
#                                          # the CPU), the varlen per-call cost of the session-start
#                                          # and the new build run alternately, pinned, and where a
#                                          # decoding-sized call's host time goes now
#   bash benchmarks/gpu_session25.sh fill  # one GPU, after the varlen forward stopped filling its
#                                          # outputs before the kernel: the attention GPU tests (the
#                                          # varlen ones, the graphs, a part of the dense sweep), the
#                                          # varlen per-call A/B and profile again
#   bash benchmarks/gpu_session25.sh host  # one GPU: the varlen per-call A/B alone, five rounds,
#                                          # with the fastest block of 15 beside the median (the
#                                          # decoding-sized rows of `fill` were too noisy to read)
#   bash benchmarks/gpu_session25.sh decode  # one GPU: attention at decoding shapes, every candidate
#                                            # and ops.attention, GPU time (bench_attention_decode.py)
#   bash benchmarks/gpu_session25.sh splitkv  # one GPU, with the split-KV candidate: its GPU tests
#                                             # (and the grid-limit, graph and varlen tests it now
#                                             # serves), then the decoding benchmark again (packed
#                                             # decoding rows from the wheels of the varlen commit)
set -uo pipefail
phase=${1:?one, fill, host, decode or splitkv}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=/tmp/cache PYTHONPATH=/tmp/site
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
RAW=$OUT/raw; mkdir -p "$RAW"
pack() { tar czf "$OUT/results.tgz" -C "$OUT" raw && rm -rf "$RAW"; }
if [ "$phase" = splitkv ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_attention_gpu.py \
    tests/kernels/gpu/test_cuda_graphs_gpu.py -k "split_kv or more_heads or graph or no_grad_op or varlen" 2>&1 \
    | tee "$RAW/gpu_tests_splitkv.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
fi
if [ "$phase" = decode ] || [ "$phase" = splitkv ]; then
  timeout 400 python3 benchmarks/bench_attention_decode.py --out "$RAW/attention_decode.json" 2>&1 \
    | tee "$RAW/attention_decode.log" | tail -12
  pack; exit 0
fi
cp -r /tmp/site /tmp/old
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
if [ "$phase" = one ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_cuda_graphs_gpu.py \
    tests/kernels/gpu/test_attention_gpu.py tests/kernels/gpu/test_linear_cross_entropy_gpu.py \
    -k "graph or varlen or assert or target" 2>&1 | tee "$RAW/gpu_tests.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
elif [ "$phase" = fill ]; then
  timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider -rs tests/kernels/gpu/test_cuda_graphs_gpu.py \
    tests/kernels/gpu/test_attention_gpu.py \
    -k "graph or varlen or grouped or transposed or compile or (sweep and 128 and (1024 or 2048))" \
    2>&1 | tee "$RAW/gpu_tests_fill.log" | tail -4
  echo "gpu tests rc=${PIPESTATUS[0]}"
fi
runs="old_1 new_1 old_2 new_2 old_3 new_3"
[ "$phase" = host ] && runs="$runs old_4 new_4 old_5 new_5"
for run in $runs; do
  site=/tmp/${run%_*}; [ "$site" = /tmp/new ] && site=/tmp/site
  PYTHONPATH=$site timeout 120 python3 benchmarks/bench_varlen_check.py --pin 3 --label "$run" \
    --out "$RAW/varlen_$run.json" 2>&1 | tee "$RAW/varlen_$run.log" | tail -3
done
for build in old new; do
  site=/tmp/$build; [ "$site" = /tmp/new ] && site=/tmp/site
  PYTHONPATH=$site timeout 100 taskset -c 3 python3 benchmarks/profile_varlen_host.py --calls 300 \
    > "$RAW/profile_varlen_host_$build.txt" 2>&1
  echo "profile $build rc=$? $(grep 'wall per call' "$RAW/profile_varlen_host_$build.txt")"
done
pack
