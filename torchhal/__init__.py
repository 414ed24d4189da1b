"""torchhal: one PyTorch code path across NVIDIA, AMD, Intel, simulated ASICs and the CPU.

Importing this package does no device work and loads no plugin: `HardwareAbstractionLayer()`
discovers adapters on first use. Names are resolved lazily to keep the import cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["DeviceRequirements", "HardwareAbstractionLayer", "__version__", "ops", "telemetry"]

# imported on first attribute access, as `torch.nn` is reachable after `import torch`
_SUBPACKAGES = frozenset({"ops", "telemetry", "kernels", "distributed", "evaluation", "testing"})

if TYPE_CHECKING:
    from torchhal import ops, telemetry
    from torchhal.hal_core.capabilities import DeviceRequirements
    from torchhal.hal_core.hal import HardwareAbstractionLayer


def __getattr__(name: str) -> Any:
    if name == "HardwareAbstractionLayer":
        from torchhal.hal_core.hal import HardwareAbstractionLayer

        return HardwareAbstractionLayer
    if name == "DeviceRequirements":
        from torchhal.hal_core.capabilities import DeviceRequirements

        return DeviceRequirements
    if name in _SUBPACKAGES:  # `torchhal.kernels.patch(model)` after `import torchhal`, as torch.nn
        return importlib.import_module(f"torchhal.{name}")
    raise AttributeError(f"module 'torchhal' has no attribute {name!r}")
