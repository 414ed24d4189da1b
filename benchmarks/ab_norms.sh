#!/usr/bin/env bash
# A/B of a kernel change on the GPU host: bench_norms of the build in .whl_old/ (before) and the
# one in .whl/ (after), interleaved ROUNDS times (3) so drift hits both alike, then one table.
# Build .whl_old/ from the older commit's worktree with benchmarks/build_device_wheels.sh.
#   bash benchmarks/ab_norms.sh --ops swiglu geglu [--shapes 16384x8192 ...]   (results under $OUT/ab/)
# ROUNDS=5 runs five old/new pairs instead of three.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_old \
  .whl_old/*.whl $(ls .whl/*.whl | grep -v torchhal) || exit 1
export PYTHONUNBUFFERED=1
ab=$OUT/ab
runs=()
for r in $(seq "${ROUNDS:-3}"); do
  for build in old new; do
    site=/tmp/site; [ $build = old ] && site=/tmp/site_old
    mkdir -p "$ab/$build$r"
    if PYTHONPATH=$site OUT=$ab/$build$r timeout 150 python3 benchmarks/bench_norms.py "$@" --budget-s 0 \
      > "$ab/$build$r.log" 2>&1; then
      runs+=("$build=$ab/$build$r/bench_norms.json")
    else
      echo "bench_norms of $build$r failed (left out of the table): see $build$r.log"
    fi
  done
done
python3 benchmarks/compare_norm_runs.py "${runs[@]}" | tee "$ab/compare.txt"
