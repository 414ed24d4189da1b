#!/usr/bin/env bash
# Nsight Compute counters of torchhal's and Liger-Kernel's row kernels at 8192x16384 bf16, to say why
# some of torchhal's trail Liger (docs/benchmarks.md, "Fourth session"): bytes moved, DRAM throughput,
# occupancy, registers, spills and stall reasons, side by side. One ncu run per (case, impl) over
# benchmarks/profile_row_kernels.py, which calls the op ITERS times inside the NVTX start/end range
# "profiled" after its warm-up; ncu profiles those launches alone (every kernel in the range, so the
# norm backwards' weight-gradient sums show too), caches flushed before each replay pass (ncu's
# default, as do_bench flushes L2), clocks left alone (--clock-control none, as in the benchmarks).
#
# Usage, from the repository root on the GPU host (torchhal and Liger-Kernel importable, ncu on PATH):
#   OUT=/some/dir bash benchmarks/profile_row_kernels.sh [CASE ...]
#   CASE: one of `python3 benchmarks/profile_row_kernels.py --list`;
#         default: swiglu-fwd swiglu-bwd geglu-bwd rms-bwd ln-fwd copy (copy: the bandwidth reference).
#   Env: ROWS (8192), COLS (16384), ITERS (1 call profiled per case: 1-3 launches), NCU (ncu),
#        BUDGET_S (330: later runs are skipped, and said so, once the script has run this long),
#        NCU_KEEP_FILES=1 (keep $OUT/ncu/ loose instead of packing it).
# Writes $OUT/ncu/<case>.<impl>.csv (ncu --csv --page raw --print-units base) and <case>.<impl>.log
# (the driver's output), prints benchmarks/summarize_ncu.py's table and saves it as
# $OUT/ncu_summary.txt, then packs $OUT/ncu/ into $OUT/ncu.tar.gz and removes the loose folder,
# since the device tool returns at most 8 files. Expected: 15-30 s a run; the default 11 runs, 3-5 min.
set -uo pipefail
: "${OUT:?OUT must name an output directory}"
ROWS=${ROWS:-8192}
COLS=${COLS:-16384}
ITERS=${ITERS:-1}
NCU=${NCU:-ncu}
BUDGET_S=${BUDGET_S:-330}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
driver=$here/profile_row_kernels.py
dir=$OUT/ncu
mkdir -p "$dir" || exit 1
export PYTHONUNBUFFERED=1

command -v "$NCU" >/dev/null || { echo "profile_row_kernels.sh: '$NCU' is not on PATH"; exit 1; }
"$NCU" --version | tail -n 1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader

impls=(torchhal liger)
if ! err=$(python3 -c "import liger_kernel.transformers.functional" 2>&1); then
  echo "Liger-Kernel cannot be imported, so its cases are skipped: $(tail -n 1 <<<"$err")"
  impls=(torchhal)
fi
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(swiglu-fwd swiglu-bwd geglu-bwd rms-bwd ln-fwd copy)

# Sections by their stable identifiers (Occupancy brings achieved occupancy and its limits, WarpStateStats
# the stall reasons); the extra metrics are what the summary reads that the sections may not collect
# (DRAM bytes each way, local-memory spill bytes, L2 hit rate). Should this ncu not know one of them,
# the run is repeated without them.
sections=(--section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy
          --section LaunchStats --section SchedulerStats --section WarpStateStats)
extra=dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sector_hit_rate.pct
extra+=,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum
# a cap, not a count: a norm backward launches 3 kernels a call (its kernel, the partials' sum, the
# cast), the others 1; one more is left room for, should Liger's autograd.Function launch another
ncu_args=(--clock-control none --target-processes all --nvtx --nvtx-include "profiled"
          --launch-count $((4 * ITERS)) "${sections[@]}"
          --csv --page raw --print-units base --print-kernel-base function)

profile() {  # CASE IMPL: one ncu run; with the extra metrics unless ncu refuses one of them
  local name=$1 impl=$2 rc metrics=()
  local csv=$dir/$name.$impl.csv log=$dir/$name.$impl.log
  [ -n "$extra" ] && metrics=(--metrics "$extra")
  rm -f "$csv"
  timeout 150 "$NCU" "${ncu_args[@]}" ${metrics[@]+"${metrics[@]}"} --log-file "$csv" \
    python3 "$driver" --case "$name" --impl "$impl" --rows "$ROWS" --cols "$COLS" --iters "$ITERS" \
    >"$log" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && [ -n "$extra" ] && grep -hi error "$csv" "$log" 2>/dev/null | grep -qi metric; then
    echo "  ncu refused an extra metric: $(grep -hi error "$csv" "$log" | grep -i -m 1 metric)"
    echo "  again with the sections' metrics only, for this run and the later ones"
    extra=""
    profile "$name" "$impl"
    return $?
  fi
  return $rc
}

failed=()
for name in "${cases[@]}"; do
  case_impls=("${impls[@]}")
  [ "$name" = copy ] && case_impls=(torch)
  for impl in "${case_impls[@]}"; do
    if [ "$SECONDS" -ge "$BUDGET_S" ]; then
      echo "$name $impl: skipped, the script has run past BUDGET_S=${BUDGET_S}s"
      continue
    fi
    start=$SECONDS
    profile "$name" "$impl"
    rc=$?
    launches=$(grep -c '^"[0-9]' "$dir/$name.$impl.csv" 2>/dev/null)
    echo "$name $impl: ncu exit $rc, ${launches:-0} kernel launches profiled, $((SECONDS - start)) s"
    if [ "$rc" -ne 0 ] || [ "${launches:-0}" -eq 0 ]; then
      tail -n 6 "$dir/$name.$impl.log" "$dir/$name.$impl.csv" 2>&1
      failed+=("$name.$impl")
    fi
  done
done

python3 "$here/summarize_ncu.py" "$dir" | tee "$OUT/ncu_summary.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed+=(summary)
if [ "${NCU_KEEP_FILES:-0}" != 1 ]; then
  if tar -czf "$OUT/ncu.tar.gz" -C "$OUT" ncu; then
    rm -rf "$dir"
    echo "packed $dir into $OUT/ncu.tar.gz (NCU_KEEP_FILES=1 keeps the folder)"
  else
    echo "could not pack $dir: left as it is"
  fi
fi
echo "total ${SECONDS} s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed: ${failed[*]}"
  exit 1
fi
