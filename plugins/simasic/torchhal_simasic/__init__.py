"""torchhal-simasic: a simulated systolic-array ASIC for torchhal, and the template adapter.

Numerics are real (torch on the CPU); time and memory are modelled from a spec file.
"""

__version__ = "0.1.0"
