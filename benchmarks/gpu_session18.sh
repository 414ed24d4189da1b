#!/usr/bin/env bash
# The eighteenth session's GPU checks (wheels: ../shared/tools/device-wheels, then
# benchmarks/build_device_wheels.sh; .whl_old/ holds the torchhal wheel from before the attention
# batch-slicing commit, 812f75a^, for the A/B). Two device calls:
#   bash benchmarks/gpu_session18.sh checks  # adapter on the real GPU (health, topology), attention
#                                            # GPU tests, profile (launch latency's plain-torch peer),
#                                            # conformance, the logits probe
#   bash benchmarks/gpu_session18.sh ab      # bench_attention, old and new builds alternately
#   bash benchmarks/gpu_session18.sh final   # the final commit: real-GPU adapter and guard tests,
#                                            # bench_dispatch against the session's first commit
#                                            # (47ea2d4, in .whl_old/) alternately
set -uo pipefail
phase=${1:?checks or ab}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
rm -rf torchhal  # the installed wheels, not the checkout, as a user has them
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
export PYTHONUNBUFFERED=1 TORCHHAL_CACHE_DIR=$OUT/cache
if [ "$phase" = checks ]; then
  export PYTHONPATH=/tmp/site
  python3 -m torchhal info --json > "$OUT/info.json"; echo "info rc=$?"
  python3 -c "import json,sys; d=json.load(open('$OUT/info.json')); [print(x['id'], x.get('health')) for x in d.get('devices', [])]" 2>&1 | head -5
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu tests/plugins \
    tests/kernels/gpu/test_attention_gpu.py -k "not shape_sweep" 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  COLUMNS=140 timeout 120 python3 -m torchhal profile cuda:0 --refresh 2>&1 | tee "$OUT/profile.log" | tail -14
  timeout 120 python3 -m torchhal conformance nvidia --json > "$OUT/conformance_nvidia.json"; echo "conformance rc=$?"
  timeout 150 python3 benchmarks/probe_attention_logits.py --out "$OUT/probe_logits.json" > "$OUT/probe_logits.log" 2>&1
  echo "probe rc=$?"; tail -31 "$OUT/probe_logits.log"
elif [ "$phase" = final ]; then
  export PYTHONPATH=/tmp/site
  timeout 200 python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/gpu tests/plugins \
    tests/core/test_guards.py tests/core/test_memo_guards.py tests/core/test_hal.py 2>&1 | tee "$OUT/gpu_tests_final.log" | tail -4
  cp -r /tmp/site /tmp/old
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
  bash benchmarks/dispatch_ab.sh
else
  cp -r /tmp/site /tmp/old
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/old .whl_old/torchhal-*.whl 2>/dev/null || exit 1
  for run in old_1 new_1 old_2 new_2; do
    site=/tmp/${run%_*}; [ "$site" = /tmp/new ] && site=/tmp/site
    PYTHONPATH=$site timeout 140 python3 benchmarks/bench_attention.py --seqlens 2048 8192 \
      --head-dims 64 128 --compile-at > "$OUT/attention_$run.log" 2>&1
    echo "attention $run rc=$?"; mv -f "$OUT/bench_attention.json" "$OUT/attention_$run.json" 2>/dev/null
    sed -n '/^fwd/,$p' "$OUT/attention_$run.log" | grep -v '^$' 
  done
fi
