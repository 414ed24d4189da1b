"""Which host a rank is on and which device it takes: the rules `Mesh` and `init` build on.

A host is its hostname and its kernel's boot id, so containers sharing a hostname on two machines
are two hosts. The device for a local rank is chosen by one function for `init` and
`Communicator.create`, which agree with one visible GPU as under `srun --gpus-per-task=1`.
"""

from __future__ import annotations

import importlib
import socket
from pathlib import Path

import pytest
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe

from tests.plugins.facts import load
from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.hal_core import ConfigurationError, telemetry
from torchhal.hal_core.process_groups import _resolve_device
from torchhal.hal_core.settings import Settings

init_module = importlib.import_module("torchhal.distributed.init")  # `thd.init` is the function
NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def recorded(fact: str) -> HardwareAbstractionLayer:
    return HardwareAbstractionLayer(
        adapters=[NvidiaAdapter(probe=RecordedCudaProbe(load(fact)))], settings=NO_AUTOLOAD
    )


# -- hosts -----------------------------------------------------------------------------------------


@pytest.mark.skipif(not BOOT_ID.is_file(), reason="no kernel boot id here (not Linux)")
def test_a_context_names_its_host_by_hostname_and_boot_id(ctx):
    assert ctx.host == f"{socket.gethostname()}/{BOOT_ID.read_text().strip()}"
    assert ctx.report()["host"] == ctx.host


def test_containers_sharing_a_hostname_on_two_machines_are_two_hosts(monkeypatch, tmp_path):
    """`docker run --hostname trainer` on two nodes: the mesh took them for one host and put ranks
    of both nodes on each inner group; by boot id, each node's ranks stay together."""
    monkeypatch.setattr(socket, "gethostname", lambda: "trainer")
    hosts = []
    for machine in ("node-a", "node-a", "node-b", "node-b"):  # torchrun: ranks 0, 1 on a; 2, 3 on b
        (tmp_path / machine).write_text(f"{machine}-boot\n")
        monkeypatch.setattr(init_module, "_BOOT_ID", tmp_path / machine)
        hosts.append(init_module.host_identity())
    assert hosts == ["trainer/node-a-boot"] * 2 + ["trainer/node-b-boot"] * 2
    topology = NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h200x2"))).topology()
    assert thd.rank_order(topology, ["cuda:0", "cuda:1"] * 2, hosts) == (0, 1, 2, 3)


def test_without_a_boot_id_the_hostname_alone_names_the_host_and_that_is_counted(monkeypatch, tmp_path):
    monkeypatch.setattr(init_module, "_BOOT_ID", tmp_path / "missing")
    key = "torchhal.distributed.host_by_hostname_only"
    before = telemetry.counts().get(key, 0)
    assert init_module.host_identity() == socket.gethostname()
    assert telemetry.counts().get(key, 0) == before + 1


# -- the device of a local rank --------------------------------------------------------------------


@pytest.mark.parametrize("fact", ["nvidia-h100-sxm", "nvidia-h200x2"])
@pytest.mark.parametrize("local_rank", [None, 0, 1, 3])
def test_init_and_communicator_create_choose_the_same_device(monkeypatch, fact, local_rank):
    hal = recorded(fact)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    def outcome(choose) -> str:
        try:
            return choose().id
        except ConfigurationError as exc:
            return str(exc)

    assert outcome(lambda: thd.local_device(hal, local_rank)) == outcome(lambda: _resolve_device(hal, None))


def test_one_visible_gpu_is_taken_by_any_local_rank_and_that_is_counted(monkeypatch):
    """`srun --gpus-per-task=1`: each task sees one GPU while LOCAL_RANK counts the node's tasks.
    init refused local rank 3 where Communicator.create took cuda:0."""
    hal = recorded("nvidia-h100-sxm")
    key = "torchhal.collective.one_device_per_task,device=cuda:0"
    before = telemetry.counts().get(key, 0)
    assert thd.local_device(hal, 3).id == "cuda:0"
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _resolve_device(hal, None).id == "cuda:0"
    assert telemetry.counts().get(key, 0) == before + 2


def test_more_local_ranks_than_several_gpus_is_refused_by_both(monkeypatch):
    hal = recorded("nvidia-h200x2")
    message = (
        r"local rank 2: adapter 'nvidia' has 2 matching device\(s\) \['cuda:0', 'cuda:1'\], so at most 2"
    )
    with pytest.raises(ConfigurationError, match=message):
        thd.local_device(hal, 2)
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigurationError, match=message):
        _resolve_device(hal, None)
