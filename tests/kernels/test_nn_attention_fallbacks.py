"""torchhal.kernels.nn attention where ops.attention alone cannot compute the call: a fixed-length
(static) KV cache without a mask, and Hugging Face's score modifiers (softcap, attention sinks,
position bias), each against a plain-PyTorch or transformers' own eager reference on fresh random
inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchhal.hal_core import InvalidArgumentError
from torchhal.kernels import nn as thnn

pytest.importorskip("transformers")

HEADS, KV_HEADS, DIM = 4, 2, 8


def _rotate_half(u):
    half = u.shape[-1] // 2
    return torch.cat((-u[..., half:], u[..., :half]), dim=-1)


def _full_causal(attn, rotary, x, window):
    """The whole sequence at once in plain PyTorch: projections, rotate-half RoPE, SDPA with an
    explicit causal mask (Hugging Face's window: key j visible to query i iff i - W < j <= i)."""
    batch, seq, _ = x.shape

    def project(linear):
        return linear(x).view(batch, seq, -1, DIM).transpose(1, 2)

    q, k, v = project(attn.q_proj), project(attn.k_proj), project(attn.v_proj)
    cos, sin = rotary(x, torch.arange(seq)[None])
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    groups = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=allowed
    )
    return attn.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("positions", ["cache_position", "cache's count"])
def test_a_static_cache_without_a_mask_attends_the_filled_slots_causally(on_plain, window, positions):
    """A StaticCache returns all its slots, the empty ones after the filled. Without a mask only a
    prefill from slot 0 was right: a decode step attended the empty slots (0.19 off) and a second
    chunk saw the first slots as its own (1.2 off). Prefill, a chunk, decode steps and, with a
    window, steps past a sliding layer's length, from `cache_position` (transformers before 5.x
    passes it) or from the cache's own count (5.x does not), against the whole sequence at once."""
    from transformers import LlamaConfig, MistralConfig
    from transformers.cache_utils import StaticCache

    hidden = HEADS * DIM
    attn = thnn.Attention(hidden, HEADS, KV_HEADS, layer_idx=0, sliding_window=window).eval()
    rotary = thnn.RotaryEmbedding(DIM)
    config_type = LlamaConfig if window is None else MistralConfig
    config = config_type(
        hidden_size=hidden, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=1,
        sliding_window=window,
    )  # fmt: skip
    cache = StaticCache(config=config, max_cache_len=16)
    x = torch.randn(2, 11, hidden)
    with torch.no_grad():
        expected = _full_causal(attn, rotary, x, window)
        for lo, hi in ((0, 4), (4, 7), (7, 8), (8, 9), (9, 11)):
            at = torch.arange(lo, hi)
            kwargs = {"cache_position": at} if positions == "cache_position" else {}
            got, _ = attn(x[:, lo:hi], rotary(x, at[None]), None, cache, **kwargs)
            torch.testing.assert_close(got, expected[:, lo:hi], rtol=1e-5, atol=1e-5, msg=f"{lo}:{hi}")


class _Module(torch.nn.Module):
    """What transformers' eager attention functions read of the attention module."""

    def __init__(self, sinks=None):
        super().__init__()
        self.is_causal, self.head_dim = True, DIM
        self.num_key_value_groups = HEADS // KV_HEADS
        if sinks is not None:
            self.sinks = torch.nn.Parameter(sinks)
        self.eval()


def _qkv(seq=7):
    q = 3 * torch.randn(2, HEADS, seq, DIM)  # large scores, so a softcap matters
    return q, 3 * torch.randn(2, KV_HEADS, seq, DIM), torch.randn(2, KV_HEADS, seq, DIM)


def _additive_causal(seq):
    blocked = ~torch.ones(seq, seq, dtype=torch.bool).tril()
    return torch.zeros(seq, seq).masked_fill(blocked, torch.finfo(torch.float32).min)[None, None]


@pytest.mark.parametrize("output_attentions", [False, True])
def test_softcap_is_applied_as_gemma2_eager_attention_applies_it(output_attentions):
    """attention_function sent softcap to the fallback, which ignored it: the uncapped result."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module, (q, k, v) = _Module(), _qkv()
    kwargs = {"scaling": DIM**-0.5, "softcap": 2.5, "output_attentions": output_attentions}
    got, weights = thnn.attention_function(module, q, k, v, None, **kwargs)
    expected, expected_weights = eager_attention_forward(module, q, k, v, _additive_causal(7), **kwargs)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if output_attentions:
        torch.testing.assert_close(weights, expected_weights, rtol=1e-5, atol=1e-6)
    else:
        assert weights is None


def test_attention_sinks_are_applied_as_gpt_oss_eager_attention_applies_them():
    """s_aux (gpt-oss's per-head sink logits) was ignored by the fallback: the result without sinks.
    Through attention_function with its default fallback, and through the "torchhal" attention
    function registered with transformers (its fallback, transformers' SDPA, ignored them too)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from torchhal.kernels.hf_attention import torchhal_attention

    sinks = torch.randn(HEADS) + 2
    module, (q, k, v) = _Module(sinks), _qkv()
    expected, _ = eager_attention_forward(module, q, k, v, _additive_causal(7), scaling=DIM**-0.5)
    got, _ = thnn.attention_function(module, q, k, v, None, scaling=DIM**-0.5, s_aux=module.sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()[None, None]
    got, _ = torchhal_attention(module, q, k, v, causal, scaling=DIM**-0.5, s_aux=module.sinks)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_position_bias_is_added_as_transformers_adds_it():
    """position_bias (T5-style, per head and key) was ignored by the fallback."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, (q, k, v) = _Module(), _qkv()
    bias = torch.randn(1, HEADS, 7, 7)
    got, _ = thnn.attention_function(module, q, k, v, None, scaling=DIM**-0.5, position_bias=bias)
    expected, _ = sdpa_attention_forward(module, q, k, v, None, scaling=DIM**-0.5, position_bias=bias)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_score_modifiers_that_cannot_apply_are_refused_by_name():
    module, (q, k, v) = _Module(), _qkv()
    with pytest.raises(InvalidArgumentError, match=r"softcap must be a finite number > 0, got 0"):
        thnn.attention_function(module, q, k, v, None, softcap=0)
    with pytest.raises(InvalidArgumentError, match=r"s_aux .* one logit per query head \(4\), got \(2,\)"):
        thnn.attention_function(module, q, k, v, None, s_aux=torch.zeros(2))
