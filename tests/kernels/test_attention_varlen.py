"""attention_varlen: the Triton kernels on packed sequences (CPU interpreter, fp32) against the fp64
reference under FlashAttention's rule, against the dense op per sequence, a property test over
lengths, heads, head dims, causal, scale and packed layouts, and bad offsets."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, example, given, settings
from hypothesis import strategies as st

import torchhal.ops
from torchhal.hal_core import InvalidArgumentError, RejectionReason
from torchhal.kernels import attention, attention_varlen, plugin
from torchhal.kernels.autograd import DifferentiableOp
from torchhal.kernels.triton_attention_config import DECODE_MAX_ROWS

from .conftest import assert_out_and_lse_within_pytorch_error, new_memory_as_nan

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


def _packed(lens_q, lens_k, heads_q, heads_kv, dim, spare_q=0, spare_k=0):
    """Packed q, k, v with `spare_q` query and `spare_k` key tokens after the last sequence
    (outside every sequence)."""
    q = torch.randn(sum(lens_q) + spare_q, heads_q, dim)
    k = torch.randn(sum(lens_k) + spare_k, heads_kv, dim)
    v = torch.randn(sum(lens_k) + spare_k, heads_kv, dim)
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


@pytest.mark.parametrize(
    ("lens_q", "max_extra", "spare"),
    [([1, 1, 1], 0, 70), ([50, 3], 40, 5), ([50, 3], 40, 200)],
    ids=["one-program-per-head-long-tail", "many-programs-short-tail", "many-programs-long-tail"],
)
def test_the_kernel_writes_the_rows_after_the_last_sequence(ops, candidate, lens_q, max_extra, spare):
    """The Triton forward allocates its outputs unfilled (two launches less per call) and the first
    sequence's programs write the rows no sequence owns: output 0, lse -inf. Under deterministic
    algorithms torch fills new memory with NaN, so a row left unwritten shows. (The FlashAttention
    forward; the split-KV one's: test_attention_decode.)"""
    lens_k = [20, 33, 7][: len(lens_q)]
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 16, spare_q=spare)
    fixed = (cu_q, cu_k, max(lens_q) + max_extra, max(lens_k), True, None)
    forward = candidate(ops.hal, "attention_varlen_forward", "triton", q, k, v, *fixed)
    with new_memory_as_nan():
        out, lse = forward(q, k, v, *fixed)
    expected_out, expected_lse = attention_varlen.reference_forward(q, k, v, *fixed)
    assert torch.count_nonzero(out[sum(lens_q) :]) == 0 and torch.isneginf(lse[:, sum(lens_q) :]).all()
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("lens_q", "lens_k", "spare_q", "spare_k"),
    [([5, 0, 9], [7, 12, 0], 70, 40), ([1, 1], [0, 0], 3, 50), ([50, 3], [20, 33], 5, 200)],
    ids=["sequences-without-queries-or-keys", "no-keys-at-all", "many-programs-long-tails"],
)
def test_the_backward_writes_every_gradient_row(ops, candidate, lens_q, lens_k, spare_q, spare_k):
    """The Triton backward allocates dq, dk, dv unfilled: its kernels write the rows after the last
    sequence (0) and the key rows of a sequence without queries (0), the dk/dv kernel launching one
    key tile when max_seqlen_k is 0. NaN-filled new memory shows a row left unwritten."""
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 16, spare_q=spare_q, spare_k=spare_k)
    fixed = (cu_q, cu_k, max(lens_q), max(lens_k), True, None)
    out, lse = attention_varlen.reference_forward(q, k, v, *fixed)
    args = (torch.randn(q.shape), q, k, v, out, lse, *fixed)
    backward = candidate(ops.hal, "attention_varlen_backward", "triton", *args)
    with new_memory_as_nan():
        grads = backward(*args)
    expected = attention_varlen.reference_backward(*args)
    for name, got, want in zip(("dq", "dk", "dv"), grads, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


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
        # a bool reached the Triton kernels as a 1-bit value; their failure demoted them for max 1
        (
            torch.tensor([0, 5, 9]),
            torch.tensor([0, 5, 9]),
            True,
            "max_seqlen_q must be an int >= 0, got True",
        ),
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


# --- property test: sequence lengths, heads, head dims, causal, scale and packed layouts ---------


def _packed_view(layout, tokens, heads, dim):
    """A random (tokens, heads, dim) tensor laid out as packed code hands it over."""
    if layout == "fused-qkv":  # one of three parts of a fused projection: token stride 3 * heads * dim
        return torch.randn(tokens, 3, heads, dim)[:, 1]
    if layout == "heads-first":  # (heads, tokens, dim) memory, transposed
        return torch.randn(heads, tokens, dim).transpose(0, 1)
    if layout == "token-strided":  # every other token of a longer buffer, at an offset
        return torch.randn(2 * tokens + 1, heads, dim)[1::2]
    if layout == "dim-strided":  # every other element along the head dim (slow, never wrong)
        return torch.randn(tokens, heads, 2 * dim)[..., ::2]
    return torch.randn(tokens, heads, dim)


def _cu_seqlens(lengths, dtype, strided):
    cu = _offsets(lengths, dtype)
    if strided:  # every other entry of a longer table: the kernels must not read it as contiguous
        cu = torch.stack([cu, torch.full_like(cu, 10**6)], dim=1).flatten()[::2]
        assert not cu.is_contiguous()
    return cu


LAYOUTS = ["contiguous", "fused-qkv", "heads-first", "token-strided", "dim-strided"]


@settings(
    max_examples=4,  # and the two explicit examples
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
    phases=[Phase.explicit, Phase.generate],
)
@given(
    lengths=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1, max_size=3),
    spare=st.tuples(st.sampled_from([0, 2]), st.sampled_from([0, 2])),
    heads=st.sampled_from([(2, 2), (4, 2), (2, 1)]),  # MHA, GQA, MQA (and 3 / 1 below)
    dim=st.sampled_from([8, 16, 24, 40]),
    causal=st.booleans(),
    scale=st.sampled_from([None, 0.3, -0.5]),
    layouts=st.tuples(*[st.sampled_from(LAYOUTS)] * 4),  # q, k, v, grad_out
    offsets=st.tuples(st.sampled_from([torch.int32, torch.int64]), st.booleans()),  # dtype, strided
    max_extra=st.sampled_from([0, 3]),
)
@example(  # one sequence, more keys than queries, causal (bottom-right), GQA, a fused projection
    lengths=[(23, 37)], spare=(2, 0), heads=(4, 2), dim=24, causal=True, scale=None,
    layouts=("fused-qkv", "heads-first", "token-strided", "dim-strided"), offsets=(torch.int32, True),
    max_extra=0,
)  # fmt: skip
@example(  # empty query and key sequences, more queries than keys (the first see no key), MQA
    lengths=[(0, 5), (19, 4), (7, 0), (11, 11)], spare=(2, 2), heads=(3, 1), dim=16, causal=True,
    scale=-0.5, layouts=("heads-first", "contiguous", "fused-qkv", "token-strided"),
    offsets=(torch.int64, False), max_extra=3,
)  # fmt: skip
def test_lengths_heads_and_layouts_property(
    triton_hal,
    on_triton,
    check_op,
    candidate,
    lengths,
    spare,
    heads,
    dim,
    causal,
    scale,
    layouts,
    offsets,
    max_extra,
):
    """torchhal.ops.attention_varlen on random packed batches: sequences of length 0 on either side,
    query and key lengths that differ per sequence, tokens after the last sequence, max_seqlen above
    the longest, (tokens, heads, dim) views of bigger tensors and strided cu_seqlens; forward and the
    gradients of q, k and v under the rule, zero output and gradient outside every sequence, and on
    each sequence the dense op's answer. The Triton candidates serve every call but those with nothing
    to launch (max_seqlen_q 0), which go to the reference, Triton rejected by type (SHAPE); conftest's
    guard fails a test whose kernel raised and fell back, so the candidate selected is the one that ran."""
    lens_q, lens_k = [q for q, _ in lengths], [k for _, k in lengths]
    # every query seeing at most one key (p = 1) makes dq and dk exactly 0 in truth, and the rule's
    # floor with them, while FlashAttention's p * (dO.v - dO.o) rounds: test_attention's
    # test_a_single_key bounds that rounding. A one-key sequence beside longer ones stays in.
    assume(any(q > 0 and k > 1 for q, k in lengths) or not any(q > 0 and k == 1 for q, k in lengths))
    # at least one token each (the rule's max error needs an element), after every sequence if spare
    total_q, total_k = max(1, sum(lens_q) + spare[0]), max(1, sum(lens_k) + spare[1])
    (heads_q, heads_kv), (cu_dtype, strided) = heads, offsets
    q = _packed_view(layouts[0], total_q, heads_q, dim)
    k = _packed_view(layouts[1], total_k, heads_kv, dim)
    v = _packed_view(layouts[2], total_k, heads_kv, dim)
    grad_out = _packed_view(layouts[3], total_q, heads_q, dim)
    cu_q, cu_k = _cu_seqlens(lens_q, cu_dtype, strided), _cu_seqlens(lens_k, cu_dtype, strided)
    fixed = (cu_q, cu_k, max(lens_q) + max_extra, max(lens_k) + max_extra)
    leaves, outs = [], []

    def varlen(q, k, v):
        leaves[:] = q, k, v
        outs.append(torchhal.ops.attention_varlen(q, k, v, *fixed, causal=causal, scale=scale))
        return outs[-1]

    def reference(q, k, v):
        return attention_varlen.reference(q, k, v, *fixed, causal, scale)

    on_triton.clear()  # hypothesis runs every example in one call of the test
    check_op(varlen, reference, (q, k, v), (grad_out,), (0, 1, 2))
    nothing = fixed[2] == 0  # max_seqlen_q 0: no query to compute
    few_rows = heads_q // heads_kv * fixed[2] <= DECODE_MAX_ROWS  # the split-KV forward's case
    assert on_triton == [
        ("attention_varlen_forward", "reference" if nothing else "triton_decode" if few_rows else "triton"),
        ("attention_varlen_backward", "reference" if nothing else "triton"),
    ]
    if nothing:
        sel = triton_hal.kernels.select("attention_varlen_forward", triton_hal.device("cpu"), q, k, v, *fixed,
                                        causal, scale)  # fmt: skip
        assert {r.candidate: r.reason for r in sel.rejected}["torchhal/triton"] is RejectionReason.SHAPE
    elif few_rows:  # the split-KV forward served the op: the FlashAttention one on these layouts too
        args = (q, k, v, *fixed, causal, scale)
        with new_memory_as_nan():
            flash = candidate(triton_hal, "attention_varlen_forward", "triton", *args)(*args)
        reference_forward = attention_varlen.reference_forward
        assert_out_and_lse_within_pytorch_error(*flash, reference_forward, (q, k, v), (*fixed, causal, scale))

    out = outs[0].detach()
    spans = list(zip(_offsets(lens_q).tolist(), _offsets(lens_k).tolist(), strict=True))
    outside_q = torch.ones(total_q, dtype=torch.bool)
    outside_k = torch.ones(total_k, dtype=torch.bool)
    for (q0, k0), (q1, k1) in itertools.pairwise(spans):
        outside_q[q0:q1], outside_k[k0:k1] = False, False
    dq, dk, dv = (leaf.grad for leaf in leaves)
    for what, t, outside in (("out", out, outside_q), ("dq", dq, outside_q), ("dk", dk, outside_k),
                             ("dv", dv, outside_k)):  # fmt: skip
        assert torch.count_nonzero(t[outside]) == 0, f"{what} outside every sequence"
    with torch.no_grad():  # each sequence through the dense op (the Triton kernel unless nothing to do)
        for (q0, k0), (q1, k1) in itertools.pairwise(spans):
            if q1 > q0:
                dense = torchhal.ops.attention(
                    *(t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
                    causal=causal, scale=scale,
                )  # fmt: skip
                torch.testing.assert_close(out[q0:q1], dense[0].transpose(0, 1), rtol=1e-5, atol=1e-6)
