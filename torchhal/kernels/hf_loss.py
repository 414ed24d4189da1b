"""The fused causal-LM loss a patched *ForCausalLM runs; hf_patch.py only installs its forward.

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
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn

from torchhal import ops
from torchhal.kernels import nn as thnn
from torchhal.kernels.hf_families import Left, PatchReport, Swap, _Family, _has_hooks

__all__ = ["LOSS_PATH", "causal_lm_loss"]

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
    found = _causal_lm_inside(model, family)
    if found is None:
        return  # a base model, or a head other than causal LM: no loss of the kind to swap
    path, model, causal_lm = found
    where = f"{path}.{LOSS_PATH}" if path else LOSS_PATH
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
        report.left.append(Left(where, "loss", why))
        return
    model.forward = _CausalLMForward(model, causal_lm)  # this instance only
    report.swapped.append(Swap(where, "loss", "ForCausalLMLoss", _FUSED_NOW))


def _causal_lm_inside(model: nn.Module, family: _Family) -> tuple[str, nn.Module, type] | None:
    """The model if it is the family's causal LM, else the first one inside it (the model a
    wrapper such as PEFT's PeftModel calls): its path, itself and its transformers class."""
    for path, module in model.named_modules():
        causal_lm = _causal_lm_class(module, family)
        if causal_lm is not None:
            return path, module, causal_lm
    return None


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
