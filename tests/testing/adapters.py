"""Adapters for the conformance kit's tests: sound ones, and broken variants of the CPU adapter.

Each broken adapter breaks exactly one promise of the adapter contract, so the kit must fail
exactly the check that covers it and pass (or find not applicable) everything else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    Feature,
    HealthStatus,
    KernelRegistry,
    Link,
    LinkType,
    MemoryInfo,
    RejectionReason,
    Topology,
    Unsupported,
    UnsupportedError,
)
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.kernels import attention, linear_cross_entropy, rms_norm

CPU_NOT_APPLICABLE = {  # what the CPU adapter does not have, so the kit must find not applicable
    "device.timer_events",  # no device-side timing events
    "device.graphs",  # no graphs
    "dtype.tf32",
    "dtype.fp8_e4m3",
    "dtype.fp8_e5m2",
    "dtype.fp8_e4m3fnuz",
    "dtype.fp8_e5m2fnuz",
    "kernels.candidates",  # it registers no kernels
}


class TwinHostAdapter(CPUAdapter):
    """Two host "devices" (twin:0, twin:1) joined by a declared link: a sound multi-device adapter."""

    name = "twin"
    vendor = "twin"
    namespace = "twin"

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [host.model_copy(update={"index": i}) for i in range(2)]

    def device_id(self, index: int, device_type: str) -> str:
        return f"twin:{index}"

    def topology(self) -> Topology:
        return Topology(
            devices=("twin:0", "twin:1"),
            links=(Link(a="twin:0", b="twin:1", type=LinkType.PCIE, bandwidth_gbps=32.0, source="declared"),),
        )


class AsymmetricTopology(TwinHostAdapter):
    def topology(self) -> Topology:
        return Topology(
            devices=("twin:0", "twin:1"),
            links=(
                Link(a="twin:0", b="twin:1", type=LinkType.NVLINK, count=4, source="declared"),
                Link(a="twin:1", b="twin:0", type=LinkType.PCIE, source="declared"),
            ),
        )


class ForeignTopology(TwinHostAdapter):
    def topology(self) -> Topology:
        return Topology(
            devices=("twin:0", "twin:1", "cuda:7"),  # a link to an unlisted device is refused by Topology
            links=(Link(a="twin:0", b="cuda:7", type=LinkType.NVLINK, source="declared"),),
        )


class FrozenMemory(CPUAdapter):
    """memory_info figures that never move, whatever is allocated."""

    def memory_info(self, index: int) -> MemoryInfo:
        return MemoryInfo(total_bytes=2**34, free_bytes=2**33, used_bytes=2**30)


class OverfullMemory(CPUAdapter):
    """free and used that each fit the capacity but together exceed it (free reported as total)."""

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        return info.model_copy(update={"free_bytes": info.total_bytes})


class InflatedMemory(CPUAdapter):
    """used_bytes that grows by ten times what is allocated (from what it read first)."""

    baseline: int | None = None

    def memory_info(self, index: int) -> MemoryInfo:
        info = super().memory_info(index)
        if self.baseline is None:
            self.baseline = info.used_bytes
        return info.model_copy(update={"used_bytes": self.baseline + 10 * (info.used_bytes - self.baseline)})


class RepeatedLink(TwinHostAdapter):
    def topology(self) -> Topology:
        link = Link(a="twin:0", b="twin:1", type=LinkType.PCIE, bandwidth_gbps=32.0, source="declared")
        return Topology(devices=("twin:0", "twin:1"), links=(link, link))  # the same way twice


class NegativeBandwidth(TwinHostAdapter):
    def topology(self) -> Topology:
        link = Link(a="twin:0", b="twin:1", type=LinkType.PCIE, bandwidth_gbps=-32.0, source="declared")
        return Topology(devices=("twin:0", "twin:1"), links=(link,))


class ShiftingDiscovery(CPUAdapter):
    """discover() whose records change between calls (memory read live into the record)."""

    calls = 0

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        self.calls += 1
        return [host.model_copy(update={"memory_bytes": host.memory_bytes - self.calls})]


class TensorSwitch(CPUAdapter):
    """numerics_settings() holding a tensor: a fingerprint cannot record it as JSON."""

    def numerics_settings(self) -> dict[str, Any]:
        return {"scale": torch.ones(1)}


class CountingSwitch(CPUAdapter):
    """numerics_settings() whose value moves on every read (a counter, a clock)."""

    reads = 0

    def numerics_settings(self) -> dict[str, Any]:
        self.reads += 1
        return {"reads": self.reads}


class Fp8Unstorable(CPUAdapter):
    """Declares fp8 e4m3 on a device whose allocator cannot hold it (a fake op raising)."""

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [host.model_copy(update={"dtypes": host.dtypes | {DType.FP8_E4M3}})]

    def allocate(
        self, index: int, torch_device: torch.device, shape: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        if dtype.itemsize == 1 and dtype.is_floating_point:
            raise UnsupportedError(f"fp8-less device: cannot allocate {dtype}")
        return super().allocate(index, torch_device, shape, dtype)


class Fp8OnlyHost(CPUAdapter):
    """A sound host device declaring fp8 e4m3 only: nothing the kit can fill for an all_reduce."""

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [host.model_copy(update={"dtypes": frozenset({DType.FP8_E4M3})})]


class DuplicateIndexes(CPUAdapter):
    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [host, host]


class RaisingProbe(CPUAdapter):
    def probe(self):  # type: ignore[no-untyped-def]
        raise RuntimeError("driver exploded")


class AbsentRuntime(CPUAdapter):
    def probe(self):  # type: ignore[no-untyped-def]
        from torchhal.hal_core import ProbeResult

        return ProbeResult(available=False, reason="no such runtime on this machine")


class SlowProbe(CPUAdapter):
    delay_s = 0.05

    def probe(self):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return super().probe()


class FutureApi(CPUAdapter):
    api_versions = (2, 3)


class ZeroTimer(CPUAdapter):
    """A timer whose marks never advance."""

    class _Stopped:
        def mark(self) -> object:
            return 0

        def elapsed_ms(self, start: object, end: object) -> float:
            return 0.0

    def timer(self, index: int):  # type: ignore[no-untyped-def]
        return self._Stopped()


class EventsClaimedNotUsed(CPUAdapter):
    """Declares device_events but keeps the host-clock timer."""

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [host.model_copy(update={"features": host.features | {Feature.DEVICE_EVENTS}})]


class GraphsClaimedNotCaptured(CPUAdapter):
    """Declares graphs but keeps the default graph_replay, which captures nothing."""

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [host.model_copy(update={"features": host.features | {Feature.GRAPHS}})]


class StaleReplay(GraphsClaimedNotCaptured):
    """Runs the work once at capture and replays nothing: a replay leaves the old result."""

    def graph_replay(self, index, work):
        work()
        return lambda: None


class UnknownBackend(CPUAdapter):
    def collective_backend(self) -> str:
        return "warpdrive"


class UnavailableBackendDeclared(CPUAdapter):
    """Declares a second collective backend that this torch build does not have."""

    def discover(self) -> Sequence[DeviceCapabilities]:
        (host,) = super().discover()
        return [host.model_copy(update={"collective_backends": ("gloo", "warpdrive")})]


class RaisingSynchronize(CPUAdapter):
    """synchronize() raises: the checks that wait on the device are blocked, not failed again."""

    def synchronize(self, index: int) -> None:
        raise RuntimeError("stream 0 lost")


class HangingSynchronize(CPUAdapter):
    """synchronize() that does not return until `release` is set (a lost stream)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def synchronize(self, index: int) -> None:
        self.release.wait()


class WrongHealth(CPUAdapter):
    def health(self, index: int):  # type: ignore[no-untyped-def]
        return HealthStatus.OK  # a status, not a HealthReport


class EinsumMatmul(CPUAdapter):
    """One correct candidate: matmul by einsum of two matrices, declining every other layout."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register("matmul", "einsum", _einsum_matmul, provider=self.name, supports=_only_2d)


class GoodKernels(EinsumMatmul):
    """Correct candidates: einsum matmul, the core's SDPA and ATen rms_norm, autograd attention backward."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        super().register_kernels(registry)
        registry.register(
            "attention", "sdpa", attention.sdpa, provider=self.name, supports=attention.sdpa_supports
        )
        registry.register("rms_norm", "aten", rms_norm.aten, provider=self.name)
        if "attention_backward" in registry.ops():
            registry.register(
                "attention_backward", "autograd", _autograd_attention_backward, provider=self.name
            )


class WrongKernel(EinsumMatmul):
    """Adds a matmul candidate that is off by 0.1%: small, but far above rounding error."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        super().register_kernels(registry)
        registry.register("matmul", "sloppy", lambda a, b: torch.matmul(a, b) * 1.001, provider=self.name)


class RaisingPredicate(EinsumMatmul):
    def register_kernels(self, registry: KernelRegistry) -> None:
        super().register_kernels(registry)
        registry.register("matmul", "fragile", torch.matmul, provider=self.name, supports=_predicate_raises)


class DtypeChangingKernel(EinsumMatmul):
    """A candidate that silently computes and returns fp32 for half-precision inputs."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        super().register_kernels(registry)
        registry.register(
            "matmul", "upcast", lambda a, b: torch.matmul(a.float(), b.float()), provider=self.name
        )


class WrongAndScribbling(CPUAdapter):
    """An rms_norm candidate 50% off that also negates its input: the reference must not read the
    negated input, or its error (and the allowed error) grows with the damage."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register("rms_norm", "sloppy", _wrong_and_scribbling, provider=self.name)


class ScribblingKernel(CPUAdapter):
    """A swiglu candidate with the right values, written over its `up` input."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register("swiglu", "inplace", lambda gate, up: up.mul_(F.silu(gate)), provider=self.name)


class IndexScribbling(CPUAdapter):
    """A linear_cross_entropy candidate with the right loss that then marks every target ignored:
    index tensors too must reach the candidate as copies, or the write goes unseen."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register("linear_cross_entropy", "inplace", _ignore_targets_after, provider=self.name)


class FastShapesOnly(CPUAdapter):
    """An attention candidate returning zeros whose predicate takes only head_dim 64 and 128, as
    most flash-style kernels do: the kit's cases must reach it."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register(
            "attention",
            "flashish",
            lambda q, k, v, **kw: torch.zeros_like(q),
            provider=self.name,
            supports=_head_dim_64_or_128,
        )


class RaisingRegistration(CPUAdapter):
    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register("no_such_op", "x", torch.add, provider=self.name)


def _wrong_and_scribbling(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    out = rms_norm.reference(x, weight, eps) * 1.5
    x.neg_()
    return out


def _ignore_targets_after(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
    loss = linear_cross_entropy.reference(hidden, weight, target, *args, **kwargs)
    target.fill_(-100)
    return loss


def _einsum_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.einsum("...ik,kj->...ij", a, b)


def _autograd_attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
    window: Sequence[int] | None = None,
) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv by autograd through the forward reference: independent of the hand-written backward."""
    compute = torch.promote_types(q.dtype, torch.float32)
    leaves = [t.detach().to(compute).requires_grad_() for t in (q, k, v)]
    forward = attention.reference(*leaves, causal=causal, scale=scale, window=window)
    grads = torch.autograd.grad(forward, leaves, grad_out.to(compute))
    return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))


def _only_2d(caps: DeviceCapabilities, sig: object) -> Unsupported | None:
    if (getattr(sig, "a_dims", 2), getattr(sig, "b_dims", 2)) != (2, 2):
        return Unsupported(RejectionReason.SHAPE, "einsum candidate takes two 2-D operands")
    return None


def _predicate_raises(caps: DeviceCapabilities, sig: object) -> Unsupported | None:
    raise KeyError("forgot a case")


def _head_dim_64_or_128(caps: DeviceCapabilities, sig: attention.AttentionSignature) -> Unsupported | None:
    if sig.head_dim not in (64, 128):
        return Unsupported(RejectionReason.SHAPE, f"head_dim {sig.head_dim} is not 64 or 128")
    return None
