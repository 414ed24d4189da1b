"""`Mesh`: a torch DeviceMesh whose rank order follows the HAL topology.

`init_device_mesh` lays ranks out in rank order, so the inner (last) mesh dimension joins
consecutive ranks. Ranks are reordered here so that ranks of one host, and within a host of
one fast-link island (NVLink, xGMI, Xe Link), are consecutive: the inner dimension, which
carries the most traffic (tensor parallel, FSDP inside a node), then stays on the fastest links.
The dimensions' process groups are made here, in that order and with the job's timeout: torch's
DeviceMesh would sort each group's ranks, and DTensor's shard offsets would then disagree with
the collectives (`_dimension_groups`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from torchhal.hal_core import CollectiveError, ConfigurationError, InvalidArgumentError, Topology, telemetry
from torchhal.hal_core.collective_checks import as_integer
from torchhal.hal_core.process_groups import world_group

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
        given); the placements are exchanged so that every rank computes the same order. Each
        dimension's process groups are made here, their ranks in the layout's order and with the
        job's timeout (see `_dimension_groups`), and the DeviceMesh is built from them.
        """
        from torch.distributed.device_mesh import DeviceMesh  # imports DTensor: 2 s

        shape = _checked_shape(shape, ctx.world_size)
        names = _checked_names(names, shape)
        topo = topology if topology is not None else ctx.hal.topology()
        mine = placement(topo, ctx.device.id, ctx.host)
        gathered: list[Any] = [None] * ctx.world_size
        dist.all_gather_object(gathered, mine, group=ctx.communicator.group)
        placements: list[Placement] = [tuple(p) for p in gathered]
        order = order_from_placements(placements)
        layout = torch.tensor(order, dtype=torch.int64).view(shape)
        if not _KEEPS_RANK_ORDER and not _ascending(layout):
            log.warning(
                "mesh laid out in rank order: this torch's new_group sorts each group's ranks (no "
                "sort_ranks), so the topology's order would give mesh coordinates that disagree "
                "with group ranks",
                order=order,
                torch=torch.__version__,
            )
            telemetry.count("torchhal.distributed.mesh_order_not_kept")
            order = tuple(range(ctx.world_size))
            layout = torch.tensor(order, dtype=torch.int64).view(shape)
        with telemetry.span("torchhal.distributed.mesh", shape=list(shape), order=list(order)):
            groups = _dimension_groups(layout, names, ctx.communicator.timeout)
            device_mesh = DeviceMesh.from_group(
                groups, ctx.device.torch_device.type, mesh=layout, mesh_dim_names=names
            )
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


def _checked_shape(shape: object, world_size: int) -> tuple[int, ...]:
    """`shape` as a tuple of ints (any integer type), or a ConfigurationError naming it."""
    if shape is None:
        return (world_size,)
    given = [] if isinstance(shape, (str, bytes)) or not isinstance(shape, Iterable) else list(shape)
    sizes = [size for size in map(as_integer, given) if size is not None and size >= 1]
    if not sizes or len(sizes) != len(given) or math.prod(sizes) != world_size:
        raise ConfigurationError(
            f"mesh shape {shape!r}: needs a sequence of at least one integer size >= 1 (not bool), "
            f"the sizes multiplying to the world size {world_size}"
        )
    return tuple(sizes)


def _checked_names(names: object, shape: tuple[int, ...]) -> tuple[str, ...]:
    """`names` as a tuple of distinct non-empty strs, one a dimension; one str is not split."""
    if names is None:
        return ("dp",) if len(shape) == 1 else tuple(f"dim{i}" for i in range(len(shape)))
    given = () if isinstance(names, (str, bytes)) or not isinstance(names, Iterable) else tuple(names)
    if (
        not all(isinstance(n, str) and n for n in given)
        or len(given) != len(shape)
        or len(set(given)) != len(given)
    ):
        raise ConfigurationError(
            f"mesh names {names!r}: need a sequence of {len(shape)} distinct non-empty names (str), "
            f"one for each dimension of shape {shape}"
        )
    return given


_KEEPS_RANK_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters
"""Whether this torch's new_group can keep a group's ranks in the order given (`sort_ranks`)."""


def _ascending(layout: torch.Tensor) -> bool:
    """Whether every group along every dimension of `layout` lists its ranks in ascending order."""
    return all(bool((layout.diff(dim=d) > 0).all()) for d in range(layout.dim()))


def _dimension_groups(
    layout: torch.Tensor, names: tuple[str, ...], timeout: timedelta | None
) -> list[dist.ProcessGroup]:
    """This rank's process group along each dimension of `layout`, its ranks in layout order.

    torch's DeviceMesh sorts a group's ranks and reuses the world group for a dimension over
    every rank, so where the layout lists ranks out of ascending order a rank's mesh coordinate
    (which DTensor and DCP take shard offsets from) differed from its rank in the group (which
    the collectives and FSDP2's sharding use): checkpoints held permuted shards. Its groups also
    had torch's default timeout (gloo: 30 min), not the job's. Every rank makes every group, in
    the same order; a group over every rank in rank order is the world group itself.
    """
    me, world = dist.get_rank(), list(range(dist.get_world_size()))
    mine: list[dist.ProcessGroup] = []
    for dim, name in enumerate(names):
        for row in layout.movedim(dim, -1).reshape(-1, layout.size(dim)).tolist():
            try:
                group = world_group() if row == world else _new_group(row, timeout)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                raise CollectiveError(
                    f"mesh dimension {name!r}: making its process group over ranks {row} failed: {exc}"
                ) from exc
            if me in row:
                mine.append(group)
    return mine


def _new_group(ranks: list[int], timeout: timedelta | None) -> dist.ProcessGroup:
    """A group over `ranks` whose group rank i is `ranks[i]`; ranks in order need no sort_ranks,
    which a torch without it never gets asked for (`_KEEPS_RANK_ORDER`)."""
    group: dist.ProcessGroup
    if ranks == sorted(ranks):
        group = dist.new_group(ranks, timeout=timeout)
    else:
        group = dist.new_group(ranks, timeout=timeout, sort_ranks=False)
    return group
