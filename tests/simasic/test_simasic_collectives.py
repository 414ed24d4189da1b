"""Collectives on simulated devices charge the clock for their transfer over the declared host
links (ring algorithms), so a simulated training step includes its communication."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.cost import collective_time_s
from torchhal_simasic.spec import SimASICSpec

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import InvalidArgumentError, telemetry
from torchhal.hal_core.collectives import Communicator
from torchhal.hal_core.settings import Settings

WORKER = Path(__file__).with_name("_collective_worker.py")
ROOT = Path(__file__).parents[2]
MiB = 2**20


def test_collective_times_by_hand(tiny: Callable[..., SimASICSpec]):
    """Bytes each rank sends over a 1 GB/s link, plus the tiny spec's 1 µs launch."""
    spec = tiny(host_link_bytes_per_s=1e9)
    o = 1e-6
    assert collective_time_s(spec, "all_reduce", MiB, 4) == pytest.approx(2 * 3 / 4 * MiB / 1e9 + o)
    assert collective_time_s(spec, "all_gather", MiB, 4) == pytest.approx(3 * MiB / 1e9 + o)
    assert collective_time_s(spec, "reduce_scatter", MiB, 4) == pytest.approx(3 / 4 * MiB / 1e9 + o)
    assert collective_time_s(spec, "all_to_all", MiB, 8) == pytest.approx(7 / 8 * MiB / 1e9 + o)
    assert collective_time_s(spec, "broadcast", MiB, 2) == pytest.approx(MiB / 1e9 + o)
    assert collective_time_s(spec, "send", 1000, 2) == pytest.approx(1000 / 1e9 + o)
    assert collective_time_s(spec, "barrier", 0, 8) == pytest.approx(o)
    for alone in ("all_reduce", "all_gather", "broadcast", "reduce"):  # one rank moves nothing
        assert collective_time_s(spec, alone, MiB, 1) == pytest.approx(o)
    assert collective_time_s(tiny(), "all_reduce", MiB, 4) is None  # no link declared
    with pytest.raises(InvalidArgumentError, match=r"no cost model for 'gossip'; known: all_reduce"):
        collective_time_s(spec, "gossip", MiB, 4)
    with pytest.raises(InvalidArgumentError, match=r"world_size must be an integer >= 0, got -1"):
        collective_time_s(spec, "all_reduce", MiB, -1)


def test_two_ranks_charge_each_collective_its_transfer(tmp_path):
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(rank), "2", str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=90)[0].decode() for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    link, o, b = 2e9, 1e-6, 4096 * 4  # the worker's link, the tiny spec's launch, 16 KiB a rank
    expected = {  # ring algorithms over two ranks, by hand
        "all_reduce": b / link + o,  # 2(n-1)/n = 1
        "all_gather": b / link + o,  # n-1 = 1
        "reduce_scatter": b / 2 / link + o,  # (n-1)/n
        "broadcast": b / link + o,
        "reduce": b / link + o,
        "all_to_all": b / 2 / link + o,
        "send_recv": b / link + o,
        "barrier": o,
    }
    for rank in range(2):
        times = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert times == pytest.approx(expected, rel=1e-9), f"rank {rank}"


def test_without_a_declared_link_collectives_are_uncharged_said_once_and_counted(tiny, tmp_path, capsys):
    hal = HardwareAbstractionLayer(
        adapters=[SimASICAdapter(tiny())],
        settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}),
    )
    device = hal.device("simasic:0")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    counted = "torchhal.simasic.uncharged_collectives,collective=all_reduce"
    before = telemetry.counts().get(counted, 0)
    with Communicator.create(
        hal, device=device, rank=0, world_size=1, store=store, timeout=timedelta(seconds=10)
    ) as comm:
        clock = device.adapter.states[0].clock
        start = clock.now()
        comm.all_reduce(torch.rand(8))
        comm.all_reduce(torch.rand(8))
        assert clock.now() == start
    assert telemetry.counts()[counted] == before + 2
    logged = capsys.readouterr().err
    assert logged.count("simulated collectives cost no time: the spec declares no host_link_bytes_per_s") == 1
