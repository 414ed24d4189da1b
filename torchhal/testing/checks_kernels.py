"""Kernel checks: register_kernels behaves, and each candidate matches its op's reference.

Candidates are called directly, never through `KernelRegistry.call`, whose fallback would
hide a raising candidate behind the reference. Each runs on every device of the adapter, in
every declared floating dtype, on the kit's random cases (for an op a plugin defines, the
arguments its `examples` returns for that device and dtype) whose signature its predicate
accepts; a predicate must answer None or an `Unsupported`, never raise.
The candidate gets its own copies of the inputs and the references read pristine ones, so a
candidate that writes into its inputs cannot move its own yardstick; it then fails for the
write itself, naming the input: ops are registered as custom ops that declare no mutation.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from torchhal.hal_core import DType, Unsupported
from torchhal.testing import kernel_inputs, tolerance
from torchhal.testing.context import (
    ADAPTER_ERRORS,
    AdapterUnderTest,
    CheckFailed,
    NotApplicable,
    describe,
    where,
)

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core import Device, DeviceCapabilities, KernelRegistry
    from torchhal.hal_core.kernels import Candidate

CANDIDATE_DTYPES = (DType.FP32, DType.BF16, DType.FP16, DType.FP64)


def check_register_kernels(ctx: AdapterUnderTest) -> str:
    try:
        candidates = ctx.kernel_candidates()
    except NotApplicable:
        raise
    except ADAPTER_ERRORS as exc:
        raise CheckFailed(f"register_kernels(registry) raised {describe(exc)}") from exc
    problems = []
    for cand in candidates:
        name = f"{cand.op}/{cand.qualified_name}"
        if not isinstance(cand.provider, str) or not cand.provider:
            problems.append(f"{name}: provider must be a non-empty string, got {cand.provider!r}")
        if not callable(cand.fn):
            problems.append(f"{name}: implementation is not callable: {cand.fn!r}")
        if cand.supports is not None and not callable(cand.supports):
            problems.append(f"{name}: predicate is not callable: {cand.supports!r}")
        if cand.bind is not None and not callable(cand.bind):
            problems.append(f"{name}: bind is not callable: {cand.bind!r}")
        if not isinstance(cand.priority, (int, float)) or not math.isfinite(cand.priority):
            problems.append(f"{name}: priority must be a finite number, got {cand.priority!r}")
    if problems:
        raise CheckFailed("; ".join(problems))
    if not candidates:
        return "register_kernels ran and added no candidate"
    return "added " + ", ".join(f"{c.op}/{c.qualified_name}" for c in candidates)


def candidate_id(cand: Candidate) -> str:
    return f"kernel.{cand.op}/{cand.qualified_name}"


def _judge(cand: Candidate, caps: DeviceCapabilities, sig: Hashable) -> Unsupported | None:
    if cand.supports is None:
        return None
    try:
        verdict = cand.supports(caps, sig)
    except Exception as exc:
        raise CheckFailed(
            f"predicate raised {describe(exc)} for {sig}; it must return None or Unsupported"
        ) from exc
    if verdict is not None and not isinstance(verdict, Unsupported):
        raise CheckFailed(f"predicate returned {verdict!r} for {sig}; it must return None or Unsupported")
    return verdict


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors of an op's output, in order (a tensor, or a tuple/list of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensors(item)]
    raise CheckFailed(f"output contains a {type(value).__name__}, not tensors")


def _bound(cand: Candidate, device: Device) -> Callable[..., Any]:
    """The callable the registry would run on `device`: `bind(caps)` when the candidate has one."""
    if cand.bind is None:
        return cand.fn
    try:
        fn = cand.bind(device.capabilities)
    except Exception as exc:
        raise CheckFailed(f"bind(capabilities) raised {describe(exc)}") from exc
    if not callable(fn):
        raise CheckFailed(f"bind(capabilities) returned {fn!r}, not a callable")
    return fn


def _run_case(
    cand: Candidate, registry: KernelRegistry, device: Device, host: kernel_inputs.Case
) -> tolerance.Comparison | Unsupported:
    reference = registry.op(cand.op).reference
    case = kernel_inputs.on_device(host, device)  # the candidate's copy: it may scribble on it
    try:
        sig = registry.signature(cand.op, *case.args, **case.kwargs)
    except Exception as exc:
        if registry.op(cand.op).examples is not None:
            raise CheckFailed(
                f"the op's signature rejected its own examples ({describe(exc)}): "
                "examples and signature disagree"
            ) from exc
        raise CheckFailed(
            f"the op's signature rejected the kit's inputs ({describe(exc)}): a torchhal.testing/op mismatch"
        ) from exc
    verdict = _judge(cand, device.capabilities, sig)
    if verdict is not None:
        return verdict
    fn = _bound(cand, device)
    try:
        got = fn(*case.args, **case.kwargs)
        device.synchronize()
    except Exception as exc:
        raise CheckFailed(f"raised {describe(exc)} ({where(exc)})") from exc
    pristine = kernel_inputs.on_device(host, device)
    same_dtype = _tensors(reference(*pristine.args, **pristine.kwargs))
    fp64 = host.map(_to_fp64)
    truth = _tensors(reference(*fp64.args, **fp64.kwargs))
    outputs = _tensors(got)
    if len(outputs) != len(same_dtype):
        raise CheckFailed(f"returned {len(outputs)} tensor(s), the reference returns {len(same_dtype)}")
    worst: tolerance.Comparison | None = None
    for i, (out, ref, true) in enumerate(zip(outputs, same_dtype, truth, strict=True)):
        if (out.dtype, tuple(out.shape), out.device) != (ref.dtype, tuple(ref.shape), ref.device):
            raise CheckFailed(
                f"output {i} is {out.dtype} {tuple(out.shape)} on {out.device}; "
                f"the reference gives {ref.dtype} {tuple(ref.shape)} on {ref.device}"
            )
        comparison = tolerance.compare(out, ref, true)
        if not comparison.ok:
            raise CheckFailed(f"output {i}: {comparison}")
        if worst is None or comparison.ratio > worst.ratio:
            worst = comparison
    changed = _changed_inputs(reference, case, host)
    if changed:
        raise CheckFailed(
            f"modified its input(s) {', '.join(changed)} in place; custom ops may not mutate their inputs"
        )
    assert worst is not None
    return worst


def _changed_inputs(
    reference: Callable[..., Any], case: kernel_inputs.Case, host: kernel_inputs.Case
) -> list[str]:
    """The tensor inputs of `case` that no longer equal the host's, named by the reference's parameters."""
    import torch

    names = list(inspect.signature(reference).parameters)
    positional = [(names[i] if i < len(names) else f"argument {i}", a) for i, a in enumerate(case.args)]
    changed = []
    for (name, value), original in zip(
        [*positional, *case.kwargs.items()], [*host.args, *host.kwargs.values()], strict=True
    ):
        if isinstance(value, torch.Tensor) and not torch.equal(value.cpu(), original):
            changed.append(repr(name))
    return changed


def _to_fp64(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.cpu()
        return value.double() if value.is_floating_point() else value
    return value


def candidate_check(op: str, qualified_name: str) -> Callable[[AdapterUnderTest], str]:
    """The check that the candidate `qualified_name` of `op` matches the op's reference."""

    def check(ctx: AdapterUnderTest) -> str:
        registry = ctx.kernel_registry()
        ctx.require_synchronize()
        cand = next(c for c in registry.candidates(op) if c.qualified_name == qualified_name)
        opdef = registry.op(op)
        if opdef.examples is None and op not in kernel_inputs.CASES:
            raise NotApplicable(
                f"the kit has no inputs for op {op!r}: give them where the op is defined, as "
                f"define_op({op!r}, ..., examples=fn), fn(device, dtype, generator) returning a "
                "list of argument tuples (fresh random inputs at odd shapes)"
            )
        generator = ctx.generator(f"kernel:{op}/{qualified_name}")
        host_cases: dict[torch.dtype, list[kernel_inputs.Case]] = {}  # the kit's own, per dtype
        drawn, tested, rejected, without = False, 0, [], []  # without: dtypes its examples skip
        worst: tolerance.Comparison | None = None
        for device in ctx.devices():
            for dtype in CANDIDATE_DTYPES:
                torch_dtype = dtype.to_torch()
                if dtype not in device.capabilities.dtypes or torch_dtype is None:
                    continue
                drawn = True
                if opdef.examples is not None:  # the op's own, drawn for each device and dtype
                    cases = kernel_inputs.examples(op, opdef.examples, device, torch_dtype, generator)
                    if not cases:
                        without.append(f"{device.id} {dtype.value}")
                elif torch_dtype in host_cases:
                    cases = host_cases[torch_dtype]
                else:
                    made = kernel_inputs.cases(op, generator, torch_dtype, registry)
                    assert made is not None  # op is in kernel_inputs.CASES
                    cases = host_cases[torch_dtype] = made
                for case in cases:
                    label = f"{device.id} {dtype.value} {case.label}"
                    try:
                        outcome = _run_case(cand, registry, device, case)
                    except CheckFailed as exc:
                        raise CheckFailed(f"{label}: {exc}") from exc
                    if isinstance(outcome, Unsupported):
                        rejected.append(f"{label}: {outcome.reason.value} ({outcome.detail})")
                        continue
                    tested += 1
                    if worst is None or outcome.ratio > worst.ratio:
                        worst = outcome
        if not drawn:  # no case was drawn, so none was rejected either
            raise NotApplicable(
                "no device declares a dtype the kit runs kernels in "
                f"({', '.join(d.value for d in CANDIDATE_DTYPES)})"
            )
        skipped = f"; its op's examples give no inputs in {', '.join(without)}" if without else ""
        if worst is None and not rejected:
            raise NotApplicable(f"no inputs: its op's examples give none in {', '.join(without)}")
        if worst is None:
            raise NotApplicable(
                "its predicate rejected every case the kit tried: " + "; ".join(rejected) + skipped
            )
        return (
            f"{tested} case(s) within tolerance, worst {worst.ratio:.2f} of the allowed error ({worst}); "
            f"{len(rejected)} case(s) declined by its predicate" + skipped
        )

    return check
