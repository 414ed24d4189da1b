"""The cost model against values worked out by hand on the tiny 4 × 4 spec (conftest.TINY:
1 GHz, fp32 1 MAC/cell/cycle, bf16 2, 1024 B of SRAM, 1e11 B/s, 1 µs launch overhead)."""

from __future__ import annotations

import json
import math

import pytest
from torchhal_simasic.cost import (
    Bound,
    Matmul,
    Reuse,
    copy_time_s,
    elementwise_cost,
    matmul_cost,
    matmul_traffic,
    op_cost,
)
from torchhal_simasic.spec import bundled_spec
from torchhal_simasic.workloads import attention_cost

from torchhal.hal_core import DType, InvalidArgumentError, UnsupportedError


def test_compute_bound_matmul_counts_fill_and_drain(tiny):
    # 8×16×8 fp32: 2·2 tiles × (16 + 4 + 4 − 2 = 22 cycles) = 88 ns on the array.
    # Panels 4·16·4 = 256 B each; all of A plus one B panel fits 1024 B: read once.
    # Bytes: A 512 + B 512 + C 256 = 1280 → 12.8 ns at 1e11 B/s.
    cost = matmul_cost(tiny(), 8, 16, 8, DType.FP32)
    assert cost.compute_s == pytest.approx(88e-9, rel=1e-12)
    assert cost.bytes == 1280
    assert cost.reuse is Reuse.ONCE
    assert cost.memory_s == pytest.approx(12.8e-9, rel=1e-12)
    assert cost.bound is Bound.COMPUTE
    assert cost.time_s == pytest.approx(88e-9 + 1e-6, rel=1e-12)
    assert cost.flops == 2 * 8 * 16 * 8
    peak = 2 * 4 * 4 * 1 * 1e9
    assert cost.utilisation == pytest.approx(2048 / (88e-9 + 1e-6) / peak, rel=1e-12)


def test_more_macs_per_cell_shorten_only_the_streaming_cycles(tiny):
    # bf16 (2 MACs/cell/cycle): 4 tiles × (ceil(16/2) + 6 = 14) = 56 cycles; bytes halve.
    cost = matmul_cost(tiny(), 8, 16, 8, DType.BF16)
    assert cost.compute_s == pytest.approx(56e-9, rel=1e-12)
    assert cost.bytes == 640


def test_memory_bound_matmul(tiny):
    # The same 8×16×8 at 1e9 B/s: 1280 B take 1.28 µs, more than the 88 ns of compute.
    cost = matmul_cost(tiny(memory_bandwidth_bytes_per_s=1e9), 8, 16, 8, DType.FP32)
    assert cost.bound is Bound.MEMORY
    assert cost.memory_s == pytest.approx(1.28e-6, rel=1e-12)
    assert cost.time_s == pytest.approx(1.28e-6 + 1e-6, rel=1e-12)
    assert cost.utilisation == pytest.approx(1280 / 2.28e-6 / 1e9, rel=1e-12)


def test_edge_tiles_cost_like_full_ones(tiny):
    # 5×3×5: ceil(5/4)² = 4 tiles of 3 + 6 = 9 cycles, though most of the array idles.
    cost = matmul_cost(tiny(), 5, 3, 5, DType.FP32)
    assert cost.compute_s == pytest.approx(36e-9, rel=1e-12)


def test_restreaming_when_only_one_panel_of_each_fits(tiny):
    # 16×32×16 fp32: panels 4·32·4 = 512 B each, a pair fills the 1024 B. One A panel is held
    # (floor((1024 − 512) / 512) = 1), so B (2048 B) is read once per tile row: 4 times.
    # Reads 2048 + 4·2048 = 10240 (B-stationary ties; A-stationary wins the tie); C 1024.
    assert matmul_traffic(tiny(), 16, 32, 16, DType.FP32) == (11264, Reuse.A_STATIONARY)


def test_no_reuse_when_a_panel_pair_does_not_fit(tiny):
    # 8×64×8 fp32: panels 4·64·4 = 1024 B each, 2048 B > 1024 B. Every tile streams its own:
    # A read once per tile column (2 × 2048), B once per tile row (2 × 2048), C 256.
    assert matmul_traffic(tiny(), 8, 64, 8, DType.FP32) == (8448, Reuse.NONE)


def test_the_cheaper_operand_stays_resident(tiny):
    # 32×16×24 fp32: panels 256 B, 3 of one operand fit beside a panel of the other.
    # A-stationary: 2048 + ceil(8/3)·1536 = 6656; B-stationary: 1536 + ceil(6/3)·2048 = 5632.
    assert matmul_traffic(tiny(), 32, 16, 24, DType.FP32) == (5632 + 3072, Reuse.B_STATIONARY)
    # The transpose is the mirror case.
    assert matmul_traffic(tiny(), 24, 16, 32, DType.FP32) == (5632 + 3072, Reuse.A_STATIONARY)


def test_batched_matmul_is_batch_times_one_plus_one_overhead(tiny):
    one = matmul_cost(tiny(), 8, 16, 8, DType.FP32)
    three = matmul_cost(tiny(), 8, 16, 8, DType.FP32, batch=3)
    assert three.compute_s == pytest.approx(3 * one.compute_s, rel=1e-12)
    assert three.bytes == 3 * one.bytes
    assert three.time_s == pytest.approx(3 * (one.time_s - 1e-6) + 1e-6, rel=1e-12)


def test_elementwise_is_bytes_over_bandwidth(tiny):
    cost = elementwise_cost(tiny(), "scale", DType.FP32, 4000)
    assert (cost.bound, cost.compute_s, cost.flops) == (Bound.MEMORY, 0.0, 0)
    assert cost.time_s == pytest.approx(4000 / 1e11 + 1e-6, rel=1e-12)


def test_an_op_is_its_matmuls_then_its_streamed_bytes_in_one_launch(tiny):
    # 8×16×8 fp32 twice (88 ns of compute each, 12.8 ns of bytes), a 5×3×5 (4 tiles of 9
    # cycles, 36 ns; 15 + 15 + 25 floats = 220 B, 2.2 ns), each its own roofline, and 1000
    # streamed bytes (10 ns), after one 1 µs launch.
    cost = op_cost(tiny(), "fused", DType.FP32, [Matmul(8, 16, 8, 2), Matmul(5, 3, 5)], 1000)
    assert cost.time_s == pytest.approx(2 * 88e-9 + 36e-9 + 10e-9 + 1e-6, rel=1e-12)
    assert cost.compute_s == pytest.approx(2 * 88e-9 + 36e-9, rel=1e-12)
    assert cost.bytes == 2 * 1280 + 220 + 1000
    assert cost.flops == 2 * (2 * 8 * 16 * 8 + 5 * 3 * 5)
    assert cost.reuse is None, "two matmul shapes have no one reuse"
    assert cost.op == "fused"


@pytest.mark.parametrize("member", [*Bound, *Reuse])
def test_bound_and_reuse_print_as_their_values(member):
    """Reports print and serialise them; on Python 3.10 too (no enum.StrEnum there)."""
    assert str(member) == f"{member}" == format(member, "") == member.value
    assert json.dumps({"v": member}) == json.dumps({"v": member.value})
    assert member == member.value


def test_attention_is_two_matmuls_and_the_softmax_bytes(tiny):
    # Per head (seq_q 4, seq_k 8, dim 4, fp32):
    #   Q·Kᵀ 4×4×8: 2 tiles × (4 + 6) = 20 ns; bytes 64 + 128 + 128 = 320 (3.2 ns)
    #   softmax: read and write the 4×8 scores, 256 B (2.56 ns)
    #   P·V 4×8×4: 1 tile × (8 + 6) = 14 ns; bytes 128 + 128 + 64 = 320 (3.2 ns)
    # Two heads back to back: 2 × (20 + 2.56 + 14) ns, then the one launch overhead.
    cost = attention_cost(
        tiny(), batch=1, heads=2, seq_q=4, seq_k=8, head_dim=4, v_head_dim=4, dtype=DType.FP32
    )
    assert cost.time_s == pytest.approx(2 * 36.56e-9 + 1e-6, rel=1e-12)
    assert cost.compute_s == pytest.approx(68e-9, rel=1e-12)
    assert cost.bytes == 2 * (320 + 256 + 320)
    assert cost.flops == 2 * 2 * 4 * 8 * (4 + 4)
    assert cost.bound is Bound.COMPUTE


def test_copy_reads_and_writes_every_byte_after_one_launch(tiny):
    assert copy_time_s(tiny(), 5000) == pytest.approx(1e-7 + 1e-6, rel=1e-12)


def test_dtype_without_a_mac_rate_has_no_matmul(tiny):
    """A spec built without validation (which refuses a dtype without a rate) still gets no matmul."""
    spec = tiny().model_copy(update={"dtypes": frozenset({DType.FP32, DType.BF16, DType.FP16})})
    with pytest.raises(UnsupportedError, match=r"dtype fp16 has no MAC rate .*\['bf16', 'fp32'\]"):
        matmul_cost(spec, 4, 4, 4, DType.FP16)
    with pytest.raises(UnsupportedError, match="dtype fp64 not in dtypes"):
        elementwise_cost(spec, "scale", DType.FP64, 8)


def test_negative_sizes_are_refused(tiny):
    with pytest.raises(InvalidArgumentError, match="matmul cost: k must be an integer >= 0, got -1"):
        matmul_cost(tiny(), 4, -1, 4, DType.FP32)
    with pytest.raises(InvalidArgumentError, match="attention cost: seq_k must be an integer >= 0, got -2"):
        attention_cost(
            tiny(), batch=1, heads=1, seq_q=4, seq_k=-2, head_dim=4, v_head_dim=4, dtype=DType.FP32
        )


def test_h100_like_estimate_for_8192_cubed_bf16():
    """The figure the lead compares with a measured H100: about 1.70 ms, 647 TFLOP/s."""
    spec = bundled_spec("h100-like")
    cost = matmul_cost(spec, 8192, 8192, 8192, DType.BF16)
    tiles = math.ceil(8192 / 132) * math.ceil(8192 / 128)  # 63 · 64 = 4032
    cycles = 8192 // 16 + 132 + 128 - 2  # 770 per tile
    assert cost.compute_s == pytest.approx(tiles * cycles / 1.83e9, rel=1e-12)
    # 23 panels of one operand fit the 50 MiB beside a panel of the other: A read once and
    # B three times (A-stationary), plus C: 5 × 128 MiB.
    assert (cost.bytes, cost.reuse) == (5 * 8192 * 8192 * 2, Reuse.A_STATIONARY)
    assert cost.bound is Bound.COMPUTE
    assert cost.time_s == pytest.approx(1.7005e-3, rel=1e-4)
    assert cost.achieved_flops_per_s == pytest.approx(646.6e12, rel=1e-3)
    assert cost.utilisation == pytest.approx(0.6535, rel=1e-3)
