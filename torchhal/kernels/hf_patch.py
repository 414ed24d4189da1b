"""`torchhal.kernels.patch(model)`: run a Hugging Face Llama, Qwen2 or Mistral model on torchhal's ops.

What changes, per instance (the transformers modules and classes are never modified, so other
models in the process, patched or not, keep their own behaviour):

- RMSNorm modules (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm) are replaced by
  `torchhal.kernels.nn.RMSNorm` holding the same `weight` Parameter.
- MLP modules with a SiLU activation are replaced by `nn.SwiGLUMLP` holding the same three
  Linear modules (gate_proj, up_proj, down_proj).
- Attention modules keep their class; their `forward` is rebound, on that instance, to
  `nn.rotary_attention`, and the model's attention implementation is set to "torchhal"
  (hf_attention.py: what runs, and where the fast path does not apply).
- Gradient checkpointing (`gradient_checkpointing_enable`, before or after the patch) recomputes
  each layer's forward under the `hal.use` block its forward ran in (checkpointing.py).
- `*ForCausalLM` models: with labels, in training mode, the forward computes transformers' loss
  through ops.linear_cross_entropy without making the logits (hf_loss.py: what is computed, and
  when transformers' own forward runs instead).

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

import sys
from collections.abc import Callable
from typing import Any, cast

from torch import nn

from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry
from torchhal.kernels import nn as thnn
from torchhal.kernels.checkpointing import keep_use_in_checkpointing
from torchhal.kernels.hf_attention import ATTN_IMPLEMENTATION, _rewire_attention, _use_torchhal_attention
from torchhal.kernels.hf_families import SUPPORTED, Left, PatchReport, Swap, _has_hooks
from torchhal.kernels.hf_loss import _patch_loss, causal_lm_loss

__all__ = ["ATTN_IMPLEMENTATION", "SUPPORTED", "Left", "PatchReport", "Swap", "causal_lm_loss", "patch"]

log = telemetry.get_logger("torchhal.kernels.patch")


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
    _keep_use_in_checkpointing(model, report)
    log.info("patched", model=report.model, swapped=len(report.swapped), left=len(report.left))
    return report


def _keep_use_in_checkpointing(model: nn.Module, report: PatchReport) -> None:
    """Gradient checkpointing (enabled now or later) recomputes under the forward's `hal.use`
    block; see `checkpointing.keep_use_in_checkpointing`."""
    if not hasattr(model, "_set_gradient_checkpointing"):
        return
    path, kind = "", "gradient_checkpointing"
    if keep_use_in_checkpointing(model):
        report.swapped.append(
            Swap(path, kind, "torch.utils.checkpoint", "recompute under the forward's hal.use block")
        )
    else:
        report.left.append(Left(path, kind, "already patched"))


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


_HOOKED = (
    "has hooks or a forward replaced on the instance (accelerate's device_map/offload?) that a "
    "replacement would drop"
)
"""Why a norm or MLP module with hooks is left as it is."""


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
    return thnn.SwiGLUMLP.sharing(*cast("list[nn.Linear]", projections))  # all nn.Linear: checked above
