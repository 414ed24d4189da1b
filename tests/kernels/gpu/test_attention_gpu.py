"""Triton FlashAttention on an NVIDIA GPU in bf16 and fp16: FlashAttention's shape sweep under its
rule (error vs fp64 at most 2x, gradients 3x, PyTorch's own error in the same precision), GQA/MQA,
sliding windows, varlen against dense, torch.compile with inductor, and the SDPA backend candidates."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torchhal_nvidia import sdpa

from tests.kernels.gpu.device_assert import run_expecting_device_assert
from torchhal.kernels import attention, attention_varlen, plugin
from torchhal.kernels.autograd import DifferentiableOp
from torchhal.testing import tolerance

from ..conftest import assert_within_pytorch_error, new_memory_as_nan

pytestmark = pytest.mark.gpu

NAMESPACE = "torchhal_test_attention_gpu"
# FlashAttention-2's test sweep (tests/test_flash_attn.py, test_flash_attn_output), both dtypes
SEQLENS = [
    (113, 203), (128, 217), (113, 211), (108, 256), (256, 512),
    (512, 256), (1024, 1024), (1023, 1024), (1024, 1023), (2048, 2048),
]  # fmt: skip
HEAD_DIMS = [32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]


def torch_math(q, k, v, causal=False, scale=None, window=None):
    """Attention as plain PyTorch computes it in the inputs' own precision (FlashAttention's
    `attention_ref(upcast=False)`): the baseline whose error the kernel's is held to, and in
    fp64 the truth. Queries that see no key give 0, as the op defines."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q * scale, k.transpose(-1, -2))
    mask = attention.allowed_keys(q.shape[2], k.shape[2], causal, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:
        probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return torch.matmul(probs, v)


def _qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, dtype):
    return (
        torch.randn(batch, heads_q, seq_q, dim, device="cuda", dtype=dtype),
        torch.randn(batch, heads_kv, seq_k, dim, device="cuda", dtype=dtype),
        torch.randn(batch, heads_kv, seq_k, dim, device="cuda", dtype=dtype),
    )


class _Ops:
    def __init__(self) -> None:
        self.hal = None
        self.attention = DifferentiableOp(attention.AUTOGRAD, self.dispatch, namespace=NAMESPACE)
        self.varlen = DifferentiableOp(attention_varlen.AUTOGRAD, self.dispatch, namespace=NAMESPACE)

    def dispatch(self, op, first, *args):
        return self.hal.dispatch(op, first, *args)


_OPS = _Ops()


@pytest.fixture
def ops(gpu_hal):
    if attention_varlen not in plugin.OP_MODULES and "attention_varlen" not in gpu_hal.kernels.ops():
        attention_varlen.register(gpu_hal.kernels)
    _OPS.hal = gpu_hal
    yield _OPS
    _OPS.hal = None


def _check(ops, check_op, args):
    """Forward and gradients through the autograd glue, after checking the registry picks Triton."""
    q, k, v = args[:3]
    device = ops.hal.device_for_tensor(q)
    out, lse = attention.reference_forward(*args)
    assert ops.hal.kernels.select("attention_forward", device, *args).candidate.name == "triton"
    backward_args = (out, q, k, v, out, lse, *args[3:])
    assert ops.hal.kernels.select("attention_backward", device, *backward_args).candidate.name == "triton"
    check_op(ops.attention, torch_math, args, (torch.randn_like(out),), (0, 1, 2))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dim", HEAD_DIMS)
@pytest.mark.parametrize(("seq_q", "seq_k"), SEQLENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_shape_sweep(ops, check_op, dtype, seq_q, seq_k, dim, causal):
    args = (*_qkv(2, 6, 6, seq_q, seq_k, dim, dtype), causal, None, None)
    _check(ops, check_op, args)


@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "causal", "scale", "window"),
    [
        (8, 2, True, None, None),
        (8, 1, False, 0.5, None),
        (8, 2, False, None, (256, 64)),
        (4, 4, True, None, (511, 0)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_heads_scale_and_windows(ops, check_op, heads_q, heads_kv, causal, scale, window, dtype):
    args = (*_qkv(2, heads_q, heads_kv, 1000, 1537, 128, dtype), causal, scale, window)
    _check(ops, check_op, args)


@pytest.mark.parametrize("scale", [0.0, -0.5])
def test_causal_with_a_scale_of_zero_or_less_is_served_by_triton_and_right(ops, check_op, scale):
    """seq_q == seq_k, where the SDPA candidates (flash, cuDNN, the core's) would otherwise serve:
    they mask before they scale, so they turn causal with a scale <= 0 down."""
    _check(ops, check_op, (*_qkv(2, 8, 2, 512, 512, 128, torch.bfloat16), True, scale, None))


def test_transposed_layout(ops, check_op):
    """(batch, seq, heads, dim) views, as a projection's output reshaped without a copy."""
    q, k, v = (
        torch.randn(2, 777, 8, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(3)
    )
    _check(ops, check_op, (q, k, v, True, None, None))


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def _dense(t, start, stop):
    """Rows start:stop of a packed (tokens, heads, dim) tensor as a dense (1, heads, rows, dim) view."""
    return t[start:stop].transpose(0, 1).unsqueeze(0)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_dense_per_sequence(ops, candidate, causal):
    """Sequences of 300, 1, 1029 and 64 queries against 517, 77, 1029 and 0 keys (the last sees none)."""
    lens_q, lens_k = [300, 1, 1029, 64], [517, 77, 1029, 0]
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    q = torch.randn(sum(lens_q), 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fixed = (cu_q, cu_k, max(lens_q), max(lens_k), causal, None)
    out, lse = candidate(ops.hal, "attention_varlen_forward", "triton", q, k, v, *fixed)(q, k, v, *fixed)
    grad_out = torch.randn_like(out)
    backward = candidate(ops.hal, "attention_varlen_backward", "triton", grad_out, q, k, v, out, lse, *fixed)
    dq, dk, dv = backward(grad_out, q, k, v, out, lse, *fixed)
    first = (_dense(q, 0, 300), _dense(k, 0, 517), _dense(v, 0, 517), causal)
    dense_forward = candidate(ops.hal, "attention_forward", "triton", *first)
    o_first, lse_first = dense_forward(*first)
    dense_backward = candidate(
        ops.hal,
        "attention_backward",
        "triton",
        _dense(grad_out, 0, 300),
        *first[:3],
        o_first,
        lse_first,
        causal,
    )
    for b in range(3):  # the sequences with keys
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qkv = (_dense(q, q0, q1), _dense(k, k0, k1), _dense(v, k0, k1))
        o_b, lse_b = dense_forward(*qkv, causal)
        torch.testing.assert_close(out[q0:q1], o_b[0].transpose(0, 1), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(lse[:, q0:q1], lse_b[0], rtol=1e-5, atol=1e-5)
        grads = dense_backward(_dense(grad_out, q0, q1), *qkv, o_b, lse_b, causal)
        for packed, dense, (start, stop) in zip(
            (dq, dk, dv), grads, ((q0, q1), (k0, k1), (k0, k1)), strict=True
        ):
            torch.testing.assert_close(packed[start:stop], dense[0].transpose(0, 1), rtol=2e-2, atol=2e-2)
    assert torch.count_nonzero(out[cu_q[3] :]) == 0 and torch.isneginf(lse[:, cu_q[3] :]).all()
    assert torch.count_nonzero(dq[cu_q[3] :]) == 0


@pytest.mark.parametrize(
    ("lens_q", "spare"),
    [([1] * 8, 1000), ([300, 1029], 17)],
    ids=["decoding-long-tail", "prefill-short-tail"],
)
def test_varlen_kernel_writes_the_rows_after_the_last_sequence(ops, candidate, lens_q, spare):
    """The forward's outputs are allocated unfilled; the kernel writes the rows no sequence owns
    (output 0, lse -inf). Under deterministic algorithms new memory is NaN, so a row left unwritten
    shows; the rows of the sequences match the reference."""
    lens_k = [1024] * len(lens_q)
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    q = torch.randn(sum(lens_q) + spare, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fixed = (cu_q, cu_k, max(lens_q), max(lens_k), True, None)
    forward = candidate(ops.hal, "attention_varlen_forward", "triton", q, k, v, *fixed)
    with new_memory_as_nan():
        out, lse = forward(q, k, v, *fixed)
    assert torch.count_nonzero(out[sum(lens_q) :]) == 0 and torch.isneginf(lse[:, sum(lens_q) :]).all()
    expected_out, expected_lse = attention_varlen.reference_forward(q, k, v, *fixed)
    torch.testing.assert_close(out, expected_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    ("lens_q", "lens_k", "spare_k"),
    [([700, 0, 1029, 1], [900, 2000, 0, 1], 3000), ([1] * 8, [0] * 8, 100)],
    ids=["sequences-without-queries-or-keys", "no-keys-at-all"],
)
def test_varlen_backward_writes_every_gradient_row(ops, candidate, lens_q, lens_k, spare_k):
    """dq, dk, dv are allocated unfilled; the backward's kernels write the rows after the last
    sequence and the key rows of sequences without queries (0). Under deterministic algorithms new
    memory is NaN, so a row left unwritten shows; the rest matches the reference."""
    cu_q, cu_k = _offsets(lens_q), _offsets(lens_k)
    q = torch.randn(sum(lens_q) + 37, 32, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k) + spare_k, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fixed = (cu_q, cu_k, max(lens_q), max(lens_k), True, None)
    out, lse = attention_varlen.reference_forward(q, k, v, *fixed)
    args = (torch.randn_like(q), q, k, v, out, lse, *fixed)
    backward = candidate(ops.hal, "attention_varlen_backward", "triton", *args)
    with new_memory_as_nan():
        grads = backward(*args)
    expected = attention_varlen.reference_backward(*args)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        assert not got.isnan().any(), f"{name}: rows left unwritten"
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m, name=name: f"{name}: {m}")


def test_varlen_valid_offsets_pass_the_device_check(ops, check_op):
    """Random lengths (some 0), max_seqlen exactly the longest, tokens after the last sequence: the
    check queued before the kernels passes, and forward and gradients are within PyTorch's error."""
    g = torch.Generator().manual_seed(24)
    lens_q, lens_k = (torch.randint(0, 300, (9,), generator=g) for _ in range(2))
    lens_q[2], lens_k[5] = 0, 0
    cu_q, cu_k = _offsets(lens_q.tolist()), _offsets(lens_k.tolist())
    q = torch.randn(int(lens_q.sum()) + 5, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(int(lens_k.sum()), 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    fixed = (cu_q, cu_k, int(lens_q.max()), int(lens_k.max()), True, None)
    device = ops.hal.device_for_tensor(q)
    assert (
        ops.hal.kernels.select("attention_varlen_forward", device, q, k, v, *fixed).candidate.name == "triton"
    )
    check_op(
        lambda q, k, v: ops.varlen(q, k, v, *fixed),
        lambda q, k, v: attention_varlen.reference(q, k, v, *fixed),
        (q, k, v),
        (torch.randn_like(q),),
        (0, 1, 2),
    )
    torch.cuda.synchronize()  # a failed device assert would raise here


def test_varlen_validation_is_memoised_on_the_gpu(ops, monkeypatch):
    """Off the CPU attention_varlen's signature reads no offsets (its kernels check them on the
    device), so a layout seen before skips validation, as every other op's does: the layers of a
    decoding step share one layout, and validating cost a quarter of a small call's host time. New
    offsets of that layout, with and without gradients, still give the reference's answer."""
    validated = []

    def counting(op, signature):
        return lambda *args: validated.append(op) or signature(*args)

    for op in ("attention_varlen", "attention_varlen_forward", "attention_varlen_backward"):
        opdef = ops.hal.kernels.op(op)
        replaced = dataclasses.replace(opdef, signature=counting(op, opdef.signature))
        monkeypatch.setitem(ops.hal.kernels._ops, op, replaced)
    g = torch.Generator().manual_seed(25)
    total_q, total_k = 1241, 1237  # a layout no other test uses: not in the memo yet
    q = torch.randn(total_q, 4, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total_k, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def offsets(total):  # five sequences, fresh random lengths; the offsets' shape stays
        cuts = torch.randint(0, total + 1, (4,), generator=g).sort().values.tolist()
        return torch.tensor([0, *cuts, total], dtype=torch.int32, device="cuda")

    for grad in (False, False, False, True, True):
        fixed = (offsets(total_q), offsets(total_k), total_q, total_k, True, None)
        inputs = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            out = ops.varlen(*inputs, *fixed)
        torch.testing.assert_close(out, attention_varlen.reference(q, k, v, *fixed), rtol=2e-2, atol=2e-2)
        if grad:
            out.float().square().sum().backward()
            assert all(t.grad is not None for t in inputs)
    torch.cuda.synchronize()  # a failed device check would raise here
    assert validated == ["attention_varlen", "attention_varlen_forward", "attention_varlen_backward"]


# A device assert poisons the process's CUDA context, so the bad call runs in a child process. The
# offsets change in place after a warm call: same signature and graph, no selection or compile.
_BAD_OFFSETS_CHILD = """
import sys, torch, torchhal.ops
mode = sys.argv[1]
fn = torchhal.ops.attention_varlen
if mode == "compiled":
    fn = torch.compile(fn, fullgraph=True)
cu = torch.tensor([0, 300, 301, 1330, 1394], dtype=torch.int32, device="cuda")
q = torch.randn(1394 + 16, 8, 128, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "no_grad")
k = torch.randn(1394, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "no_grad")
v = torch.randn(1394, 2, 128, device="cuda", dtype=torch.bfloat16, requires_grad=mode != "no_grad")
cu_q = cu.clone()
torch.set_grad_enabled(mode != "no_grad")
fn(q, k, v, cu_q, cu, 1029, 1029, causal=True)  # warm: compile, select outside the no-sync block
torch.cuda.synchronize()
cu_q[3] += 10  # query sequence 2 now has 1039 rows, above max_seqlen_q 1029: its tail went uncomputed
torch.cuda.set_sync_debug_mode("error")  # any host sync in the checked call raises
out = fn(q, k, v, cu_q, cu, 1029, 1029, causal=True)
"""


@pytest.mark.parametrize("mode", ["no_grad", "grad", "compiled"])
def test_varlen_offsets_past_max_seqlen_are_a_device_assert_without_a_sync(gpu_hal, tmp_path, mode):
    """A sequence longer than max_seqlen_q: the Triton kernels left its tail uncomputed (their grid
    covers max_seqlen rows per sequence) and returned. The offsets are not read on the host (a sync
    per call): the candidates queue a check and torch._assert_async, which fails at the next
    synchronisation with the op's message. The bad call's layout was seen by the warm call, so the
    registry skips its validation (memoised off the CPU): the kernels' check alone catches it."""
    # autotune off: the Triton candidates serve the call (the reference reads the offsets, a sync)
    child = run_expecting_device_assert(_BAD_OFFSETS_CHILD, mode, tmp_path, TORCHHAL_AUTOTUNE="off")
    op = "attention_varlen" if mode == "no_grad" else "attention_varlen_forward"
    assert f"{op}: cu_seqlens_q/_k must rise from 0 to at most 1410/1394 tokens" in child.stderr


@pytest.mark.parametrize(
    ("batch", "heads_q", "heads_kv", "seq_q", "seq_k", "dim", "causal", "window"),
    [
        (1, 32, 8, 1, 131072, 128, False, None),
        (4, 32, 8, 4, 8193, 128, True, None),
        (2, 16, 2, 1, 3000, 64, True, (512, 0)),
        (3, 8, 8, 3, 777, 96, True, None),
        (1, 4, 1, 2, 5000, 256, False, None),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_kv_decode_candidate(
    gpu_hal, candidate, batch, heads_q, heads_kv, seq_q, seq_k, dim, causal, window, dtype
):
    """The split-KV kernel at decoding shapes, its key slices sized from the H100's compute units:
    output (2x PyTorch's error) and lse against fp64."""
    q, k, v = _qkv(batch, heads_q, heads_kv, seq_q, seq_k, dim, dtype)
    args = (q, k, v, causal, None, window)
    out, lse = candidate(gpu_hal, "attention_forward", "triton_decode", *args)(*args)
    truth_out, truth_lse = attention.reference_forward(*(t.double() for t in (q, k, v)), causal, None, window)
    assert out.is_contiguous() and lse.shape == (batch, heads_q, seq_q) and lse.dtype == torch.float32
    assert_within_pytorch_error("out", out, torch_math(*args[:3], causal, None, window), truth_out, 2)
    torch.testing.assert_close(lse, truth_lse.float(), rtol=0, atol=1e-4)
    no_grad = candidate(gpu_hal, "attention", "triton_decode", *args)(*args)
    torch.testing.assert_close(no_grad, out, rtol=0, atol=0)


def test_compile_with_inductor(ops):
    """The custom ops inside one torch.compile(fullgraph=True) graph, forward and backward, against eager."""
    torch._dynamo.reset()
    q, k, v = (t.requires_grad_(True) for t in _qkv(2, 8, 2, 1024, 1024, 128, torch.bfloat16))

    def block(q, k, v):
        return ops.attention(q, k * 2, v, True, None, None).float().square().mean()

    eager = torch.autograd.grad(block(q, k, v), (q, k, v))
    compiled = torch.compile(block, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for g, e in zip(got, eager, strict=True):
        torch.testing.assert_close(g, e)


@pytest.mark.parametrize(
    ("name", "backend"),
    [("sdpa_flash", sdpa.FLASH_BACKEND), ("sdpa_cudnn", sdpa.CUDNN_BACKEND)],
)
def test_sdpa_backend_candidates(gpu_hal, candidate, name, backend):
    """The NVIDIA adapter offers both on Ampere and newer (the GPU hosts here are Hopper)."""
    _require_sdpa_backend(gpu_hal, backend)
    args = (*_qkv(2, 8, 2, 1024, 1024, 128, torch.bfloat16), True)
    got = candidate(gpu_hal, "attention", name, *args)(*args)
    truth = torch_math(*(t.double() for t in args[:3]), True)
    same = torch_math(*args)
    bound = 2 * (same.double() - truth).abs().max() + tolerance.floor(truth, got.dtype)
    assert (got.double() - truth).abs().max() <= bound


def _require_sdpa_backend(hal, backend):
    device = hal.device_for_tensor(torch.empty(0, device="cuda"))
    if device.capabilities.vendor != "nvidia" or device.capabilities.arch < "sm_80":
        pytest.skip(f"{device.id} ({device.capabilities.arch}) is not an NVIDIA GPU of sm_80 or newer")
    assert backend in device.capabilities.kernel_backends


def _bshd(batch, heads, seq, dim, dtype):
    """A (batch, heads, seq, dim) view of a (batch, seq, heads, dim) tensor, as projections give."""
    return torch.randn(batch, seq, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)


@pytest.mark.parametrize(
    ("name", "backend"),
    [("sdpa_flash", sdpa.FLASH_BACKEND), ("sdpa_cudnn", sdpa.CUDNN_BACKEND)],
)
@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "seq", "dim", "causal", "layout"),
    [
        (8, 8, 1024, 128, True, "bhsd"),
        (8, 2, 777, 64, False, "bhsd"),
        (8, 1, 512, 128, True, "bshd"),
        (6, 6, 333, 64, False, "bshd"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sdpa_training_candidates(
    gpu_hal, candidate, name, backend, heads_q, heads_kv, seq, dim, causal, layout, dtype
):
    """The SDPA training pair under the rule: the forward's out (2x) and its lse against fp64; the
    backward (3x) from the fp64 reference's out and lse, so any forward's pair with it, and with a
    grad_out laid out unlike out (cuDNN's backward alone gets that wrong without a word)."""
    _require_sdpa_backend(gpu_hal, backend)
    if layout == "bhsd":
        q, k, v = _qkv(2, heads_q, heads_kv, seq, seq, dim, dtype)
    else:
        q, k, v = (_bshd(2, heads, seq, dim, dtype) for heads in (heads_q, heads_kv, heads_kv))
    args = (q, k, v, causal, None, None)
    out, lse = candidate(gpu_hal, "attention_forward", name, *args)(*args)
    truth_out, truth_lse = attention.reference_forward(*(t.double() for t in (q, k, v)), causal)
    assert out.is_contiguous() and lse.shape == (2, heads_q, seq) and lse.dtype == torch.float32
    assert_within_pytorch_error("out", out, torch_math(*args[:3], causal), truth_out, 2)
    torch.testing.assert_close(lse, truth_lse, rtol=0, atol=1e-4)  # both fp32; truth from fp64

    grad_out = torch.randn(2, seq, heads_q, dim, device="cuda", dtype=dtype).transpose(1, 2)
    saved = (truth_out.to(dtype), truth_lse.float())
    grads = candidate(gpu_hal, "attention_backward", name, grad_out, *args[:3], *saved, *args[3:])(
        grad_out, *args[:3], *saved, *args[3:]
    )
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    truth = torch.autograd.grad(torch_math(*leaves64, causal), leaves64, grad_out.double())
    same = torch.autograd.grad(torch_math(*leaves, causal), leaves, grad_out)
    for what, got, s, t in zip(("dq", "dk", "dv"), grads, same, truth, strict=True):
        assert got.is_contiguous()
        assert_within_pytorch_error(what, got, s, t, 3)


@pytest.mark.parametrize(
    ("heads_q", "heads_kv", "seq_q"), [(65536 + 8, 4, 5), (2 * 65535 + 2, 2 * 65535 + 2, 70)]
)
def test_more_heads_than_cudas_grid_limit(ops, check_op, heads_q, heads_kv, seq_q):
    """65535 is CUDA's cap on grid axis 1 (query heads; kv heads in the dk/dv kernel): past it
    the kernels launch in slices, each head keeping its kv head across them. (70 query rows per kv
    head: more than the split-KV kernel takes, so the FlashAttention kernels serve the forward.)"""
    args = (*_qkv(1, heads_q, heads_kv, seq_q, 7, 16, torch.bfloat16), True, None, None)
    _check(ops, check_op, args)


@pytest.mark.parametrize(
    ("rows", "caches", "spare"),
    [(1, [512 << i for i in range(8)], 3), (4, [40000, 0, 777, 9000], 0), (2, [1, 300, 65536], 100)],
    ids=["decoding-caches-512-to-64k", "4-rows-an-empty-cache", "2-rows-more-rows-than-keys-padding"],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_split_kv_packed_decode(gpu_hal, candidate, rows, caches, spare, dtype):
    """The split-KV kernel on packed sequences, each with its own cache length, causal: output (2x
    PyTorch's error) and lse against fp64 per sequence; tokens after the last sequence 0 and -inf
    (new memory is NaN under deterministic algorithms, so a row left unwritten shows)."""
    lens_q = [rows] * len(caches)
    q = torch.randn(sum(lens_q) + spare, 32, 128, device="cuda", dtype=dtype)
    k, v = (torch.randn(sum(caches), 8, 128, device="cuda", dtype=dtype) for _ in range(2))
    fixed = (_offsets(lens_q), _offsets(caches), rows, max(caches), True, None)
    forward = candidate(gpu_hal, "attention_varlen_forward", "triton_decode", q, k, v, *fixed)
    with new_memory_as_nan():
        out, lse = forward(q, k, v, *fixed)
    truth_out, truth_lse = attention_varlen.reference_forward(*(t.double() for t in (q, k, v)), *fixed)
    same_out = attention_varlen.reference_forward(q, k, v, *fixed)[0]
    assert_within_pytorch_error("out", out, same_out, truth_out, 2)
    torch.testing.assert_close(lse, truth_lse.float(), rtol=0, atol=1e-4)
    assert torch.count_nonzero(out[sum(lens_q) :]) == 0


def test_split_kv_past_cudas_grid_limit(gpu_hal, candidate):
    """The split-KV kernels launch one-dimensional grids: 131072 kv heads of a few rows each."""
    q, k, v = _qkv(1, 2 * 65535 + 2, 2 * 65535 + 2, 5, 40, 16, torch.bfloat16)
    out, lse = candidate(gpu_hal, "attention_forward", "triton_decode", q, k, v, True)(q, k, v, True)
    truth_out, truth_lse = attention.reference_forward(q.double(), k.double(), v.double(), True)
    assert_within_pytorch_error("out", out, torch_math(q, k, v, True), truth_out, 2)
    torch.testing.assert_close(lse, truth_lse.float(), rtol=0, atol=1e-4)
