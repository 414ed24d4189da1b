"""Drop-in `torch.nn` modules whose math runs through `torchhal.ops`.

Each module computes what its Hugging Face (or `torch.nn`) namesake computes, with parameters
under the same names, so a state_dict of the original loads into it and `torchhal.kernels.patch`
can swap modules of a loaded model while sharing their Parameters. The ops dispatch through the
default HAL (or the one of an active `hal.use(device)` block), so each call runs the best kernel
the device offers and falls back to the reference where none fits.

Attention is the one module with a choice to make: `torchhal.ops.attention` expresses causal
attention (bottom-right aligned, optionally a sliding window) and nothing else. `attention_function`
takes Hugging Face's attention-interface arguments and runs ops.attention when the call means
exactly that; anything else (an explicit mask: padding, packed sequences, a custom 4-D mask;
dropout while training; requested attention weights; a non-causal module) goes to a fallback that
computes it with the mask, and is logged once per reason and counted (`FALLBACK_COUNTER`), so a
fast path never stands in for a case it cannot compute.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import nn

from torchhal import ops
from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry
from torchhal.hal_core.kernels import is_finite_number
from torchhal.kernels.autograd import (
    _AUTOCAST_DEVICE_TYPES,
    _any_autocast,
    _autocast_off,
    _is_compiling,
    run_while_traced,
)

__all__ = [
    "FALLBACK_COUNTER",
    "Attention",
    "LayerNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "SwiGLUMLP",
    "apply_rotary",
    "attention_function",
    "kv_cache",
    "masked_attention",
    "rotary_attention",
]

FALLBACK_COUNTER = "torchhal.nn.fallback"
"""telemetry counter of module calls torchhal.ops could not express, with attribute `reason`."""

log = telemetry.get_logger("torchhal.kernels.nn")
_warned: set[str] = set()


def _normalized_size(
    module: str, normalized_shape: int | Sequence[int] | None, hidden_size: int | None = None
) -> int:
    """The size of the last dimension: these norms normalise over it alone (torch.nn's take a shape
    of several dimensions, the ops do not). Given as torch.nn names it (`normalized_shape`) or as
    Hugging Face's norms do (`hidden_size=`, keyword only), not both."""
    if (normalized_shape is None) == (hidden_size is None):
        raise InvalidArgumentError(
            f"{module}: give normalized_shape (torch.nn's name) or hidden_size (Hugging Face's), one of "
            f"them; got normalized_shape={normalized_shape!r}, hidden_size={hidden_size!r}"
        )
    size = normalized_shape if normalized_shape is not None else hidden_size
    shape = (size,) if isinstance(size, int) else tuple(size)  # type: ignore[arg-type]
    if len(shape) != 1:
        raise UnsupportedError(
            f"{module}: normalises over the last dimension only, got normalized_shape={normalized_shape}"
        )
    return shape[0]


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (Llama's RMSNorm).

    Parameter `weight` as Hugging Face names it; constructor as torch.nn.RMSNorm's, default eps
    Hugging Face's. The op computes in fp32 and rounds once to x's dtype; Hugging Face rounds the
    normalised x before the weight multiply, so in bf16 the two differ by about one rounding (ours
    is the closer to the exact value). With x and weight in different dtypes (autocast with fp32
    weights) the op does not apply (it changes no dtype silently): the module then computes Hugging
    Face's formula in PyTorch, output in the promoted dtype, as the original would, and counts the
    fallback (FALLBACK_COUNTER, logged once). Autocast leaves Hugging Face's module alone (it is
    elementwise math), so this one returns under autocast what it returns outside it, where
    ops.rms_norm and torch.nn.RMSNorm follow F.rms_norm's autocast policy (fp32 out on CUDA and
    XPU, where torch's autocast lists it). `eps=None` means what torch.nn.RMSNorm's does: the
    epsilon of the dtype the norm computes in (fp32 for bf16/fp16 x).
    """

    weight: nn.Parameter | None

    def __init__(
        self,
        normalized_shape: int | Sequence[int] | None = None,
        eps: float | None = 1e-6,
        elementwise_affine: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        hidden_size: int | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (_normalized_size("RMSNorm", normalized_shape, hidden_size),)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        weight = torch.empty(self.normalized_shape, device=device, dtype=dtype)
        self.register_parameter("weight", nn.Parameter(weight) if elementwise_affine else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight = 1, as torch.nn.RMSNorm's (meta-device init calls it after to_empty())."""
        if self.weight is not None:
            nn.init.ones_(self.weight)

    @property
    def variance_epsilon(self) -> float | None:
        """Hugging Face's name for eps, for code that reads or sets it on the module."""
        return self.eps

    @variance_epsilon.setter
    def variance_epsilon(self, eps: float | None) -> None:
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps if self.eps is None else self.eps
        weight = self.weight if self.weight is not None else x.new_ones(self.normalized_shape)
        if x.dtype != weight.dtype and x.dtype.is_floating_point:  # ops.rms_norm refuses the rest
            _record_mixed_dtypes("rms_norm", x, weight, "Hugging Face's formula")
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            return weight * normed.to(x.dtype)
        if _is_compiling():  # Dynamo cannot trace _autocast_off; torch.autocast it traces
            device_type = x.device.type
            if device_type in _AUTOCAST_DEVICE_TYPES and torch.is_autocast_enabled(device_type):
                with torch.autocast(device_type, enabled=False):  # the op reads x's device type only
                    return ops.rms_norm(x, weight, eps)
            return ops.rms_norm(x, weight, eps)
        if _any_autocast():  # Hugging Face's dtype, not the op's autocast policy (see the docstring)
            with _autocast_off():
                return ops.rms_norm(x, weight, eps)
        return ops.rms_norm(x, weight, eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class LayerNorm(nn.Module):
    """torch.nn.LayerNorm over the last dimension (parameters `weight`, `bias`), through ops.layer_norm.

    Constructor as torch.nn.LayerNorm's. Without a bias (`bias=False`, `elementwise_affine=False`)
    or weight the op gets zeros or ones that are not part of the state_dict. A bf16/fp16 x with fp32
    parameters (autocast with fp32 weights), the one mix of dtypes torch's layer_norm computes,
    runs torch's layer_norm (fp32 math, output in x's dtype, or as autocast decides), counted and
    logged once: the op changes no dtype.
    """

    weight: nn.Parameter | None
    bias: nn.Parameter | None

    def __init__(
        self,
        normalized_shape: int | Sequence[int] | None = None,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        hidden_size: int | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (_normalized_size("LayerNorm", normalized_shape, hidden_size),)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        empty = torch.empty(self.normalized_shape, device=device, dtype=dtype)
        self.register_parameter("weight", nn.Parameter(empty) if elementwise_affine else None)
        self.register_parameter("bias", nn.Parameter(empty.clone()) if elementwise_affine and bias else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """weight = 1, bias = 0, as torch.nn.LayerNorm's (meta-device init calls it after to_empty())."""
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight if self.weight is not None else x.new_ones(self.normalized_shape)
        if x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32:
            _record_mixed_dtypes("layer_norm", x, weight, "torch's layer_norm")
            return nn.functional.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)
        bias = self.bias if self.bias is not None else torch.zeros_like(weight)
        return ops.layer_norm(x, weight, bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape[0]}, eps={self.eps}, elementwise_affine={self.elementwise_affine}, "
            f"bias={self.bias is not None}"
        )


def _reset_linears(module: nn.Module) -> None:
    """Each child Linear's reset_parameters, in construction order, so meta-device init (to_empty(),
    then reset_parameters()) draws what construction under the same seed would."""
    for linear in module.children():
        linear.reset_parameters()  # type: ignore[operator]


class SwiGLUMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), the Llama/Qwen2/Mistral MLP.

    The three Linear layers keep Hugging Face's names; the gated activation runs as one op
    (ops.swiglu), which saves the activation's intermediate tensors in training.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        made = {"device": device, "dtype": dtype}  # torch.nn's factory keywords
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **made)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias, **made)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias, **made)

    @classmethod
    def sharing(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear) -> SwiGLUMLP:
        """A SwiGLUMLP made of these Linear modules themselves (same Parameters, no copy)."""
        mlp = cls.__new__(cls)
        nn.Module.__init__(mlp)
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = gate_proj, up_proj, down_proj
        return mlp

    def reset_parameters(self) -> None:
        _reset_linears(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # nn.Module.__call__ returns Any
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))  # type: ignore[no-any-return]


class RotaryEmbedding(nn.Module):
    """cos and sin of rotary position embeddings for given positions, as Hugging Face's default RoPE.

    `forward(x, position_ids)` returns (cos, sin) of shape (batch, seq, head_dim) in x's dtype,
    angles computed in fp32: position * theta^(-2i/head_dim), repeated in both halves (the
    rotate-half convention). `attention_scaling` multiplies both, as Hugging Face's scaled RoPE
    variants do. Made once per model and shared by its layers; `apply_rotary` rotates q and k.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float = 10000.0, *, attention_scaling: float = 1.0) -> None:
        super().__init__()
        if head_dim < 0 or head_dim % 2:
            raise InvalidArgumentError(f"RotaryEmbedding: head_dim must be even and >= 0, got {head_dim}")
        if not is_finite_number(theta) or theta <= 0:  # theta**(-2i/d) is NaN or inf for the rest
            raise InvalidArgumentError(f"RotaryEmbedding: theta must be a finite number > 0, got {theta!r}")
        self.head_dim, self.theta, self.attention_scaling = head_dim, theta, attention_scaling
        self.register_buffer("inv_freq", self._inv_freq(device=None), persistent=False)

    def _inv_freq(self, device: torch.device | None) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float, device=device) / self.head_dim
        return 1.0 / self.theta**exponents

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Recompute inv_freq, which no state_dict holds (non-persistent, as Hugging Face's): after
        meta-device construction and to_empty() it is uninitialised memory."""
        self.inv_freq.copy_(self._inv_freq(self.inv_freq.device))

    @torch.no_grad()  # position tables: ops.rope gives them no gradient
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(x.dtype), sin.to(x.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, attention_scaling={self.attention_scaling}"


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ops.rope on q (batch, heads_q, seq, dim) and k; cos/sin as RotaryEmbedding returns them
    (batch, seq, dim), or already broadcastable to (batch, 1, seq, dim)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return ops.rope(q, k, cos, sin)


AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
"""Hugging Face's attention-interface contract: (module, query, key, value, attention_mask, *,
dropout, scaling, **kwargs) -> (output (batch, seq_q, heads_q, dim), attention weights or None)."""

_UNSUPPORTED_KWARGS = ("softcap", "position_bias", "s_aux")


def _why_not_exact(
    module: nn.Module, attention_mask: Any, dropout: float, kwargs: dict[str, Any]
) -> str | None:
    """Why ops.attention(causal=True) cannot compute this call exactly, or None when it can."""
    if attention_mask is not None:
        return "attention_mask"  # padding, packed sequences or a custom mask
    if dropout:
        return "dropout"
    config = getattr(module, "config", None)
    if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
        return "output_attentions"
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return "not_causal"
    return next((key for key in _UNSUPPORTED_KWARGS if kwargs.get(key) is not None), None)


def _record_fallback(reason: str, why: str) -> None:
    """Count a module call that falls back (FALLBACK_COUNTER, attribute `reason`) and log it once per
    reason and process: a padded batch every step is not news.

    While Dynamo traces, neither the logger nor the counter can be traced (the counter's value became
    a guard: one recompilation per call, FailOnRecompileLimitHit at the 9th under fullgraph), so both
    run once per traced graph, in `_record_traced`: the count with attribute `compiled="true"` (each
    graph compiled with the fallback counts once, not each of its calls) and the warning, if not
    said yet."""
    if _is_compiling():
        _record_traced(reason, why)
        return
    telemetry.count(FALLBACK_COUNTER, reason=reason)
    _warn_once(reason, why)


def _warn_once(reason: str, why: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        log.warning(
            f"module falls back to plain PyTorch: {why} (counted in telemetry, logged once per reason)",
            reason=reason,
            counter=FALLBACK_COUNTER,
        )


@run_while_traced
def _record_traced(reason: str, why: str) -> None:
    """`_record_fallback` while Dynamo traces: Dynamo calls this itself, once per trace
    (`run_while_traced`)."""
    telemetry.count(FALLBACK_COUNTER, reason=reason, compiled="true")
    _warn_once(reason, why)


def _record_mixed_dtypes(op: str, x: torch.Tensor, weight: torch.Tensor, instead: str) -> None:
    """Count a norm whose x and weight dtypes differ (autocast with fp32 weights): ops.<op> changes no
    dtype, so `instead` computes it in plain PyTorch."""
    _record_fallback(
        f"{op}_mixed_dtypes",
        f"x is {x.dtype} but weight {weight.dtype} (autocast?); ops.{op} changes no dtype, so {instead} runs",
    )


def _window(sliding_window: int | None) -> tuple[int, int] | None:
    """Hugging Face's sliding window W lets query i see keys i - W < j <= i: W keys, itself included,
    which is ops.attention's window=(W - 1, 0)."""
    if sliding_window is None:
        return None
    if sliding_window < 1:
        raise InvalidArgumentError(f"attention: sliding_window must be >= 1, got {sliding_window}")
    return (sliding_window - 1, 0)


def masked_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with an explicit mask in plain PyTorch: the fallback of modules used on their own.

    attention_mask is boolean (True: may attend) or additive float, broadcastable to (batch,
    heads_q, seq_q, seq_k). Weights are materialised only when `output_attentions` asks for them or
    one of Hugging Face's score modifiers is given, each as transformers' eager attention of the
    model that has it computes it: `softcap` (Gemma 2: scores = tanh(scores / softcap) * softcap,
    before the mask), `position_bias` (T5-style: added to the scores, before the mask), `s_aux`
    (attention sinks, gpt-oss: one logit per query head that joins each row's softmax and is then
    dropped, so a row's weights sum to less than 1).
    """
    softcap, bias, sinks = kwargs.get("softcap"), kwargs.get("position_bias"), kwargs.get("s_aux")
    if softcap is not None and (not is_finite_number(softcap) or softcap <= 0):
        raise InvalidArgumentError(f"attention: softcap must be a finite number > 0, got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.numel() != query.shape[1]):
        got = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise InvalidArgumentError(
            f"attention: s_aux (attention sinks) must be a tensor of one logit per query head "
            f"({query.shape[1]}), got {got}"
        )
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    config = getattr(module, "config", None)
    weights_wanted = kwargs.get("output_attentions", getattr(config, "output_attentions", False))
    if not weights_wanted and softcap is None and bias is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling
        )
        return out.transpose(1, 2), None
    scale = 1.0 / math.sqrt(query.shape[-1]) if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # the dtype's lowest, not -inf: a row with every key masked (a padding token) gets uniform
        # weights, as transformers' eager attention gives it, where -inf made it NaN, and the NaN
        # reached every real token of the sequence in the next layer
        scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
    elif attention_mask is not None:
        scores = scores + attention_mask
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    else:  # the sink's column joins the softmax in fp32 and is dropped after it
        sink = sinks.reshape(1, -1, 1, 1).float().expand(*scores.shape[:-1], 1)
        logits = torch.cat([scores.float(), sink], dim=-1)
        weights = torch.softmax(logits, dim=-1)[..., :-1].to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, value).transpose(1, 2), weights if weights_wanted else None


def attention_function(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    *,
    fallback: AttentionFn = masked_attention,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention through ops.attention, with Hugging Face's attention-interface arguments.

    query (batch, heads_q, seq_q, dim), key and value (batch, heads_kv, seq_k, dim), GQA by head
    count (no repeat_kv). `attention_mask=None` means plain causal attention, bottom-right aligned
    (a KV-cache step: seq_q < seq_k), limited to the last `sliding_window` keys when given.
    Returns (output (batch, seq_q, heads_q, dim), None). Calls ops.attention cannot express go to
    `fallback` with an explicit mask (the one given, else the causal/window mask None stood for),
    logged once per reason and counted.
    """
    window = _window(sliding_window)
    reason = _why_not_exact(module, attention_mask, dropout, kwargs)
    if reason is None:
        out = ops.attention(query, key, value, causal=True, scale=scaling, window=window)
        return out.transpose(1, 2), None
    _record_fallback(reason, "ops.attention expresses causal attention only; computed with the mask")
    if attention_mask is None and reason != "not_causal":
        from torchhal.kernels.attention import allowed_keys

        seq_q, seq_k = query.shape[2], key.shape[2]
        allowed = allowed_keys(seq_q, seq_k, True, window, query.device)
        attention_mask = cast(torch.Tensor, allowed).view(1, 1, seq_q, seq_k)  # None only when not causal
    return fallback(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
        sliding_window=sliding_window, **kwargs,
    )  # fmt: skip


def _fixed_length(cache: Any) -> bool:
    """Whether a Hugging Face cache holds a fixed number of slots (StaticCache: compileable layers)."""
    return bool(getattr(cache, "is_compileable", False))


def kv_cache(module: nn.Module, past_key_values: Any, cache: Any, others: dict[str, Any]) -> Any:
    """The KV cache `module`'s forward was given, under either of Hugging Face's names:
    `past_key_values`, or `cache` from transformers 5.24 on (its modules pass the new name; the old
    one is still accepted). Both given must be the same object. A Hugging Face Cache among `others`
    (the forward's other keyword arguments) is refused: it would not be updated, and attention
    would see only the new keys, a wrong answer rather than an error (the 5.24 rename did that to a
    forward that knew only the old name)."""
    cache_utils = sys.modules.get("transformers.cache_utils")  # no such Cache exists before its import
    if cache_utils is not None:
        stray = [name for name, value in others.items() if isinstance(value, cache_utils.Cache)]
        if stray:
            raise UnsupportedError(
                f"{type(module).__name__}.forward: got a KV cache as {stray}, an argument it does not "
                "know (only `cache` and `past_key_values`); it would not be updated"
            )
    if cache is None:
        return past_key_values
    if past_key_values is not None and past_key_values is not cache:
        raise InvalidArgumentError("attention: got both `cache` and `past_key_values`; pass one KV cache")
    return cache


_UPDATE_TAKES_KWARGS: dict[type, bool] = {}


def _update_takes_kwargs(cache_type: type) -> bool:
    """Whether `cache_type.update` takes the attention forward's keyword arguments as `kwargs`, as
    transformers >= 5.24 passes them (`update(k, v, layer_idx, kwargs=kwargs)`): its continuous-batching
    PagedAttentionCache reads its indices from them and fills in, in place, what the attention function
    then needs. Caches before 5.24 (and third-party ones written for them) take `cache_kwargs`, a dict
    of sin, cos and cache_position. Memoised per type: the signature is read once, not on every call."""
    takes = _UPDATE_TAKES_KWARGS.get(cache_type)
    if takes is None:
        parameters = inspect.signature(cache_type.update).parameters  # type: ignore[attr-defined]
        takes = "kwargs" in parameters and "cache_kwargs" not in parameters
        _UPDATE_TAKES_KWARGS[cache_type] = takes
    return takes


def _filled_slots(
    module: nn.Module,
    cache: Any,
    key: torch.Tensor,
    value: torch.Tensor,
    seq_q: int,
    cache_position: torch.Tensor | None,
    sliding_window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Keys, values and mask for a fixed-length cache called without a mask: its `update` returns every
    slot, the empty ones after the filled ones, and the queries are the newest `seq_q` filled slots.
    Each attends the filled slots up to its own, causally (and within the window): bottom-right
    causal over the filled slots, whichever position the call starts at (the first prefill, a later
    chunk, a decode step).

    How many slots are filled: `cache_position[-1] + 1` where the call gives the positions (as
    transformers before 5.x does, whose caches write there), else the cache's own
    `get_seq_length(layer_idx)` after the update, at most the slots returned (a sliding layer that has
    wrapped returns only filled ones). A count on the host (an int) slices the keys, and ops.attention
    computes the call; a tensor (StaticCache's count, cache_position) becomes a mask built on the
    device, computed by the fallback: no host sync, and a graph of fixed shapes under torch.compile.
    """
    seq_k = key.shape[2]
    if cache_position is not None:
        filled: Any = cache_position[..., -1] + 1
    else:
        seq_length = getattr(cache, "get_seq_length", None)
        if seq_length is None:
            raise UnsupportedError(
                f"{type(module).__name__}: a fixed-length KV cache ({type(cache).__name__}) without "
                "attention_mask needs cache_position or the cache's get_seq_length(layer_idx) to tell "
                "its filled slots from the empty ones; it has neither"
            )
        filled = seq_length(module.layer_idx)
    if isinstance(filled, int):
        filled = min(filled, seq_k)
        if filled < seq_q:
            raise InvalidArgumentError(
                f"{type(module).__name__}: the fixed-length KV cache holds {filled} filled slots after "
                f"its update, fewer than the {seq_q} queries just added to it"
            )
        return key[:, :, :filled], value[:, :, :filled], None
    if not isinstance(filled, torch.Tensor):
        raise UnsupportedError(
            f"{type(module).__name__}: {type(cache).__name__}.get_seq_length returned "
            f"{type(filled).__name__}, expected an int or a tensor"
        )
    slots = torch.arange(seq_k, device=key.device)
    # the slot of each query: (batch or 1, 1, seq_q, 1)
    newest = filled.to(key.device).clamp(max=seq_k).reshape(-1, 1, 1, 1) - seq_q + slots[:seq_q, None]
    allowed = slots <= newest
    if sliding_window is not None:
        allowed &= slots > newest - sliding_window
    return key, value, allowed


def rotary_attention(
    module: nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
    attention_mask: torch.Tensor | None,
    past_key_values: Any,
    *,
    attention_fn: AttentionFn,
    sliding_window: int | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The body of a Llama-style attention block, on any module with Hugging Face's attribute names
    (q_proj, k_proj, v_proj, o_proj, head_dim, scaling, attention_dropout, layer_idx): project,
    rotate q and k through ops.rope, append to the KV cache, attend, project out.

    Shared by `Attention` and the attention modules `torchhal.kernels.patch` rewires, so both run
    the same code. `past_key_values` is a Hugging Face Cache (`update(k, v, layer_idx, ...)` returns
    the keys and values to attend to; called as the cache's transformers version calls it) or None.
    A fixed-length cache returns its empty slots too: without a mask, the queries attend its filled
    slots only (`_filled_slots`).
    """
    if position_embeddings is None:
        raise InvalidArgumentError(
            f"{type(module).__name__}: position_embeddings=(cos, sin) is required "
            "(RotaryEmbedding makes them)"
        )
    batch_seq = hidden_states.shape[:-1]
    shape = (*batch_seq, -1, module.head_dim)
    # nn.Module's __getattr__ is typed Tensor | Module: the projections are the module's Linears
    query = cast(nn.Module, module.q_proj)(hidden_states).view(shape).transpose(1, 2)
    key = cast(nn.Module, module.k_proj)(hidden_states).view(shape).transpose(1, 2)
    value = cast(nn.Module, module.v_proj)(hidden_states).view(shape).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = apply_rotary(query, key, cos, sin)
    if past_key_values is not None:
        if module.layer_idx is None:  # the cache keys each layer's keys and values by it
            raise InvalidArgumentError(
                f"{type(module).__name__}: a KV cache needs the layer's index, got layer_idx=None; "
                "build it with layer_idx=<its index among the model's attention layers>"
            )
        if _update_takes_kwargs(type(past_key_values)):  # transformers >= 5.24's convention
            key, value = past_key_values.update(key, value, module.layer_idx, kwargs=kwargs)
        else:
            cache_kwargs = {"sin": sin, "cos": cos, "cache_position": kwargs.get("cache_position")}
            key, value = past_key_values.update(key, value, module.layer_idx, cache_kwargs)
        if attention_mask is None and query.shape[2] < key.shape[2] and _fixed_length(past_key_values):
            key, value, attention_mask = _filled_slots(
                module, past_key_values, key, value, query.shape[2], kwargs.get("cache_position"),
                sliding_window,
            )  # fmt: skip
    out, weights = attention_fn(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=module.attention_dropout if module.training else 0.0,
        scaling=module.scaling,
        sliding_window=sliding_window,
        **kwargs,
    )
    return cast(nn.Module, module.o_proj)(out.reshape(*batch_seq, -1)), weights


class Attention(nn.Module):
    """Causal self-attention with RoPE and grouped-query heads, Hugging Face's Llama layout.

    Projections q_proj, k_proj, v_proj (bias `bias`, as Qwen2 has) and o_proj (bias `o_bias`,
    default `bias`, as Llama's attention_bias); num_heads query heads share num_kv_heads key/value
    heads. `sliding_window` W limits each query to the last W keys, itself included (Mistral's
    meaning). forward takes a Hugging Face attention module's arguments, (hidden_states,
    position_embeddings, attention_mask, past_key_values, **kwargs) -> (output, weights), the KV
    cache also as `cache` (transformers >= 5.24 passes that name), so it can stand in for one;
    attention_mask=None means causal (with a fixed-length cache: over its filled slots, see
    `_filled_slots`), a mask goes to `masked_attention`.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        *,
        bias: bool = False,
        o_bias: bool | None = None,
        sliding_window: int | None = None,
        dropout: float = 0.0,
        layer_idx: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads < 1:
            raise InvalidArgumentError(f"Attention: num_heads must be >= 1, got {num_heads}")
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise InvalidArgumentError(
                f"Attention: num_heads must be a multiple of num_kv_heads, got {num_heads} and {num_kv_heads}"
            )
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_heads
        if self.head_dim < 1:
            raise InvalidArgumentError(
                f"Attention: head_dim must be >= 1, got {self.head_dim} (hidden_size {hidden_size}, "
                f"num_heads {num_heads})"
            )
        if not is_finite_number(dropout) or not 0 <= dropout <= 1:  # else refused only in training
            raise InvalidArgumentError(f"Attention: dropout must be a number in [0, 1], got {dropout!r}")
        self.num_heads, self.num_key_value_heads = num_heads, num_kv_heads
        self.num_key_value_groups = num_heads // num_kv_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = dropout
        _window(sliding_window)  # refused here, not at the first forward
        self.sliding_window = sliding_window
        self.layer_idx = layer_idx
        self.is_causal = True
        o_bias = bias if o_bias is None else o_bias
        made = {"device": device, "dtype": dtype}  # torch.nn's factory keywords
        self.q_proj = nn.Linear(hidden_size, num_heads * self.head_dim, bias=bias, **made)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias, **made)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=bias, **made)
        self.o_proj = nn.Linear(num_heads * self.head_dim, hidden_size, bias=o_bias, **made)

    def reset_parameters(self) -> None:
        _reset_linears(self)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Any = None,
        *,
        cache: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return rotary_attention(
            self, hidden_states, position_embeddings, attention_mask,
            kv_cache(self, past_key_values, cache, kwargs),
            attention_fn=attention_function, sliding_window=self.sliding_window, **kwargs,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, kv_heads={self.num_key_value_heads}, head_dim={self.head_dim}, "
            f"sliding_window={self.sliding_window}"
        )
