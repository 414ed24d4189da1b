"""torch's process-wide numerics switches: read them, and set fp32 matmul precision for a block.

torch keeps switches that change results and timings without any call naming them: TF32, the
reduced-precision reductions, cuDNN's autotuning. From torch 2.9 each backend has its own fp32
precision (`torch.backends.cuda.matmul.fp32_precision`, ...) and the legacy getters
(`torch.get_float32_matmul_precision()`, `allow_tf32`) raise once a caller has used that API.
So these helpers read the new flags where this torch has them and the legacy ones only where
it does not, and never use a legacy getter to put a value back.

The names of the flags each runtime answers are torch's facts; which of them matter to a device
is its adapter's (`VendorAdapter.numerics_settings`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

# torch's CUDA API, which ROCm builds answer as well (MIOpen behind the cudnn switches)
CUDA_API_FLAGS = (
    "cuda.matmul.fp32_precision",
    "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction",
    "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision",
    "cudnn.benchmark",
    "cudnn.deterministic",
)
CUDA_API_LEGACY_FLAGS = ("cuda.matmul.allow_tf32", "cudnn.allow_tf32")
# oneDNN, which serves the CPU and Intel's XPU
ONEDNN_FLAGS = (
    "mkldnn.enabled",
    "mkldnn.deterministic",
    "mkldnn.matmul.fp32_precision",
    "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision",
)
ONEDNN_LEGACY_FLAGS = ("mkldnn.allow_tf32",)


def per_backend_precision() -> bool:
    """Whether this torch keeps fp32 precision per backend (torch 2.9 on)."""
    import torch

    return hasattr(torch.backends, "fp32_precision")


def backend_flags(flags: Sequence[str], legacy: Sequence[str] = ()) -> dict[str, Any]:
    """The values of `torch.backends.<flag>` for each flag this torch has, plus `legacy`'s where
    it keeps no per-backend precision (there they are the only record of TF32; from torch 2.9
    they repeat the new flags and may raise). Reads flags only: no runtime is initialised."""
    import torch

    values: dict[str, Any] = {}
    for flag in (*flags, *(() if per_backend_precision() else legacy)):
        owner: Any = torch.backends
        *path, name = flag.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and hasattr(owner, name):
            value = getattr(owner, name)
            values[flag] = (
                value if isinstance(value, (bool, int, float, str)) or value is None else repr(value)
            )
    return values


def general_settings() -> dict[str, Any]:
    """torch's switches for every device: thread counts, deterministic algorithms and fp32
    matmul precision: the legacy level (Inductor still reads it) and, from torch 2.9, the general
    `torch.backends.fp32_precision` (each backend's own through its adapter). Where the legacy
    level does not read (it and the per-backend flags disagree), that is recorded instead."""
    import torch

    settings: dict[str, Any] = {
        "num_threads": torch.get_num_threads(),
        "num_interop_threads": torch.get_num_interop_threads(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "deterministic_algorithms_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
    }
    if per_backend_precision():
        settings["fp32_precision"] = getattr(torch.backends, "fp32_precision")  # noqa: B009  # set at import, unknown to torch's stubs
    try:
        settings["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch 2.9+: the legacy level and the per-backend flags disagree
        settings["float32_matmul_precision"] = "unreadable: mixed legacy and per-backend settings"
    return settings


# what `torch.set_float32_matmul_precision(level)` sets each backend's matmul precision to
_PER_BACKEND_LEVEL = {"highest": "ieee", "high": "tf32"}


@contextlib.contextmanager
def float32_matmul_precision(level: str) -> Iterator[None]:
    """fp32 matmul at `level` ("highest" or "high": TF32) for the block, then torch as it was.

    From torch 2.9 torch keeps the legacy level and each backend's matmul precision apart, and
    the legacy getter raises once they disagree (a process that used the per-backend API). Where
    the legacy level reads, the block sets it as `torch.set_float32_matmul_precision` does, then
    puts it back and each backend's precision after it (the legacy setter also sets those; a
    legacy level left behind moved what Inductor compiles). Where it raises, the process speaks
    the per-backend API, and the block sets and restores only that."""
    import torch

    if level not in _PER_BACKEND_LEVEL:
        raise ValueError(
            f"float32_matmul_precision: level must be one of {sorted(_PER_BACKEND_LEVEL)}, got {level!r}"
        )
    if not per_backend_precision():
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision(level)
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)
        return
    owners = [
        module.matmul
        for module in vars(torch.backends).values()
        if hasattr(getattr(module, "matmul", None), "fp32_precision")
    ]
    saved = [(owner, owner.fp32_precision) for owner in owners]
    try:
        legacy: str | None = torch.get_float32_matmul_precision()
    except RuntimeError:  # the legacy and per-backend settings disagree: the per-backend API is in use
        legacy = None
    if legacy is None:
        for owner in owners:
            owner.fp32_precision = _PER_BACKEND_LEVEL[level]
    else:
        torch.set_float32_matmul_precision(level)
    try:
        yield
    finally:
        if legacy is not None:
            torch.set_float32_matmul_precision(legacy)
        for owner, value in saved:
            owner.fp32_precision = value
