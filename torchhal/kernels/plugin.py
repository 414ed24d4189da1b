"""Registers the core ops and their built-in candidates with a HAL's kernel registry.

Found through the entry point `builtin-kernels` in group `torchhal.adapters`, as a vendor
plugin's hooks are, so `torchhal.hal_core` never imports this package. Each op module has a
`register(registry)` that defines its op and adds its candidates.
"""

from __future__ import annotations

from torchhal.hal_core import KernelRegistry, hookimpl
from torchhal.kernels import (
    attention,
    attention_varlen,
    layer_norm,
    linear_cross_entropy,
    matmul,
    rms_norm,
    rope,
    swiglu,
)

OP_MODULES = (
    matmul,
    rms_norm,
    layer_norm,
    swiglu,
    rope,
    attention,
    attention_varlen,
    linear_cross_entropy,
)


@hookimpl
def torchhal_register_kernels(registry: KernelRegistry) -> None:
    for module in OP_MODULES:
        module.register(registry)
