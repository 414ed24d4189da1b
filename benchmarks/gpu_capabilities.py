"""Capabilities of cuda:0 for the kernel benchmarks, shared by bench_attention and bench_norms.

Kernels pick launch configurations from `DeviceCapabilities`; a benchmark takes them from the HAL
when a plugin declares Triton on cuda:0, else builds them from torch's own device facts and says so.
"""

from __future__ import annotations

import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceCapabilities, DeviceNotFoundError, DType, Feature


def device_capabilities(benchmark: str) -> tuple[DeviceCapabilities, str]:
    """(capabilities, where they came from) for cuda:0."""
    try:
        caps = HardwareAbstractionLayer().device_for_tensor(torch.empty(0, device="cuda")).capabilities
        if Feature.TRITON in caps.features:
            return caps, f"HAL device {caps.adapter}:{caps.index}"
    except DeviceNotFoundError:
        pass
    props = torch.cuda.get_device_properties(0)
    caps = DeviceCapabilities(
        vendor="nvidia",
        adapter=benchmark,
        device_type="cuda",
        index=0,
        name=props.name,
        arch=f"sm_{props.major}{props.minor}",
        compute_units=props.multi_processor_count,
        simd_width=getattr(props, "warp_size", 32),
        memory_bytes=props.total_memory,
        dtypes=frozenset({DType.FP32, DType.BF16, DType.FP16}),
        features=frozenset({Feature.TRITON}),
        shared_memory_per_block_bytes=getattr(props, "shared_memory_per_block_optin", None),
    )
    return caps, "torch.cuda.get_device_properties (no torchhal plugin declares Triton on cuda:0)"
