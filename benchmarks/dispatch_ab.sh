#!/usr/bin/env bash
# bench_dispatch.py with two torchhal builds run alternately (old, new, old, new), pinned, then the
# table (dispatch_ab_table.py). Expects /tmp/site (the wheels of .whl/) and /tmp/old (the same with
# .whl_old/'s torchhal wheel) installed by the calling session script; writes $OUT/dispatch_<run>.*
set -uo pipefail
for run in old_1 new_1 old_2 new_2; do
  site=/tmp/${run%_*}; [ "$site" = /tmp/new ] && site=/tmp/site
  PYTHONPATH=$site timeout 100 python3 benchmarks/bench_dispatch.py --pin 3 --rounds 21 --calls 5000 \
    --no-layers --modes unconfigured --out "$OUT/dispatch_$run.json" > "$OUT/dispatch_$run.log" 2>&1
  echo "dispatch $run rc=$?"
done
python3 benchmarks/dispatch_ab_table.py "$OUT"
