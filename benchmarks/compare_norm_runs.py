"""Side-by-side table of interleaved bench_norms runs of two builds (A/B of one kernel change).

Each argument is LABEL=PATH of a bench_norms.json; runs with the same label are repeats of one
build. Prints, per op, shape and direction, torchhal's GB/s in every run, its ratio to Liger, its
kernels' ratio to Liger's (backwards: GPU time alone) and its fraction of the copy bandwidth (each
taken within its own run, so they compare across runs).

    python3 benchmarks/compare_norm_runs.py old=a/bench_norms.json new=b/bench_norms.json ...
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def main(pairs: list[str]) -> None:
    runs: dict[str, list[dict]] = defaultdict(list)
    for pair in pairs:
        label, _, path = pair.partition("=")
        if not path:
            raise SystemExit(f"compare_norm_runs: argument {pair!r} is not LABEL=PATH")
        with open(path) as f:
            runs[label].append(json.load(f))
    cases: dict[tuple[str, str, str], dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for label, results in runs.items():
        for result in results:
            for row in result["summary"]:
                cases[(row["op"], row["shape"], row["direction"])][label].append(row)
    print(
        "per run, in order: torchhal GB/s | speed vs Liger | its kernels' vs Liger's (backward) "
        "| fraction of copy ('-': not measured)"
    )
    for (op, shape, direction), by_label in cases.items():
        for label, rows in by_label.items():
            gbps = " ".join(_cell(r, "torchhal_gbps", "6.0f") for r in rows)
            liger = " ".join(_cell(r, "vs_liger", "5.2f") for r in rows)
            kernels = " ".join(_cell(r, "kernels_vs_liger", "5.2f") for r in rows)
            copy = " ".join(_cell(r, "fraction_of_copy", "5.2f") for r in rows)
            print(f"{op:10s} {shape:11s} {direction:8s} {label:5s} {gbps} | {liger} | {kernels} | {copy}")


def _cell(row: dict, key: str, fmt: str) -> str:
    value = row.get(key)
    width = int(fmt.split(".")[0])
    return format(value, fmt) if value is not None else "-".rjust(width)


if __name__ == "__main__":
    main(sys.argv[1:])
