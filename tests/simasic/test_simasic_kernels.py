"""simasic kernels: the reference's numbers, exactly the cost model's time, dtype rejection."""

from __future__ import annotations

import gc

import pytest
import torch
from torchhal_simasic import workloads
from torchhal_simasic.cost import Matmul, elementwise_cost, matmul_cost, op_cost
from torchhal_simasic.workloads import attention_cost, matmul_dims

import torchhal
from torchhal.hal_core import DeviceOutOfMemoryError, DType, RejectionReason, UnsupportedError, telemetry


def _clock(dev):
    return dev.adapter.state(dev.index).clock.now()


def test_matmul_gives_reference_numbers_and_charges_the_cost_model(sim_hal, tiny):
    spec = tiny()
    hal = sim_hal(spec)
    a, b = torch.randn(13, 37), torch.randn(37, 11)
    with hal.use("simasic:0") as dev:
        out = torchhal.ops.matmul(a, b)
        assert hal.kernels.select("matmul", dev, a, b).candidate.qualified_name == "simasic/simasic"
    assert torch.equal(out, hal.kernels.op("matmul").reference(a, b))
    torch.testing.assert_close(out, (a.double() @ b.double()).float(), rtol=1e-5, atol=1e-5)
    expected = matmul_cost(spec, 13, 37, 11, DType.FP32)
    assert _clock(dev) == expected.time_s
    assert dev.memory_info().used_bytes == 13 * 11 * 4


def test_batched_bf16_matmul(sim_hal, tiny):
    spec = tiny()
    hal = sim_hal(spec)
    a = torch.randn(3, 5, 9, dtype=torch.bfloat16)
    b = torch.randn(3, 9, 6, dtype=torch.bfloat16)
    with hal.use("simasic:0") as dev:
        out = torchhal.ops.matmul(a, b)
    assert torch.equal(out, torch.matmul(a, b))
    assert _clock(dev) == matmul_cost(spec, 5, 9, 6, DType.BF16, batch=3).time_s


def test_matmul_gradients_are_computed_and_charged(sim_hal, tiny):
    """The backward's two products (da = g·bᵀ: 13×11×37, db = aᵀ·g: 37×13×11) go through the
    registry's matmul_backward, so the device's clock and ledger see them."""
    spec = tiny()
    hal = sim_hal(spec)
    a, b = torch.randn(13, 37, requires_grad=True), torch.randn(37, 11, requires_grad=True)
    grad = torch.randn(13, 11)
    with hal.use("simasic:0") as dev:
        out = torchhal.ops.matmul(a, b)
        forward = _clock(dev)
        out.backward(grad)
        assert hal.kernels.select("matmul_backward", dev, grad, a, b).candidate.qualified_name == (
            "simasic/simasic"
        )
    torch.testing.assert_close(a.grad, grad @ b.detach().t())
    torch.testing.assert_close(b.grad, a.detach().t() @ grad)
    assert forward == matmul_cost(spec, 13, 37, 11, DType.FP32).time_s
    backward = op_cost(spec, "matmul_backward", DType.FP32, [Matmul(13, 11, 37), Matmul(37, 13, 11)])
    assert _clock(dev) == forward + backward.time_s


@pytest.mark.parametrize(
    ("a", "b", "partials"),
    [
        ((3, 5, 7), (7, 4), 0),  # a's batch folds into its rows: no partial gradients
        ((3, 5, 7), (3, 7, 4), 0),  # equal batches
        ((3, 5, 7), (1, 7, 4), 3 * 7 * 4),  # b broadcast over 3: db summed from 3 partials
        ((7,), (3, 7, 4), 3 * 7),  # the vector a broadcast over 3
    ],
)
def test_matmul_backward_streams_the_partials_of_broadcast_operands(tiny, a, b, partials):
    spec = tiny()
    ta, tb = torch.randn(a), torch.randn(b)
    grad = torch.randn(torch.matmul(ta, tb).shape)
    batch, m, k, n = matmul_dims(a, b)
    cost = workloads.matmul_backward(spec, (), grad_out=grad, a=ta, b=tb)
    products = [Matmul(m, n, k, batch), Matmul(k, m, n, batch)]
    assert cost == op_cost(spec, "matmul_backward", DType.FP32, products, 2 * partials * 4)


@pytest.mark.parametrize(
    ("a", "b", "dims"),
    [
        ((7,), (7,), (1, 1, 7, 1)),
        ((4, 5, 7), (7,), (1, 20, 7, 1)),
        ((7,), (3, 7, 2), (3, 1, 7, 2)),
        ((2, 4, 5, 7), (7, 3), (1, 40, 7, 3)),
        ((2, 1, 5, 7), (3, 7, 6), (6, 5, 7, 6)),
    ],
)
def test_matmul_dims_follow_torch_matmul(a, b, dims):
    assert matmul_dims(a, b) == dims
    batch, m, _, n = dims
    assert torch.matmul(torch.randn(a), torch.randn(b)).numel() == batch * m * n


def test_rms_norm_and_attention(sim_hal, tiny):
    spec = tiny()
    hal = sim_hal(spec)
    x, w = torch.randn(3, 5, 24), torch.randn(24)
    q = torch.randn(2, 4, 7, 8)
    k, v = torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    with hal.use("simasic:0") as dev:
        normed = torchhal.ops.rms_norm(x, w, 1e-5)
        after_norm = _clock(dev)
        attended = torchhal.ops.attention(q, k, v, causal=True, scale=0.3, window=(4, 1))
    assert torch.equal(normed, hal.kernels.op("rms_norm").reference(x, w, 1e-5))
    reference = hal.kernels.op("attention").reference(q, k, v, causal=True, scale=0.3, window=(4, 1))
    assert torch.equal(attended, reference)
    norm_cost = elementwise_cost(spec, "rms_norm", DType.FP32, (2 * 15 * 24 + 24) * 4)  # x, weight in; y out
    attn_cost = attention_cost(
        spec, batch=2, heads=4, seq_q=7, seq_k=9, head_dim=8, v_head_dim=8, dtype=DType.FP32
    )
    assert after_norm == norm_cost.time_s
    assert _clock(dev) == norm_cost.time_s + attn_cost.time_s
    positional = hal.kernels.call("attention", dev, q, k, v, True, 0.3, (4, 1))  # as autograd glue calls it
    assert torch.equal(positional, reference)
    assert _clock(dev) == norm_cost.time_s + attn_cost.time_s + attn_cost.time_s


def test_fp64_is_rejected_through_ops_inside_use(sim_hal):
    hal = sim_hal()
    a = torch.randn(4, 4, dtype=torch.float64)
    with hal.use("simasic:0") as dev, pytest.raises(UnsupportedError) as err:
        torchhal.ops.matmul(a, a)
    message = str(err.value)
    assert "'matmul' on simasic:0" in message
    assert "dtype torch.float64 is not supported" in message
    assert "bf16, fp32" in message
    assert _clock(dev) == 0.0
    assert torch.equal(torchhal.ops.matmul(a, a), a @ a), "outside use() the CPU computes it"


def test_dtype_without_a_mac_rate_is_rejected_by_the_predicate_and_said_so(sim_hal, tiny, capsys):
    """Spec validation refuses a dtype without a MAC rate (test_spec_rates_and_width); a spec
    built without validation (model_copy) is still turned down by the predicate, said so."""
    unvalidated = tiny().model_copy(update={"dtypes": frozenset({DType.FP32, DType.BF16, DType.FP16})})
    hal = sim_hal(unvalidated)
    a = torch.randn(4, 4, dtype=torch.float16)
    counted = "torchhal.simasic.host_runs,device=simasic:0,op=matmul"
    before = telemetry.counts().get(counted, 0)
    with hal.use("simasic:0") as dev:
        out = torchhal.ops.matmul(a, a)
    assert telemetry.counts()[counted] == before + 1  # once per selection
    selection = hal.kernels.select("matmul", dev, a, a)
    rejection = next(r for r in selection.rejected if r.candidate == "simasic/simasic")
    assert rejection.reason is RejectionReason.DTYPE
    assert "matmul on simasic supports ['bf16', 'fp32'], got torch.float16" in rejection.detail
    assert torch.equal(out, a @ a) and _clock(dev) == 0.0, "a host candidate ran it, uncharged"
    logged = capsys.readouterr().err
    assert "simasic turns this op down: it runs on the host, without simulated time or memory" in logged
    assert "simasic:0" in logged and rejection.detail in logged


def test_rope_tables_in_a_dtype_the_spec_lacks_are_rejected(sim_hal):
    hal = sim_hal()
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    cos, sin = torch.randn(1, 1, 3, 4, dtype=torch.float64), torch.randn(1, 1, 3, 4, dtype=torch.float64)
    selection = hal.kernels.select("rope", hal.device("simasic:0"), q, k, cos, sin)
    rejection = next(r for r in selection.rejected if r.candidate == "simasic/simasic")
    assert rejection.reason is RejectionReason.DTYPE
    assert rejection.detail == (
        "rope on simasic: cos and sin must be in the spec's dtypes ['bf16', 'fp32'], got torch.float64"
    )


def test_other_devices_are_rejected_by_the_predicate(sim_hal):
    hal = sim_hal()
    a = torch.randn(4, 4)
    selection = hal.kernels.select("matmul", hal.device("cpu"), a, a)
    assert selection.candidate.qualified_name == "torchhal/reference"
    rejection = next(r for r in selection.rejected if r.candidate == "simasic/simasic")
    assert rejection.reason is RejectionReason.DEVICE


def test_each_device_charges_its_own_clock(sim_hal, tiny):
    spec = tiny(devices=2)
    hal = sim_hal(spec)
    a = torch.randn(6, 10)
    with hal.use("simasic:1"):
        torchhal.ops.matmul(a, a.T)
    with hal.use("simasic:0"):
        torchhal.ops.matmul(a, a.T)
        torchhal.ops.matmul(a, a.T)
    one = matmul_cost(spec, 6, 10, 6, DType.FP32).time_s
    assert _clock(hal.device("simasic:1")) == one
    assert _clock(hal.device("simasic:0")) == one + one


def test_output_beyond_capacity_raises_and_leaves_clock_and_ledger(sim_hal, tiny):
    hal = sim_hal(tiny(memory_bytes=1000, sram_bytes=1000))  # SRAM at most the memory
    dev = hal.device("simasic:0")
    a, b = torch.randn(16, 8), torch.randn(8, 16)  # a 1024-byte output
    kernel = hal.kernels.select("matmul", dev, a, b).fn
    with pytest.raises(DeviceOutOfMemoryError, match="requested 1024 bytes with 0 of 1000 bytes in use"):
        kernel(a, b)
    gc.collect()
    assert (_clock(dev), dev.memory_info().used_bytes) == (0.0, 0)


def test_the_unbound_candidate_explains_itself(sim_hal):
    hal = sim_hal()
    candidate = next(c for c in hal.kernels.candidates("matmul") if c.provider == "simasic")
    with pytest.raises(UnsupportedError, match="bound to a device when the registry selects it"):
        candidate.fn(torch.randn(2, 2), torch.randn(2, 2))
