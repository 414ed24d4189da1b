"""`init()`: join a training job on this rank's HAL device, with the backend its capabilities need.

The process group itself is torch.distributed's, made by the HAL's `Communicator`; this module
adds the choice of the local device (LOCAL_RANK among the best adapter's devices) and a store
prefix, so that a job can rebuild its process group under a new generation (`prefix="gen1"`)
over the same rendezvous store after a failure.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from torchhal.hal_core import ConfigurationError, Device, DeviceRequirements, telemetry
from torchhal.hal_core.collectives import DEFAULT_TIMEOUT, Communicator, backend_for
from torchhal.hal_core.process_groups import check_create_arguments, checked_local_rank, env_int
from torchhal.hal_core.process_groups import local_device as local_device  # thd.local_device

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from torchhal.hal_core.hal import HardwareAbstractionLayer

log = telemetry.get_logger("torchhal.distributed")

_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def host_identity() -> str:
    """This machine, as `Mesh` tells hosts apart: its hostname and its kernel's boot id.

    A hostname alone is not enough: containers on different nodes may share one (`docker run
    --hostname trainer`, compose), and the mesh then took the ranks of several nodes for one
    host and interleaved them on its inner dimension. The boot id is the running kernel's, so
    every container of one machine reads the same one and two machines never do. Where it
    cannot be read (not Linux), the hostname alone is used, logged and counted.
    """
    name = socket.gethostname()
    try:
        boot = _BOOT_ID.read_text().strip()
    except OSError as exc:
        boot, why = "", f"{type(exc).__name__}: {exc}"
    else:
        why = "empty"
    if not boot:
        log.info(
            "host told apart by its hostname alone: no kernel boot id", host=name, path=str(_BOOT_ID), why=why
        )
        telemetry.count("torchhal.distributed.host_by_hostname_only")
        return name
    return f"{name}/{boot}"


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the job: who it is, which device it trains on, how it talks."""

    rank: int
    world_size: int
    local_rank: int
    device: Device
    backend: str
    hal: HardwareAbstractionLayer = field(repr=False)
    communicator: Communicator = field(repr=False)
    prefix: str | None = None
    host: str = field(default_factory=host_identity)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def report(self) -> dict[str, Any]:
        """JSON-able facts about this rank, for logs and run reports."""
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "local_rank": self.local_rank,
            "host": self.host,
            "device": self.device.id,
            "device_name": self.device.capabilities.name,
            "simulated": self.device.simulated,
            "backend": self.backend,
            "prefix": self.prefix,
        }

    def shutdown(self) -> None:
        """Destroy the process groups this context made (the default group too, if init made it)."""
        self.communicator.destroy()


def init(
    hal: HardwareAbstractionLayer | None = None,
    *,
    device: Device | str | None = None,
    requirements: DeviceRequirements | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    init_method: str | None = None,
    store: Store | None = None,
    prefix: str | None = None,
    timeout: timedelta | None = None,
) -> DistContext:
    """Initialise (or wrap) the default process group for this rank and return its context.

    Rendezvous comes from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT) unless `init_method` or `store` is given. `device` defaults to the device of
    index LOCAL_RANK among the devices of the adapter `hal.best_device(requirements)` belongs
    to, as `Communicator.create` chooses it (`local_device` says how: the best device where
    LOCAL_RANK is unset, the one device where only one is visible). `prefix` namespaces every
    key the process group writes in the rendezvous store, so a group rebuilt after a failure
    (`prefix="gen2"`) never reads the keys of the one it replaces. `hal` defaults to the
    process's default HAL, the one `torchhal.ops` dispatches through.
    """
    if prefix is not None and dist.is_initialized():
        # checked before the rendezvous: it waited for peers (up to the timeout) that never
        # came, only for Communicator.create to refuse the store it made
        raise ConfigurationError(
            f"prefix {prefix!r}: the default process group already exists (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}); a prefix applies only to a group torchhal makes: call init "
            "without prefix to wrap the existing group, or destroy it first"
        )
    # every argument is checked before the rendezvous, which waits for peers up to the timeout
    rank, world_size = check_create_arguments(rank, world_size, timeout, "init")
    local = checked_local_rank(local_rank if local_rank is not None else env_int("LOCAL_RANK"))
    if hal is None:
        from torchhal.ops import default_hal

        hal = default_hal()
    dev = local_device(hal, local, requirements) if device is None else hal.device(device)
    if prefix is not None:
        rendezvous = DEFAULT_TIMEOUT if timeout is None else timeout
        store, init_method = _prefixed_store(prefix, store, init_method, rank, world_size, rendezvous), None
    with telemetry.span("torchhal.distributed.init", device=dev.id, prefix=prefix):
        comm = Communicator.create(
            hal,
            device=dev,
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            store=store,
            timeout=timeout,
        )
    ctx = DistContext(
        rank=comm.rank,
        world_size=comm.world_size,
        local_rank=0 if local is None else local,
        device=dev,
        backend=backend_for([dev]),
        hal=hal,
        communicator=comm,
        prefix=prefix,
    )
    log.info("distributed initialised", **ctx.report())
    return ctx


def _prefixed_store(
    prefix: str,
    store: Store | None,
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    timeout: timedelta,
) -> Store:
    """`store` (or the store torch's rendezvous makes from `init_method`/env://) under `prefix`."""
    if not prefix or "/" in prefix:
        raise ConfigurationError(f"prefix must be a non-empty name without '/', got {prefix!r}")
    if store is not None and init_method is not None:
        raise ConfigurationError("init_method and store: give one, not both")
    if store is None:
        url = init_method or "env://"
        r = rank if rank is not None else env_int("RANK", default=None)
        w = world_size if world_size is not None else env_int("WORLD_SIZE", default=None)
        # checked before the rendezvous: a rank outside the world waited there for the whole
        # timeout (300 s by default) and then reported only a socket timeout
        if w is None or r is None or w < 1 or not 0 <= r < w:
            raise ConfigurationError(
                f"rendezvous for prefix {prefix!r}: need 0 <= rank < world_size, given as arguments or "
                f"RANK/WORLD_SIZE as torchrun sets them; got rank {r!r}, world size {w!r} (None: not given)"
            )
        try:
            store, _, _ = next(dist.rendezvous(url, r, w, timeout=timeout))
        except (RuntimeError, ValueError) as exc:
            raise ConfigurationError(
                f"rendezvous through {url} for prefix {prefix!r} (rank {r}, world size {w}) failed: {exc}"
            ) from exc
    return dist.PrefixStore(prefix + "/", store)
