"""Collective checks: the adapter's backend is one torch.distributed has, and all_reduce works on it.

The all_reduce runs on the adapter's first device, in a world-size-1 process group on a
FileStore in a temporary directory:
it proves the backend initialises, accepts the device's tensors and returns the right sum
without spawning processes (multi-rank correctness is the Communicator's own test suite).
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from torchhal.testing.checks_device import fill_dtype
from torchhal.testing.context import AdapterUnderTest, CheckFailed, NotApplicable, describe, where

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core import Device

GROUP_TIMEOUT = timedelta(seconds=60)
ALL_REDUCE_ELEMENTS = 4099  # odd, so no backend fast path for aligned sizes hides a bug


def _require_distributed() -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        raise NotApplicable(f"torch {torch.__version__} was built without torch.distributed")


def check_collective_backend(ctx: AdapterUnderTest) -> str:
    import torch.distributed as dist

    devices = ctx.devices()
    name = ctx.adapter.collective_backend()
    _require_distributed()
    if not isinstance(name, str) or not name:
        raise CheckFailed(f"collective_backend() must return a backend name, got {name!r}")
    if not dist.is_backend_available(name):
        raise CheckFailed(
            f"collective_backend() is {name!r}, which this torch.distributed does not have available "
            f"(registered backends: {dist.Backend.backend_list})"
        )
    undeclared = [d.id for d in devices if name not in d.capabilities.collective_backends]
    if undeclared:
        raise CheckFailed(
            f"collective_backend() is {name!r} but {undeclared} do not list it in collective_backends"
        )
    return f"{name!r} is available in torch.distributed and declared by every device"


def _declared_backends(devices: tuple[Device, ...]) -> list[str]:
    seen: dict[str, None] = {}
    for device in devices:
        seen.update(dict.fromkeys(device.capabilities.collective_backends))
    return list(seen)


def _tensor_for(ctx: AdapterUnderTest, device: Device | None, backend: str) -> torch.Tensor:
    """Random values (never zeros) on the device, or on the host when the backend is a host bridge."""
    import torch

    dtype = fill_dtype(device) if device is not None else torch.float32
    values = torch.randn(ALL_REDUCE_ELEMENTS, generator=ctx.generator(f"all_reduce:{backend}")).mul_(50)
    host = values.to(dtype) if dtype.is_floating_point else values.clamp_(-127, 127).to(dtype)
    return host if device is None else device.to_device(host)


def _all_reduce_world_1(ctx: AdapterUnderTest, backend: str, device: Device | None) -> None:
    import torch
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="torchhal-conformance-") as tmp:
        accelerator = device.torch_device if device is not None else None
        dist.init_process_group(
            backend,
            init_method=Path(tmp, "store").as_uri(),  # a FileStore
            rank=0,
            world_size=1,
            timeout=GROUP_TIMEOUT,
            device_id=accelerator if accelerator is not None and accelerator.type != "cpu" else None,
        )
        try:
            tensor = _tensor_for(ctx, device, backend)
            expected = tensor.cpu().clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            if device is not None:
                device.synchronize()
            got = tensor.cpu()
        finally:
            dist.destroy_process_group()
    if got.dtype != expected.dtype or not torch.equal(got, expected):
        worst = (got.double() - expected.double()).abs().max().item() if got.shape == expected.shape else None
        raise CheckFailed(
            f"{backend}: all_reduce(SUM) over one rank must return its input unchanged; "
            f"dtype {got.dtype} (sent {expected.dtype}), largest difference {worst}"
        )


def check_all_reduce(ctx: AdapterUnderTest) -> str:
    import torch.distributed as dist

    devices = ctx.devices()
    declared = _declared_backends(devices)
    if not declared:
        raise NotApplicable("no device declares a collective backend")
    _require_distributed()
    if dist.is_initialized():
        raise NotApplicable(
            f"this process already has a default process group (rank {dist.get_rank()} of "
            f"{dist.get_world_size()}); run the kit in a process without one to test all_reduce"
        )
    ctx.require_synchronize()
    device = devices[0]
    problems, notes, untested = [], [], []
    for backend in declared:
        if not dist.is_backend_available(backend):
            problems.append(f"{backend}: declared but not available in this torch.distributed")
            continue
        handles = dist.Backend.backend_capability.get(backend)
        if handles is None or device.torch_device.type in handles:
            target, placement = device, f"{device.id} tensors"
        elif "cpu" in handles:
            target, placement = None, "host tensors (it handles only " + ", ".join(handles) + ")"
        else:
            problems.append(f"{backend}: handles {handles}, not this device's {device.torch_device.type!r}")
            continue
        try:
            _all_reduce_world_1(ctx, backend, target)
        except NotApplicable as exc:  # the device declares no dtype the kit can fill
            untested.append(f"{backend}: {exc}")
        except CheckFailed as exc:
            problems.append(str(exc))
        except Exception as exc:
            problems.append(f"{backend}: {describe(exc)} ({where(exc)})")
        else:
            notes.append(f"{backend} on {placement}")
    if problems:
        raise CheckFailed("; ".join(problems))
    if not notes:
        raise NotApplicable("; ".join(untested))
    return f"all_reduce(SUM) of {ALL_REDUCE_ELEMENTS} random values, world size 1: " + "; ".join(
        notes + [f"not tested: {u}" for u in untested]
    )
