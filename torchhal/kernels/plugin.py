"""Registers the core ops and their built-in candidates with a HAL's kernel registry.

Found through the entry point `builtin-kernels` in group `torchhal.adapters`, as a vendor
plugin's hooks are, so `torchhal.hal_core` never imports this package.
"""

from __future__ import annotations

from torchhal.hal_core import KernelRegistry, hookimpl
from torchhal.kernels import attention, matmul, rms_norm

PROVIDER = "torchhal"


@hookimpl
def torchhal_register_kernels(registry: KernelRegistry) -> None:
    registry.define_op("matmul", matmul.reference, signature=matmul.signature, doc="a @ b")
    registry.define_op("rms_norm", rms_norm.reference, signature=rms_norm.signature, doc="RMSNorm, last dim")
    registry.define_op("attention", attention.reference, signature=attention.signature, doc="SDPA layout")
    registry.register("rms_norm", "aten", rms_norm.aten, provider=PROVIDER, supports=rms_norm.aten_supports, priority=10)
    registry.register("attention", "sdpa", attention.sdpa, provider=PROVIDER, supports=attention.sdpa_supports, priority=10)
