"""Capability-conditional checks: every declared dtype really computes on the device.

Operands are random (fresh per run), rounded to the dtype on the host, allocated through
the adapter (`Device.to_device`) and computed on the device; results are compared with an
fp64 computation of the same rounded operands on the host, within textbook bounds:
one rounding for an addition (|err| <= eps·|x|), and Higham's dot-product bound
|err| <= gamma_K·(|A|@|B|), taken with slack as (K + 2)·eps, for a matmul with inner size K.
Formats without portable arithmetic in torch (fp8, int8 matmul) are checked on the
operations they do have, and the reason says which.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torchhal.hal_core import DType, torch_flags
from torchhal.testing.context import AdapterUnderTest, CheckFailed, NotApplicable, each_device

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core import Device

ROWS, INNER, COLS = 17, 33, 9  # odd sizes: no vector-width fast path hides a remainder bug
TF32_EPS = 2.0**-10  # TF32 keeps 10 explicit mantissa bits
INT8_RANGE = 60  # |a|, |b| <= 60: a + b stays inside int8
FP8_RANGE = 4.0  # inside every fp8 format's finite range, so no saturation rule is involved

FLOATS = {DType.FP64, DType.FP32, DType.BF16, DType.FP16}
FP8 = {DType.FP8_E4M3, DType.FP8_E5M2, DType.FP8_E4M3_FNUZ, DType.FP8_E5M2_FNUZ}

WHAT = {
    "float": f"add and a {ROWS}x{INNER} @ {INNER}x{COLS} matmul within rounding bounds",
    DType.TF32: (
        f"fp32 {ROWS}x{INNER} @ {INNER}x{COLS} matmul with float32 matmul precision 'high' "
        "(TF32 allowed) within TF32 rounding bounds"
    ),
    DType.INT8: f"exact add of values in [-{INT8_RANGE}, {INT8_RANGE}] and an int8 -> int32 -> int8 "
    "round trip (int8 matmul is not portable across torch backends)",
    "fp8": "fp32 -> fp8 cast on the device equal to the host's rounding, fp8 -> fp32 -> fp8 round trip exact "
    "(fp8 has no portable arithmetic in torch)",
}


def _what(dtype: DType) -> str:
    return WHAT["float"] if dtype in FLOATS else WHAT["fp8"] if dtype in FP8 else WHAT[dtype]


def _host_operands(ctx: AdapterUnderTest, dtype: DType, device: Device) -> tuple[torch.Tensor, ...]:
    import torch

    g = ctx.generator(f"dtype:{dtype.value}:{device.id}")
    return (
        torch.randn(ROWS, INNER, generator=g),
        torch.randn(ROWS, INNER, generator=g),
        torch.randn(INNER, COLS, generator=g),
    )


def _float_ops(ctx: AdapterUnderTest, dtype: DType, device: Device) -> None:
    import torch

    torch_dtype = dtype.to_torch()
    assert torch_dtype is not None
    a, c, b = (t.to(torch_dtype) for t in _host_operands(ctx, dtype, device))
    eps, tiny = torch.finfo(torch_dtype).eps, torch.finfo(torch_dtype).tiny
    da, dc, db = (device.to_device(t) for t in (a, c, b))
    _require_result(
        "add", da + dc, a.double() + c.double(), eps * (a.double() + c.double()).abs() + tiny, torch_dtype
    )
    bound = (INNER + 2) * eps * (a.double().abs() @ b.double().abs()) + tiny
    _require_result("matmul", da @ db, a.double() @ b.double(), bound, torch_dtype)


def _tf32_matmul(ctx: AdapterUnderTest, dtype: DType, device: Device) -> None:
    import torch

    ctx.require_synchronize()
    a, _, b = _host_operands(ctx, dtype, device)
    da, db = device.to_device(a), device.to_device(b)
    with torch_flags.float32_matmul_precision("high"):
        out = da @ db
        device.synchronize()
    bound = (INNER + 2) * TF32_EPS * (a.double().abs() @ b.double().abs()) + torch.finfo(torch.float32).tiny
    _require_result("tf32 matmul", out, a.double() @ b.double(), bound, torch.float32)


def _int8_ops(ctx: AdapterUnderTest, dtype: DType, device: Device) -> None:
    import torch

    g = ctx.generator(f"dtype:int8:{device.id}")
    a, c = (
        torch.randint(-INT8_RANGE, INT8_RANGE + 1, (ROWS, INNER), generator=g, dtype=torch.int8) for _ in "ac"
    )
    da, dc = device.to_device(a), device.to_device(c)
    total = (da + dc).cpu()
    if total.dtype != torch.int8 or not torch.equal(total.long(), a.long() + c.long()):
        raise CheckFailed(f"int8 add gave {total.dtype} values that differ from the exact sums")
    back = da.to(torch.int32).to(torch.int8).cpu()
    if not torch.equal(back, a):
        raise CheckFailed("int8 -> int32 -> int8 round trip changed values")


def _fp8_casts(ctx: AdapterUnderTest, dtype: DType, device: Device) -> None:
    import torch

    fp8 = dtype.to_torch()
    assert fp8 is not None
    src = _host_operands(ctx, dtype, device)[0].clamp_(-FP8_RANGE, FP8_RANGE)
    host8 = src.to(fp8)
    stored = device.to_device(host8)
    widened = stored.to(torch.float32)
    if not torch.equal(widened.cpu(), host8.to(torch.float32)):
        raise CheckFailed(f"{fp8} -> fp32 on the device changed the values stored through the adapter")
    if not torch.equal(widened.to(fp8).cpu().to(torch.float32), host8.to(torch.float32)):
        raise CheckFailed(f"{fp8} -> fp32 -> {fp8} round trip on the device is not exact")
    if DType.FP32 in device.capabilities.dtypes:
        narrowed = device.to_device(src).to(fp8).cpu()
        if not torch.equal(narrowed.to(torch.float32), host8.to(torch.float32)):
            bad = int((narrowed.to(torch.float32) != host8.to(torch.float32)).sum())
            raise CheckFailed(f"fp32 -> {fp8} on the device differs from the host's rounding in {bad} values")


def _require_result(
    op: str, got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype
) -> None:
    if got.dtype != dtype:
        raise CheckFailed(f"{op} returned {got.dtype} for {dtype} operands")
    error = (got.cpu().double() - exact).abs()
    excess = error - bound
    if not bool((excess <= 0).all()):
        worst = int(excess.argmax())
        raise CheckFailed(
            f"{op} in {dtype}: error {error.flatten()[worst].item():.3g} exceeds the rounding bound "
            f"{bound.flatten()[worst].item():.3g} (element {worst})"
        )


def _runner(dtype: DType) -> Callable[[AdapterUnderTest, DType, Device], None]:
    if dtype in FLOATS:
        return _float_ops
    if dtype in FP8:
        return _fp8_casts
    return _tf32_matmul if dtype is DType.TF32 else _int8_ops


def dtype_check(dtype: DType) -> Callable[[AdapterUnderTest], str]:
    """The check that `dtype`, where declared, computes correctly on every device declaring it."""
    run = _runner(dtype)

    def check(ctx: AdapterUnderTest) -> str:
        declaring = [d for d in ctx.devices() if dtype in d.capabilities.dtypes]
        if not declaring:
            raise NotApplicable(f"no device declares {dtype.value}")

        def one(device: Device) -> None:
            run(ctx, dtype, device)

        each_device(declaring, one)
        return f"{', '.join(d.id for d in declaring)}: {_what(dtype)}"

    return check
