"""`torchhal.kernels.patch(model)`: run a Hugging Face Llama, Qwen2 or Mistral model on torchhal's ops.

What changes, per instance (the transformers modules and classes are never modified, so other
models in the process, patched or not, keep their own behaviour):

- RMSNorm modules (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm) are replaced by
  `torchhal.kernels.nn.RMSNorm` holding the same `weight` Parameter.
- MLP modules with a SiLU activation are replaced by `nn.SwiGLUMLP` holding the same three
  Linear modules (gate_proj, up_proj, down_proj).
- Attention modules keep their class and Linear modules; their `forward` is rebound, on that
  instance, to `nn.rotary_attention`, which rotates q and k through ops.rope (Hugging Face's
  forward calls a module-level `apply_rotary_pos_emb` that cannot be swapped per instance).
  Keeping the instance, rather than replacing it with `nn.Attention`, keeps what transformers
  keys on the class: `output_attentions` capture hooks, `_no_split_modules`, tensor-parallel and
  PEFT plans by module name.
- The model gets its own copy of its config (models built from one config object share it) and
  its attention implementation is set to "torchhal": an attention function registered with
  transformers' `AttentionInterface` under that name, and a mask function registered with
  `AttentionMaskInterface`. The mask function returns None when the mask is exactly causal
  (with the layer's sliding window, bottom-right aligned as after a KV cache), and the mask
  SDPA takes otherwise (padding, packed sequences, static-cache slots, custom masks). The
  attention function runs ops.attention (GQA, no repeat_kv) for None and falls back to
  transformers' own SDPA attention (eager when attention weights are requested) with the mask,
  logged once per reason and counted as `nn.FALLBACK_COUNTER`; dropout > 0 in training falls
  back the same way. A patched model never computes a mask it was given as if it were causal.

Where the fast path does not apply, by transformers' own rules: decoding with a static cache
(transformers materialises the mask for compiled decoding; its empty slots need it anyway), and a
model compiled whole with torch.compile (transformers cannot rule out packed sequences while
tracing, so it always builds a mask; its own SDPA path loses `is_causal` the same way). Both fall
back, counted; compiling the decoder layers keeps the fast path.

Left as they are: the rotary embedding module (it makes cos/sin once per forward for every RoPE
variant transformers knows; their application is what goes through ops.rope), embeddings,
lm_head and the loss. `PatchReport` lists what was swapped and what was left, with reasons.
`torchhal.kernels.patch` is this module's `patch`. Supports transformers >= 4.57 (tested with
4.57, 5.0, 5.17 and 5.23).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchhal.hal_core import UnsupportedError, telemetry
from torchhal.kernels import nn as thnn

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED", "Left", "PatchReport", "Swap", "patch"]

ATTN_IMPLEMENTATION = "torchhal"

log = telemetry.get_logger("torchhal.kernels.patch")


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


SUPPORTED: dict[str, _Family] = {
    "llama": _Family("LlamaRMSNorm", "LlamaMLP", "LlamaAttention", _no_window),
    "qwen2": _Family("Qwen2RMSNorm", "Qwen2MLP", "Qwen2Attention", _own_window),
    "mistral": _Family("MistralRMSNorm", "MistralMLP", "MistralAttention", _config_window),
}
"""Model types (config.model_type) `patch` handles, with the class names of their modules."""


@dataclass(frozen=True)
class Swap:
    path: str  # module path in the model, as named_modules() gives it
    kind: str  # "rms_norm", "mlp" or "attention"
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


def patch(
    model: nn.Module, *, rms_norm: bool = True, mlp: bool = True, attention: bool = True
) -> PatchReport:
    """Swap the modules of a Hugging Face Llama, Qwen2 or Mistral model for torchhal's, in place.

    Parameters are shared, not copied: optimizers, state_dicts and tied weights are unaffected.
    Call it before torch.compile or wrapping the model (FSDP, DDP). Raises UnsupportedError for
    other model types. Patching twice changes nothing the second time (reported as left).
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = SUPPORTED.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise UnsupportedError(
            f"torchhal.kernels.patch: model type {model_type!r} ({type(model).__name__}) is not "
            f"supported; supported: {', '.join(SUPPORTED)}"
        )
    before = getattr(config, "_attn_implementation", None)
    report = PatchReport(type(model).__name__, str(model_type), (before, before))
    replacements: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        name = type(module).__name__
        if name == family.norm:
            _match(report, replacements, path, module, "rms_norm", rms_norm, _as_rms_norm)
        elif name == family.mlp:
            _match(report, replacements, path, module, "mlp", mlp, _as_swiglu)
        elif name == family.attention:
            _match(report, replacements, path, module, "attention", attention, _rewire_attention(family))
        elif "Rotary" in name:
            report.left.append(
                Left(path, "rotary_embedding", "cos/sin made once per forward by transformers (any RoPE "
                     "variant); attention applies them through ops.rope")
            )  # fmt: skip
    for path, new in replacements:
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, new)
    if attention and report.count("attention"):
        _use_torchhal_attention(model, report)
    log.info("patched", model=report.model, swapped=len(report.swapped), left=len(report.left))
    return report


def _match(
    report: PatchReport,
    replacements: list[tuple[str, nn.Module]],
    path: str,
    module: nn.Module,
    kind: str,
    enabled: bool,
    convert: Callable[[nn.Module], nn.Module | str | None],
) -> None:
    """Convert one recognised module: a replacement, None (rewired in place) or why it is left."""
    if not enabled:
        report.left.append(Left(path, kind, f"patch(..., {kind}=False)"))
        return
    result = convert(module)
    if isinstance(result, str):
        report.left.append(Left(path, kind, result))
        return
    if result is not None:
        replacements.append((path, result))
    now = type(result).__qualname__ if result is not None else "forward: torchhal.kernels.nn.rotary_attention"
    report.swapped.append(Swap(path, kind, type(module).__name__, now))


def _as_rms_norm(module: nn.Module) -> nn.Module | str:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return "no 1-D `weight` Parameter and float `variance_epsilon`"
    norm = thnn.RMSNorm(weight.shape[0], eps)
    norm.weight = weight  # the same Parameter
    return norm


def _is_silu(act: Any) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _as_swiglu(module: nn.Module) -> nn.Module | str:
    projections = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(p, nn.Linear) for p in projections):
        return "gate_proj, up_proj and down_proj are not all nn.Linear"
    act = getattr(module, "act_fn", None)
    if not _is_silu(act):
        return f"activation {type(act).__name__} is not SiLU"
    return thnn.SwiGLUMLP.sharing(*projections)


_ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")


def _rewire_attention(family: _Family) -> Callable[[nn.Module], str | None]:
    def rewire(module: nn.Module) -> str | None:
        if isinstance(vars(module).get("forward"), _AttentionForward):
            return "already patched"
        missing = [a for a in _ATTENTION_ATTRS if not hasattr(module, a)]
        if missing:
            return f"missing attributes {missing}"
        module.forward = _AttentionForward(module, family.window)  # this instance only
        return None

    return rewire


class _AttentionForward:
    """A patched Hugging Face attention module's forward: its own projections and cache, RoPE via
    ops.rope, and the attention function of the model's current implementation (looked up on every
    call, as the original forward does, so switching the model back to "sdpa" or "eager" keeps
    masks right). A class rather than a bound function so the model still pickles (torch.save)
    and deep-copies with the forward bound to the copy."""

    def __init__(self, module: nn.Module, window: Callable[[nn.Module], int | None]) -> None:
        self.module = module
        self.window = window

    def __call__(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.module
        return thnn.rotary_attention(
            module, hidden_states, position_embeddings, attention_mask, past_key_values,
            attention_fn=_attention_interface(module), sliding_window=self.window(module), **kwargs,
        )  # fmt: skip


def _attention_interface(module: nn.Module) -> thnn.AttentionFn:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    implementation = module.config._attn_implementation
    if implementation in (None, "eager"):
        return _eager(module)
    return ALL_ATTENTION_FUNCTIONS[implementation]  # type: ignore[no-any-return]


def _eager(module: nn.Module) -> thnn.AttentionFn:
    """The eager attention function of the module's own modeling file."""
    return sys.modules[type(module).__module__].eager_attention_forward  # type: ignore[no-any-return]


def _hf_fallback(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' SDPA attention with the mask; its eager attention when weights are requested
    (SDPA returns none), with a boolean mask made additive as eager expects."""
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            blocked = torch.finfo(query.dtype).min
            attention_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, blocked
            )
        return _eager(module)(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]


def torchhal_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention function registered as "torchhal": ops.attention, or transformers' own path."""
    return thnn.attention_function(module, query, key, value, attention_mask, fallback=_hf_fallback, **kwargs)


def _plain_causal(
    *,
    kv_length: int,
    q_length: int | None = None,
    q_offset: Any = 0,
    cache_position: torch.Tensor | None = None,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    allow_is_causal_skip: bool = True,
    config: Any = None,
    **_: Any,
) -> bool:
    """Whether the mask transformers asks for is exactly ops.attention's causal mask (with the layer's
    sliding window), so None can stand for it.

    transformers turns `allow_is_causal_skip` off whenever it combines the causal pattern with
    anything (packed sequences, extra mask functions, compiled decoding with a static cache). What
    is left: the pattern is causal (`causal_mask_function`), or causal within the config's sliding
    window (`local_size`; chunked attention passes its chunk size there, which is refused); the
    positions line up bottom-right (true for dynamic caches, full or sliding; not for a static cache
    with empty slots); and no key in range is padding. Before transformers 5.1 the queries' positions
    come as `cache_position` (a tensor) rather than q_length and q_offset.
    """
    from transformers.masking_utils import causal_mask_function

    if not allow_is_causal_skip or getattr(config, "model_type", None) not in SUPPORTED:
        return False
    if local_size is None:
        if mask_function is not causal_mask_function:
            return False
    elif local_size != getattr(config, "sliding_window", None):
        return False
    compiling = torch.compiler.is_compiling()
    if cache_position is not None:
        q_length = cache_position.shape[0]
        if kv_length == q_length and kv_offset == 0:
            q_offset = 0  # keys are the queries themselves: no cache, or its first fill
        elif compiling:
            return False  # reading the positions would break the graph
        else:
            first, last = cache_position[[0, -1]].tolist()
            if last - first != q_length - 1:
                return False
            q_offset = first
    if not all(isinstance(v, int) for v in (q_length, kv_length, q_offset, kv_offset)):
        return False  # traced offsets (static caches under torch.compile)
    if q_offset - kv_offset != kv_length - q_length:
        return False
    if attention_mask is None:
        return True
    if compiling or attention_mask.dim() != 2:
        return False  # reading the padding mask's values would break the graph
    if attention_mask.shape[-1] < kv_offset + kv_length:
        return False
    return bool(attention_mask[:, kv_offset : kv_offset + kv_length].all())


def torchhal_mask(**kwargs: Any) -> torch.Tensor | None:
    """The mask function registered as "torchhal": None for a plain causal mask, else SDPA's boolean mask."""
    from transformers.masking_utils import sdpa_mask

    if _plain_causal(**kwargs):
        return None
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(**kwargs)  # type: ignore[no-any-return]


def register() -> None:
    """Register the "torchhal" attention and mask functions with transformers (idempotent).

    Registration adds a name; only models whose config selects it use it.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, torchhal_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, torchhal_mask)


def _use_torchhal_attention(model: nn.Module, report: PatchReport) -> None:
    register()
    shared = model.config
    own = copy.deepcopy(shared)  # other models built from the same config object must not change
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = own
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        setter(ATTN_IMPLEMENTATION)
    else:
        own._attn_implementation = ATTN_IMPLEMENTATION
    after = getattr(own, "_attn_implementation", None)
    report.attn_implementation = (report.attn_implementation[0], after)
    if after != ATTN_IMPLEMENTATION:  # attention modules still use ops.rope and a correct mask
        report.left.append(
            Left("", "attention_function", f"transformers kept attention implementation {after!r}")
        )
