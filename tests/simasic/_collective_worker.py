"""One rank of the simulated-collectives test: each collective's simulated time, as JSON.

Run as a script (never collected by pytest): python _collective_worker.py RANK WORLD OUT_DIR
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import parse_spec

from tests.simasic.tiny import TINY
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.collectives import Communicator
from torchhal.hal_core.settings import Settings

LINK_BYTES_PER_S = 2e9
ELEMENTS = 4096  # float32: 16 KiB per rank


def main(rank: int, world: int, out: Path) -> None:
    spec = parse_spec({**TINY, "memory_bytes": 1 << 26, "host_link_bytes_per_s": LINK_BYTES_PER_S}, "test")
    hal = HardwareAbstractionLayer(
        adapters=[SimASICAdapter(spec)], settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    )
    device = hal.device("simasic:0")
    comm = Communicator.create(
        hal,
        device=device,
        rank=rank,
        world_size=world,
        init_method=(out / "rendezvous").as_uri(),
        timeout=timedelta(seconds=30),
    )
    clock = device.adapter.states[0].clock
    x = torch.rand(ELEMENTS)
    calls = {
        "all_reduce": lambda: comm.all_reduce(x.clone()),
        "all_gather": lambda: comm.all_gather(x),
        "reduce_scatter": lambda: comm.reduce_scatter(x),
        "broadcast": lambda: comm.broadcast(x.clone(), src=0),
        "reduce": lambda: comm.reduce(x.clone(), dst=0),
        "all_to_all": lambda: comm.all_to_all(x),
        "send_recv": lambda: comm.send(x, dst=1) if rank == 0 else comm.recv(x.clone(), src=0),
        "barrier": comm.barrier,
    }
    times = {}
    with comm:
        for name, call in calls.items():
            before = clock.now()
            call()
            times[name] = clock.now() - before
    (out / f"rank{rank}.json").write_text(json.dumps(times))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
