"""Islands: hierarchical all-reduce over single-vendor islands, layered on a Communicator's collectives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from torchhal.hal_core import telemetry
from torchhal.hal_core.collective_checks import _check_op, _not_differentiable

if TYPE_CHECKING:
    from torchhal.hal_core.collectives import Communicator

log = telemetry.get_logger("torchhal.collectives")


@dataclass(frozen=True)
class Island:
    """Ranks (global numbering) whose devices share one vendor and backend; the first one leads."""

    vendor: str
    backend: str
    ranks: tuple[int, ...]

    @property
    def leader(self) -> int:
        return self.ranks[0]


class Islands:
    """This rank's view of a job split into single-vendor islands joined by a host bridge.

    When the islands are of equal size the bridge is sharded: the rank at position j of every
    island joins host lane j, so each rank carries 1/size of the tensor across islands and the
    lanes run side by side. Islands of unequal sizes have no common sharding, so only their
    leaders are bridged (`form` says which; the leader form is logged and counted when used).
    A single island is all-reduced on its own backend.
    """

    def __init__(
        self,
        parent: Communicator,
        mine: Island,
        layout: tuple[Island, ...],
        island: Communicator,
        lane: Communicator | None,
        form: str,
    ) -> None:
        self.parent = parent
        self.mine = mine  # this rank's island
        self.layout = layout  # every island, ordered by its first rank
        self.island = island  # collectives inside this rank's island, on its own backend
        self.lane = lane  # gloo across islands on host tensors: this rank's position's lane, or leaders only
        self.form = form  # "sharded", "leaders" or "single"

    def destroy(self) -> None:
        """Destroy this rank's island and lane groups. They are the parent's children, kept until
        it is destroyed, and every `Communicator.islands` call makes new ones: a job re-forming
        its islands (each `HeteroGroup.create`) held one more set of sockets (on NCCL, of
        communicators and their buffers) each time. Local; every rank calls it after its last
        collective on them. Collectives afterwards raise, as on any destroyed communicator."""
        for comm in (self.island, self.lane):
            if comm is not None and comm in self.parent._children:
                self.parent._children.remove(comm)
                comm.destroy()
        log.info("islands destroyed", islands=[list(i.ranks) for i in self.layout], form=self.form)

    @property
    def is_leader(self) -> bool:
        return self.mine.leader == dist.get_rank()

    @_not_differentiable
    def hierarchical_all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """All-reduce in place across islands; equals `parent.all_reduce(tensor, op)` up to the
        order of floating-point operations.

        Sharded form: reduce-scatter inside the island, all-reduce each shard across islands on
        its host lane, all-gather inside the island. Leader form: reduce to the island leader,
        all-reduce the leaders over gloo, broadcast back. Host copies for the bridge are explicit.
        """
        parent = self.parent
        parent._check_tensor("hierarchical_all_reduce", tensor, in_place=True)
        _check_op("hierarchical_all_reduce", op, tensor)
        step = "sum" if op == "avg" else op
        with parent._span("hierarchical_all_reduce", tensor, op=op, islands=len(self.layout), form=self.form):
            if self.form == "single":
                self.island.all_reduce(tensor, step)
            elif self.form == "sharded":
                self._sharded(tensor, step)
            else:
                telemetry.count("torchhal.collective.hierarchical_leaders", islands=str(len(self.layout)))
                log.debug(
                    "hierarchical all-reduce through island leaders",
                    reason="islands of unequal sizes have no common sharding",
                    sizes=[len(i.ranks) for i in self.layout],
                )
                self.island.reduce(tensor, dst=0, op=step)
                if self.lane is not None:
                    self._bridge(tensor, step)
                self.island.broadcast(tensor, src=0)
            if op == "avg":
                tensor.div_(parent.world_size)
        return tensor

    def _sharded(self, tensor: torch.Tensor, op: str) -> None:
        flat = tensor.view(-1)
        size = self.island.world_size
        shard_len = -(-flat.numel() // size)
        padding = shard_len * size - flat.numel()
        # reduce_scatter takes equal shards: a padded tail is reduced and gathered but never
        # copied back, so its values do not matter
        padded = torch.cat([flat, flat.new_zeros(padding)]) if padding else flat
        shard = self.island.reduce_scatter(padded, op)
        self._bridge(shard, op)
        flat.copy_(self.island.all_gather(shard)[: flat.numel()])

    def _bridge(self, tensor: torch.Tensor, op: str) -> None:
        """All-reduce `tensor` on this rank's host lane, staged through host memory where needed."""
        assert self.lane is not None
        on_host = tensor.device.type == "cpu"
        staged = tensor if on_host else tensor.to("cpu")
        if not on_host:
            log.debug(
                "bridge host copy", bytes=tensor.numel() * tensor.element_size(), device=str(tensor.device)
            )
        self.lane.all_reduce(staged, op)
        if not on_host:
            tensor.copy_(staged)
