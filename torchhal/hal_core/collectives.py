"""Communicator: collectives over torch.distributed process groups, backend chosen from capabilities.

Thin on purpose, as torchtitan builds it: every byte moves through torch.distributed's own
process groups and collectives. torchhal adds what the HAL knows: the backend string from the
devices' adapters (`cuda:nccl,cpu:gloo`, `xpu:xccl,cpu:gloo`, `gloo` for host tensors), input
checks that name the collective, a span per collective, timeouts surfaced as `CollectiveError`,
and, for mixed-vendor jobs, single-vendor islands joined by a host (gloo) bridge.

Where a backend refuses a fused form (`all_gather_single`, `reduce_scatter_single`,
`all_to_all_single`, `ReduceOp.AVG`, as gloo did in older torch releases), the collective is composed from
simpler ones (all_gather + cat, all_reduce + slice, paired isend/irecv, sum + divide). The
choice is logged at debug level and counted as `torchhal.collective.composed`. A refusal is
raised when the collective is issued, before any byte moves, and is the same on every rank of a
job that runs one torch build, so all ranks take the same path.
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from datetime import timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from torchhal.hal_core import telemetry
from torchhal.hal_core.capabilities import DeviceCapabilities, DType
from torchhal.hal_core.collective_checks import _REDUCE_OPS, _check_op, _not_differentiable, as_integer
from torchhal.hal_core.device import Device
from torchhal.hal_core.errors import (
    CollectiveError,
    ConfigurationError,
    InvalidArgumentError,
    UnsupportedError,
)
from torchhal.hal_core.islands import Island, Islands
from torchhal.hal_core.process_groups import (
    _check_group_serves,
    _check_wrap_arguments,
    _group_timeout,
    _init_default_group,
    _resolve_device,
    _served_by,
    check_create_arguments,
    world_group,
)

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from torchhal.hal_core.hal import HardwareAbstractionLayer

_T = TypeVar("_T")
log = telemetry.get_logger("torchhal.collectives")
_is_compiling = torch.compiler.is_compiling
_NO_SPAN = contextlib.nullcontext()

DEFAULT_TIMEOUT = timedelta(seconds=300)
"""torchtitan's default for process-group creation and collectives; torch's own is 10-30 minutes."""

HOST_BACKEND = "gloo"
"""The backend for host tensors: the one torch backend that every build ships."""

_LIVE: weakref.WeakSet[Communicator] = weakref.WeakSet()
"""Communicators not yet destroyed, so that destroying a group can destroy those that wrap it."""


def backend_for(devices: Iterable[Device | DeviceCapabilities]) -> str:
    """The torch.distributed backend string for a process whose tensors live on `devices`.

    Host devices (the CPU, simulated devices whose tensors are host tensors) use gloo, so a
    host-only process gets `"gloo"`. Each accelerator device type gets its adapter's backend
    (for a `Device`) or the first collective backend its capabilities declare (torch's names:
    ROCm's RCCL is `nccl`), with gloo for host tensors beside it: `"cuda:nccl,cpu:gloo"`. One
    device type can have one backend only.
    """
    chosen: dict[str, tuple[str, str]] = {}  # device type -> (backend, who asked for it)
    for item in devices:
        caps = item.capabilities if isinstance(item, Device) else item
        if caps.device_type == "cpu" or caps.simulated:
            continue
        backend = _declared_backend(item)
        who = f"{caps.adapter}:{caps.index} ({caps.name})"
        earlier = chosen.setdefault(caps.device_type, (backend, who))
        if earlier[0] != backend:
            raise ConfigurationError(
                f"backend for {caps.device_type} tensors: {earlier[1]} needs {earlier[0]!r} but {who} "
                f"needs {backend!r}; one process group has one backend per device type "
                "(put such devices in separate processes and join them with islands())"
            )
    if not chosen:
        return HOST_BACKEND
    return ",".join(
        [f"{device_type}:{backend}" for device_type, (backend, _) in chosen.items()] + [f"cpu:{HOST_BACKEND}"]
    )


def _declared_backend(item: Device | DeviceCapabilities) -> str:
    if isinstance(item, Device):
        return item.adapter.collective_backend()
    if not item.collective_backends:
        raise ConfigurationError(
            f"device {item.adapter}:{item.index} ({item.name}) declares no collective backend "
            "(capabilities.collective_backends is empty)"
        )
    return item.collective_backends[0]


@functools.cache
def _say_gathered_on_device(backend: str) -> None:
    """Once per backend: a group of a device backend alone has no host side for host_all_gather."""
    telemetry.count("torchhal.collective.host_gather_on_device", backend=backend)
    log.warning(
        "host_all_gather runs on the device, waiting for its queue: the group has no host backend "
        "(give it one, e.g. 'cuda:nccl,cpu:gloo', as torchhal.distributed.init does)",
        backend=backend,
    )


class Communicator:
    """Collectives over one torch.distributed process group, on one HAL device.

    Make one with `Communicator.create(hal, ...)` (or `hal.communicator(...)`). Ranks passed to
    methods (`src`, `dst`, `new_group(ranks)`) are ranks of this communicator's group.

    Collectives are not differentiable, as torch.distributed's own c10d calls are not: they run
    under torch.no_grad(), so a tensor that requires grad (a parameter, a leaf) is reduced,
    broadcast or received into in place like any other, and tensors they return do not require
    grad. This is how DeepSpeed and FSDP use them (on gradients and `.data`); differentiable
    collectives are torch.distributed.nn's.

    Every rank must pass tensors of the same shape and dtype (all_gather: the same shape past
    dim 0 and the same dim 0). Each rank checks only its own tensor: comparing them across ranks
    would cost a round trip every call, so a mismatch gives what the backend gives, as with raw
    torch.distributed (gloo: wrong values, or the process aborts). Set
    TORCH_DISTRIBUTED_DEBUG=DETAIL while debugging: torch then checks every collective's shapes
    across ranks and names the mismatch.
    """

    def __init__(
        self,
        hal: HardwareAbstractionLayer,
        group: dist.ProcessGroup,
        device: Device,
        *,
        backend: str,
        timeout: timedelta | None,
        owns_default_group: bool,
        owns_group: bool,
        fused: bool,
    ) -> None:
        """Use `create()`; this wraps a group the caller already made."""
        self.hal = hal
        self.group = group
        self.device = device
        self.backend = backend
        self.timeout = timeout
        self.fused = fused
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._owns_default_group = owns_default_group
        self._owns_group = owns_group
        self._children: list[Communicator] = []
        self._refused: dict[str, str] = {}  # fused collectives the backend refused, with its reason
        self._native: set[str] = set()  # fused collectives the backend accepted once
        self._accepted: set[tuple[torch.device, torch.dtype]] = set()  # passed the device checks
        self._destroyed = False
        # a simulated device's clock is charged for each collective (a real one spends real time)
        self._charge = device.adapter.charge_collective if device.simulated else None
        _LIVE.add(self)

    @classmethod
    def create(
        cls,
        hal: HardwareAbstractionLayer,
        *,
        device: Device | str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        init_method: str | None = None,
        store: Store | None = None,
        timeout: timedelta | None = None,
        group: dist.ProcessGroup | None = None,
        fused: bool = True,
    ) -> Communicator:
        """A communicator for this process, initialising the default process group if needed.

        Without a default group, one is created with `backend_for([device])` from the
        arguments, or from torchrun's RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT when neither
        `init_method` nor `store` is given; `init_method="file://..."` and a `store` work too.
        With one (or with `group`), that group is wrapped after checking that its backend
        serves the device. `device` defaults to `hal.best_device()` (the device of index
        LOCAL_RANK among that adapter's devices when LOCAL_RANK is set, by `local_device`, the
        rule `torchhal.distributed.init` follows too). `fused=False`
        composes all_gather, reduce_scatter, all_to_all and avg from simpler collectives.
        `timeout` is that of a group made here (default 300 s): a group that exists keeps the one
        it was made with, and a different one given for it is logged and counted.
        """
        rank, world_size = check_create_arguments(rank, world_size, timeout)
        dev = _resolve_device(hal, device)
        backend = backend_for([dev])
        if group is None and not dist.is_initialized():
            made_with = DEFAULT_TIMEOUT if timeout is None else timeout
            _init_default_group(dev, backend, rank, world_size, init_method, store, made_with)
            return cls(
                hal,
                world_group(),
                dev,
                backend=backend,
                timeout=made_with,
                owns_default_group=True,
                owns_group=False,
                fused=fused,
            )
        if not dist.is_initialized():
            raise ConfigurationError("group: given, but torch.distributed has no default process group")
        _check_wrap_arguments(rank, world_size, init_method, store, group)
        pg = group if group is not None else world_group()
        if dist.get_rank(pg) < 0:
            raise ConfigurationError(
                f"group: rank {dist.get_rank()} of the default group is not a member of the group given; "
                "create a communicator over it on its members only"
            )
        _check_group_serves(pg, dev, backend)
        own = _group_timeout(pg, dev)
        if timeout is not None and timeout != own:  # fixed when the group was made
            log.warning(
                "timeout given for a process group that exists: it keeps the one it was made with",
                given_s=timeout.total_seconds(),
                group_s=None if own is None else own.total_seconds(),
            )
            telemetry.count("torchhal.collective.timeout_not_applied")
        comm = cls(
            hal,
            pg,
            dev,
            backend=backend,
            timeout=own,
            owns_default_group=False,
            owns_group=False,
            fused=fused,
        )
        log.info(
            "wrapped an existing process group", rank=comm.rank, world_size=comm.world_size, backend=backend
        )
        return comm

    # -- collectives -------------------------------------------------------------------------

    @_not_differentiable
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across ranks in place; returns it."""
        self._check_tensor("all_reduce", tensor, in_place=True)
        _check_op("all_reduce", op, tensor)
        if not telemetry.tracing():  # the span's set-up is ~1 µs, a twentieth of a 1 MiB all-reduce
            self._all_reduce(tensor, op)
        else:
            with self._span("all_reduce", tensor, op=op):
                self._all_reduce(tensor, op)
        self._charged("all_reduce", tensor)
        return tensor

    @_not_differentiable
    def reduce(self, tensor: torch.Tensor, dst: int, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` into rank `dst`'s copy (in place there; others' copies are unspecified)."""
        self._check_tensor("reduce", tensor, in_place=True)
        _check_op("reduce", op, tensor)
        dst = self._check_rank("reduce", "dst", dst)
        with self._span("reduce", tensor, op=op):
            root = self._global(dst)
            work = self._issue(
                "reduce",
                lambda: dist.reduce(tensor, root, _REDUCE_OPS[op], group=self.group, async_op=True),
                composable="reduce:avg" if op == "avg" else None,
            )
            if work is not None:
                self._wait("reduce", work)
            else:
                self._run(
                    "reduce",
                    lambda: dist.reduce(tensor, root, dist.ReduceOp.SUM, group=self.group, async_op=True),
                )
                if self.rank == dst:
                    tensor.div_(self.world_size)
        self._charged("reduce", tensor)
        return tensor

    @_not_differentiable
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated along dim 0 in rank order."""
        self._check_tensor("all_gather", tensor)
        _require_dim0("all_gather", tensor)
        src = tensor.contiguous()
        out = src.new_empty((self.world_size * src.shape[0], *src.shape[1:]))
        with self._span("all_gather", src):
            fused_op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = self._issue(
                "all_gather",
                lambda: fused_op(out, src, group=self.group, async_op=True),
                composable="all_gather",
            )
            if work is not None:
                self._wait("all_gather", work)
            else:
                parts = list(out.chunk(self.world_size))
                self._run("all_gather", lambda: dist.all_gather(parts, src, group=self.group, async_op=True))
        self._charged("all_gather", src)
        return out

    @functools.cached_property
    def _host_side(self) -> bool:
        """Whether the group's backend serves CPU tensors (gloo beside nccl, say): read once, since
        a training step asks before each micro-batch."""
        return _served_by(dist.get_backend_config(self.group), "cpu") is not None

    def host_all_gather(self, value: float) -> list[float]:
        """Every rank's `value`, in rank order, over the group's host backend (gloo): for what the
        ranks agree on about host state (has each a batch?), so that the host waits for the other
        ranks and never for its device's queue, which a device tensor read back drains (a
        training step agrees before each micro-batch). A group without a host backend gathers
        on its device in fp32 (exact for flags and counts below 2**24), warned once and counted:
        each call then waits for the device's queue."""
        self._check_live("host_all_gather")
        if not self._host_side:
            _say_gathered_on_device(self.backend)
            # fp32, which devices declare far more often than fp64: exact for flags and counts
            on_device = torch.full((1,), float(value), dtype=torch.float32, device=self.device.torch_device)
            return [float(v) for v in self.all_gather(on_device).tolist()]
        src = torch.full((1,), float(value), dtype=torch.float64)
        parts = [torch.empty_like(src) for _ in range(self.world_size)]
        with self._span("host_all_gather", src):
            self._run("host_all_gather", lambda: dist.all_gather(parts, src, group=self.group, async_op=True))
        return [part.item() for part in parts]

    @_not_differentiable
    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce `tensor` across ranks and return this rank's equal dim-0 slice of the result."""
        self._check_tensor("reduce_scatter", tensor)
        _check_op("reduce_scatter", op, tensor)
        self._require_divisible("reduce_scatter", tensor)
        src = tensor.contiguous()
        out = src.new_empty((src.shape[0] // self.world_size, *src.shape[1:]))
        with self._span("reduce_scatter", src, op=op):
            fused_op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
            work = self._issue(
                "reduce_scatter",
                lambda: fused_op(out, src, op=_REDUCE_OPS[op], group=self.group, async_op=True),
                composable="reduce_scatter",
            )
            if work is not None:
                self._wait("reduce_scatter", work)
            else:
                # Composed: the full reduction on every rank, then this rank's slice (2x the traffic).
                full = src.clone()
                self._all_reduce(full, op)
                out.copy_(full.narrow(0, self.rank * out.shape[0], out.shape[0]))
        self._charged("reduce_scatter", src)
        return out

    @_not_differentiable
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite `tensor` on every rank with rank `src`'s; returns it."""
        self._check_tensor("broadcast", tensor, in_place=True)
        src = self._check_rank("broadcast", "src", src)
        with self._span("broadcast", tensor, src=src):
            self._run(
                "broadcast",
                lambda: dist.broadcast(tensor, self._global(src), group=self.group, async_op=True),
            )
        self._charged("broadcast", tensor)
        return tensor

    @_not_differentiable
    def all_to_all(self, tensor: torch.Tensor) -> torch.Tensor:
        """Send dim-0 chunk j of `tensor` to rank j; returns the chunks received, in rank order."""
        self._check_tensor("all_to_all", tensor)
        self._require_divisible("all_to_all", tensor)
        src = tensor.contiguous()
        out = torch.empty_like(src)
        with self._span("all_to_all", src):
            work = self._issue(
                "all_to_all",
                lambda: dist.all_to_all_single(out, src, group=self.group, async_op=True),
                composable="all_to_all",
            )
            if work is not None:
                self._wait("all_to_all", work)
            else:
                # Composed: one isend/irecv pair per peer, issued together so no pair waits on another.
                sends, recvs = src.chunk(self.world_size), out.chunk(self.world_size)
                recvs[self.rank].copy_(sends[self.rank])
                ops = [
                    dist.P2POp(fn, buf[peer], self._global(peer), self.group)
                    for peer in range(self.world_size)
                    if peer != self.rank
                    for fn, buf in ((dist.isend, sends), (dist.irecv, recvs))
                ]
                for pending in self._issued("all_to_all", lambda: dist.batch_isend_irecv(ops)) if ops else []:
                    self._wait("all_to_all", pending)
        self._charged("all_to_all", src)
        return out

    @_not_differentiable
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send `tensor` to rank `dst`; returns once it has been handed to the backend and sent."""
        self._check_tensor("send", tensor)
        dst = self._check_rank("send", "dst", dst, peer=True)
        with self._span("send", tensor, dst=dst):
            self._run("send", lambda: dist.isend(tensor.contiguous(), self._global(dst), group=self.group))
        self._charged("send", tensor)

    @_not_differentiable
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into `tensor` from rank `src`; returns it."""
        self._check_tensor("recv", tensor, in_place=True)
        src = self._check_rank("recv", "src", src, peer=True)
        with self._span("recv", tensor, src=src):
            self._run("recv", lambda: dist.irecv(tensor, self._global(src), group=self.group))
        self._charged("recv", tensor)
        return tensor

    def barrier(self) -> None:
        """Return once every rank of the group has entered the barrier."""
        self._check_live("barrier")
        with telemetry.span(
            "torchhal.collective.barrier", backend=self.backend, bytes=0, world_size=self.world_size
        ):
            self._run("barrier", lambda: dist.barrier(group=self.group, async_op=True))
        self._charged("barrier", None)

    # -- groups ------------------------------------------------------------------------------

    def new_group(self, ranks: Iterable[int]) -> Communicator | None:
        """A communicator over `ranks` (ranks of this group), or None on ranks outside it.

        Collective: every rank of this communicator calls it, with the same ranks, in the same
        order as its other group creations (torch.distributed's rule for new_group). Only a
        communicator over every rank of the job makes groups (see `_require_every_rank`).
        """
        self._check_live("new_group")
        self._require_every_rank("new_group")
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Iterable):
            raise InvalidArgumentError(
                f"new_group: ranks must be an iterable of integer ranks, got {type(ranks).__name__} {ranks!r}"
            )
        given = [self._check_rank("new_group", "every entry of ranks", r) for r in ranks]
        members = sorted(set(given))
        if not members or len(members) != len(given):
            raise InvalidArgumentError(f"new_group: ranks must be distinct and non-empty, got {given}")
        return self._subgroup("new_group", [self._global(r) for r in members], self.backend, self.device)

    def islands(self, *, vendor: str | None = None) -> Islands:
        """Group the ranks by (vendor, backend) into islands joined by gloo host lanes (see `Islands`).

        Collective over this communicator. `vendor` overrides this rank's device vendor (to
        split a host-only job into islands in tests, or to keep two runtimes of one vendor apart).
        """
        self._check_live("islands")
        self._require_every_rank("islands")
        mine = (vendor or self.device.capabilities.vendor, self.backend)
        with telemetry.span("torchhal.collective.islands", backend=self.backend, world_size=self.world_size):
            everyone = self._exchange("islands", mine)
            layout: dict[tuple[str, str], list[int]] = {}
            for r, key in enumerate(everyone):
                layout.setdefault(key, []).append(self._global(r))
            islands = tuple(Island(v, b, tuple(rs)) for (v, b), rs in layout.items())
            own: Communicator | None = None
            for island in islands:  # every rank creates every group, in the same order
                sub = self._subgroup("islands", list(island.ranks), island.backend, self.device)
                own = sub if sub is not None else own
            host = self.hal.device("cpu")
            sizes = {len(i.ranks) for i in islands}
            # One island needs no bridge; equal islands get one host lane per island position
            # (lane 0 joins the leaders); unequal ones only the leaders' bridge.
            form = "single" if len(islands) == 1 else "sharded" if len(sizes) == 1 else "leaders"
            lanes = {"single": range(0), "sharded": range(sizes.pop()), "leaders": range(1)}[form]
            lane: Communicator | None = None
            for position in lanes:
                sub = self._subgroup("islands", [i.ranks[position] for i in islands], HOST_BACKEND, host)
                lane = sub if sub is not None else lane
        assert own is not None, "every rank belongs to its own island"
        me = dist.get_rank()
        result = Islands(self, next(i for i in islands if me in i.ranks), islands, own, lane, form)
        log.info(
            "islands formed",
            islands=[list(i.ranks) for i in islands],
            leaders=[i.leader for i in islands],
            form=result.form,
        )
        return result

    def _subgroup(
        self, name: str, global_ranks: list[int], backend: str, device: Device
    ) -> Communicator | None:
        """Create a group over `global_ranks` for the operation `name` (named in its errors)."""
        try:
            pg = dist.new_group(global_ranks, timeout=self.timeout, backend=backend)
        except (RuntimeError, ValueError) as exc:  # the store barrier timed out, or the backend failed
            raise self._failure(name, exc) from exc
        if dist.get_rank() not in global_ranks:
            return None
        sub = Communicator(
            self.hal,
            pg,
            device,
            backend=backend_for([device]),
            timeout=self.timeout,
            owns_default_group=False,
            owns_group=True,
            fused=self.fused,
        )
        self._children.append(sub)
        return sub

    def _require_every_rank(self, name: str) -> None:
        """Refuse to make groups from a communicator over only some ranks of the job.

        Every rank of the job must call dist.new_group, or torch must be told
        use_local_synchronization=True; it then names the group from its ranks and the number
        of groups the calling process holds, so members whose histories differ (one made or
        destroyed a group the other is not in) wait on different store keys until the timeout
        (torch 2.13's _process_group_name). Public torch offers no way to choose the name.
        """
        world = dist.get_world_size()
        if self.world_size != world:
            ranks = dist.get_process_group_ranks(self.group)
            raise UnsupportedError(
                f"{name}: this communicator spans ranks {ranks} of {world}, and groups are made "
                "only from a communicator over every rank: torch names a group made by some "
                "ranks alone from a per-process count of groups, so members with different "
                "histories never meet and wait until the timeout. Call it on a communicator over "
                "all ranks, with these global ranks, on every rank (ranks outside get None)"
            )

    def _exchange(self, name: str, value: tuple[str, str]) -> list[tuple[str, str]]:
        """Every rank's `value`, over host tensors (a gloo group when this group has no cpu backend)."""
        if self._host_side:
            gathered: list[Any] = [None] * self.world_size
            try:
                dist.all_gather_object(gathered, value, group=self.group)
            except RuntimeError as exc:
                raise self._failure(name, exc) from exc
            return [tuple(v) for v in gathered]
        host = self._subgroup(
            name, [self._global(r) for r in range(self.world_size)], HOST_BACKEND, self.hal.device("cpu")
        )
        assert host is not None, "every rank is a member of a group of all ranks"
        try:
            return host._exchange(name, value)
        finally:
            self._children.remove(host)
            host.destroy()

    # -- lifetime ----------------------------------------------------------------------------

    def destroy(self) -> None:
        """Destroy the groups this communicator made (the default group too, if it initialised it).

        Other communicators on a group destroyed here (wrappers made by `create`) are destroyed
        with it, so their calls fail as calls on a destroyed communicator do instead of reaching a
        dead group; destroying the default group destroys every group, so it takes them all."""
        if self._destroyed:
            return
        self._destroyed = True
        _LIVE.discard(self)
        for child in reversed(self._children):
            child.destroy()
        self._children.clear()
        # the default group it made, not one made after that one was destroyed behind its back
        takes_all = self._owns_default_group and dist.is_initialized() and world_group() is self.group
        if takes_all:  # destroy_process_group() destroys every group, and so every communicator
            for other in _LIVE:
                other._destroyed = True
            _LIVE.clear()
        elif self._owns_group:
            for other in [c for c in _LIVE if c.group is self.group]:
                other.destroy()
        if self._owns_group:
            dist.destroy_process_group(self.group)
        if takes_all:
            dist.destroy_process_group()
            log.info("default process group destroyed", backend=self.backend)

    def __enter__(self) -> Communicator:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, world_size={self.world_size}, backend={self.backend!r}, "
            f"device={self.device.id!r})"
        )

    # -- helpers -----------------------------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> None:
        if _COALESCING is not None and self.group in _COALESCING:
            self._record_coalesced(tensor, op, _COALESCING[self.group])
            return
        if op != "avg" or "all_reduce:avg" in self._native:
            # Issued blocking, as raw torch.distributed is: an async handle and its wait() cost
            # ~8 µs more a call, which a 1 MiB all-reduce on NVLink (~24 µs) cannot hide.
            if self.rank < 0:
                raise _not_a_member("all_reduce")
            try:
                _all_reduce_now(self.group, tensor, op)
            except (RuntimeError, ValueError) as exc:
                raise self._failure("all_reduce", exc) from exc
            return
        work = self._issue(
            "all_reduce",
            lambda: dist.all_reduce(tensor, _REDUCE_OPS[op], group=self.group, async_op=True),
            composable="all_reduce:avg",
        )
        if work is not None:
            self._wait("all_reduce", work)
            self._native.add("all_reduce:avg")  # accepted at issue time: later calls go blocking
            return
        self._run(
            "all_reduce", lambda: dist.all_reduce(tensor, dist.ReduceOp.SUM, group=self.group, async_op=True)
        )
        tensor.div_(self.world_size)

    def _record_coalesced(self, tensor: torch.Tensor, op: str, recorded: list[Any]) -> None:
        """Inside dist._coalescing_manager: recorded, issued with the block's others when it ends.
        `recorded`: the block's collectives so far. torch reduces every tensor of a block with the
        first one's op (a sum after an avg came back averaged), so a second op is refused. avg is
        recorded as the backend's own AVG: the composed form divides after a reduction that has
        not happened yet."""
        first = next((collective.redop for collective in recorded), None)
        if first is not None and first != _REDUCE_OPS[op]:
            raise InvalidArgumentError(
                f"all_reduce: op {op!r} inside a coalescing block that reduces with {first}: torch "
                "reduces every tensor of a block with its first op; use one block per op"
            )
        if op == "avg" and (not self.fused or "all_reduce:avg" in self._refused):
            raise InvalidArgumentError(
                f"all_reduce: avg inside a coalescing block needs backend {self.backend!r}'s own AVG, "
                f"which this communicator composes ({self._refused.get('all_reduce:avg', 'fused=False')})"
            )
        self._issued("all_reduce", lambda: dist.all_reduce(tensor, _REDUCE_OPS[op], group=self.group))

    def _issue(
        self, name: str, issue: Callable[[], dist.Work | None], *, composable: str | None
    ) -> dist.Work | None:
        """Issue a collective. With `composable` (the key of a fused form that has a composed
        equivalent), None means: compose it instead (fused=False, or the backend refused it)."""
        if name in _RECORDED_IN_BLOCKS and _COALESCING is not None and self.group in _COALESCING:
            # recorded there, its async handle an _IllegalWork whose wait() raises, which left
            # the group recording: later all-reduces outside any block silently did nothing (and
            # the composed reduce_scatter would slice a reduction that has not happened yet)
            raise InvalidArgumentError(
                f"{name}: inside dist._coalescing_manager this communicator coalesces all_reduce only"
            )
        if composable is None:
            return self._issued(name, issue)
        reason = self._refused.get(composable) if self.fused else "fused=False"
        if reason is None:
            try:
                return issue()
            except (RuntimeError, ValueError, NotImplementedError) as exc:  # at issue time, no byte moved
                if not _refusal(exc):  # a mismatch or a dead peer: not a backend without the fused form
                    raise self._failure(name, exc) from exc
                reason = self._refused[composable] = f"backend {self.backend!r} refused it: {exc}"
        telemetry.count("torchhal.collective.composed", collective=composable, backend=self.backend)
        log.debug(
            "collective composed from simpler ones",
            collective=composable,
            backend=self.backend,
            reason=reason,
        )
        return None

    def _issued(self, name: str, issue: Callable[[], _T]) -> _T:
        """`issue()`, its failure (a dead peer, a mismatch torch detected) a CollectiveError."""
        try:
            return issue()
        except (RuntimeError, ValueError) as exc:
            raise self._failure(name, exc) from exc

    def _run(self, name: str, issue: Callable[[], dist.Work | None]) -> None:
        """Issue a collective and wait for it, every failure a CollectiveError naming it."""
        self._wait(name, self._issued(name, issue))

    def _wait(self, name: str, work: dist.Work | None) -> None:
        if work is None:
            raise _not_a_member(name)
        try:
            work.wait()
        except (RuntimeError, ValueError) as exc:
            raise self._failure(name, exc) from exc

    def _failure(self, name: str, exc: Exception) -> CollectiveError:
        limit = f"{self.timeout.total_seconds():g} s" if self.timeout is not None else "unknown"
        message = str(exc).lower()
        what = "timed out" if "timed out" in message or "timeout" in message else "failed"  # gloo, store
        return CollectiveError(
            f"{name} {what} on rank {self.rank} of {self.world_size} (backend {self.backend!r}, "
            f"process-group timeout {limit}): {exc}"
        )

    def _span(self, name: str, tensor: torch.Tensor, **attributes: Any) -> AbstractContextManager[object]:
        if not telemetry.tracing():
            return _NO_SPAN  # attributes cost ~1 µs: a small all-reduce feels it
        return telemetry.span(
            f"torchhal.collective.{name}",
            backend=self.backend,
            bytes=tensor.numel() * tensor.element_size(),
            world_size=self.world_size,
            dtype=str(tensor.dtype).removeprefix("torch."),
            **attributes,
        )

    def _charged(self, name: str, tensor: torch.Tensor | None) -> None:
        """A simulated device's adapter charges the finished collective (`tensor`: this rank's
        buffer, None for a barrier); a real device's is not called."""
        if self._charge is not None:
            nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
            self._charge(self.device.index, name, nbytes, self.world_size)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank)

    def _check_live(self, name: str) -> None:
        if self._destroyed:
            raise CollectiveError(f"{name}: this communicator was destroyed")

    def _check_tensor(self, name: str, tensor: object, *, in_place: bool = False) -> None:
        if self._destroyed:
            self._check_live(name)
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        if (tensor.device, tensor.dtype) not in self._accepted:  # one lookup per call once seen
            self._accept(name, tensor)
        if in_place and not tensor.is_contiguous():
            raise InvalidArgumentError(
                f"{name}: writes the tensor in place, so it must be contiguous; got shape "
                f"{tuple(tensor.shape)} with strides {tensor.stride()}"
            )

    def _accept(self, name: str, tensor: torch.Tensor) -> None:
        """Check the tensor's device and dtype against this communicator's device, once per pair."""
        want = self.device.torch_device
        where = tensor.device
        if where != want and not (where.type == want.type and want.index is None):
            raise InvalidArgumentError(
                f"{name}: tensor is on {where}, but this communicator's device is "
                f"{self.device.id} ({want}); copy it there explicitly"
            )
        if DType.from_torch(tensor.dtype) is not None:  # untracked formats go to the backend
            self.device.require_dtype(tensor.dtype, what=name)
        self._accepted.add((where, tensor.dtype))

    def _require_divisible(self, name: str, tensor: torch.Tensor) -> None:
        _require_dim0(name, tensor)
        if tensor.shape[0] % self.world_size:
            raise InvalidArgumentError(
                f"{name}: dim 0 must be divisible by the world size {self.world_size}; "
                f"got shape {tuple(tensor.shape)}"
            )

    def _check_rank(self, name: str, what: str, rank: object, *, peer: bool = False) -> int:
        """`rank` as an int of this group (see `as_integer` for the types taken)."""
        value = as_integer(rank)
        if value is None:
            raise InvalidArgumentError(
                f"{name}: {what} must be an integer rank, got {type(rank).__name__} {rank!r}"
            )
        if not 0 <= value < self.world_size:
            raise InvalidArgumentError(
                f"{name}: {what} must be a rank in [0, {self.world_size}), got {value}"
            )
        if peer and value == self.rank:
            raise InvalidArgumentError(f"{name}: {what} must be another rank, got this rank ({value})")
        return value


def _sync_all_reduce_options(op: Any) -> dist.AllreduceOptions:  # ReduceOp or its RedOpType
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    if hasattr(opts, "asyncOp"):  # torch >= 2.7: a blocking collective may run on the current stream
        opts.asyncOp = False
    return opts


_SYNC_ALL_REDUCE = {name: _sync_all_reduce_options(op) for name, op in _REDUCE_OPS.items()}
# The groups inside dist._coalescing_manager, whose collectives are recorded rather than issued.
# Read once; a torch without it gets every all-reduce through dist.all_reduce.
_COALESCING: dict[Any, Any] | None = getattr(
    getattr(dist.distributed_c10d, "_world", None), "pg_coalesce_state", None
)


def _all_reduce_now(group: dist.ProcessGroup, tensor: torch.Tensor, op: str) -> None:
    """`dist.all_reduce(tensor, op, group=group)`, issued straight to the process group where its
    Python wrapper has nothing to add: the Communicator already checked the tensor and the
    membership, and the wrapper's own checks and logging decorators cost ~3-5 µs a call, a fifth
    of a 1 MiB NVLink all-reduce. Tensor subclasses (torch function modes), complex tensors,
    Dynamo tracing and a torch without `pg_coalesce_state` keep the wrapper, which handles each
    of them (coalescing blocks never get here: `Communicator._record_coalesced`)."""
    if type(tensor) is not torch.Tensor or _COALESCING is None or tensor.is_complex() or _is_compiling():
        dist.all_reduce(tensor, _REDUCE_OPS[op], group=group)
        return
    work = group.allreduce([tensor], _SYNC_ALL_REDUCE[op])
    if work is not None:  # as dist.all_reduce: a backend that synchronised in C++ returns None
        work.wait()


# The collectives besides all_reduce that dist._coalescing_manager records rather than issues
# (torch 2.13: all_gather_into_tensor/single, reduce_scatter_tensor/single); the others it issues
_RECORDED_IN_BLOCKS = frozenset({"all_gather", "reduce_scatter"})
# What backends say of a fused collective they lack ("Cannot use ReduceOp.AVG with Gloo",
# "... does not support reduce_scatter", "unsupported"): only these switch it to the composed form.
_REFUSAL = re.compile(r"not support|unsupported|cannot use|not implemented", re.IGNORECASE)


def _refusal(exc: BaseException) -> bool:
    return isinstance(exc, NotImplementedError) or _REFUSAL.search(str(exc)) is not None


def _not_a_member(name: str) -> CollectiveError:
    return CollectiveError(f"{name}: rank {dist.get_rank()} is not a member of this communicator's group")


def _require_dim0(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() == 0:
        raise InvalidArgumentError(f"{name}: needs a tensor with at least one dimension, got a 0-d tensor")
