"""Ops: a plain-PyTorch reference and faster candidates per op, one module per op.

The core distribution registers these with a HAL through the `builtin-kernels` entry point
(`plugin.py`), the same path a vendor plugin's kernels take.
"""
