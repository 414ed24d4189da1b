"""Ops: a plain-PyTorch reference and faster candidates per op, one module per op.

The core distribution registers these with a HAL through the `builtin-kernels` entry point
(`plugin.py`), the same path a vendor plugin's kernels take.

Three names are loaded on first use, so importing this package stays cheap and never imports
transformers: `nn` (drop-in torch.nn modules running on torchhal.ops) and `patch` (call it on a
Hugging Face Llama, Qwen2 or Mistral model: `torchhal.kernels.patch(model)`). `checkpoint` is
torch.utils.checkpoint.checkpoint recomputing under the forward's `hal.use` block.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["checkpoint", "nn", "patch"]


def __getattr__(name: str) -> Any:
    if name == "nn":
        return importlib.import_module(f"{__name__}.nn")  # binds the submodule as our attribute
    if name == "checkpoint":
        return importlib.import_module(f"{__name__}.checkpointing").checkpoint
    if name == "patch":
        return importlib.import_module(f"{__name__}.hf_patch").patch
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
