"""torchhal-intel: the Intel XPU adapter for torchhal.

Importing this package is free: torch.xpu is touched only when the HAL asks the adapter
(see `probe.py`, the one module that reads it).
"""

__version__ = "0.1.0"
