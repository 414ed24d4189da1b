"""Every op run on simasic:0 is charged: the clock by the cost model, the ledger by its results.

Expected times are worked out here from the spec, not by the plugin's helpers. The spec is
the tiny one with SRAM enough to keep every operand (so a matmul reads A and B once and
writes C once): 4 × 4 array at 1 GHz, fp32 1 MAC per cell per cycle, 1e11 B/s, 1 µs launch.
A matmul M×K×N takes max(ceil(M/4)·ceil(N/4)·(K + 6) ns, (MK + KN + MN)·4 B / bandwidth);
streamed bytes take bytes / bandwidth; each op adds one launch overhead.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torchhal_simasic import kernels as simasic_kernels
from torchhal_simasic.kernels import register_simasic_kernels
from torchhal_simasic.state import DeviceState

import torchhal
from torchhal.hal_core import DeviceOutOfMemoryError, KernelRegistry

BANDWIDTH, CLOCK, LAUNCH = 1e11, 1e9, 1e-6
FP32 = 4


def stream_s(nbytes: int) -> float:
    return nbytes / BANDWIDTH


def matmul_s(m: int, k: int, n: int, count: int = 1) -> float:
    compute = math.ceil(m / 4) * math.ceil(n / 4) * (k + 4 + 4 - 2) / CLOCK
    moved = (m * k + k * n + m * n) * FP32 / BANDWIDTH
    return count * max(compute, moved)


def attention_s(seq_q: int, seq_k: int, dim: int, count: int) -> float:
    """S = Q·Kᵀ and O = P·V on the array; the softmax reads S and writes P."""
    return (
        matmul_s(seq_q, dim, seq_k, count)
        + matmul_s(seq_q, seq_k, dim, count)
        + stream_s(count * 2 * seq_q * seq_k * FP32)
    )


def attention_lse_s(seq_q: int, count: int) -> float:
    """The training forward also writes the fp32 log-sum-exp of each query."""
    return stream_s(count * seq_q * 4)


def attention_backward_s(seq_q: int, seq_k: int, dim: int, count: int) -> float:
    """S again, dV = Pᵀ·dO, dP = dO·Vᵀ, dQ = dS·K, dK = dSᵀ·Q; streamed: P from S and the lse,
    D = rowsum(dO·O), dS = P·(dP − D)."""
    array = (
        matmul_s(seq_q, dim, seq_k, count)
        + matmul_s(seq_k, seq_q, dim, count)
        + matmul_s(seq_q, dim, seq_k, count)
        + matmul_s(seq_q, seq_k, dim, count)
        + matmul_s(seq_k, seq_q, dim, count)
    )
    score = seq_q * seq_k * FP32
    stats = seq_q * 4
    p = 2 * score + stats  # S and lse in, P out
    d = 2 * seq_q * dim * FP32 + stats  # dO and O in, D out
    ds = 3 * score + stats  # P, dP and D in, dS out
    return array + stream_s(count * (p + d + ds))


@dataclass(frozen=True)
class Case:
    """One public op: fresh inputs, how to call it, a plain-torch truth, and what it costs.

    `*_s` are times without the launch overhead; `*_bytes` the bytes its results hold."""

    name: str
    make: Callable[[], tuple[Any, ...]]
    call: Callable[..., Any]
    truth: Callable[..., Any]  # differentiable, independent of torchhal
    grad_inputs: tuple[int, ...]  # positions of the inputs that get gradients
    inference_s: float
    inference_bytes: int
    forward_s: float
    forward_bytes: int
    backward_s: float
    backward_bytes: int


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rope_inputs() -> tuple[torch.Tensor, ...]:
    angles = torch.rand(2, 1, 11, 8) * 10
    emb = torch.cat((angles, angles), dim=-1)
    return torch.randn(2, 4, 11, 16), torch.randn(2, 2, 11, 16), emb.cos(), emb.sin()


def _target() -> torch.Tensor:
    target = torch.randint(0, 11, (9,))
    target[4] = -100  # one ignored token
    return target


CU_Q, CU_K = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 10], dtype=torch.int32)


def _varlen_truth(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    outs = []
    for (q0, q1), (k0, k1) in zip(((0, 3), (3, 8)), ((0, 4), (4, 10)), strict=True):
        dense = [t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1])]
        outs.append(F.scaled_dot_product_attention(*dense, enable_gqa=True)[0].transpose(0, 1))
    return torch.cat(outs)


LOGITS = 9 * 11 * FP32  # linear_cross_entropy's 9 tokens × vocab 11
LCE_MATMULS = matmul_s(9, 8, 11) + matmul_s(9, 11, 8) + matmul_s(11, 9, 8)  # logits, dhidden, dweight
LCE_GRADS = 9 * 8 * FP32 + 11 * 8 * FP32 + 11 * FP32  # dhidden, dweight, dbias
LCE_SIDE = 9 * 8 + 11 * FP32  # int64 target and the bias, read by the loss

CASES = [
    Case(
        "rms_norm",
        lambda: (torch.randn(3, 5, 24), 1 + 0.1 * torch.randn(24)),
        torchhal.ops.rms_norm,
        _rms,
        (0, 1),
        # x and weight in, y out; the backward reads dy, x, weight and writes dx, dweight
        inference_s=stream_s((2 * 360 + 24) * FP32),
        inference_bytes=360 * FP32,
        forward_s=stream_s((2 * 360 + 24) * FP32),
        forward_bytes=360 * FP32,
        backward_s=stream_s((3 * 360 + 2 * 24) * FP32),
        backward_bytes=(360 + 24) * FP32,
    ),
    Case(
        "layer_norm",
        lambda: (torch.randn(3, 5, 24), 1 + 0.1 * torch.randn(24), torch.randn(24)),
        torchhal.ops.layer_norm,
        lambda x, w, b: F.layer_norm(x, (24,), w, b, 1e-5),
        (0, 1, 2),
        inference_s=stream_s((2 * 360 + 2 * 24) * FP32),
        inference_bytes=360 * FP32,
        # the training forward also writes mean and rstd, 15 rows of fp32 each, which the backward reads
        forward_s=stream_s((2 * 360 + 2 * 24) * FP32 + 2 * 15 * 4),
        forward_bytes=360 * FP32 + 2 * 15 * 4,
        backward_s=stream_s((3 * 360 + 24 + 2 * 24) * FP32 + 2 * 15 * 4),
        backward_bytes=(360 + 2 * 24) * FP32,
    ),
    *(
        Case(
            name,
            lambda: (2 * torch.randn(6, 45), torch.randn(6, 45)),
            getattr(torchhal.ops, name),
            act,
            (0, 1),
            inference_s=stream_s(3 * 270 * FP32),  # gate and up in, out
            inference_bytes=270 * FP32,
            forward_s=stream_s(3 * 270 * FP32),
            forward_bytes=270 * FP32,
            backward_s=stream_s(5 * 270 * FP32),  # dy, gate, up in; dgate, dup out
            backward_bytes=2 * 270 * FP32,
        )
        for name, act in (
            ("swiglu", lambda g, u: F.silu(g) * u),
            ("geglu", lambda g, u: F.gelu(g, approximate="tanh") * u),
        )
    ),
    Case(
        "rope",
        _rope_inputs,
        torchhal.ops.rope,
        lambda q, k, cos, sin: (_rotate(q, cos, sin), _rotate(k, cos, sin)),
        (0, 1),
        # q (1408), k (704), cos and sin (352 each) in; q', k' out; the backward likewise
        inference_s=stream_s((2 * 1408 + 2 * 704 + 2 * 352) * FP32),
        inference_bytes=(1408 + 704) * FP32,
        forward_s=stream_s((2 * 1408 + 2 * 704 + 2 * 352) * FP32),
        forward_bytes=(1408 + 704) * FP32,
        backward_s=stream_s((2 * 1408 + 2 * 704 + 2 * 352) * FP32),
        backward_bytes=(1408 + 704) * FP32,
    ),
    Case(
        "attention",  # batch 2, 4 query heads over 2 kv heads, 7 queries, 9 keys, dim 8
        lambda: (torch.randn(2, 4, 7, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)),
        torchhal.ops.attention,
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
        (0, 1, 2),
        inference_s=attention_s(7, 9, 8, count=8),
        inference_bytes=2 * 4 * 7 * 8 * FP32,
        forward_s=attention_s(7, 9, 8, count=8) + attention_lse_s(7, count=8),
        forward_bytes=(2 * 4 * 7 * 8 + 2 * 4 * 7) * FP32,
        backward_s=attention_backward_s(7, 9, 8, count=8),
        backward_bytes=(2 * 4 * 7 * 8 + 2 * 2 * 2 * 9 * 8) * FP32,  # dq; dk and dv
    ),
    Case(
        "attention_varlen",  # sequences of 3 and 5 queries over 4 and 6 keys, 4 / 2 heads, dim 8
        lambda: (torch.randn(8, 4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)),
        lambda q, k, v: torchhal.ops.attention_varlen(q, k, v, CU_Q, CU_K, 5, 6),
        _varlen_truth,
        (0, 1, 2),
        inference_s=attention_s(3, 4, 8, count=4) + attention_s(5, 6, 8, count=4),
        inference_bytes=8 * 4 * 8 * FP32,
        forward_s=attention_s(3, 4, 8, 4)
        + attention_s(5, 6, 8, 4)
        + attention_lse_s(3, 4)
        + attention_lse_s(5, 4),
        forward_bytes=(8 * 4 * 8 + 4 * 8) * FP32,
        backward_s=attention_backward_s(3, 4, 8, 4) + attention_backward_s(5, 6, 8, 4),
        backward_bytes=(8 * 4 * 8 + 2 * 10 * 2 * 8) * FP32,
    ),
    Case(
        "linear_cross_entropy",  # 9 tokens, hidden 8, vocab 11, a bias, reduction "mean"
        lambda: (torch.randn(9, 8), torch.randn(11, 8) / 3, _target(), torch.randn(11)),
        torchhal.ops.linear_cross_entropy,
        lambda h, w, t, b: F.cross_entropy(F.linear(h, w, b), t),
        (0, 1, 3),
        # logits on the array; the loss reads them, the target and the bias, and writes the loss
        inference_s=matmul_s(9, 8, 11) + stream_s(LOGITS + LCE_SIDE + FP32),
        inference_bytes=FP32,
        # training: dlogits written and read twice more (the dhidden and dweight matmuls read
        # them; dbias sums them), dbias written; the backward scales the three gradients
        forward_s=LCE_MATMULS + stream_s(3 * LOGITS + LCE_SIDE + FP32 + 11 * FP32),
        forward_bytes=FP32 + LCE_GRADS,
        backward_s=stream_s(FP32 + 2 * LCE_GRADS),
        backward_bytes=LCE_GRADS,
    ),
    Case(
        "linear_cross_entropy, reduction none",  # the backward recomputes, per-token grad_loss
        lambda: (torch.randn(9, 8), torch.randn(11, 8) / 3, _target(), torch.randn(11)),
        lambda h, w, t, b: torchhal.ops.linear_cross_entropy(h, w, t, b, reduction="none"),
        lambda h, w, t, b: F.cross_entropy(F.linear(h, w, b), t, reduction="none"),
        (0, 1, 3),
        inference_s=matmul_s(9, 8, 11) + stream_s(LOGITS + LCE_SIDE + 9 * FP32),
        inference_bytes=9 * FP32,
        forward_s=matmul_s(9, 8, 11) + stream_s(LOGITS + LCE_SIDE + 9 * FP32),
        forward_bytes=9 * FP32,  # and three empty gradient slots
        backward_s=LCE_MATMULS + stream_s(3 * LOGITS + LCE_SIDE + 9 * FP32 + 11 * FP32),
        backward_bytes=LCE_GRADS,
    ),
]
IDS = [c.name for c in CASES]


@pytest.fixture
def roomy(sim_hal, tiny):
    """A HAL over the tiny spec with SRAM for every operand and `memory_bytes` as given (SRAM at
    most the memory, as a spec must have it: the out-of-memory cases raise before any cost)."""

    def make(memory_bytes: int = 1 << 20) -> Any:
        return sim_hal(tiny(sram_bytes=min(1 << 20, memory_bytes), memory_bytes=memory_bytes))

    return make


def _state(dev):
    return dev.adapter.state(dev.index)


def _tuple(value: Any) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, tuple) else (value,)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_inference_is_charged_and_computes_the_op(roomy, case):
    """Charged by the cost model and the results' bytes; the numbers are plain torch's."""
    hal = roomy()
    inputs = case.make()
    with hal.use("simasic:0") as dev:
        state = _state(dev)
        out = case.call(*inputs)
        assert state.clock.now() == pytest.approx(case.inference_s + LAUNCH, rel=1e-12)
        assert state.ledger.used == case.inference_bytes
    with torch.no_grad():
        truth = case.truth(*inputs)
    torch.testing.assert_close(_tuple(out), _tuple(truth), rtol=1e-5, atol=1e-5)
    del out
    gc.collect()
    assert state.ledger.used == 0, "freeing the results gives their bytes back"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_training_charges_forward_and_backward(roomy, case):
    hal = roomy()
    inputs = [t.requires_grad_() if i in case.grad_inputs else t for i, t in enumerate(case.make())]
    with hal.use("simasic:0") as dev:
        state = _state(dev)
        out = _tuple(case.call(*inputs))
        assert state.clock.now() == pytest.approx(case.forward_s + LAUNCH, rel=1e-12)
        assert state.ledger.used == case.forward_bytes
        grads_out = [torch.randn_like(o) for o in out]
        torch.autograd.backward(out, grads_out)
        assert state.clock.now() == pytest.approx(case.forward_s + case.backward_s + 2 * LAUNCH, rel=1e-12)
        assert state.ledger.peak == case.forward_bytes + case.backward_bytes
    plain = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    truth = _tuple(case.truth(*plain))
    torch.testing.assert_close(tuple(o.detach() for o in out), tuple(t.detach() for t in truth))
    torch.autograd.backward(truth, grads_out)
    for i in case.grad_inputs:
        torch.testing.assert_close(inputs[i].grad, plain[i].grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_results_that_do_not_fit_raise_and_leave_the_ledger_and_clock(roomy, case):
    capacity = case.inference_bytes - 1
    hal = roomy(memory_bytes=capacity)
    inputs = case.make()
    with hal.use("simasic:0") as dev, pytest.raises(DeviceOutOfMemoryError) as err:
        case.call(*inputs)
    assert str(err.value) == (
        f"simasic:0: out of memory: requested {case.inference_bytes} bytes with 0 of {capacity} bytes "
        f"in use ({capacity} free)"
    )
    gc.collect()
    assert (_state(dev).clock.now(), _state(dev).ledger.used, _state(dev).ledger.peak) == (0.0, 0, 0)


@pytest.mark.parametrize(
    "case", [c for c in CASES if c.name in ("layer_norm", "rope", "attention")], ids=lambda c: c.name
)
def test_several_results_are_charged_all_or_none(roomy, case):
    """The training forward's first result fits, its statistics (or k') do not: nothing is held."""
    hal = roomy(memory_bytes=case.forward_bytes - 1)
    inputs = [t.requires_grad_() if i in case.grad_inputs else t for i, t in enumerate(case.make())]
    with hal.use("simasic:0") as dev, pytest.raises(DeviceOutOfMemoryError, match="with 0 of"):
        case.call(*inputs)
    gc.collect()
    assert (_state(dev).clock.now(), _state(dev).ledger.used) == (0.0, 0)


def test_bf16_streams_two_bytes_an_element(roomy):
    hal = roomy()
    gate, up = torch.randn(6, 45, dtype=torch.bfloat16), torch.randn(6, 45, dtype=torch.bfloat16)
    with hal.use("simasic:0") as dev:
        out = torchhal.ops.swiglu(gate, up)
    assert _state(dev).clock.now() == pytest.approx(stream_s(3 * 270 * 2) + LAUNCH, rel=1e-12)
    assert _state(dev).ledger.used == 270 * 2
    assert torch.equal(out, hal.kernels.op("swiglu").reference(gate, up))


def test_every_op_of_the_registry_has_a_simasic_candidate(roomy):
    """A core op without one would run on simasic:0 on the host, uncharged."""
    hal = roomy()
    dev = hal.device("simasic:0")
    missing = [
        op for op in hal.kernels.ops() if not any(c.provider == "simasic" for c in hal.kernels.candidates(op))
    ]
    assert missing == []
    x, w = torch.randn(4, 8), torch.randn(8)
    assert hal.kernels.select("layer_norm", dev, x, w, w).candidate.qualified_name == "simasic/simasic"


def test_an_op_without_a_cost_is_named_at_registration(tiny, capsys):
    simasic_kernels._say_uncosted.cache_clear()  # said once per process: this test starts unsaid
    registry = KernelRegistry()
    registry.define_op("mystery", lambda x: x, signature=lambda x: ())
    register_simasic_kernels(registry, "simasic", tiny(), [DeviceState.create("simasic:0", 1)])
    logged = capsys.readouterr().err
    assert "simasic has no cost for this op" in logged and "mystery" in logged
    assert [c.qualified_name for c in registry.candidates("mystery")] == ["torchhal/reference"]
    again = KernelRegistry()  # the next HAL's discovery: said once per process, as other warnings
    again.define_op("mystery", lambda x: x, signature=lambda x: ())
    register_simasic_kernels(again, "simasic", tiny(), [DeviceState.create("simasic:0", 1)])
    assert "mystery" not in capsys.readouterr().err
