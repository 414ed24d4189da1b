"""simasic candidates for every core op: real numerics, charged simulated time and memory.

The device's tensors live in host memory, so any host candidate could compute an op for it,
but only this plugin's charges the clock and the ledger: an op it did not cover would run
on `simasic:N` for free. So every op the registry defines gets one candidate, named for the
adapter as provider and name (`simasic/simasic` for the installed plugin; `mychip/mychip` for
a subclass named `mychip`, so that several simulated adapters load side by side in one HAL),
charged by the op's workload (`torchhal_simasic.workloads`); an op the plugin has no workload
for (one a newer core adds) is named in a warning at registration.

The registry calls a kernel as `fn(*args, **kwargs)`, without the device, and caches its
choice per (device id, signature). The candidate's predicate accepts only this adapter's
devices, and its `bind` hook makes, once per selection, a kernel bound to the selected
device's clock and ledger. Routing comes from the registry alone: no hidden "current device"
state, and several devices used at once (threads, `hal.use` blocks) each charge their own.

A bound kernel first charges the ledger what the op's results will take, worked out from its
arguments (`workloads.OUTPUT_BYTES`): beyond capacity, DeviceOutOfMemoryError before anything
is computed (an output beyond host memory never reaches the host allocator), ledger and clock
untouched. It then computes with the op's reference implementation (real numerics, on the
host), exchanges that reservation for its results' storage (a result size that differs from
the estimate is warned once per op and counted, `torchhal.simasic.output_estimates_missed`;
the ledger holds what the results take), and advances the clock by exactly the workload's time.
If anything fails on the way, the reservation is given back.

The predicate turns down a dtype the device cannot run the op in: a rope table in a dtype the
spec does not hold (and an array op in a dtype without a MAC rate, which only a spec built
without validation has: validation refuses a dtype without one, whose array ops ran uncharged).
The registry then runs the op on a host candidate, without simulated time or memory; the
predicate says so in a warning and a count (`torchhal.simasic.host_runs`), once per selection,
as well as in the rejection `Selection.explain()` shows.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    KernelRegistry,
    RejectionReason,
    Unsupported,
    UnsupportedError,
    telemetry,
)

from torchhal_simasic.spec import SimASICSpec
from torchhal_simasic.state import DeviceState
from torchhal_simasic.workloads import ARRAY_WORKLOADS, OUTPUT_BYTES, WORKLOADS, OutputBytes, Workload

PRIORITY = 100.0  # above the built-in host candidates, which would run without simulated cost

log = telemetry.get_logger("torchhal_simasic.kernels")

Reference = Callable[..., Any]
Kernel = Callable[..., Any]


def register_simasic_kernels(
    registry: KernelRegistry, adapter: str, spec: SimASICSpec, states: Sequence[DeviceState]
) -> None:
    """Register a candidate for every op the registry defines; `adapter` is the adapter's name
    as capabilities carry it, and the candidates' provider and name (`adapter/adapter`), so
    that two simulated adapters (a subclass beside the installed plugin) each register theirs."""
    array_dtypes = frozenset(spec.macs_per_cell_per_cycle)
    for op in registry.ops():
        workload, output_bytes = WORKLOADS.get(op), OUTPUT_BYTES.get(op)
        if workload is None or output_bytes is None:
            _say_uncosted(op)
            continue
        registry.register(
            op,
            adapter,
            _unbound(op, adapter),
            provider=adapter,
            supports=_predicate(
                adapter, op, array_dtypes if op in ARRAY_WORKLOADS else spec.dtypes, spec.dtypes, states
            ),
            priority=PRIORITY,
            bind=_binder(op, workload, output_bytes, spec, states, registry.op(op).reference),
        )


@functools.cache
def _say_uncosted(op: str) -> None:
    """Once per process and op (each HAL's discovery registers every op): its calls on simasic
    devices run on the host, uncharged."""
    telemetry.count("torchhal.simasic.uncosted_ops", op=op)
    log.warning(
        "simasic has no cost for this op: on simasic devices it runs on the host, "
        "without simulated time or memory",
        op=op,
        known=sorted(WORKLOADS),
    )


def _binder(
    op: str,
    workload: Workload,
    output_bytes: OutputBytes,
    spec: SimASICSpec,
    states: Sequence[DeviceState],
    reference: Reference,
) -> Callable[[DeviceCapabilities], Kernel]:
    """The `bind` hook: a kernel charging the selected device (capabilities' index). The
    reference's signature is read at bind, not at discovery, which registers every op."""

    def bind(caps: DeviceCapabilities) -> Kernel:
        state = states[caps.index]
        parameters = inspect.signature(reference)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            arguments = parameters.bind(*args, **kwargs)
            arguments.apply_defaults()
            reserved = output_bytes(**arguments.arguments)
            state.ledger.charge(reserved)  # out of memory here: nothing computed, nothing charged
            try:
                outputs = reference(*args, **kwargs)
                results = outputs if isinstance(outputs, tuple) else (outputs,)
                cost = workload(spec, results, **arguments.arguments)
                held = state.ledger.settle(reserved, *results)
            except BaseException:
                state.ledger.release(reserved)
                raise
            if held != reserved:
                _say_missed_estimate(op, state.device, reserved, held)
            state.clock.advance(cost.time_s)
            return outputs

        return kernel

    return bind


def _say_missed_estimate(op: str, device: str, estimated: int, held: int) -> None:
    """Results whose storage differs from `OUTPUT_BYTES`' estimate (a core op's contract changed):
    the ledger holds what they take, but the check before computing used another figure."""
    telemetry.count("torchhal.simasic.output_estimates_missed", op=op)
    if op not in _missed:
        _missed.add(op)
        log.warning(
            "simasic estimated this op's results at another size than they took: the ledger holds "
            "their real size, but the out-of-memory check before computing used the estimate",
            op=op,
            device=device,
            estimated_bytes=estimated,
            held_bytes=held,
        )


_missed: set[str] = set()  # ops whose missed estimate was warned about, once per process


def _predicate(
    adapter: str, op: str, dtypes: frozenset[DType], held: frozenset[DType], states: Sequence[DeviceState]
) -> Callable[[DeviceCapabilities, Any], Unsupported | None]:
    """This adapter's devices only, in `dtypes` (the op's own), with rope's tables in a dtype the
    spec holds (`held`); a dtype turned down on this adapter's device is also a warning."""

    def supports(caps: DeviceCapabilities, sig: Any) -> Unsupported | None:
        if caps.adapter != adapter:
            return Unsupported(RejectionReason.DEVICE, f"runs on {adapter} devices only, not {caps.adapter}")
        verdict = _dtype_verdict(f"{op} on {adapter}", sig, dtypes, held)
        if verdict is not None:
            log.warning(
                "simasic turns this op down: it runs on the host, without simulated time or memory",
                op=op,
                device=states[caps.index].device,
                reason=verdict.detail,
            )
            telemetry.count("torchhal.simasic.host_runs", op=op, device=states[caps.index].device)
        return verdict

    return supports


def _dtype_verdict(
    what: str, sig: Any, dtypes: frozenset[DType], held: frozenset[DType]
) -> Unsupported | None:
    if DType.from_torch(sig.dtype) not in dtypes:
        supported = sorted(d.value for d in dtypes)
        return Unsupported(RejectionReason.DTYPE, f"{what} supports {supported}, got {sig.dtype}")
    tables = getattr(sig, "table_dtype", None)  # rope's cos and sin
    if tables is not None and DType.from_torch(tables) not in held:
        declared = sorted(d.value for d in held)
        return Unsupported(
            RejectionReason.DTYPE,
            f"{what}: cos and sin must be in the spec's dtypes {declared}, got {tables}",
        )
    return None


def _unbound(op: str, adapter: str) -> Kernel:
    """The candidate's `fn`: it needs a device, so only its bound form (via `bind`) runs."""

    def unbound(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise UnsupportedError(
            f"{op}: the {adapter} kernel is bound to a device when the registry selects it; "
            "call it through KernelRegistry.call or torchhal.ops"
        )

    return unbound
