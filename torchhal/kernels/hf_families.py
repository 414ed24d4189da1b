"""What the three patch modules share: the model families `patch` knows (their module class
names and where each reads its sliding window), the report `patch` returns, and the test for a
module that hooks or a replaced forward make unsafe to swap or go around. Apart so that
hf_attention.py and hf_loss.py need not import hf_patch.py, which imports them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["SUPPORTED", "Left", "PatchReport", "Swap"]


def _no_window(module: nn.Module) -> int | None:
    return None


def _own_window(module: nn.Module) -> int | None:  # Qwen2: per layer, None on full-attention layers
    return getattr(module, "sliding_window", None)


def _config_window(module: nn.Module) -> int | None:  # Mistral: the config's, read on every call
    return getattr(module.config, "sliding_window", None)


@dataclass(frozen=True)
class _Family:
    norm: str
    mlp: str
    attention: str
    window: Callable[[nn.Module], int | None]  # the sliding window Hugging Face's forward passes
    causal_lm: str  # the causal-LM class whose forward the fused loss stands in for


SUPPORTED: dict[str, _Family] = {
    "llama": _Family("LlamaRMSNorm", "LlamaMLP", "LlamaAttention", _no_window, "LlamaForCausalLM"),
    "qwen2": _Family("Qwen2RMSNorm", "Qwen2MLP", "Qwen2Attention", _own_window, "Qwen2ForCausalLM"),
    "mistral": _Family(
        "MistralRMSNorm", "MistralMLP", "MistralAttention", _config_window, "MistralForCausalLM"
    ),
}
"""Model types (config.model_type) `patch` handles, with the class names of their modules."""


@dataclass(frozen=True)
class Swap:
    path: str  # module path in the model, as named_modules() gives it
    kind: str  # "rms_norm", "mlp", "attention" or "loss"
    original: str  # class name of what was there
    now: str  # what runs now


@dataclass(frozen=True)
class Left:
    path: str
    kind: str
    reason: str


@dataclass
class PatchReport:
    """What `patch` did to one model: swapped modules, modules left as they were, and why."""

    model: str
    model_type: str
    attn_implementation: tuple[str | None, str | None]  # (before, after)
    swapped: list[Swap] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.swapped)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_type": self.model_type,
            "attn_implementation": list(self.attn_implementation),
            "swapped": [vars(s) for s in self.swapped],
            "left": [vars(x) for x in self.left],
        }

    def __str__(self) -> str:
        kinds = sorted({s.kind for s in self.swapped})
        lines = [
            f"{self.model} ({self.model_type}): "
            + (", ".join(f"{self.count(k)} {k}" for k in kinds) or "nothing")
            + " swapped; attention implementation "
            + " -> ".join(str(a) for a in dict.fromkeys(self.attn_implementation))
        ]
        lines += [f"  left {x.path} ({x.kind}): {x.reason}" for x in self.left]
        return "\n".join(lines)


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _has_hooks(module: nn.Module) -> bool:
    """Whether `module` has hooks registered on it or its forward replaced on the instance (accelerate's
    device_map and offload hooks do that): what a module standing in for it, or a computation going
    around it, would not run."""
    return "forward" in vars(module) or any(getattr(module, h, None) for h in _HOOKS)
