"""Attention of patched models, run by transformers on every forward; hf_patch.py only wires it in.

Attention modules keep their class and Linear modules; their `forward` is rebound, on that
instance, to `nn.rotary_attention`, which rotates q and k through ops.rope (Hugging Face's
forward calls a module-level `apply_rotary_pos_emb` that cannot be swapped per instance).
Keeping the instance, rather than replacing it with `nn.Attention`, keeps what transformers
keys on the class: `output_attentions` capture hooks, `_no_split_modules`, tensor-parallel and
PEFT plans by module name. The forward takes the KV cache as `cache` (transformers >= 5.24, which
renamed the argument) or `past_key_values` (before), and refuses a Cache passed under any other
name: a cache it did not update would leave attention with only the new keys.

The model gets its own copy of its config (models built from one config object share it) and
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
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from torchhal.kernels import nn as thnn
from torchhal.kernels.hf_families import SUPPORTED, Left, PatchReport, _Family

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["ATTN_IMPLEMENTATION", "register", "torchhal_attention", "torchhal_mask"]

ATTN_IMPLEMENTATION = "torchhal"


_ATTENTION_ATTRS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling", "layer_idx", "config")


def _rewire_attention(family: _Family) -> Callable[[nn.Module], str | None]:
    def rewire(module: nn.Module) -> str | None:
        if isinstance(vars(module).get("forward"), _AttentionForward):
            return "already patched"
        if "forward" in vars(module):  # hooks registered on it stay: the instance is kept
            return (
                "its forward is replaced on the instance (accelerate's device_map/offload?); "
                "rewiring would drop it"
            )
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
    and deep-copies with the forward bound to the copy. Loaded in a process that never patched a
    model, it registers the "torchhal" attention and mask functions, which the model's config
    names: transformers raised KeyError 'torchhal' at the loaded model's first forward."""

    def __init__(self, module: nn.Module, window: Callable[[nn.Module], int | None]) -> None:
        self.module = module
        self.window = window

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        register()

    def __call__(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        *,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        module = self.module
        return thnn.rotary_attention(
            module, hidden_states, position_embeddings, attention_mask,
            thnn.kv_cache(module, past_key_values, cache, kwargs),
            attention_fn=_attention_interface(module), sliding_window=self.window(module), **kwargs,
        )  # fmt: skip


def _attention_interface(module: nn.Module) -> thnn.AttentionFn:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    # nn.Module's __getattr__ is typed Tensor | Module; a Hugging Face module's config is this
    implementation = cast("PretrainedConfig", module.config)._attn_implementation
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
    (SDPA returns none), with a boolean mask made additive as eager expects. A call with `softcap`
    or `s_aux` (attention sinks) runs `nn.masked_attention`, which computes both: transformers' SDPA
    refuses the first and ignored the second (a model of another family set to "torchhal" by hand)."""
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        return thnn.masked_attention(module, query, key, value, attention_mask, **kwargs)
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            blocked = torch.finfo(query.dtype).min
            attention_mask = torch.zeros((), dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, blocked
            )
        return _eager(module)(module, query, key, value, attention_mask, **kwargs)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


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
    if q_offset - kv_offset != kv_length - cast(int, q_length):  # an int: checked just above
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
    return sdpa_mask(**kwargs)


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
    else:  # nn.Module's __getattr__ says Tensor | Module; a Hugging Face model's config is this
        cast("PretrainedConfig", own)._attn_implementation = ATTN_IMPLEMENTATION
    after = getattr(own, "_attn_implementation", None)
    report.attn_implementation = (report.attn_implementation[0], after)
    if after != ATTN_IMPLEMENTATION:  # attention modules still use ops.rope and a correct mask
        report.left.append(
            Left("", "attention_function", f"transformers kept attention implementation {after!r}")
        )
