"""A fix for triton <= 3.6's CPU interpreter under numpy >= 2.4, applied only where both have the bug.

The interpreter turns a scalar tensor into a Python int with `int(array)`, which numpy 2.4
refuses for 1-element arrays, so any `for i in range(lo, hi)` with computed bounds fails
(triton-lang/triton#9171, fixed upstream by #9172). The attention kernels need computed loop
bounds (they skip masked key blocks) and `for` loops (only those are software-pipelined on a
GPU), so rather than rewrite them as `while` loops this module replaces the interpreter's
conversion with one that reads the single element. The compiled path is never touched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import triton

from torchhal.hal_core import telemetry

log = telemetry.get_logger("torchhal.kernels.attention")


def _major_minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def needs_fix() -> bool:
    interpreting = bool(triton.knobs.runtime.interpret)
    numpy_refuses = _major_minor(np.__version__) >= (2, 4)
    return interpreting and numpy_refuses and _major_minor(triton.__version__) <= (3, 6)


def apply() -> None:
    """Patch the interpreter's tensor `__index__` (idempotent); logs once when it patches."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "torchhal_fixed", False):
        return

    def patch_lang_tensor(tensor: Any, scope: Any) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor.torchhal_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patch_lang_tensor
    log.info(
        "patched the Triton interpreter's scalar-to-int conversion (triton#9171)",
        numpy=np.__version__,
        triton=triton.__version__,
    )
