"""The `torchhal demo` section on distributed training: two processes train the tiny GPT example.

Rank 0 trains on the CPU and rank 1 on a simulated ASIC when the HAL has one (the embedded
default spec unless TORCHHAL_SIMASIC_SPEC says otherwise), as one heterogeneous job: the global
batch is split by each device's matmul throughput (the CPU's measured, the simulated device's
modelled) and gradients are averaged across the two single-vendor islands. Without a simulated
device both ranks use the CPU under DDP.
The workers are `examples/train_tiny_gpt.py`, started here with a FileStore rendezvous.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from torchhal.hal_core import telemetry
from torchhal.hal_core.hal import HardwareAbstractionLayer

log = telemetry.get_logger("torchhal.distributed.demo")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_gpt.py"
STEPS = 6
WORLD = 2
TIMEOUT_S = 60


def demo_section(
    console: Console, hal: HardwareAbstractionLayer | None = None
) -> list[dict[str, Any]] | None:
    """Run the 2-process training, print each rank's device, policy, step times and loss.

    `hal` only tells whether a simulated ASIC is present; the workers discover their devices
    from the same environment. Returns each rank's report (None when the section could not
    run; it says why).
    """
    console.rule("6. Distributed training: 2 processes, tiny GPT")
    if not EXAMPLE.exists():
        console.print(
            f"  skipped: the example {EXAMPLE} is not in this installation (needs a source checkout)"
        )
        log.warning("distributed demo skipped: example script missing", path=str(EXAMPLE))
        return None
    hal = hal or HardwareAbstractionLayer()
    simulated = next((d for d in hal.devices() if d.simulated), None)
    if simulated is not None:
        args = ["--strategy", "hetero", "--devices", f"cpu,{simulated.id}"]
        console.print(
            f"  rank 0 on the CPU, rank 1 on {simulated.id} ({simulated.capabilities.name}), one job"
        )
    else:
        args = ["--strategy", "ddp", "--devices", "cpu,cpu"]
        console.print("  no simulated ASIC found (plugin simasic not loaded): both ranks on the CPU, DDP")
    with tempfile.TemporaryDirectory(prefix="torchhal-demo-") as tmp:
        reports, outputs = _run(Path(tmp), args)
    if reports is None:
        console.print("  [red]training failed[/]")
        for rank, text in enumerate(outputs):
            console.print(f"  --- rank {rank}\n{text[-2000:]}", markup=False)
        return None
    console.print(_table(reports))
    for r in reports:
        console.print(f"  rank {r['context']['rank']} policy: {r['prepared']['precision']['reason']}")
    hetero = reports[0]["hetero"]
    if hetero is not None:
        # a simulated device's rate is its model's, while its share of the work runs on this
        # host: "measured" beside it read as a measured speedup
        rates = ", ".join(
            f"{r['context']['device']} {t:.4g} ({'modelled' if r['context']['simulated'] else 'measured'})"
            for r, t in zip(reports, hetero["throughputs_tflops"], strict=True)
        )
        console.print(
            f"  batch split {hetero['batch_sizes']} from matmul TFLOP/s {rates}; a simulated device's "
            f"figure is simulated time, and its work runs on this host's CPU; islands {hetero['islands']}",
            markup=False,
        )
    return reports


def _run(tmp: Path, args: list[str]) -> tuple[list[dict[str, Any]] | None, list[str]]:
    """Each rank's JSON report (None when a worker failed or hung) and each worker's output."""
    store = tmp / "store"
    out = tmp / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": str(WORLD)}
    command = [sys.executable, str(EXAMPLE), "--steps", str(STEPS), "--json-out", str(out), *args]
    command += ["--init-method", f"file://{store}"]
    procs = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORLD)
    ]
    outputs, failed = [], False
    for p in procs:
        try:
            text, _ = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
            failed = True
        outputs.append(text)
        failed = failed or p.returncode != 0
    if failed:
        log.error("distributed demo: a worker failed", exit_codes=[p.returncode for p in procs])
        return None, outputs
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)], outputs


def _table(reports: list[dict[str, Any]]) -> Table:
    table = Table()
    for col in ("rank", "device", "policy", "batch", "step time (ms, median)", "loss first → last"):
        table.add_column(col)
    for report in reports:
        ctx, steps = report["context"], report["steps"]
        kind = " (simulated)" if ctx["simulated"] else ""
        table.add_row(
            str(ctx["rank"]),
            f"{ctx['device']}{kind}",
            report["prepared"]["precision"]["policy"],
            f"{report['batch']['local']} of {report['batch']['global']}",
            f"{statistics.median(s['step_time_s'] for s in steps[1:]) * 1e3:.1f} (wall)",
            f"{steps[0]['loss']:.3f} → {steps[-1]['loss']:.3f}",
        )
    return table
