"""One rank of the mesh and island-group checks (world 2, gloo, simulated ASICs).

Run as a script by test_mesh_groups.py, through `_worker.main` (same arguments, same result
files); this module adds the scenario "mesh" to `_worker.SCENARIOS`. Rank 0 trains on simasic:1
and rank 1 on simasic:0, so the mesh's topology order is (1, 0): a layout listing ranks out of
ascending order, as a cyclic launch over hosts (`srun --distribution=cyclic`) gives too. Each
rank's mesh coordinate must be its rank in the dimension's process group, the groups must have
the job's timeout, and an FSDP2 checkpoint on that mesh must hold the model's own weights
(before: shards permuted, the unevenly sharded ones wrong, the groups on torch's 30 minutes).
Island groups re-formed by `HeteroGroup.create` must be released by `close`.
"""

from __future__ import annotations

import os
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from torchhal import distributed as thd
from torchhal.distributed import mesh as mesh_module
from torchhal.hal_core import CollectiveError, Link, LinkType, Topology, telemetry

try:  # imported by a test: the checkout's root is on the path
    from tests.distributed import _worker as w
except ImportError:  # run as a script: its own directory is the path's first entry
    import _worker as w  # type: ignore[no-redef]

TIMEOUT = timedelta(seconds=10)
TOPOLOGY = Topology(
    devices=("simasic:0", "simasic:1"),
    links=(Link(a="simasic:0", b="simasic:1", type=LinkType.NVLINK, source="declared"),),
)


def check_init(state: Any) -> None:
    store = dist.FileStore(str(state.out / "store"), state.world)
    state._ctx = thd.init(
        device=f"simasic:{1 - state.rank}",
        rank=state.rank,
        world_size=state.world,
        store=store,
        timeout=TIMEOUT,
    )


def _assert_coordinates_are_group_ranks(mesh: thd.Mesh) -> None:
    """Along every dimension: coordinate == group rank, the group's ranks are the layout's row
    through this rank, and a group made for the mesh has the job's timeout."""
    device_mesh = mesh.device_mesh
    coordinate = device_mesh.get_coordinate()
    assert coordinate is not None
    me = dist.get_rank()
    for dim, name in enumerate(mesh.names):
        group = mesh.group(name)
        (row,) = [
            r for r in device_mesh.mesh.movedim(dim, -1).reshape(-1, mesh.shape[dim]).tolist() if me in r
        ]
        assert dist.get_process_group_ranks(group) == row, (name, dist.get_process_group_ranks(group), row)
        assert coordinate[dim] == dist.get_rank(group), (name, coordinate, dist.get_rank(group))
        timeout = group._get_backend(torch.device("cpu")).options._timeout
        assert timeout == TIMEOUT, (name, timeout)


def _layout_kept() -> list[int]:
    """The topology's order (1, 0) where new_group keeps a group's ranks in the order given
    (`sort_ranks`, torch 2.13); rank order on a torch without it (2.11), the fallback."""
    return [1, 0] if mesh_module._KEEPS_RANK_ORDER else [0, 1]


def check_a_permuted_mesh_keeps_coordinates_and_group_ranks_together(state: Any) -> None:
    full = torch.arange(4.0)
    for shape in ((2,), (1, 2), (2, 1)):
        mesh = thd.Mesh.create(state.ctx, shape, topology=TOPOLOGY)
        assert list(mesh.order) == mesh.device_mesh.mesh.flatten().tolist() == _layout_kept(), mesh.order
        _assert_coordinates_are_group_ranks(mesh)
        # each rank holds its coordinate's chunk, as DTensor and FSDP2 place them
        sharded = shape.index(2)
        placements = [Shard(0) if size == 2 else Replicate() for size in shape]
        local = full.chunk(2)[mesh.device_mesh.get_coordinate()[sharded]].clone()
        gathered = DTensor.from_local(local, mesh.device_mesh, placements).full_tensor()
        assert gathered.tolist() == full.tolist(), (shape, gathered.tolist())


def check_an_fsdp_checkpoint_on_a_permuted_mesh_holds_the_model(state: Any) -> None:
    """prepare's own mesh follows the HAL's topology: (1, 0) here (`_layout_kept`). 3 rows over 2 ranks shard
    unevenly; before, those came back wrong even on this mesh and the even ones permuted."""
    torch.manual_seed(zlib.crc32(f"{state.seed}:mesh_model".encode()))
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    prepared = thd.prepare(model, lambda p: torch.optim.SGD(p, lr=0.1), ctx=state.ctx, strategy="fsdp")
    weight = prepared.model[0].weight
    assert weight.device_mesh.mesh.tolist() == _layout_kept(), weight.device_mesh.mesh.tolist()
    path = state.out / "checkpoint"
    dcp.save(prepared.model.state_dict(), checkpoint_id=path)
    dist.barrier()
    wrong: list[str] = []
    if state.rank == 0:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        try:
            dcp_to_torch_save(path, state.out / "checkpoint.pt")
        except AssertionError as exc:  # DCP's own check of the shards' sizes
            wrong = [f"every key: the shards do not fit together ({exc})"]
        else:
            saved = torch.load(state.out / "checkpoint.pt")
            wrong = [k for k in reference if not torch.equal(saved[k], reference[k])]
    dist.barrier()  # rank 1 waits for rank 0's reading either way
    assert not wrong, f"the checkpoint holds other values than the model for {wrong}"


def check_a_torch_that_sorts_group_ranks_gets_the_mesh_in_rank_order(state: Any) -> None:
    """Where new_group has no sort_ranks, a layout out of ascending order cannot be kept: the mesh
    falls back to rank order, warned and counted, rather than disagree with its groups."""
    key = "torchhal.distributed.mesh_order_not_kept"
    before = telemetry.counts().get(key, 0)
    kept, mesh_module._KEEPS_RANK_ORDER = mesh_module._KEEPS_RANK_ORDER, False
    try:
        mesh = thd.Mesh.create(state.ctx, topology=TOPOLOGY)
    finally:
        mesh_module._KEEPS_RANK_ORDER = kept
    assert mesh.order == (0, 1) and telemetry.counts().get(key, 0) == before + 1
    assert mesh.group("dp") is dist.group.WORLD  # the world in rank order is the world group
    assert mesh.device_mesh.get_coordinate() == (state.rank,)


def check_re_formed_island_groups_are_released(state: Any) -> None:
    """Each HeteroGroup.create makes new island groups; `close` (here a `with` block) and
    `Islands.destroy` release them, where 30 creates held 150 more descriptors until shutdown."""
    comm = state.ctx.communicator
    children = len(comm._children)
    descriptors = len(os.listdir("/proc/self/fd"))
    for _ in range(4):
        with thd.HeteroGroup.create(state.ctx, global_batch=8, throughput=1.0 + state.rank) as group:
            summed = group.islands.hierarchical_all_reduce(torch.ones(3))
            assert summed.tolist() == [2.0] * 3
    islands = comm.islands(vendor=f"vendor{state.rank}")  # two islands of one rank: a host lane
    assert islands.form == "sharded" and islands.lane is not None
    islands.destroy()
    assert len(comm._children) == children, (children, len(comm._children))
    try:
        islands.hierarchical_all_reduce(torch.ones(1))
    except CollectiveError as exc:
        assert "destroyed" in str(exc), str(exc)
    else:
        raise AssertionError("an all-reduce over destroyed islands ran")
    del group, islands
    assert len(os.listdir("/proc/self/fd")) <= descriptors, (descriptors, os.listdir("/proc/self/fd"))


w.SCENARIOS["mesh"] = [
    check_init,
    check_a_permuted_mesh_keeps_coordinates_and_group_ranks_together,
    check_an_fsdp_checkpoint_on_a_permuted_mesh_holds_the_model,
    check_a_torch_that_sorts_group_ranks_gets_the_mesh_in_rank_order,
    check_re_formed_island_groups_are_released,
]
check_names = w.check_names

if __name__ == "__main__":
    w.main()
