"""Mixed-precision policy from device capabilities: bf16, else fp16 with a gradient scaler, else fp32.

A low-precision format is chosen only where the device both stores it and computes it faster
than fp32: it declares matrix units (`Feature.TENSOR_CORES`) or a declared peak for the format
above its fp32 peak. A host CPU that stores bf16 but has neither trains in fp32, because
autocast there costs time and buys nothing. The choice and its reason are logged, counted and
carried in the policy's report; a format the device lacks is refused, never substituted.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from torchhal.hal_core import (
    Device,
    DeviceCapabilities,
    DType,
    Feature,
    InvalidArgumentError,
    UnsupportedError,
    telemetry,
)

log = telemetry.get_logger("torchhal.distributed.precision")

PolicyName = Literal["bf16", "fp16", "fp32"]
_FORMATS: dict[str, tuple[DType, torch.dtype]] = {
    "bf16": (DType.BF16, torch.bfloat16),
    "fp16": (DType.FP16, torch.float16),
    "fp32": (DType.FP32, torch.float32),
}
STRATEGIES = ("ddp", "fsdp", "local")


@dataclass(frozen=True)
class PrecisionPolicy:
    """How a model trains on one device: compute dtype, reduction dtype, scaler, and why.

    Parameters and optimizer state stay fp32. Under DDP (and `local`) the forward runs in
    `torch.autocast(compute_dtype)`; under FSDP2 the same policy is FSDP's
    `MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=fp32)` and no autocast.
    The two differ on the forward's inputs: autocast casts what each op computes with (a
    matmul's operands) and leaves the tensors passed to the model as they are, while FSDP2 casts
    every floating-point tensor passed to a sharded module's forward (the model's root: the
    batch's) to `compute_dtype`, regression targets and float masks included (see
    `fsdp_policy`). `train` warns once a call where that cast happens.
    `strategy` is set by `prepare`; `train` takes it from the model (its DDP or FSDP2 module)
    where a policy has none, so `choose_precision`'s policy and `prepared.policy` train alike.
    """

    name: PolicyName
    compute_dtype: torch.dtype
    device_type: str  # torch device type, for autocast and the gradient scaler
    reason: str
    reduce_dtype: torch.dtype = torch.float32
    strategy: str | None = None  # set by prepare()

    def __post_init__(self) -> None:
        """Refuse fields that contradict each other: `name` decides the gradient scaler and the
        device check, `compute_dtype` what autocast and FSDP compute in, so a hand-made
        `PrecisionPolicy("bf16", torch.float16, ...)` trained in fp16 without loss scaling."""
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise UnsupportedError(
                f"PrecisionPolicy: strategy must be one of {STRATEGIES} or None, got {self.strategy!r}"
            )
        problems = []
        if not isinstance(self.name, str) or self.name not in _FORMATS:
            problems.append(f"name must be one of {sorted(_FORMATS)}, got {self.name!r}")
        elif self.compute_dtype != (want := _FORMATS[self.name][1]):
            problems.append(
                f"compute_dtype must be {want} for name {self.name!r}, got {self.compute_dtype!r}"
            )
        if not (isinstance(self.reduce_dtype, torch.dtype) and self.reduce_dtype.is_floating_point):
            problems.append(f"reduce_dtype must be a floating-point torch.dtype, got {self.reduce_dtype!r}")
        if not _is_device_type(self.device_type):
            problems.append(
                f"device_type must be a torch device type such as 'cuda', got {self.device_type!r}"
            )
        if problems:
            raise InvalidArgumentError(f"PrecisionPolicy: {'; '.join(problems)}")

    @property
    def uses_grad_scaler(self) -> bool:
        """fp16 gradients underflow without loss scaling; bf16 has fp32's exponent range."""
        return self.name == "fp16"

    def for_strategy(self, strategy: str) -> PrecisionPolicy:
        return dataclasses.replace(self, strategy=strategy)  # checked by __post_init__

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward's autocast context: none for fp32, and none under FSDP (it casts params)."""
        if self.name == "fp32" or self.strategy == "fsdp":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    def fsdp_policy(self) -> Any:
        """FSDP2's MixedPrecisionPolicy for this policy (fp32: no casting at all).

        `cast_forward_inputs` stays on (FSDP2's default): a sharded module's own parameters are
        in `compute_dtype` during its forward and FSDP2 runs no autocast, so a root that computes
        with its parameters on its inputs (an input projection, a norm before the blocks) needs
        them cast. The price: every floating-point tensor passed to the model's forward arrives
        in `compute_dtype`, targets included (a target of 1.001 reaches an MSE loss as 1.0 in
        bf16), where DDP's autocast leaves it fp32. Which input is a target cannot be told, so
        the cast stays, and `train` warns once a call where it happens (counted as
        `torchhal.train.fsdp_cast_inputs`); compute the loss from the targets in `loss_fn`,
        outside the model, to keep them in fp32. Integer inputs (token ids, class labels) are
        never cast.
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.name == "fp32":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler | None:
        """A fresh GradScaler for fp16 on this device type; None when no scaling is needed."""
        if not self.uses_grad_scaler:
            return None
        return torch.amp.GradScaler(self.device_type)

    def check_device(self, device: Device, what: str) -> None:
        """Refuse a policy made for another kind of device: autocast for another device type
        leaves this device's forward in fp32 (torch only warns), and a format the device does not
        declare would be substituted by whatever torch does with it."""
        if self.device_type != device.torch_device.type:
            raise UnsupportedError(
                f"{what}: precision policy {self.name!r} is for {self.device_type} tensors, but "
                f"{device.id} holds {device.torch_device.type} tensors; make it with "
                "choose_precision(ctx.device)"
            )
        _require_format(device, self.name, what)

    def report(self) -> dict[str, Any]:
        return {
            "policy": self.name,
            "compute_dtype": dtype_name(self.compute_dtype),
            "reduce_dtype": dtype_name(self.reduce_dtype),
            "grad_scaler": self.uses_grad_scaler,
            "autocast": self.name != "fp32" and self.strategy != "fsdp",
            "device_type": self.device_type,
            "strategy": self.strategy,
            "reason": self.reason,
        }


def choose_precision(device: Device, *, prefer: PolicyName | None = None) -> PrecisionPolicy:
    """The policy for training on `device`; `prefer` asks for one format (refused if unsupported)."""
    policy = _from_capabilities(device) if prefer is None else _requested(device, prefer)
    telemetry.count("torchhal.distributed.precision", policy=policy.name, device=device.id)
    log.info("precision policy chosen", device=device.id, policy=policy.name, reason=policy.reason)
    return policy


def _requested(device: Device, name: str) -> PrecisionPolicy:
    if name not in _FORMATS:
        raise UnsupportedError(f"precision must be one of {sorted(_FORMATS)}, got {name!r}")
    fmt = _require_format(device, name, "choose_precision")
    return _policy(device, name, f"requested; {device.id} declares {fmt.value}")


def _require_format(device: Device, name: str, what: str) -> DType:
    fmt = _FORMATS[name][0]
    caps = device.capabilities
    if fmt not in caps.dtypes:
        declared = ", ".join(sorted(d.value for d in caps.dtypes))
        raise UnsupportedError(
            f"{what}: precision {name!r} on {device.id}: the device does not declare {fmt.value} "
            f"(declared dtypes: {declared})"
        )
    return fmt


def _from_capabilities(device: Device) -> PrecisionPolicy:
    caps = device.capabilities
    passed_over = []
    for name in ("bf16", "fp16"):
        fmt = _FORMATS[name][0]
        if fmt not in caps.dtypes:
            passed_over.append(f"{name}: not declared")
            continue
        faster = _faster_than_fp32(caps, fmt)
        if faster is None:
            passed_over.append(f"{name}: declared, but no matrix units or declared peak above fp32")
            continue
        reason = f"{device.id} declares {fmt.value} and {faster}"
        if passed_over:
            reason += f" (passed over: {'; '.join(passed_over)})"
        return _policy(device, name, reason)
    if DType.FP32 not in caps.dtypes:
        declared = ", ".join(sorted(d.value for d in caps.dtypes))
        raise UnsupportedError(
            f"training on {device.id}: needs bf16, fp16 or fp32; the device declares {declared}"
        )
    return _policy(device, "fp32", f"{device.id}: fp32 ({'; '.join(passed_over)})")


def _faster_than_fp32(caps: DeviceCapabilities, fmt: DType) -> str | None:
    """Why `fmt` computes faster than fp32 on this device, or None when nothing says it does."""
    if caps.has(Feature.TENSOR_CORES):
        return "matrix units (tensor_cores)"
    peaks = caps.declared_peaks
    if peaks is not None and peaks.tflops.get(fmt, 0.0) > peaks.tflops.get(DType.FP32, float("inf")):
        return (
            f"a declared {fmt.value} peak of {peaks.tflops[fmt]:g} TFLOP/s above fp32's "
            f"{peaks.tflops[DType.FP32]:g} ({peaks.source})"
        )
    return None


def _policy(device: Device, name: str, reason: str) -> PrecisionPolicy:
    return PrecisionPolicy(
        name=name,  # type: ignore[arg-type]
        compute_dtype=_FORMATS[name][1],
        device_type=device.torch_device.type,
        reason=reason,
    )


def _is_device_type(value: object) -> bool:
    """Whether `value` is a device type torch knows ("cuda"; not "cuda:0", not "gpu")."""
    try:
        return isinstance(value, str) and torch.device(value).type == value
    except RuntimeError:
        return False


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as people write it: "bfloat16", not "torch.bfloat16"."""
    return str(dtype).removeprefix("torch.")
