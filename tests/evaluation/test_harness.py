"""The measurement harness: timers, order, rotation, outlier flags, memory, fingerprint, bad input."""

from __future__ import annotations

import math
import subprocess

import numpy as np
import pytest
import torch
from torchhal_simasic.cost import matmul_cost
from torchhal_simasic.spec import bundled_spec

import torchhal
from tests.evaluation.helpers import cpu_hal, sim_hal
from torchhal.evaluation import harness
from torchhal.evaluation.harness import Variant, measure, schedule
from torchhal.evaluation.inputs import Inputs, input_hash, sets_to_exceed_cache
from torchhal.evaluation.outliers import tukey_fences
from torchhal.evaluation.variants import kernel_variants
from torchhal.hal_core import Device, DType, InvalidArgumentError


def _matmul_inputs(sizes: list[int]) -> Inputs:
    return Inputs([(torch.randn(n, 96), torch.randn(96, n)) for n in sizes])


def test_cpu_samples_are_positive_host_timer_readings():
    hal = cpu_hal()
    cpu = hal.device("cpu")
    inputs = _matmul_inputs([48, 48])
    m = measure(Variant("mm", torch.matmul, cpu, inputs), warmup=1, repetitions=6)
    result = m.variants["mm"]
    assert result.timer == "HostTimer"
    assert result.latency_ms.shape == (6,)
    assert (result.latency_ms > 0).all()
    assert not result.simulated
    assert np.allclose(result.throughput, 1e3 / result.latency_ms)


@pytest.mark.parametrize("n", [64, 200])
def test_simulated_time_equals_the_cost_model(n):
    spec = bundled_spec("edge")
    hal = sim_hal(spec)
    sim = hal.device("simasic:0")
    inputs = Inputs(
        [(sim.to_device(torch.randn(n, 130)), sim.to_device(torch.randn(130, n))) for _ in range(3)]
    )
    expected_ms = matmul_cost(spec, n, 130, n, DType.FP32).time_s * 1e3
    through_ops = Variant("ops", torchhal.ops.matmul, sim, inputs, hal=hal)
    (kernel,) = kernel_variants(hal, "matmul", sim, inputs, candidates=["simasic/simasic"])
    m = measure([through_ops, kernel], warmup=2, repetitions=5, track_memory=True)
    for name in ("ops", "simasic/simasic"):
        result = m.variants[name]
        assert result.timer == "SimulatedTimer" and result.simulated
        np.testing.assert_allclose(result.latency_ms, expected_ms, rtol=1e-9)
        # the output, held while memory is read, is exactly what the ledger charged
        np.testing.assert_array_equal(result.memory_bytes, n * n * 4)


def test_interleaved_order_is_recorded_and_followed():
    hal = cpu_hal()
    cpu = hal.device("cpu")
    calls: list[str] = []

    def tagged(tag):
        def fn(a, b):
            calls.append(tag)
            return a @ b

        fn.__qualname__ = f"tagged_{tag}"
        return fn

    inputs = _matmul_inputs([16])
    variants = [Variant(t, tagged(t), cpu, inputs) for t in "ABC"]
    m = measure(variants, warmup=0, repetitions=4, flush_every=100)  # one read: no refill calls
    expected = ["A", "B", "C", "B", "C", "A", "C", "A", "B", "A", "B", "C"]
    assert [s.variant for s in m.order] == expected
    assert calls == expected
    assert [(s.round, s.position) for s in m.order[:4]] == [(0, 0), (0, 1), (0, 2), (1, 0)]
    assert m.settings["order"] == "interleaved"


def test_random_order_is_a_seeded_permutation_per_round_and_blocked_is_blocked():
    names = ["a", "b", "c", "d"]
    first = schedule(names, 5, "random", seed=7)
    assert first == schedule(names, 5, "random", seed=7)
    assert first != schedule(names, 5, "random", seed=8)
    for r in range(5):
        assert sorted(s.variant for s in first if s.round == r) == names
    blocked = schedule(names, 3, "blocked", seed=0)
    assert [s.variant for s in blocked] == [n for n in names for _ in range(3)]


def test_rotation_gives_each_call_the_next_input_set():
    hal = cpu_hal()
    seen: list[int] = []

    def record(x):
        seen.append(int(x[0]))
        return x * 2

    inputs = Inputs([(torch.full((3,), float(i)),) for i in range(4)])
    measure(
        Variant("r", record, hal.device("cpu"), inputs), warmup=0, repetitions=3, inner=2, flush_every=100
    )
    assert seen == [0, 1, 2, 3, 0, 1]  # round r uses sets 2r and 2r + 1, mod 4


def test_tukey_fences_flag_planted_outliers():
    """Inliers spread evenly over [9.9, 10.1], in random order: their fences then lie about 0.1
    outside that range (a uniform random sample can put some of its own values outside them).
    Three outliers planted at random places are flagged, the two far ones as far out."""
    rng = np.random.default_rng()
    x = rng.permutation(np.linspace(9.9, 10.1, 40))
    high_1, high_2, low = (int(i) for i in rng.choice(40, size=3, replace=False))
    x[[high_1, high_2]] += 5.0
    x[low] -= 0.9
    fences = tukey_fences(x)
    assert set(fences.flagged) == {high_1, high_2, low}
    assert {high_1, high_2} <= set(fences.far_out)
    q1, q3 = np.quantile(x, [0.25, 0.75])
    assert fences.low == pytest.approx(q1 - 1.5 * (q3 - q1))
    assert fences.high == pytest.approx(q3 + 1.5 * (q3 - q1))


def test_harness_flags_slow_rounds_and_keeps_them():
    """Input set 5 of 8 is a far larger matmul; on simulated time its rounds are exact outliers."""
    hal = sim_hal("edge")
    sim = hal.device("simasic:0")
    sizes = [64] * 8
    sizes[5] = 512
    inputs = Inputs([(sim.to_device(torch.randn(n, n)), sim.to_device(torch.randn(n, n))) for n in sizes])
    m = measure(Variant("mm", torchhal.ops.matmul, sim, inputs, hal=hal), warmup=0, repetitions=16)
    result = m.variants["mm"]
    assert result.latency_ms.size == 16  # flagged, never dropped
    assert result.fences is not None and result.fences.flagged == (5, 13)


def test_fingerprint_names_devices_versions_and_commit():
    hal = sim_hal("edge")
    sim = hal.device("simasic:0")
    m = measure(
        Variant("mm", torchhal.ops.matmul, sim, _matmul_inputs([32]).map(sim.to_device), hal=hal),
        warmup=0,
        repetitions=2,
    )
    fp = m.fingerprint
    (device,) = fp["devices"]
    assert device["id"] == "simasic:0"
    assert device["capabilities"]["name"] == sim.capabilities.name
    assert device["capabilities"]["dtypes"] == sorted(d.value for d in sim.capabilities.dtypes)
    assert len(device["fingerprint"]) == 16
    assert fp["versions"]["torch"] == torch.__version__
    assert fp["versions"]["torchhal"] == torchhal.__version__
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False)
    if head.returncode == 0:
        assert fp["git"]["commit"] == head.stdout.strip()
        assert isinstance(fp["git"]["dirty"], bool)
    else:
        assert fp["git"]["commit"] is None and fp["git"]["reason"]
    assert len(fp["digest"]) == 16


def test_a_callable_that_runs_no_simulated_op_is_refused():
    hal = sim_hal("edge")
    sim = hal.device("simasic:0")
    host_only = Variant("host", torch.matmul, sim, _matmul_inputs([32]), hal=hal)
    with pytest.raises(InvalidArgumentError, match="simulated clock did not advance"):
        measure(host_only, warmup=0, repetitions=2)


def test_bad_arguments_are_refused_with_the_value():
    hal = cpu_hal()
    cpu = hal.device("cpu")
    v = Variant("a", torch.matmul, cpu, _matmul_inputs([8]))
    with pytest.raises(InvalidArgumentError, match="repetitions must be an integer >= 1, got 0"):
        measure(v, repetitions=0)
    with pytest.raises(InvalidArgumentError, match=r"repeated: \['a'\]"):
        measure([v, v])
    with pytest.raises(InvalidArgumentError, match="order must be one of"):
        measure(v, order="zigzag")
    with pytest.raises(InvalidArgumentError, match="items_per_call must be a finite number > 0, got 0"):
        Variant("b", torch.matmul, cpu, items_per_call=0)
    with pytest.raises(InvalidArgumentError, match="must be a HAL Device"):
        Variant("c", torch.matmul, "cpu")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="needs at least one argument set"):
        Inputs([])
    with pytest.raises(InvalidArgumentError, match="at least 4 values"):
        tukey_fences([1.0, 2.0, 3.0])
    with pytest.raises(InvalidArgumentError, match="index 2 is nan"):
        tukey_fences([1.0, 2.0, math.nan, 4.0, 5.0])


def test_sets_to_exceed_cache_uses_the_declared_l2():
    hal = cpu_hal()
    cpu = hal.device("cpu")
    assert sets_to_exceed_cache(cpu, 1000) == 2  # the CPU adapter declares no L2 size
    with_l2 = Device(cpu.adapter, cpu.capabilities.model_copy(update={"l2_cache_bytes": 1 << 20}))
    assert sets_to_exceed_cache(with_l2, 256 << 10) == 9  # ceil(2 MiB / 256 KiB) + 1


def test_clear_cache_overwrites_twice_the_l2_before_every_sample(monkeypatch):
    hal = cpu_hal()
    cpu = hal.device("cpu")
    with_l2 = Device(cpu.adapter, cpu.capabilities.model_copy(update={"l2_cache_bytes": 1 << 20}))
    clear = harness._cache_clearer(with_l2)
    buffer = clear.__self__  # the bound zero_ of the buffer it overwrites
    assert buffer.numel() * buffer.element_size() == 2 << 20
    buffer.fill_(3)
    clear()
    assert not buffer.any()
    assert harness._cache_clearer(cpu) is None  # no declared L2: nothing to clear, logged
    # a device that computes in int8 alone (no fp32 declared) still has its cache cleared
    int8_only = cpu.capabilities.model_copy(
        update={"l2_cache_bytes": 1 << 20, "dtypes": frozenset({DType.INT8})}
    )
    buffer = harness._cache_clearer(Device(cpu.adapter, int8_only)).__self__
    assert buffer.numel() * buffer.element_size() == 2 << 20

    events: list[str] = []
    monkeypatch.setattr(harness, "_cache_clearer", lambda device: lambda: events.append("clear"))

    def call(a, b):
        events.append("call")
        return a @ b

    measure(Variant("mm", call, cpu, _matmul_inputs([8])), warmup=2, repetitions=4, clear_cache=True)
    assert events == ["call"] * 2 + ["clear", "call"] * 4  # warm-up uncleared, then before each sample


def test_input_hash_depends_on_content_dtype_and_shape_only():
    x = torch.randn(4, 5)
    assert input_hash((x, 1.5)) == input_hash((x.clone(), 1.5))
    assert input_hash((x, 1.5)) != input_hash((x.to(torch.float64), 1.5))
    assert input_hash(x) != input_hash(x.reshape(5, 4))
    y = x.clone()
    y[2, 3] += 1.0
    assert input_hash(x) != input_hash(y)
    assert input_hash(x.t()) == input_hash(x.t().contiguous())
    with pytest.raises(InvalidArgumentError, match="cannot hash an input of type object"):
        input_hash(object())
