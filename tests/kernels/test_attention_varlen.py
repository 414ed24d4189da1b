"""attention_varlen: the Triton kernels on packed sequences (CPU interpreter, fp32) against the fp64
reference under FlashAttention's rule, against the dense op per sequence, and bad offsets."""

from __future__ import annotations

import pytest
import torch

from torchhal.hal_core import InvalidArgumentError
from torchhal.kernels import attention, attention_varlen, plugin
from torchhal.kernels.autograd import DifferentiableOp

NAMESPACE = "torchhal_test_attention_varlen"


class VarlenOps:
    def __init__(self) -> None:
        self.hal = None
        self.varlen = DifferentiableOp(attention_varlen.AUTOGRAD, self.dispatch, namespace=NAMESPACE)
        self.dense = DifferentiableOp(attention.AUTOGRAD, self.dispatch, namespace=NAMESPACE)

    def dispatch(self, op, first, *args):
        return self.hal.dispatch(op, first, *args)


_OPS = VarlenOps()


def _with_varlen(hal):
    """The session HALs register plugin.OP_MODULES; add attention_varlen until the core lists it."""
    if attention_varlen not in plugin.OP_MODULES and "attention_varlen" not in hal.kernels.ops():
        attention_varlen.register(hal.kernels)
    _OPS.hal = hal
    return _OPS


@pytest.fixture
def ops(triton_hal):
    yield _with_varlen(triton_hal)
    _OPS.hal = None


@pytest.fixture
def plain_ops(plain_hal):
    yield _with_varlen(plain_hal)
    _OPS.hal = None


def _offsets(lengths, dtype=torch.int32):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=dtype)


def _packed(lens_q, lens_k, heads_q, heads_kv, dim, spare_q=0):
    """Packed q, k, v with `spare_q` query tokens after the last sequence (outside every sequence)."""
    q = torch.randn(sum(lens_q) + spare_q, heads_q, dim)
    k = torch.randn(sum(lens_k), heads_kv, dim)
    v = torch.randn(sum(lens_k), heads_kv, dim)
    return q, k, v, _offsets(lens_q), _offsets(lens_k)


VARLEN_CASES = [  # lengths of q and k per sequence, heads, dim, causal
    pytest.param([37, 12, 61], [50, 0, 61], 4, 2, 32, False, id="gqa-full-with-an-empty-key-sequence"),
    pytest.param([37, 0, 61], [20, 23, 90], 2, 1, 64, True, id="mqa-causal-with-an-empty-query-sequence"),
]


@pytest.mark.parametrize(("lens_q", "lens_k", "heads_q", "heads_kv", "dim", "causal"), VARLEN_CASES)
def test_triton_varlen_forward_and_gradients_within_pytorch_error(
    ops, check_op, lens_q, lens_k, heads_q, heads_kv, dim, causal
):
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, heads_q, heads_kv, dim, spare_q=3)
    grad_out = torch.randn(q.shape)
    fixed = (cu_q, cu_k, max(lens_q), max(lens_k), causal, None)
    cpu = ops.hal.device("cpu")
    assert ops.hal.kernels.select("attention_varlen_forward", cpu, q, k, v, *fixed).candidate.name == "triton"
    out, lse = attention_varlen.reference_forward(q, k, v, *fixed)
    sel = ops.hal.kernels.select("attention_varlen_backward", cpu, grad_out, q, k, v, out, lse, *fixed)
    assert sel.candidate.name == "triton"

    def run(op):
        return lambda q, k, v: op(q, k, v, *fixed)

    check_op(run(ops.varlen), run(attention_varlen.reference), (q, k, v), (grad_out,), (0, 1, 2))


def test_varlen_matches_the_dense_op_on_each_sequence(ops):
    """Also with int64 offsets (FlashAttention takes int32; both index the same)."""
    lens_q, lens_k = [29, 45], [45, 33]
    q, k, v, _, _ = _packed(lens_q, lens_k, 4, 2, 32, spare_q=2)
    cu_q, cu_k = _offsets(lens_q, torch.int64), _offsets(lens_k, torch.int64)
    grad_out = torch.randn(q.shape)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ops.varlen(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), True, 0.2)
    out.backward(grad_out)
    assert (
        torch.count_nonzero(out[sum(lens_q) :]) == 0
        and torch.count_nonzero(leaves[0].grad[sum(lens_q) :]) == 0
    )
    for b in range(len(lens_q)):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        dense = [
            t[s].transpose(0, 1).unsqueeze(0).clone().requires_grad_(True)
            for t, s in zip((q, k, v), (sq, sk, sk), strict=True)
        ]
        expected = ops.dense(*dense, True, 0.2, None)
        expected.backward(grad_out[sq].transpose(0, 1).unsqueeze(0))
        torch.testing.assert_close(out[sq], expected[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
        for leaf, part, s in zip(leaves, dense, (sq, sk, sk), strict=True):
            torch.testing.assert_close(leaf.grad[s], part.grad[0].transpose(0, 1), rtol=1e-5, atol=1e-6)


def test_compile_fullgraph(plain_ops):
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _packed([9, 14], [12, 14], 2, 1, 16)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def block(q, k, v):
        return plain_ops.varlen(q, k, v, cu_q, cu_k, 14, 14, True, None)

    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(*leaves)
    out.sum().backward()
    expected = attention_varlen.reference(q.detach(), k.detach(), v.detach(), cu_q, cu_k, 14, 14, True)
    torch.testing.assert_close(out, expected)
    assert all(leaf.grad is not None for leaf in leaves)


@pytest.mark.parametrize(
    ("cu_q", "cu_k", "max_q", "message"),
    [
        (
            torch.tensor([0.0, 5.0]),
            torch.tensor([0, 5]),
            5,
            "cu_seqlens_q must be a non-empty int32 or int64",
        ),
        (torch.tensor([0, 5, 9]), torch.tensor([0, 5]), 5, "cu_seqlens lengths must agree"),
        (torch.tensor([0, 6, 5]), torch.tensor([0, 5, 9]), 6, "cu_seqlens_q must rise from 0"),
        (torch.tensor([0, 5, 12]), torch.tensor([0, 5, 9]), 7, "at most 10 tokens"),
        (
            torch.tensor([0, 5, 9]),
            torch.tensor([0, 5, 9]),
            3,
            "max_seqlen_q must be >= the longest sequence 5",
        ),
        (torch.tensor([0, 5, 9]), torch.tensor([0, 5, 9]), -1, "max_seqlen_q must be an int >= 0"),
    ],
)
def test_bad_offsets_are_refused(plain_ops, cu_q, cu_k, max_q, message):
    q, k, v = torch.randn(10, 2, 8), torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    with pytest.raises(InvalidArgumentError, match=message) as err:
        plain_ops.varlen(q, k, v, cu_q, cu_k, max_q, 5, False, None)
    assert str(err.value).startswith("attention_varlen")


def test_packed_tensors_must_have_three_dimensions(plain_ops):
    q = torch.randn(1, 10, 2, 8)
    with pytest.raises(InvalidArgumentError, match="q must have 3 dimensions"):
        plain_ops.varlen(q, q[0], q[0], _offsets([10]), _offsets([10]), 10, 10, False, None)
