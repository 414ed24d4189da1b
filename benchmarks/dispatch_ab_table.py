"""Prints the dispatch A/B table of alternated bench_dispatch.py runs: median µs over the direct
call per case and run, from `OUT/dispatch_<run>.json`.

    python3 benchmarks/dispatch_ab_table.py OUT [RUN ...]   # runs default to old_1 new_1 old_2 new_2
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    out, runs = sys.argv[1], sys.argv[2:] or ["old_1", "new_1", "old_2", "new_2"]
    rows: dict[str, dict[str, float]] = {}
    for run in runs:
        try:
            with open(f"{out}/dispatch_{run}.json") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            print(run, "no result:", exc)
            continue
        for key, row in data.items():
            if isinstance(row, dict) and "overhead_us" in row:
                rows.setdefault(key, {})[run] = row["overhead_us"]
    print(f"{'overhead us, median':36s} " + " ".join(f"{r:>7s}" for r in runs))
    for key, by_run in rows.items():
        print(f"{key:36s} " + " ".join(f"{by_run.get(r, float('nan')):7.2f}" for r in runs))


if __name__ == "__main__":
    main()
