"""One comparison table from the Nsight Compute CSVs of benchmarks/profile_row_kernels.sh.

Why: ncu's raw page holds hundreds of counters per launch; telling why a torchhal row kernel trails
Liger-Kernel needs a handful of them side by side, per case, per implementation, per kernel:
duration, DRAM bytes read and written (against the least the op must move), DRAM and SM throughput
(% of peak), achieved and theoretical occupancy, registers per thread, block and grid, local-memory
(spill) bytes, L2 hit rate and the two stall reasons that cost the most cycles per issued instruction.

Reads every *.csv under DIR, each the output of `ncu --csv --page raw` named <case>.<impl>.csv: a
header row of metric names, a row of units, then one row per profiled launch. Lines that are not
part of that table (ncu's ==PROF== messages, a program's own output) are skipped; units are read
from the units row, so the CSVs may come with or without --print-units base. Launches of one kernel
are averaged (n: how many); "all, per call" sums a case's kernels over one call, and each case with
both implementations ends with torchhal's speed relative to Liger's (Liger's time / torchhal's).

Usage:
    python3 benchmarks/summarize_ncu.py DIR
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

# Each column's metric, with the names other ncu versions give it, first found wins.
DURATION = ("gpu__time_duration.sum",)
DRAM_READ = ("dram__bytes_read.sum",)
DRAM_WRITE = ("dram__bytes_write.sum",)
DRAM_PCT = (
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
)
SM_PCT = ("sm__throughput.avg.pct_of_peak_sustained_elapsed",)
ACHIEVED_OCC = ("sm__warps_active.avg.pct_of_peak_sustained_active",)
THEORETICAL_OCC = ("sm__maximum_warps_per_active_cycle_pct",)
REGISTERS = ("launch__registers_per_thread",)
BLOCK = ("launch__block_size",)
GRID = ("launch__grid_size",)
SPILL_LOAD = ("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum",)
SPILL_STORE = ("l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum",)
L2_HIT = ("lts__t_sector_hit_rate.pct",)
# Stall reasons, per family of metric; the first family present in a file is used. WarpStateStats
# collects the first (warps stalled per issued instruction, i.e. cycles of latency it adds).
STALL_FAMILIES = (
    re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$"),
    re.compile(r"^smsp__average_warp_latency_issue_stalled_(\w+?)\.ratio$"),
    re.compile(r"^smsp__pcsamp_warps_issue_stalled_(\w+)$"),
    re.compile(r"^smsp__warp_issue_stalled_(\w+?)_per_warp_active\.pct$"),
)
NOT_STALLS = {"selected"}  # the warp issued: no stall

# Units to bytes and to nanoseconds; other units (%, register/thread, none) are kept as they are.
BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
BYTES |= {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
NANOSECONDS = {"nsecond": 1.0, "usecond": 1e3, "msecond": 1e6, "second": 1e9}
NANOSECONDS |= {"ns": 1.0, "us": 1e3, "ms": 1e6, "s": 1e9}
IMPL_ORDER = {"torchhal": 0, "liger": 1, "torch": 2}


@dataclass
class Launch:
    """One profiled kernel launch: its name and its numeric metrics (bytes in bytes, times in ns)."""

    kernel: str
    values: dict[str, float] = field(default_factory=dict)


def number(text: str, unit: str) -> float | None:
    """A CSV cell as a number in base units; None for n/a, blanks and anything else not numeric."""
    cleaned = text.strip().replace(",", "")
    try:
        value = float(cleaned)
    except ValueError:
        return None
    unit = unit.strip()
    return value * BYTES.get(unit, NANOSECONDS.get(unit, 1.0))


def read_raw_csv(path: Path) -> list[Launch]:
    """The launches in one `ncu --csv --page raw` output, skipping whatever surrounds the table."""
    lines = path.read_text(errors="replace").splitlines()
    rows = csv.reader(line for line in lines if line.strip() and not line.startswith("=="))  # ==PROF== etc.
    header: list[str] | None = None
    units: list[str] | None = None
    launches: list[Launch] = []
    for row in rows:
        if header is None:
            if "ID" in row and "Kernel Name" in row:
                header = row
            continue
        if len(row) != len(header):  # a message or program output line, not a table row
            continue
        cells = dict(zip(header, row, strict=True))
        if not cells["ID"].strip().isdigit():
            if units is None:  # the row after the header: each metric's unit
                units = row
            continue
        unit_of = dict(zip(header, units or [""] * len(header), strict=True))
        values = {}
        for name, cell in cells.items():
            value = number(cell, unit_of[name])
            if value is not None:
                values[name] = value
        for name, column in ((BLOCK[0], "Block Size"), (GRID[0], "Grid Size")):
            if name not in values and column in cells:  # "(512, 1, 1)": threads or blocks in all
                dims = [int(d) for d in re.findall(r"\d+", cells[column])]
                if dims:
                    values[name] = float(math.prod(dims))
        launches.append(Launch(cells["Kernel Name"].strip(), values))
    return launches


def first(values: dict[str, float], names: tuple[str, ...]) -> float | None:
    return next((values[n] for n in names if n in values), None)


def stall_reasons(values: dict[str, float]) -> dict[str, float]:
    """Stall reason -> its metric, from the first family of stall metrics present."""
    for family in STALL_FAMILIES:
        found = {}
        for name, value in values.items():
            match = family.match(name)
            if match and match.group(1) not in NOT_STALLS and not match.group(1).endswith("_not_issued"):
                found[match.group(1)] = value
        if found:
            return found
    return {}


def averaged(launches: list[Launch]) -> dict[str, float]:
    """Each metric's mean over the launches that report it."""
    collected: dict[str, list[float]] = defaultdict(list)
    for launch in launches:
        for name, value in launch.values.items():
            collected[name].append(value)
    return {name: sum(v) / len(v) for name, v in collected.items()}


def label(path: Path) -> tuple[str, str]:
    """(case, impl) from <case>.<impl>.csv."""
    case, _, impl = path.stem.rpartition(".")
    return (case, impl) if case else (impl, "?")


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 1] + "~"


COLUMNS = (
    ("case", "<11"),
    ("impl", "<8"),
    ("kernel", "<26"),
    ("n", ">2"),
    ("us", ">8"),
    ("rd GB", ">6"),
    ("wr GB", ">6"),
    ("GB/s", ">5"),
    ("DRAM%", ">5"),
    ("SM%", ">4"),
    ("occ ach/th", ">10"),
    ("regs", ">4"),
    ("block", ">5"),
    ("grid", ">7"),
    ("spill B", ">7"),
    ("L2hit", ">5"),
    ("top stalls (cycles/instruction)", ""),
)


def row_text(cells: list[str]) -> str:
    return " ".join(format(c, spec) for c, (_, spec) in zip(cells, COLUMNS, strict=True)).rstrip()


def kernel_row(case: str, impl: str, kernel: str, launches: list[Launch]) -> list[str]:
    v = averaged(launches)
    us = first(v, DURATION)
    rd, wr = first(v, DRAM_READ), first(v, DRAM_WRITE)
    gbps = (rd + wr) / us if None not in (rd, wr, us) and us else None  # bytes / ns = GB/s
    ach, theo = first(v, ACHIEVED_OCC), first(v, THEORETICAL_OCC)
    spill_parts = [x for x in (first(v, SPILL_LOAD), first(v, SPILL_STORE)) if x is not None]
    stalls = sorted(stall_reasons(v).items(), key=lambda kv: -kv[1])[:2]
    return [
        case,
        impl,
        short(kernel, 26),
        str(len(launches)),
        fmt(us, ".1f", 1e3),
        fmt(rd, ".3f", 1e9),
        fmt(wr, ".3f", 1e9),
        fmt(gbps, ".0f"),
        fmt(first(v, DRAM_PCT), ".1f"),
        fmt(first(v, SM_PCT), ".0f"),
        f"{fmt(ach, '.0f')}/{fmt(theo, '.0f')}",
        fmt(first(v, REGISTERS), ".0f"),
        fmt(first(v, BLOCK), ".0f"),
        fmt(first(v, GRID), ".0f"),
        fmt(sum(spill_parts) if spill_parts else None, ".0f"),
        fmt(first(v, L2_HIT), ".0f"),
        ", ".join(f"{reason} {value:.2f}" for reason, value in stalls) or "-",
    ]


def per_call(launches: list[Launch]) -> tuple[float | None, float | None, float | None, int]:
    """(ns, bytes read, bytes written) of one call, all kernels summed, and the calls seen: each
    call launches each of its kernels once, so the most launched kernel counts the calls."""
    counts: dict[str, int] = defaultdict(int)
    for launch in launches:
        counts[launch.kernel] += 1
    calls = max(counts.values())
    sums = []
    for names in (DURATION, DRAM_READ, DRAM_WRITE):
        found = [x for x in (first(launch.values, names) for launch in launches) if x is not None]
        sums.append(sum(found) / calls if found else None)
    return sums[0], sums[1], sums[2], calls


def summarize(directory: Path) -> tuple[list[str], list[str]]:
    """(the table's lines, notes on files that gave nothing)."""
    notes: list[str] = []
    by_case: dict[str, dict[str, list[Launch]]] = defaultdict(dict)
    for path in sorted(directory.glob("*.csv")):
        launches = read_raw_csv(path)
        if not launches:
            notes.append(f"{path.name}: no profiled launches (no kernel in the NVTX range? see its .log)")
            continue
        case, impl = label(path)
        by_case[case][impl] = launches
    lines = [row_text([name for name, _ in COLUMNS])]
    for case in sorted(by_case):
        impls = by_case[case]
        totals: dict[str, float | None] = {}
        for impl in sorted(impls, key=lambda i: (IMPL_ORDER.get(i, 9), i)):
            launches = impls[impl]
            kernels: dict[str, list[Launch]] = defaultdict(list)
            for launch in launches:
                kernels[launch.kernel].append(launch)
            for kernel, group in kernels.items():
                lines.append(row_text(kernel_row(case, impl, kernel, group)))
            ns, rd, wr, calls = per_call(launches)
            totals[impl] = ns
            if len(kernels) > 1:
                gbps = (rd + wr) / ns if None not in (rd, wr, ns) and ns else None
                cells = [case, impl, "(all, per call)", str(calls), fmt(ns, ".1f", 1e3)]
                cells += [fmt(rd, ".3f", 1e9), fmt(wr, ".3f", 1e9), fmt(gbps, ".0f")]
                lines.append(row_text(cells + [""] * (len(COLUMNS) - len(cells))))
        ours, liger = totals.get("torchhal"), totals.get("liger")
        if ours and liger:
            lines.append(f"{case}: torchhal {liger / ours:.3f}x Liger's speed (Liger's time / torchhal's)")
    return lines, notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Summarize profile_row_kernels.sh's ncu CSVs.")
    parser.add_argument("directory", type=Path, help="folder of <case>.<impl>.csv files")
    args = parser.parse_args(argv)
    if not any(args.directory.glob("*.csv")):
        print(f"summarize_ncu: no *.csv under {args.directory}", file=sys.stderr)
        return 1
    lines, notes = summarize(args.directory)
    print("\n".join(lines))
    print(
        "us: mean duration; rd/wr GB: DRAM bytes; GB/s: their sum over the duration; DRAM%, SM%: of peak; "
        "occ: achieved/theoretical %; spill B: local-memory bytes loaded and stored; L2hit: %; stalls: "
        "cycles each adds per issued instruction (WarpStateStats; sample counts where only pc sampling ran)"
    )
    for note in notes:
        print(note, file=sys.stderr)
    return 0 if len(lines) > 1 else 1


if __name__ == "__main__":
    sys.exit(main())
