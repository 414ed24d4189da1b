"""torchhal-amd: the AMD ROCm adapter for torchhal.

Importing this package is free: torch and amdsmi are touched only when the HAL asks the
adapter (see `probe.py`, the one module that reads them).
"""

__version__ = "0.1.0"
