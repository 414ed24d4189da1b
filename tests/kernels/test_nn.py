"""torchhal.kernels.nn: each module against a plain-PyTorch reference on fresh random inputs, outputs
and gradients (of inputs and parameters) under FlashAttention's rule (conftest's check_op), with
torchhal.ops dispatching to the Triton candidates through the interpreter (fp32)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry
from torchhal.kernels import nn as thnn

HIDDEN = 123  # odd: no power-of-two luck in the row kernels


def _check_module(check_op, module, reference, inputs, grads):
    """module(*inputs) against reference(*inputs, *parameters): outputs 2x, gradients of the float
    inputs and of every parameter 3x PyTorch's own fp32 error, all against fp64."""
    names = [n for n, _ in module.named_parameters()]
    params = tuple(p.detach() for _, p in module.named_parameters())

    def run(*args):
        values = dict(zip(names, args[len(inputs) :], strict=True))
        return functional_call(module, values, args[: len(inputs)])

    args = (*inputs, *params)
    wrt = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point())
    check_op(run, reference, args, grads, wrt)


def test_rms_norm(on_triton, check_op):
    norm = thnn.RMSNorm(HIDDEN, eps=0.1)  # an eps that matters, so one ignored would show
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(HIDDEN))
    x = torch.randn(2, 7, HIDDEN)

    def reference(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.1) * weight

    _check_module(check_op, norm, reference, (x,), (torch.randn(x.shape),))
    assert {("rms_norm", "triton"), ("rms_norm_backward", "triton")} <= set(on_triton)
    assert list(norm.state_dict()) == ["weight"] and norm.variance_epsilon == 0.1


def test_rms_norm_with_mixed_dtypes_follows_hugging_face():
    """fp32 weight, bf16 x: no op can take that without a cast, so the module computes Hugging Face's
    formula (normalise in fp32, round to x's dtype, multiply by the weight), in the promoted dtype."""
    norm = thnn.RMSNorm(HIDDEN)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(HIDDEN))
    x = torch.randn(5, HIDDEN).bfloat16()
    x32 = x.float()
    expected = norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    before = _fallbacks("rms_norm_mixed_dtypes")
    got = norm(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert _fallbacks("rms_norm_mixed_dtypes") == before + 1  # counted, never silent


def test_rms_norm_refuses_integer_input_rather_than_truncating_it():
    """Only a floating x takes Hugging Face's mixed-dtype formula: an int64 one came back truncated."""
    before = _fallbacks("rms_norm_mixed_dtypes")
    with pytest.raises(
        UnsupportedError,
        match=r"rms_norm: x must be a floating-point tensor of .*, got dtype torch.int64 "
        r"\(not floating-point\)",
    ):
        thnn.RMSNorm(4)(torch.tensor([[1, 2, 3, 4]]))
    assert _fallbacks("rms_norm_mixed_dtypes") == before


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(on_triton, check_op, bias):
    norm = thnn.LayerNorm(HIDDEN, eps=0.1, bias=bias)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.3 * torch.randn(HIDDEN))
    x = 2 + torch.randn(9, HIDDEN)

    def reference(x, weight, *b):
        return F.layer_norm(x, (HIDDEN,), weight, b[0] if b else None, 0.1)

    _check_module(check_op, norm, reference, (x,), (torch.randn(x.shape),))
    assert ("layer_norm_forward", "triton") in on_triton and ("layer_norm_backward", "triton") in on_triton
    assert list(norm.state_dict()) == (["weight", "bias"] if bias else ["weight"])
    assert list(torch.nn.LayerNorm(HIDDEN, bias=bias).state_dict()) == list(norm.state_dict())


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_with_mixed_dtypes_is_torchs(autocast, bias):
    """bf16 x, fp32 parameters (after an autocast Linear): torch.nn.LayerNorm computes in fp32 and
    returns x's dtype; the op takes no mix, so the module runs torch's layer_norm, counted. The
    reverse mix, which torch refuses too, is refused by the op by name."""
    ours, torchs = thnn.LayerNorm(HIDDEN, bias=bias), torch.nn.LayerNorm(HIDDEN, bias=bias)
    with torch.no_grad():
        for p in ours.parameters():
            p.add_(0.3 * torch.randn(HIDDEN))
    torchs.load_state_dict(ours.state_dict())
    x = (2 + torch.randn(5, HIDDEN)).bfloat16()
    before = _fallbacks("layer_norm_mixed_dtypes")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got, expected = ours(x), torchs(x)
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert _fallbacks("layer_norm_mixed_dtypes") == before + 1
    with pytest.raises(InvalidArgumentError, match=r"layer_norm: dtypes must agree, got x=torch.float32"):
        ours.bfloat16()(x.float())


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_mlp(on_triton, check_op, bias):
    mlp = thnn.SwiGLUMLP(HIDDEN, 77, bias=bias)
    x = torch.randn(2, 5, HIDDEN)

    def reference(x, wg, *rest):
        if bias:
            bg, wu, bu, wd, bd = rest
        else:
            (wu, wd), bg, bu, bd = rest, None, None, None
        return F.linear(F.silu(F.linear(x, wg, bg)) * F.linear(x, wu, bu), wd, bd)

    _check_module(check_op, mlp, reference, (x,), (torch.randn(x.shape),))
    assert {("swiglu", "triton"), ("swiglu_backward", "triton")} <= set(on_triton)
    names = {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}
    assert set(mlp.state_dict()) == (names | {n.replace("weight", "bias") for n in names} if bias else names)


def test_swiglu_mlp_sharing_uses_the_given_linears():
    gate, up, down = torch.nn.Linear(8, 12), torch.nn.Linear(8, 12), torch.nn.Linear(12, 8)
    mlp = thnn.SwiGLUMLP.sharing(gate, up, down)
    assert mlp.gate_proj is gate and mlp.up_proj is up and mlp.down_proj is down
    x = torch.randn(3, 8)
    torch.testing.assert_close(mlp(x), down(F.silu(gate(x)) * up(x)))


def _hf_rope_tables(head_dim, theta, positions, dtype):
    """Hugging Face's default RoPE tables, written out (LlamaRotaryEmbedding.forward)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def test_rotary_embedding_tables_are_hugging_faces():
    rotary = thnn.RotaryEmbedding(32, theta=500000.0)
    positions = torch.randint(0, 4000, (3, 11))
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rotary(torch.empty(0, dtype=dtype), positions)
        expected = _hf_rope_tables(32, 500000.0, positions, dtype)
        assert cos.shape == (3, 11, 32) and cos.dtype == dtype and not cos.requires_grad
        torch.testing.assert_close((cos, sin), expected, rtol=0, atol=0)
    scaled = thnn.RotaryEmbedding(32, theta=500000.0, attention_scaling=0.5)(torch.empty(0), positions)
    expected = _hf_rope_tables(32, 500000.0, positions, torch.float32)
    torch.testing.assert_close(scaled, (0.5 * expected[0], 0.5 * expected[1]), rtol=0, atol=0)
    assert "inv_freq" not in rotary.state_dict()  # not persistent, as Hugging Face's
    with pytest.raises(InvalidArgumentError, match="head_dim must be even"):
        thnn.RotaryEmbedding(7)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _reference_attention(x, cos, sin, params, *, heads, kv_heads, window=None, mask=None):
    """Llama attention in plain PyTorch: projections, rotate-half RoPE, SDPA with an explicit mask
    (causal; Hugging Face's sliding window: key j visible to query i iff i - W < j <= i), o_proj."""
    wq, bq, wk, bk, wv, bv, wo = params
    batch, seq, _ = x.shape
    dim = wq.shape[0] // heads

    def project(w, b, n):
        return F.linear(x, w, b).view(batch, seq, n, dim).transpose(1, 2)

    q, k, v = project(wq, bq, heads), project(wk, bk, kv_heads), project(wv, bv, kv_heads)
    c, s = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    q, k = q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    i, j = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    if mask is not None:
        allowed = allowed & mask
    groups = heads // kv_heads
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=allowed
    )
    return F.linear(out.transpose(1, 2).reshape(batch, seq, -1), wo)


def _attention_case(window=None, seq=13):
    attn = thnn.Attention(64, 4, 2, bias=True, o_bias=False, sliding_window=window, layer_idx=0)
    x = torch.randn(2, seq, 64)
    positions = torch.arange(seq).expand(2, seq) + torch.tensor([[0], [7]])
    cos, sin = thnn.RotaryEmbedding(16)(x, positions)
    return attn, x, cos, sin


@pytest.mark.parametrize("window", [None, 4])
def test_attention_gqa_rope_and_sliding_window(on_triton, check_op, window):
    attn, x, cos, sin = _attention_case(window)

    def module(x, *params):
        names = [n for n, _ in attn.named_parameters()]
        return functional_call(attn, dict(zip(names, params, strict=True)), (x, (cos, sin)))[0]

    def reference(x, *params):
        return _reference_attention(x, cos, sin, params, heads=4, kv_heads=2, window=window)

    params = tuple(p.detach() for p in attn.parameters())
    check_op(module, reference, (x, *params), (torch.randn(x.shape),), tuple(range(1 + len(params))))
    used = set(on_triton)
    assert {("rope", "triton"), ("attention_backward", "triton")} <= used
    # 13 tokens, 2 query heads per kv head: 26 rows per kv head, few enough for the split-KV forward
    assert {candidate for op, candidate in used if op == "attention_forward"} == {"triton_decode"}
    assert [n for n, _ in attn.named_parameters()] == [
        "q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
        "o_proj.weight",
    ]  # fmt: skip


class _Cache:
    """The part of a Hugging Face Cache that attention uses: update() appends and returns everything."""

    def __init__(self):
        self.kv = {}

    def update(self, k, v, layer_idx, cache_kwargs=None):
        if layer_idx in self.kv:
            k = torch.cat((self.kv[layer_idx][0], k), dim=2)
            v = torch.cat((self.kv[layer_idx][1], v), dim=2)
        self.kv[layer_idx] = (k, v)
        return k, v


@pytest.mark.parametrize("window", [None, 4])
def test_kv_cache_steps_match_the_full_sequence(on_plain, window):
    """Prefill 9 tokens, then one step of 1 and one of 3 (seq_q < seq_k: bottom-right causal)."""
    attn, x, cos, sin = _attention_case(window)
    with torch.no_grad():
        full = attn(x, (cos, sin))[0]
        cache, parts = _Cache(), []
        for lo, hi in ((0, 9), (9, 10), (10, 13)):
            parts.append(attn(x[:, lo:hi], (cos[:, lo:hi], sin[:, lo:hi]), past_key_values=cache)[0])
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    assert "attention" in {op for op, _ in on_plain}


def test_a_kv_cache_without_layer_idx_is_refused_by_name(on_plain):
    """The cache keeps each layer's keys and values under its layer_idx: with None a Hugging Face
    cache raised a TypeError from inside transformers, a stand-in like _Cache mixed layers silently."""
    attn, x, cos, sin = _attention_case()
    attn.layer_idx, cache = None, _Cache()
    with torch.no_grad(), pytest.raises(InvalidArgumentError, match=r"Attention: .*got layer_idx=None"):
        attn(x, (cos, sin), past_key_values=cache)
    assert cache.kv == {}
    attn(x, (cos, sin))  # no cache, no index needed


def test_a_hugging_face_cache_under_a_name_it_does_not_know_is_refused(on_plain):
    """Under an unknown keyword a Cache would not be updated and attention would see only the new
    keys, a wrong answer: refused, naming the keyword, the cache untouched. Under `cache` (the name
    transformers >= 5.24 passes) it is filled."""
    transformers = pytest.importorskip("transformers", reason="a Hugging Face Cache needs transformers")
    attn, x, cos, sin = _attention_case()
    cache = transformers.DynamicCache()
    with (
        torch.no_grad(),
        pytest.raises(UnsupportedError, match=r"Attention.forward: got a KV cache as \['kv'\]"),
    ):
        attn(x, (cos, sin), kv=cache)
    assert cache.get_seq_length() == 0
    with torch.no_grad():
        attn(x, (cos, sin), cache=cache)
    assert cache.get_seq_length() == 13


def _fallbacks(reason):
    return telemetry.counts().get(f"{thnn.FALLBACK_COUNTER},reason={reason}", 0)


def test_a_padding_mask_falls_back_counted_and_is_applied(on_plain):
    attn, x, cos, sin = _attention_case()
    keep = torch.ones(2, 13, dtype=torch.bool)
    keep[0, :4] = False  # left padding of the first sequence
    mask = keep[:, None, None, :]  # (batch, 1, 1, seq_k): True may attend
    before = _fallbacks("attention_mask")
    with torch.no_grad():
        got = attn(x, (cos, sin), attention_mask=mask & torch.ones(13, 13, dtype=torch.bool).tril())[0]
        params = [p for _, p in attn.named_parameters()]
        expected = _reference_attention(x, cos, sin, params, heads=4, kv_heads=2, mask=mask)
    assert _fallbacks("attention_mask") == before + 1
    torch.testing.assert_close(got[0, 4:], expected[0, 4:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], expected[1], rtol=1e-5, atol=1e-5)
    assert not any(op.startswith("attention") for op, _ in on_plain)


def test_dropout_in_training_falls_back_and_eval_does_not(on_plain):
    attn, x, cos, sin = _attention_case()
    attn.attention_dropout = 0.5
    before = _fallbacks("dropout")
    attn.train()
    torch.manual_seed(0)
    out = attn(x, (cos, sin))[0]
    assert _fallbacks("dropout") == before + 1 and torch.isfinite(out).all()
    attn.eval()
    attn(x, (cos, sin))
    assert _fallbacks("dropout") == before + 1


def test_output_attentions_returns_the_causal_weights(on_plain):
    attn, x, cos, sin = _attention_case(window=3)
    out, weights = attn(x, (cos, sin), output_attentions=True)
    assert weights.shape == (2, 4, 13, 13)
    i, j = torch.arange(13).unsqueeze(1), torch.arange(13).unsqueeze(0)
    visible = (j <= i) & (j > i - 3)
    assert torch.count_nonzero(weights[..., ~visible]) == 0
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 13))
    torch.testing.assert_close(out, attn(x, (cos, sin))[0], rtol=1e-5, atol=1e-5)


def test_attention_refuses_bad_configuration():
    with pytest.raises(InvalidArgumentError, match="multiple of num_kv_heads"):
        thnn.Attention(64, 4, 3)
    with pytest.raises(InvalidArgumentError, match="num_heads must be >= 1, got 0"):
        thnn.Attention(16, 0, 1)
    with pytest.raises(InvalidArgumentError, match="sliding_window must be >= 1, got 0"):
        thnn.Attention(64, 4, sliding_window=0)
    with pytest.raises(InvalidArgumentError, match="position_embeddings"):
        thnn.Attention(64, 4, 2)(torch.randn(1, 3, 64))
    assert thnn.Attention(64, 4).scaling == pytest.approx(1 / math.sqrt(16))


def test_the_package_names_load_lazily_and_never_import_transformers():
    code = (
        "import sys, torchhal.kernels as k; assert 'torchhal.kernels.nn' not in sys.modules; "
        "from torchhal.kernels.hf_patch import patch; assert k.patch is patch and k.nn.RMSNorm; "
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
