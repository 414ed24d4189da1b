"""attention: the Triton FlashAttention forward and backward (CPU interpreter, fp32) against the fp64
reference under FlashAttention's rule, the references against PyTorch, selection, bad input, compile."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torchhal_nvidia import sdpa

from torchhal.hal_core import (
    DeviceCapabilities,
    DType,
    Feature,
    InvalidArgumentError,
    RejectionReason,
    UnsupportedError,
)
from torchhal.kernels import attention, triton_attention
from torchhal.kernels.autograd import DifferentiableOp
from torchhal.kernels.triton_attention_config import DECODE_MAX_ROWS

from .conftest import assert_within_pytorch_error

FLASH, CUDNN = sdpa.FLASH_BACKEND, sdpa.CUDNN_BACKEND
NAMESPACE = "torchhal_test_attention"  # custom ops of this module, apart from torchhal.ops' and conftest's


class AttentionOps:
    """`attention` as torchhal.ops makes it (autograd glue over the registry), on a chosen HAL."""

    def __init__(self) -> None:
        self.hal = None
        self.attention = DifferentiableOp(attention.AUTOGRAD, self.dispatch, namespace=NAMESPACE)

    def dispatch(self, op, first, *args):
        return self.hal.dispatch(op, first, *args)


_OPS = AttentionOps()  # custom ops are process-wide: made once


@pytest.fixture
def attn(triton_hal):
    _OPS.hal = triton_hal
    yield _OPS
    _OPS.hal = None


@pytest.fixture
def plain_attn(plain_hal):
    _OPS.hal = plain_hal
    yield _OPS
    _OPS.hal = None


def _qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, dtype=torch.float32):
    q = torch.randn(batch, heads_q, seq_q, dim, dtype=dtype)
    k = torch.randn(batch, heads_kv, seq_k, dim, dtype=dtype)
    v = torch.randn(batch, heads_kv, seq_k, dim, dtype=dtype)
    return q, k, v


def _selected(hal, op, *args):
    return hal.kernels.select(op, hal.device("cpu"), *args).candidate.name


CASES = [  # (batch, heads_q, heads_kv, seq_q, seq_k, dim, causal, scale, window)
    pytest.param(2, 4, 2, 97, 97, 32, False, None, None, id="gqa-full-97-d32"),
    pytest.param(1, 4, 1, 113, 203, 64, True, None, None, id="mqa-causal-113x203-d64"),
    pytest.param(1, 2, 2, 113, 203, 80, False, 0.3, None, id="mha-full-113x203-d80-scale"),
    pytest.param(1, 2, 1, 203, 113, 32, True, None, None, id="causal-203x113-rows-without-keys"),
    pytest.param(1, 2, 2, 97, 97, 32, False, -0.4, (16, 8), id="window-16-8-negative-scale"),
    pytest.param(1, 4, 2, 113, 203, 32, True, None, (40, 0), id="causal-window-40"),
    pytest.param(1, 2, 1, 37, 50, 16, True, 0.0, None, id="zero-scale-uniform"),
]


@pytest.mark.parametrize(
    ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "dim", "causal", "scale", "window"), CASES
)
def test_triton_forward_and_gradients_within_pytorch_error(
    attn, check_op, batch, heads_q, heads_kv, seq_q, seq_k, dim, causal, scale, window
):
    q, k, v = _qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim)
    grad_out = torch.randn(batch, heads_q, seq_q, dim)
    args = (q, k, v, causal, scale, window)
    assert _selected(attn.hal, "attention_forward", *args) == "triton"
    out, lse = attention.reference_forward(*args)
    assert (
        _selected(attn.hal, "attention_backward", grad_out, q, k, v, out, lse, causal, scale, window)
        == "triton"
    )
    check_op(attn.attention, attention.reference, args, (grad_out,), (0, 1, 2))


def test_queries_that_see_no_key_give_zeros_and_zero_gradients(attn):
    q, k, v = _qkv(1, 2, 1, 70, 40, 32)
    q.requires_grad_(True)
    out = attn.attention(q, k, v, True, None, None)  # offset -30: queries 0..29 see nothing
    out.backward(torch.randn_like(out))
    assert torch.count_nonzero(out[:, :, :30]) == 0 and torch.count_nonzero(q.grad[:, :, :30]) == 0
    assert torch.count_nonzero(out[:, :, 30:]) == out[:, :, 30:].numel()
    lse = attn.hal.kernels.call("attention_forward", attn.hal.device("cpu"), q.detach(), k, v, True)[1]
    assert torch.isneginf(lse[:, :, :30]).all() and torch.isfinite(lse[:, :, 30:]).all()


def test_the_no_grad_op_matches_the_training_forward(attn):
    q, k, v = _qkv(1, 4, 2, 61, 90, 64)
    assert _selected(attn.hal, "attention", q, k, v, True) == "triton"
    out = attn.attention(q, k, v, True, None, None)
    cpu = attn.hal.device("cpu")
    out_train, lse = attn.hal.kernels.call("attention_forward", cpu, q, k, v, True)
    torch.testing.assert_close(out, out_train, rtol=0, atol=0)
    ref_lse = attention.reference_forward(q.double(), k.double(), v.double(), True)[1]
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.generate],
)
@given(
    seq_q=st.integers(1, 70),
    seq_k=st.integers(2, 70),  # one key makes dq exactly 0 in truth: test_a_single_key covers it
    dim=st.sampled_from([16, 24, 40]),
    heads=st.sampled_from([(2, 1), (2, 2)]),
    causal=st.booleans(),
    layout=st.sampled_from(["bshd", "sliced-dim", "contiguous"]),
)
def test_any_strides_property(attn, check_op, candidate, seq_q, seq_k, dim, heads, causal, layout):
    """Inputs as PyTorch code hands them over: (b, s, h, d) transposed views and head-dim slices of
    a fused projection. The kernels index strides, so they compute every layout themselves (the
    split-KV one where a kv head has few query rows: test_attention_decode)."""

    def make(heads_n, seq):
        if layout == "bshd":
            return torch.randn(1, seq, heads_n, dim).transpose(1, 2)
        if layout == "sliced-dim":
            return torch.randn(1, heads_n, seq, dim + 7)[..., 3 : 3 + dim]
        return torch.randn(1, heads_n, seq, dim)

    q, k, v = make(heads[0], seq_q), make(heads[1], seq_k), make(heads[1], seq_k)
    grad_out = make(heads[0], seq_q)
    few_rows = heads[0] // heads[1] * seq_q <= DECODE_MAX_ROWS
    expected = "triton_decode" if few_rows else "triton"
    assert _selected(attn.hal, "attention_forward", q, k, v, causal) == expected
    check_op(attn.attention, attention.reference, (q, k, v, causal, None, None), (grad_out,), (0, 1, 2))
    if few_rows:  # the split-KV forward served the op: the FlashAttention forward on these strides too
        out, _ = candidate(attn.hal, "attention_forward", "triton", q, k, v, causal)(q, k, v, causal)
        truth = attention.reference(q.double(), k.double(), v.double(), causal)
        assert_within_pytorch_error("forward", out, attention.reference(q, k, v, causal), truth, 2.0)


def test_a_single_key_gives_its_value_and_a_dq_of_rounding_size(attn):
    """With one key, p = 1: out = v and dq = 0 in exact arithmetic. FlashAttention's dq computes
    p * (dO.v - dO.o), a cancellation of two length-D fp32 dot products, so the bound is that of
    their rounding: 2 D eps |dO| |v| per row, times |k| * scale for dq."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 2, 1, 23, 1, 32))
    grad_out = torch.randn(1, 2, 23, 32)
    out = attn.attention(q, k, v, False, None, None)
    out.backward(grad_out)
    torch.testing.assert_close(out, v.detach().expand(1, 2, 23, 32), rtol=1e-6, atol=1e-6)
    eps, dim = torch.finfo(torch.float32).eps, 32
    bound = 2 * dim * eps * grad_out.abs().max() * v.abs().max() * k.abs().max() / math.sqrt(dim)
    assert q.grad.abs().max() <= bound


def test_head_dims_pad_to_a_power_of_two(attn):
    """96 pads to 128 inside the kernel (masked loads): the answer is unchanged."""
    q, k, v = _qkv(1, 2, 2, 33, 47, 96)
    out = attn.attention(q, k, v, False, None, None)
    torch.testing.assert_close(out, attention.reference(q, k, v), rtol=1e-5, atol=1e-5)


def test_bf16_under_the_interpreter_goes_to_the_next_candidate(attn):
    q, k, v = _qkv(1, 2, 2, 16, 16, 32, torch.bfloat16)
    sel = attn.hal.kernels.select("attention_forward", attn.hal.device("cpu"), q, k, v)
    reasons = {r.candidate: r.reason for r in sel.rejected}
    assert sel.candidate.name == "reference" and reasons["torchhal/triton"] is RejectionReason.DTYPE


def test_without_triton_the_sdpa_candidate_serves_and_matches_the_reference(plain_attn):
    q, k, v = _qkv(2, 4, 2, 37, 37, 32)
    assert _selected(plain_attn.hal, "attention", q, k, v, True) == "sdpa"
    torch.testing.assert_close(
        plain_attn.attention(q, k, v, True, None, None), attention.reference(q, k, v, True)
    )


@pytest.mark.parametrize(
    ("causal", "window", "seq_q", "seq_k"),
    [(False, None, 37, 53), (True, None, 37, 37), (True, None, 19, 53), (False, (5, 3), 37, 53)],
)
def test_reference_matches_pytorch_math_with_the_same_mask(causal, window, seq_q, seq_k):
    """The reference is the ground truth: check it against SDPA's math backend given the mask."""
    q, k, v = _qkv(1, 4, 2, seq_q, seq_k, 16, torch.float64)
    mask = attention.allowed_keys(seq_q, seq_k, causal, window, q.device)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
    )
    got = attention.reference(q, k, v, causal, None, window)
    rows = mask.any(-1) if mask is not None else torch.ones(seq_q, dtype=torch.bool)
    torch.testing.assert_close(got[:, :, rows], expected[:, :, rows])
    assert torch.count_nonzero(got[:, :, ~rows]) == 0


def test_reference_backward_matches_autograd_through_the_reference():
    q, k, v = _qkv(2, 4, 2, 29, 41, 16, torch.float64)
    grad_out = torch.randn(2, 4, 29, 16, dtype=torch.float64)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = attention.reference_forward(*leaves, True, 0.7, (9, 2))
    out.backward(grad_out)
    grads = attention.reference_backward(grad_out, q, k, v, out.detach(), lse.detach(), True, 0.7, (9, 2))
    for got, leaf in zip(grads, leaves, strict=True):  # fp64 throughout, though lse is saved in fp32
        torch.testing.assert_close(got, leaf.grad, rtol=1e-12, atol=1e-12)


def test_reference_pair_keeps_pytorchs_accuracy_at_large_logits(plain_attn, check_error):
    """Logits in the thousands, fp32, through the reference training pair, against PyTorch's
    textbook attention (softmax(q kᵀ · scale) v, what SDPA's math backend computes) with autograd.
    Before: probabilities as exp(scores - lse) from an fp32 lse cost the output ~300x PyTorch's
    error, and delta as rowsum(dO * O) left rounding in dq where one-hot rows make it ~0."""
    q, k, v = (30 * t for t in _qkv(1, 2, 2, 33, 33, 16))
    grad_out = torch.randn(1, 2, 33, 16)
    assert _selected(plain_attn.hal, "attention_forward", q, k, v, True, None, None) == "reference"
    visible = attention.allowed_keys(33, 33, True, None, q.device)

    def textbook(q, k, v):
        scores = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~visible, float("-inf"))
        return torch.softmax(scores, dim=-1) @ v

    def run(fn, dtype):
        leaves = [t.to(dtype, copy=True).requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves)
        out.backward(grad_out.to(dtype))
        return [out, *(t.grad for t in leaves)]

    got = run(lambda *t: plain_attn.attention(*t, True, None, None), torch.float32)
    pytorch = run(textbook, torch.float32)
    truth = run(lambda *t: attention.reference(*t, True), torch.float64)
    for name, g, p, t, factor in zip(
        ("out", "dq", "dk", "dv"), got, pytorch, truth, (2, 3, 3, 3), strict=True
    ):
        check_error(name, g, p, t, factor)


def test_compile_fullgraph_forward_and_backward(plain_attn):
    """aot_eager runs Dynamo, the fake implementations and AOTAutograd over the custom ops."""
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 2, 1, 33, 47, 32))
    grad_out = torch.randn(1, 2, 33, 32)

    def block(q, k, v):
        return plain_attn.attention(q * 2, k, v, True, None, None).tanh()

    out = torch.compile(block, fullgraph=True, backend="aot_eager")(q, k, v)
    out.backward(grad_out)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    expected = torch.tanh(attention.reference(leaves[0] * 2, leaves[1], leaves[2], True))
    expected.backward(grad_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, leaf in zip((q, k, v), leaves, strict=True):
        torch.testing.assert_close(got.grad, leaf.grad, rtol=1e-4, atol=1e-5)


def test_custom_op_registrations_pass_opcheck(plain_attn):
    q, k, v = (t.requires_grad_(True) for t in _qkv(1, 4, 2, 9, 12, 16))
    ops = getattr(torch.ops, NAMESPACE)
    torch.library.opcheck(ops.attention_forward.default, (q, k, v, True, None, [3, 0]))
    out, lse = attention.reference_forward(q.detach(), k.detach(), v.detach(), True, None, (3, 0))
    args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, True, None, [3, 0])
    torch.library.opcheck(ops.attention_backward.default, args)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q[0], k, v), "q must have 4 dimensions"),
        (lambda q, k, v: (q, k[:1], v[:1]), "batch sizes must agree"),
        (lambda q, k, v: (q, k.expand(2, 3, 11, 16), v.expand(2, 3, 11, 16)), "multiple of heads_kv"),
        (lambda q, k, v: (q, k, v[:, :, :5]), "key and value lengths must agree"),
        (lambda q, k, v: (q, k[..., :8], v), "query and key head dims must agree"),
        (lambda q, k, v: (q, k.double(), v), "dtypes must agree"),
    ],
)
def test_bad_shapes_and_dtypes_are_refused(plain_attn, change, message):
    q, k, v = _qkv(2, 4, 1, 7, 11, 16)
    with pytest.raises(InvalidArgumentError, match=message) as err:
        plain_attn.attention(*change(q, k, v), False, None, None)
    assert str(err.value).startswith("attention")


@pytest.mark.parametrize(
    ("scale", "window", "message"),
    [
        (math.nan, None, "scale must be a finite number"),
        (None, (4, -1), "window must be"),
        (None, (1,), "window"),
        (None, (2.5, 0), r"window must be \(left, right\), two ints >= 0, got \(2.5, 0\)"),
        (None, 3, r"window must be \(left, right\), two ints >= 0, got 3"),
        (True, None, "scale must be a finite number, got True"),
        (10**400, None, "scale must be a finite number"),
        (
            -3.5e38,
            None,
            r"scale must be finite in the compute dtype torch.float32 once multiplied by log2\(e\) "
            r"\(\|scale\| <= 2.359e\+38\), got -3.5e\+38",
        ),
    ],
)
def test_bad_scale_and_window_are_refused(plain_attn, scale, window, message):
    with pytest.raises(InvalidArgumentError, match=message):
        plain_attn.attention(*_qkv(1, 2, 2, 5, 5, 8), False, scale, window)


@pytest.mark.parametrize("seq_q", [3, DECODE_MAX_ROWS + 1], ids=["split-kv", "flash"])
def test_a_scale_whose_log2e_multiple_overflows_fp32_is_refused_and_one_below_is_finite(attn, seq_q):
    """The Triton kernels scale by |scale| * log2(e) in fp32: at 3e38 (accepted before, below fp32's
    max) that is inf, and both forwards gave NaN everywhere; 2e38 still computes."""
    q, k, v = (t * 1e-19 for t in _qkv(1, 2, 2, seq_q, 41, 8))
    chosen = _selected(attn.hal, "attention", q, k, v, False, 2e38)
    assert chosen == ("triton_decode" if seq_q == 3 else "triton"), chosen
    with pytest.raises(InvalidArgumentError, match=r"\(\|scale\| <= 2.359e\+38\), got 3e\+38"):
        attn.attention(q, k, v, False, 3e38, None)
    out = attn.attention(q, k, v, False, 2e38, None)
    assert out.isfinite().all()
    torch.testing.assert_close(
        out, attention.reference(q.double(), k.double(), v.double(), False, 2e38).float()
    )


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_causal_with_a_scale_of_zero_or_less_is_turned_away_from_sdpa(plain_attn, scale):
    """torch's SDPA applies its causal mask before the scale: with a scale <= 0 the masked scores
    become NaN (torch 2.13, CPU: every row with a masked key), where the reference averages the
    visible values (scale 0) or favours the least similar keys."""
    q, k, v = _qkv(1, 4, 2, 16, 16, 8)
    cpu = plain_attn.hal.device("cpu")
    sel = plain_attn.hal.kernels.select("attention", cpu, q, k, v, True, scale, None)
    assert sel.candidate.name != "sdpa"
    assert {r.candidate: r.detail for r in sel.rejected}["torchhal/sdpa"] == attention.SDPA_CAUSAL_SCALE
    with torch.no_grad():
        out = plain_attn.attention(q, k, v, True, scale, None)
    torch.testing.assert_close(out, attention.reference(q, k, v, True, scale))
    assert (
        plain_attn.hal.kernels.select("attention", cpu, q, k, v, False, scale, None).candidate.name == "sdpa"
    )


def test_a_scale_beyond_the_compute_dtype_is_refused_by_both_layouts_and_fits_fp64(plain_attn):
    """A scale finite as a Python float but inf in fp32 (the compute dtype of fp32, bf16 and fp16)
    gave NaN outputs from every candidate, whatever the data; fp64 computes in fp64, where it fits."""
    from torchhal.kernels import attention_varlen

    q, k, v = _qkv(1, 2, 2, 5, 5, 8, torch.bfloat16)
    with pytest.raises(InvalidArgumentError, match=r"attention: scale must be finite in the compute dtype"):
        plain_attn.attention(q, k, v, False, 1e39, None)
    cu = torch.tensor([0, 5])
    with pytest.raises(
        InvalidArgumentError, match=r"attention_varlen: scale must be finite in the compute dtype"
    ):
        attention_varlen.signature(
            q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, 5, 5, False, 1e39
        )
    q, k, v = _qkv(1, 2, 2, 5, 5, 8, torch.float64)
    q = q * 1e-300  # logits of a few units at a scale of 1e300
    torch.testing.assert_close(
        plain_attn.attention(q, k, v, False, 1e300, None),
        torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=1e300),
    )


@pytest.mark.parametrize("scale", [0.0, -0.0, 1e-45, -1.5])
def test_zero_tiny_and_negative_scales_are_computed_as_sdpa_computes_them(attn, check_op, scale):
    """0 averages the values (masked keys still excluded), a negative scale favours the least
    similar keys: meaningful, so accepted (SDPA accepts them), and the Triton kernels, forward and
    backward, agree with the reference."""
    torch.manual_seed(0)
    q, k, v = _qkv(1, 4, 2, 9, 13, 16)
    check_op(
        attn.attention,
        attention.reference,
        (q, k, v, True, scale, None),
        (torch.randn(1, 4, 9, 16),),
        (0, 1, 2),
    )


def test_a_tensor_causal_flag_is_refused(plain_attn):
    """A tensor flag would be memoised by its layout, not its value: refused, naming what was seen."""
    with pytest.raises(InvalidArgumentError, match=r"attention: causal must be a bool, got Tensor"):
        plain_attn.attention(*_qkv(1, 2, 2, 5, 5, 8), torch.tensor(True), None, None)


@pytest.mark.parametrize("causal", [0, 1])
def test_an_integer_causal_flag_is_refused(plain_attn, causal):
    """SDPA's kernels take only a bool: an int reached them, failed, and demoted them for the
    shape's valid calls too."""
    with pytest.raises(InvalidArgumentError, match=rf"attention: causal must be a bool, got int {causal}"):
        plain_attn.attention(*_qkv(1, 2, 2, 5, 5, 8), causal, None, None)


def test_a_window_wider_than_the_sequences_masks_nothing(plain_attn):
    """The reference clamps the band: i + 2**63 - 1 overflowed int64 and masked every key."""
    q, k, v = _qkv(1, 2, 2, 5, 7, 8, torch.float64)
    wide = (2**63 - 1, 2**63 - 1)
    torch.testing.assert_close(plain_attn.attention(q, k, v, False, None, wide), attention.reference(q, k, v))
    torch.testing.assert_close(
        plain_attn.attention(q, k, v, True, None, wide), attention.reference(q, k, v, True), rtol=0, atol=0
    )


def test_zero_head_dim_and_other_layouts_are_refused(plain_attn):
    q, k, v = _qkv(1, 2, 2, 5, 5, 8)
    with pytest.raises(
        InvalidArgumentError, match=r"attention: the head dim must be >= 1, got q shape \(1, 2, 5, 0\)"
    ):
        plain_attn.attention(q[..., :0], k[..., :0], v, False, None, None)
    with pytest.raises(
        UnsupportedError, match=r"attention: k has layout torch.sparse_coo; the op takes strided"
    ):
        plain_attn.attention(q, k.to_sparse(), v, False, None, None)


def test_tensors_on_a_device_no_adapter_drives_are_refused_naming_the_op(plain_attn):
    q = torch.empty(1, 2, 5, 8, device="meta")
    with pytest.raises(UnsupportedError, match=r"attention: the first argument is on meta, which no adapter"):
        plain_attn.attention(q, q, q, False, None, None)


def test_integer_inputs_are_refused(plain_attn):
    q = torch.randint(0, 9, (1, 2, 5, 8))
    with pytest.raises(UnsupportedError, match="q must be a floating-point tensor"):
        plain_attn.attention(q, q, q, False, None, None)


def test_backward_refuses_saved_tensors_that_do_not_fit(plain_attn):
    q, k, v = _qkv(1, 2, 1, 9, 12, 16)
    out, lse = attention.reference_forward(q, k, v)
    cpu = plain_attn.hal.device("cpu")
    with pytest.raises(InvalidArgumentError, match="attention_backward: lse shape must agree"):
        plain_attn.hal.kernels.call(
            "attention_backward", cpu, torch.randn_like(out), q, k, v, out, lse[..., :4]
        )
    with pytest.raises(InvalidArgumentError, match="attention_backward: output shapes must agree"):
        plain_attn.hal.kernels.call("attention_backward", cpu, torch.randn(1, 2, 9, 8), q, k, v, out, lse)


def _caps(*, features=(), backends=()) -> DeviceCapabilities:
    return DeviceCapabilities(
        vendor="test", adapter="test", device_type="testdev", index=0, name="test device", arch="t1",
        compute_units=8, simd_width=32, memory_bytes=1 << 30, dtypes=frozenset({DType.FP32, DType.BF16}),
        features=frozenset(features), kernel_backends=tuple(backends),
        shared_memory_per_block_bytes=100 * 1024,
    )  # fmt: skip


def _sig(dtype=torch.bfloat16, dim=64, causal=False, square=True, window=None, stride_dim=1, scale=None):
    q = torch.empty(1, 2, 16, dim * stride_dim, dtype=dtype)[..., ::stride_dim]
    k = torch.empty(1, 2, 16 if square else 24, dim, dtype=dtype)
    return attention.signature(q, k, k, causal, scale, window)


@pytest.mark.parametrize(
    ("supports", "sig", "backends", "reason"),
    [
        (sdpa.flash_supports, _sig(), (), RejectionReason.FEATURE),
        (sdpa.flash_supports, _sig(), (FLASH,), None),
        (
            sdpa.flash_supports,
            _sig(dtype=torch.float32),
            (FLASH,),
            RejectionReason.DTYPE,
        ),
        (
            sdpa.flash_supports,
            _sig(causal=True, square=False),
            (FLASH,),
            RejectionReason.SHAPE,
        ),
        (sdpa.flash_supports, _sig(window=(4, 4)), (FLASH,), RejectionReason.SHAPE),
        (sdpa.flash_supports, _sig(stride_dim=2), (FLASH,), RejectionReason.LAYOUT),
        (sdpa.flash_supports, _sig(dim=264), (FLASH,), RejectionReason.SHAPE),
        (sdpa.cudnn_supports, _sig(), (CUDNN,), None),
        (sdpa.cudnn_supports, _sig(), (FLASH,), RejectionReason.FEATURE),
        (sdpa.cudnn_supports, _sig(dim=256), (CUDNN,), RejectionReason.SHAPE),
        (sdpa.cudnn_supports, _sig(dim=60), (CUDNN,), RejectionReason.SHAPE),
        (sdpa.flash_supports, _sig(causal=True, scale=-0.5), (FLASH,), RejectionReason.SHAPE),
        (sdpa.cudnn_supports, _sig(causal=True, scale=0.0), (CUDNN,), RejectionReason.SHAPE),
        (sdpa.flash_supports, _sig(scale=-0.5), (FLASH,), None),
    ],
)
def test_sdpa_backend_predicates(supports, sig, backends, reason):
    verdict = supports(_caps(backends=backends), sig)
    assert (verdict.reason if verdict else None) is reason


@pytest.mark.parametrize(
    ("features", "sig", "reason"),
    [
        ((), _sig(dtype=torch.float32), RejectionReason.FEATURE),
        ((Feature.TRITON,), _sig(dtype=torch.float32), None),
        ((Feature.TRITON,), _sig(dtype=torch.bfloat16, dim=256), None),
        ((Feature.TRITON,), _sig(dim=264), RejectionReason.SHAPE),
        ((Feature.TRITON,), _sig(dtype=torch.float64), RejectionReason.DTYPE),
    ],
)
def test_triton_predicate(features, sig, reason):
    verdict = triton_attention.supports(_caps(features=features), sig)
    assert (verdict.reason if verdict else None) is reason
