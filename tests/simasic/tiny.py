"""The tiny spec the simasic tests work costs out by hand for: a 4 × 4 array at 1 GHz."""

from __future__ import annotations

from typing import Any

TINY: dict[str, Any] = {
    "name": "tiny-4x4",
    "rows": 4,
    "cols": 4,
    "clock_hz": 1e9,
    "macs_per_cell_per_cycle": {"fp32": 1, "bf16": 2},
    "sram_bytes": 1024,
    "memory_bytes": 1 << 20,
    "memory_bandwidth_bytes_per_s": 1e11,
    "dtypes": ["fp32", "bf16"],
    "launch_overhead_s": 1e-6,
}
