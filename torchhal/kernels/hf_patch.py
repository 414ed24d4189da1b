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
  PEFT plans by module name. The forward takes the KV cache as `cache` (transformers >= 5.24, which
  renamed the argument) or `past_key_values` (before), and refuses a Cache passed under any other
  name: a cache it did not update would leave attention with only the new keys.
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

The loss (`*ForCausalLM` models, kind "loss", path "lm_head"): the model instance's `forward` is
wrapped (an instance attribute, as for attention; it deep-copies and pickles with the model, and
`inspect.signature(model.forward)` stays transformers', which Trainer and generate read). Called
with `labels`, it runs the decoder as transformers' forward does and computes transformers'
causal-LM loss (`ForCausalLMLoss`: labels shifted left, `ignore_index` -100 or the one passed,
the mean over tokens not ignored, or the sum over `num_items_in_batch` when given, `shift_labels`
used as given, the positions `logits_to_keep` selects, an fp32 loss) through
`ops.linear_cross_entropy` on the final hidden states and lm_head's weight (and bias): the
(tokens, vocab) logits are never made, so **the output's `logits` is None**; the caller who needs
them with the loss passes `return_logits=True` (transformers' own forward and loss then run).
That is in training mode only: in eval mode (`model.eval()`, as Trainer.evaluate runs) the
forward is transformers' own, since evaluation reads the logits (Trainer builds predictions for
compute_metrics from them), as Liger-Kernel decides too. The
op computes the logits in fp32 (transformers rounds them to the model's dtype first, then upcasts)
and returns the loss in fp32. Under autocast, hidden states and weights are cast to the autocast
dtype first, as lm_head's matmul would be. transformers applies no label smoothing in this loss
(Trainer's label smoother and `compute_loss_func` pop the labels and take the logits), so neither
does the op. Without labels (inference, generate) transformers' forward runs
unchanged. What the op cannot compute exactly falls back to transformers' forward, logged once
and counted like attention's fallbacks: a loss function other than ForCausalLMLoss (a custom
`loss_type` or `model.loss_function`), a config with `final_logit_softcapping` (these families'
forward ignores it in 5.23 and 5.24; a version that applied it would make the fused loss wrong), an
lm_head that is not a plain nn.Linear with plain tensors and no hooks (PEFT, quantised, FSDP2 or
accelerate hooks), or a class forward replaced after patching.

Left as they are: the rotary embedding module (it makes cos/sin once per forward for every RoPE
variant transformers knows; their application is what goes through ops.rope), embeddings and
the lm_head module (its weight is what the fused loss reads), and a norm, MLP or attention module
with hooks or a forward replaced on the instance (accelerate's device_map and offload hooks) that
swapping or rewiring it would drop (an attention's registered hooks stay: its instance is kept).
`PatchReport` lists what was swapped and what was left, with reasons. `torchhal.kernels.patch` is
this module's `patch`.
Supports transformers >= 4.57 (tested with 4.57, 5.0, 5.17, 5.23 and 5.24; the loss swap with 4.57.1,
5.23 and 5.24).
"""

from __future__ import annotations

import copy
import inspect
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchhal import ops
from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry
from torchhal.kernels import nn as thnn

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED", "Left", "PatchReport", "Swap", "causal_lm_loss", "patch"]

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


def patch(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    mlp: bool = True,
    attention: bool = True,
    loss: bool = True,
) -> PatchReport:
    """Swap the modules of a Hugging Face Llama, Qwen2 or Mistral model for torchhal's, in place.

    Parameters are shared, not copied: optimizers, state_dicts and tied weights are unaffected.
    Call it before torch.compile or wrapping the model (FSDP, DDP), and on the model you call: the
    patched model gets its own copy of the config, so patching `model.model` of a *ForCausalLM
    leaves the outer model on the old config object (later edits to `model.config`, such as
    `use_cache`, would no longer reach the decoder). Raises UnsupportedError for
    other model types. Patching twice changes nothing the second time (reported as left).
    Each keyword set to False leaves that kind as transformers has it. `loss` (causal-LM models
    only): with labels, the forward returns transformers' loss computed by the fused
    ops.linear_cross_entropy and `logits=None` (see the module docstring).
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # loaded once anything was compiled
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        # its modules were swapped, but the loss forward silently was not (not a *ForCausalLM)
        raise InvalidArgumentError(
            f"torchhal.kernels.patch: got a torch.compile'd model (OptimizedModule of "
            f"{type(model._orig_mod).__name__}); patch the model before compiling it: "
            "patch(model); model = torch.compile(model)"
        )
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
    _patch_loss(model, family, report, loss)
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


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_HOOKED = (
    "has hooks or a forward replaced on the instance (accelerate's device_map/offload?) that a "
    "replacement would drop"
)


def _has_hooks(module: nn.Module) -> bool:
    """Whether `module` has hooks registered on it or its forward replaced on the instance (accelerate's
    device_map and offload hooks do that): what a module standing in for it, or a computation going
    around it, would not run."""
    return "forward" in vars(module) or any(getattr(module, h, None) for h in _HOOKS)


def _as_rms_norm(module: nn.Module) -> nn.Module | str:
    if _has_hooks(module):
        return _HOOKED
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
    if _has_hooks(module):  # its Linears are shared, hooks and all; its own hooks would be lost
        return _HOOKED
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


# --- the causal-LM loss through ops.linear_cross_entropy -------------------------------------------

LOSS_PATH = "lm_head"
_FUSED_NOW = "forward with labels: torchhal.ops.linear_cross_entropy, logits None"
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


def _causal_lm_class(model: nn.Module, family: _Family) -> type | None:
    """transformers' own `*ForCausalLM` class of the family, if the model is one (or a subclass)."""
    return next(
        (
            c
            for c in type(model).__mro__
            if c.__name__ == family.causal_lm and c.__module__.startswith("transformers.")
        ),
        None,
    )


def _is_own_forward(forward: Any, causal_lm: type) -> bool:
    """Whether `forward` is transformers' own forward of `causal_lm` (not overridden in a subclass, nor
    replaced on the class, as kernel libraries do). Eager code only: dynamo does not read __qualname__."""
    return (
        getattr(forward, "__module__", None) == causal_lm.__module__
        and getattr(forward, "__qualname__", None) == f"{causal_lm.__name__}.forward"
    )


def _patch_loss(model: nn.Module, family: _Family, report: PatchReport, enabled: bool) -> None:
    causal_lm = _causal_lm_class(model, family)
    if causal_lm is None:
        return  # a base model, or a head other than causal LM: no loss of the kind to swap
    if not enabled:
        why: str | None = "patch(..., loss=False)"
    elif isinstance(vars(model).get("forward"), _CausalLMForward):
        why = "already patched"
    elif "forward" in vars(model):
        why = "the instance's forward is already replaced (hooks?); transformers' forward left to it"
    elif not _is_own_forward(type(model).forward, causal_lm):
        why = f"{type(model).__name__}.forward is not transformers' {causal_lm.__name__}.forward"
    elif not isinstance(getattr(model, "lm_head", None), nn.Linear) or not isinstance(
        getattr(model, "model", None), nn.Module
    ):
        why = "no `model` decoder and nn.Linear `lm_head`"
    else:
        why = None
    if why is not None:
        report.left.append(Left(LOSS_PATH, "loss", why))
        return
    model.forward = _CausalLMForward(model, causal_lm)  # this instance only
    report.swapped.append(Swap(LOSS_PATH, "loss", "ForCausalLMLoss", _FUSED_NOW))


class _CausalLMForward:
    """A patched causal-LM model's forward: with labels in training mode, transformers' forward with
    its loss computed by ops.linear_cross_entropy and no logits; otherwise (in eval mode, or with
    `return_logits=True`, or where the
    fused loss cannot compute transformers' loss exactly) transformers' own forward. A class rather
    than a bound function so the model still pickles and deep-copies with the forward bound to the
    copy; `__signature__` is transformers' (Trainer keeps dataset columns and passes
    num_items_in_batch by it; generate decides on logits_to_keep by it)."""

    def __init__(self, model: nn.Module, causal_lm: type) -> None:
        self.model = model
        self.causal_lm = causal_lm
        self.own_forward: Any = type(model).forward  # transformers' own: patch checked it
        parameters = list(inspect.signature(type(model).forward).parameters.values())[1:]  # less self
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        self.positional = tuple(p.name for p in parameters if p.kind in positional)

    def __getstate__(self) -> dict[str, Any]:  # the function is looked up again, by name, on loading
        return {k: v for k, v in vars(self).items() if k != "own_forward"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        vars(self).update(state)
        forward = getattr(self.causal_lm, "forward", None)
        self.own_forward = forward if _is_own_forward(forward, self.causal_lm) else None

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(type(self.model).forward, self.model))

    def __call__(self, *args: Any, return_logits: bool = False, **kwargs: Any) -> Any:
        model = self.model
        transformers_forward = type(model).forward
        if return_logits or len(args) > len(self.positional):
            return transformers_forward(model, *args, **kwargs)
        named = dict(zip(self.positional, args, strict=False))
        if named.keys() & kwargs.keys():  # transformers' forward raises the TypeError
            return transformers_forward(model, *args, **kwargs)
        named.update(kwargs)
        if named.get("labels") is None or not model.training:  # evaluation reads the logits
            return transformers_forward(model, *args, **kwargs)
        reason = _why_not_fused(model, self.own_forward)
        if reason is not None:
            thnn._record_fallback(*reason)
            return transformers_forward(model, *args, **kwargs)
        return _fused_forward(model, named)


def _why_not_fused(model: nn.Module, own_forward: Any) -> tuple[str, str] | None:
    """(reason, explanation) where the fused loss would not be transformers' loss, else None."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    if type(model).forward is not own_forward:
        return "loss_forward", f"{type(model).__name__}.forward was replaced after patching"
    function = model.loss_function
    if function is not ForCausalLMLoss:
        name = getattr(function, "__qualname__", type(function).__name__)
        return "loss_function", f"the model's loss function is {name}, not transformers' ForCausalLMLoss"
    if getattr(model.config, "final_logit_softcapping", None) is not None:
        return (
            "loss_softcapping",
            "the config sets final_logit_softcapping, which the fused loss does not apply",
        )
    lm_head = model.lm_head
    if type(lm_head) is not nn.Linear:
        return (
            "loss_lm_head",
            f"lm_head is a {type(lm_head).__name__}, not a plain nn.Linear (PEFT, quantised?)",
        )
    if _has_hooks(lm_head):
        return "loss_lm_head", "lm_head has hooks or a replaced forward (FSDP, accelerate?) that must run"
    import torch.nn.modules.module as module_globals

    if any(getattr(module_globals, h, None) for h in _GLOBAL_HOOKS):
        return "loss_lm_head", "global module hooks are registered, and they must see lm_head run"
    if any(
        type(t) not in (torch.Tensor, nn.Parameter) for t in (lm_head.weight, lm_head.bias) if t is not None
    ):
        return "loss_lm_head", f"lm_head's weight is a {type(lm_head.weight).__name__} (sharded, quantised?)"
    return None


def _fused_forward(model: Any, named: dict[str, Any]) -> Any:
    """transformers' *ForCausalLM forward with labels (Llama, Qwen2 and Mistral's are alike: every
    argument but labels and logits_to_keep goes to the decoder), the logits and their loss replaced
    by ops.linear_cross_entropy."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    labels = named.pop("labels")
    logits_to_keep = named.pop("logits_to_keep", 0)
    return_dict = getattr(model.config, "return_dict", True)  # as transformers' @can_return_tuple
    passed = named.pop("return_dict", return_dict)
    if passed is not None:
        return_dict = passed
    outputs = model.model(**named)  # every other argument, as transformers' forward passes them
    hidden = _slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    lm_head = model.lm_head
    loss = causal_lm_loss(
        hidden,
        lm_head.weight,
        labels,
        lm_head.bias,
        num_items_in_batch=named.get("num_items_in_batch"),
        ignore_index=named.get("ignore_index", -100),
        shift_labels=named.get("shift_labels"),
    )
    # the output's cache field, named `cache` from transformers 5.24 on (the old name only warns)
    cache = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    output = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **{cache: getattr(outputs, cache)},
    )
    if return_dict:
        return output
    # to_tuple() drops None fields: without the logits slot, `loss, logits = out[:2]` would bind the cache
    loss_first, *rest = output.to_tuple()
    return (loss_first, None, *rest)


def _slice_logits_to_keep(hidden: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """The positions transformers projects onto the vocabulary (its own helper where it has one)."""
    from transformers import modeling_utils

    own = getattr(modeling_utils, "slice_logits_to_keep", None)
    if own is not None:
        return own(hidden, logits_to_keep)  # type: ignore[no-any-return]
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    return hidden[:, keep, :]


def causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss on the logits hidden @ weight.T + bias, without making them.

    Labels are shifted left (the last position gets ignore_index) unless `shift_labels` is given;
    the loss is the mean over tokens not ignored, or their sum divided by `num_items_in_batch`
    when given; fp32, as transformers' (the op computes the logits and the loss in fp32; fp64 for
    fp64 inputs, cast to fp32 here as transformers' loss is). Under autocast the op casts hidden,
    weight and bias to the autocast dtype, as the lm_head matmul would cast them.
    """
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    target = shift_labels.reshape(-1).to(weight.device)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = ops.linear_cross_entropy(
        hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction
    )
    loss = loss.float()
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
