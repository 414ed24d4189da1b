"""Making the default process group and checking one to wrap: Communicator.create's one-off set-up."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, overload

import torch
import torch.distributed as dist

from torchhal.hal_core import telemetry
from torchhal.hal_core.capabilities import DeviceRequirements
from torchhal.hal_core.collective_checks import as_integer
from torchhal.hal_core.device import Device
from torchhal.hal_core.errors import CollectiveError, ConfigurationError

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

    from torchhal.hal_core.hal import HardwareAbstractionLayer

log = telemetry.get_logger("torchhal.collectives")

_ENV_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT")


def _backend_map(config: str) -> dict[str, str]:
    """`"cpu:gloo,cuda:nccl"` -> {"cpu": "gloo", "cuda": "nccl"}; a bare name serves every type ("*")."""
    if ":" not in config:
        return {"*": config.strip()}
    pairs = (part.split(":", 1) for part in config.split(",") if part.strip())
    return {device_type.strip(): backend.strip() for device_type, backend in pairs}


def _served_by(config: str, device_type: str) -> str | None:
    backends = _backend_map(config)
    return backends.get(device_type, backends.get("*"))


def world_group() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None, "called only once the default process group exists"
    return group


def _resolve_device(hal: HardwareAbstractionLayer, device: Device | str | None) -> Device:
    if device is not None:
        return hal.device(device)
    return local_device(hal, env_int("LOCAL_RANK"))


def local_device(
    hal: HardwareAbstractionLayer, local_rank: int | None, requirements: DeviceRequirements | None = None
) -> Device:
    """This process's device, the one rule of `torchhal.distributed.init` and `Communicator.create`:
    the device at position `local_rank` (torchrun's LOCAL_RANK) among the devices of the best
    device's adapter that meet `requirements`; the best device itself where no local rank is
    known (None: a process started alone).

    Past the last such device, devices whose tensors live in host memory (the CPU, simulated
    devices) are shared (`local_rank % count`), and one accelerator alone is taken: `srun
    --gpus-per-task=1` (or CUDA_VISIBLE_DEVICES set per task) shows each task only its own GPU
    while LOCAL_RANK still counts the node's tasks, and torch's `init_device_mesh` (rank % device
    count) takes it too; that is logged and counted. Otherwise more local ranks than accelerators
    is a configuration error: two processes would share one.
    """
    local = checked_local_rank(local_rank)
    req = requirements or DeviceRequirements()
    best = hal.best_device(req)
    if local is None:
        return best
    siblings = sorted(
        (d for d in hal.devices() if d.adapter is best.adapter and not req.failures(d.capabilities)),
        key=lambda d: d.index,
    )
    if local < len(siblings):
        chosen = siblings[local]
    elif best.torch_device.type == "cpu":
        chosen = siblings[local % len(siblings)]
        log.info("host-memory device shared by several local ranks", device=chosen.id, local_rank=local)
    elif len(siblings) == 1:
        chosen = siblings[0]
        log.info(
            "the one visible device taken by a local rank past it: the launcher binds one device "
            "per task (srun --gpus-per-task=1, CUDA_VISIBLE_DEVICES per task)",
            device=chosen.id,
            local_rank=local,
        )
        telemetry.count("torchhal.collective.one_device_per_task", device=chosen.id)
    else:
        raise ConfigurationError(
            f"local rank {local}: adapter {best.adapter.name!r} has {len(siblings)} matching device(s) "
            f"{[d.id for d in siblings]}, so at most {len(siblings)} processes per node, one per device"
        )
    log.info("device chosen for local rank", device=chosen.id, local_rank=local)
    return chosen


def checked_local_rank(value: object) -> int | None:
    """`value` (an argument, or LOCAL_RANK) as an int >= 0; None where not given."""
    number = None if value is None else as_integer(value)
    if value is not None and (number is None or number < 0):
        raise ConfigurationError(
            f"local_rank must be >= 0, got {value!r} (an integer, not bool, as torchrun's LOCAL_RANK)"
        )
    return number


@overload
def env_int(name: str, *, default: int) -> int: ...
@overload
def env_int(name: str, *, default: None = None) -> int | None: ...
def env_int(name: str, *, default: int | None = None) -> int | None:
    """An integer environment variable as torchrun sets them (RANK, WORLD_SIZE, LOCAL_RANK), or
    `default` where it is unset or blank; a malformed one is named. The one reader of these, for
    the core and for `torchhal.distributed` alike."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigurationError(f"{name} must be an integer, got {raw!r}") from None


def check_create_arguments(
    rank: object, world_size: object, timeout: object, what: str = "Communicator.create"
) -> tuple[int | None, int | None]:
    """Types and a positive timeout, before any group is made: world_size='2' was a TypeError
    from a comparison, and timedelta(seconds=-1) a gloo enforce failure inside CollectiveError.
    Returns rank and world_size as ints: integers of any type are taken, as ranks are elsewhere.
    `what`: the call named in the errors (`init` checks them before its rendezvous too)."""
    ints = _create_int(what, "rank", rank), _create_int(what, "world_size", world_size)
    if timeout is not None and (not isinstance(timeout, timedelta) or timeout <= timedelta(0)):
        raise ConfigurationError(f"{what}: timeout must be a positive datetime.timedelta, got {timeout!r}")
    return ints


def _create_int(what: str, name: str, value: object) -> int | None:
    number = None if value is None else as_integer(value)
    if value is not None and number is None:
        raise ConfigurationError(f"{what}: {name} must be an int, got {type(value).__name__} {value!r}")
    return number


def _init_default_group(
    device: Device,
    backend: str,
    rank: int | None,
    world_size: int | None,
    init_method: str | None,
    store: Store | None,
    timeout: timedelta,
) -> None:
    """`init_process_group` with arguments checked first, so mistakes name the missing piece."""
    if store is not None and init_method is not None:
        raise ConfigurationError("init_method and store: give one, not both")
    rank = rank if rank is not None else env_int("RANK")
    world_size = world_size if world_size is not None else env_int("WORLD_SIZE")
    via = "store" if store is not None else (init_method or "env://")
    missing = [name for name, value in (("rank", rank), ("world_size", world_size)) if value is None]
    if via == "env://":
        missing += [name for name in _ENV_RENDEZVOUS if not os.environ.get(name)]
    if missing:
        raise ConfigurationError(
            f"cannot initialise the default process group through {via}: {', '.join(missing)} "
            "not given (as arguments, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT as torchrun sets them)"
        )
    assert rank is not None and world_size is not None
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigurationError(
            f"rank must be in [0, world_size) with world_size >= 1, got rank {rank}, world_size {world_size}"
        )
    _bind_device(device)
    try:
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    except (RuntimeError, ValueError) as exc:
        raise CollectiveError(
            f"initialising the default process group (backend {backend!r}, rank {rank} of {world_size}, "
            f"through {via}, timeout {timeout.total_seconds():g} s) failed: {exc}"
        ) from exc
    log.info("default process group initialised", backend=backend, rank=rank, world_size=world_size, via=via)


def _bind_device(device: Device) -> None:
    """Make `device` this process's current accelerator, as device backends (nccl, xccl) expect."""
    if device.capabilities.device_type == "cpu" or device.simulated:
        return
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None or accelerator.type != device.torch_device.type:
        raise ConfigurationError(
            f"device {device.id}: torch's accelerator is {accelerator}, not {device.torch_device.type}; "
            "cannot make it the current device for its collective backend"
        )
    torch.accelerator.set_device_index(device.index)
    log.info("current accelerator set for collectives", device=device.id)


def _check_wrap_arguments(
    rank: int | None,
    world_size: int | None,
    init_method: str | None,
    store: Store | None,
    group: dist.ProcessGroup | None,
) -> None:
    if init_method is not None or store is not None:
        raise ConfigurationError(
            "init_method/store: the default process group already exists; they apply only when "
            "torchhal initialises it"
        )
    for what, given, actual in (
        ("rank", rank, dist.get_rank(group)),
        ("world_size", world_size, dist.get_world_size(group)),
    ):
        if given is not None and given != actual:
            raise ConfigurationError(f"{what}: given {given}, but the existing process group has {actual}")


def _check_group_serves(group: dist.ProcessGroup, device: Device, backend: str) -> None:
    """The wrapped group must run the backend this device needs for its tensors."""
    config = dist.get_backend_config(group)
    tensor_type = device.torch_device.type
    have, want = _served_by(config, tensor_type), _served_by(backend, tensor_type)
    if have != want:
        raise ConfigurationError(
            f"process group backend {config!r} serves {tensor_type} tensors with {have!r}, but device "
            f"{device.id} needs {want!r} (backend_for gives {backend!r})"
        )


def _group_timeout(group: dist.ProcessGroup, device: Device) -> timedelta | None:
    """The timeout an existing group was made with, where the backend exposes it."""
    try:
        value = group._get_backend(device.torch_device).options._timeout
    except (AttributeError, RuntimeError):
        log.debug("process-group timeout not readable", backend=dist.get_backend_config(group))
        return None
    return value if isinstance(value, timedelta) else None
