"""Time of the first `HardwareAbstractionLayer()` discovery, after `import torch`.

Each sample is a fresh interpreter (imports and entry-point scans are cold per process, as a
user sees them). Bytecode caching is on, as for a user (PYTHONDONTWRITEBYTECODE, which some
sandboxes set, is removed for the samples), and one warm-up sample writes the caches first.
Two figures per sample: from just after `import torch` to devices listed, with `import torchhal`
included ("import+discover"), and the discovery alone, after torchhal's modules are imported
("discover"). Peer: the same interpreter's `import torch` time.
Usage: python benchmarks/bench_discovery.py [--samples 15] [--out results.json]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone

SAMPLE = r"""
import json, time
t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
import torchhal, torchhal.hal_core.hal, torchhal.hal_core.plugins; t2 = time.perf_counter()
hal = torchhal.HardwareAbstractionLayer(); devices = [d.id for d in hal.devices()]; t3 = time.perf_counter()
print(json.dumps({"torch_ms": (t1 - t0) * 1e3, "import_ms": (t2 - t1) * 1e3, "discover_ms": (t3 - t2) * 1e3,
                  "devices": devices, "adapters": [a.name for a in hal.adapters]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--out")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    rows = []
    for _ in range(args.samples + 1):
        out = subprocess.run(
            [sys.executable, "-c", SAMPLE], capture_output=True, text=True, check=True, env=env
        )
        rows.append(json.loads(out.stdout))
    rows = rows[1:]  # the warm-up wrote the bytecode caches
    plugins = sorted(ep.name for ep in importlib.metadata.entry_points(group="torchhal.adapters"))
    summary = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": sys.version.split()[0],
        "entry_points": plugins,
        "adapters": rows[0]["adapters"],
        "devices": rows[0]["devices"],
        "samples": args.samples,
        "median_torch_import_ms": statistics.median(r["torch_ms"] for r in rows),
        "median_torchhal_import_ms": statistics.median(r["import_ms"] for r in rows),
        "median_discover_ms": statistics.median(r["discover_ms"] for r in rows),
        "median_import_plus_discover_ms": statistics.median(r["import_ms"] + r["discover_ms"] for r in rows),
        "max_import_plus_discover_ms": max(r["import_ms"] + r["discover_ms"] for r in rows),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=2)
    for key, value in summary.items():
        print(f"{key:<34} {value:.1f}" if isinstance(value, float) else f"{key:<34} {value}")


if __name__ == "__main__":
    main()
