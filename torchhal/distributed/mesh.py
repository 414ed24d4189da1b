"""`Mesh`: a torch DeviceMesh whose rank order follows the HAL topology.

`init_device_mesh` lays ranks out in rank order, so the inner (last) mesh dimension joins
consecutive ranks. Ranks are reordered here so that ranks of one host, and within a host of
one fast-link island (NVLink, xGMI, Xe Link), are consecutive: the inner dimension, which
carries the most traffic (tensor parallel, FSDP inside a node), then stays on the fastest links.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchhal.hal_core import ConfigurationError, InvalidArgumentError, Topology, telemetry

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchhal.distributed.init import DistContext

log = telemetry.get_logger("torchhal.distributed.mesh")

Placement = tuple[str, int, int]
"""(host, island index on that host, position of the device in that host's topology)."""


def placement(topology: Topology, device_id: str, host: str = "") -> Placement:
    """Where a device sits: its island among `topology.islands()` and its position.

    Devices the topology does not list come after every island (and then in rank order).
    """
    islands = topology.islands()
    for index, island in enumerate(islands):
        if device_id in island:
            return host, index, topology.devices.index(device_id)
    return host, len(islands), len(topology.devices)


def order_from_placements(placements: Sequence[Placement]) -> tuple[int, ...]:
    """Ranks sorted by (host in order of first appearance, island, position, rank)."""
    first_seen: dict[str, int] = {}
    for host, _, _ in placements:
        first_seen.setdefault(host, len(first_seen))
    return tuple(
        sorted(range(len(placements)), key=lambda r: (first_seen[placements[r][0]], *placements[r][1:], r))
    )


def rank_order(
    topology: Topology, devices_per_rank: Sequence[str], hosts: Sequence[str] | None = None
) -> tuple[int, ...]:
    """Ranks reordered so that ranks on one host, then on one fast-link island, are consecutive.

    `devices_per_rank[r]` is rank r's device id in `topology`; `hosts[r]` its host (one host
    when omitted; every host is assumed to have this topology).
    """
    if hosts is not None and len(hosts) != len(devices_per_rank):
        raise InvalidArgumentError(
            f"rank_order: hosts has {len(hosts)} entries, devices_per_rank {len(devices_per_rank)}"
        )
    where = hosts or [""] * len(devices_per_rank)
    return order_from_placements(
        [placement(topology, d, h) for d, h in zip(devices_per_rank, where, strict=True)]
    )


class Mesh:
    """A DeviceMesh over every rank of a job, laid out island-contiguously."""

    def __init__(self, device_mesh: DeviceMesh, order: tuple[int, ...], placements: Sequence[Placement]):
        """Use `Mesh.create`."""
        self.device_mesh = device_mesh
        self.order = order
        self.placements = tuple(placements)

    @classmethod
    def create(
        cls,
        ctx: DistContext,
        shape: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        *,
        topology: Topology | None = None,
    ) -> Mesh:
        """Build the mesh collectively on every rank. `shape` defaults to `(world_size,)`.

        Each rank places its own device in its own host's topology (`hal.topology()` unless
        given); the placements are exchanged so that every rank computes the same order.
        """
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # imports DTensor: 2 s

        shape = tuple(shape) if shape is not None else (ctx.world_size,)
        names = tuple(names) if names is not None else _default_names(len(shape))
        sizes_ok = all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in shape)
        if not shape or not sizes_ok or math.prod(shape) != ctx.world_size:  # () was an IndexError
            raise ConfigurationError(
                f"mesh shape {shape}: needs at least one dimension, and integer sizes >= 1 that multiply "
                f"to the world size {ctx.world_size}"
            )
        if (
            len(names) != len(shape)
            or len(set(names)) != len(names)
            or not all(isinstance(n, str) and n for n in names)
        ):
            raise ConfigurationError(
                f"mesh names {names}: need {len(shape)} distinct non-empty names (str) for shape {shape}"
            )
        topo = topology if topology is not None else ctx.hal.topology()
        mine = placement(topo, ctx.device.id, ctx.host)
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine, group=ctx.communicator.group)
        placements: list[Placement] = [tuple(p) for p in gathered]
        order = order_from_placements(placements)
        device_type = ctx.device.torch_device.type
        with telemetry.span("torchhal.distributed.mesh", shape=list(shape), order=list(order)):
            if order == tuple(range(ctx.world_size)):
                device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
            else:  # init_device_mesh only lays out ranks in order; DeviceMesh takes any layout
                layout = torch.tensor(order, dtype=torch.int64).view(shape)
                device_mesh = DeviceMesh(device_type, layout, mesh_dim_names=names)
        mesh = cls(device_mesh, order, placements)
        mesh._warn_if_inner_spans_islands(shape[-1])
        log.info("mesh created", shape=shape, names=names, order=order, rank=ctx.rank)
        return mesh

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.device_mesh.shape)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.device_mesh.mesh_dim_names or ())

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D sub-mesh along dimension `name`, containing this rank."""
        if name not in self.names:
            raise InvalidArgumentError(f"mesh has dimensions {self.names}, not {name!r}")
        return self.device_mesh[name]

    def group(self, name: str) -> dist.ProcessGroup:
        """This rank's process group along dimension `name`."""
        return self[name].get_group()

    def _warn_if_inner_spans_islands(self, inner: int) -> None:
        """An inner group crossing islands runs at the slowest link's speed: say so."""
        for start in range(0, len(self.order), inner):
            ranks = self.order[start : start + inner]
            islands = {self.placements[r][:2] for r in ranks}
            if len(islands) > 1:
                log.warning(
                    "inner mesh dimension spans several fast-link islands",
                    ranks=list(ranks),
                    islands=sorted(islands),
                    inner_size=inner,
                )
                telemetry.count("torchhal.distributed.mesh_inner_spans_islands")
                return


def _default_names(ndim: int) -> tuple[str, ...]:
    return ("dp",) if ndim == 1 else tuple(f"dim{i}" for i in range(ndim))
