"""A/B experiments: verdicts on planted effects, A/A runs, quality, cost, Pareto, resume, bad input."""

from __future__ import annotations

import json
import math
import sqlite3

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torchhal_simasic.cost import matmul_cost
from torchhal_simasic.spec import bundled_spec

import torchhal
from tests.evaluation.helpers import Counting, cpu_hal, rms_norm_reference, sim_hal
from torchhal.evaluation.compare import MIN_SAMPLES, Verdict, compare
from torchhal.evaluation.cost import cost_row, pareto_front
from torchhal.evaluation.experiment import ExperimentConfig, run_experiment
from torchhal.evaluation.harness import Variant
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.metrics import METRICS, Threshold
from torchhal.evaluation.quality import output_error
from torchhal.evaluation.store import SampleStore
from torchhal.evaluation.variants import dtype_variants
from torchhal.hal_core import ConfigurationError, DType, InvalidArgumentError

FAST = dict(warmup=2, repetitions=12, n_resamples=2000)


def _square(n: int, sets: int = 3) -> Inputs:
    return Inputs([(torch.randn(n, n), torch.randn(n, n)) for _ in range(sets)])


def _mm_small(a, b):
    return a[:32, :32] @ b[:32, :32]


def _mm_large(a, b):
    return a @ b


def test_planted_cost_difference_gives_regressed_and_improved():
    """The large matmul does ~200x the work of the small one: a regression one way, an improvement
    the other, on latency and throughput alike."""
    hal = cpu_hal()
    cpu = hal.device("cpu")
    inputs = _square(192)
    small = Variant("small", _mm_small, cpu, inputs)
    large = Variant("large", _mm_large, cpu, inputs)
    config = ExperimentConfig(baseline="small", metrics=("latency", "throughput"), **FAST)
    result = run_experiment([small, large], config)
    assert result.comparison("large", "latency").verdict is Verdict.REGRESSED
    assert result.comparison("large", "throughput").verdict is Verdict.REGRESSED
    c = result.comparison("large", "latency")
    assert c.ratio is not None and c.ratio > 2 and c.ratio_interval[0] > 1.05
    assert c.p_corrected >= c.p_beyond and c.correction == "holm"
    assert [x.variant for x in result.regressions()] == ["large", "large"]

    flipped = run_experiment([small, large], ExperimentConfig(baseline="large", metrics=("latency",), **FAST))
    assert flipped.comparison("small", "latency").verdict is Verdict.IMPROVED
    assert flipped.regressions() == []


@pytest.mark.parametrize("attempt", range(3))
def test_a_a_is_never_improved_or_regressed(attempt):
    hal = cpu_hal()
    cpu = hal.device("cpu")
    inputs = _square(96)

    def first(a, b):
        return a @ b

    def second(a, b):
        return a @ b

    config = ExperimentConfig(baseline="first", metrics=("latency",), seed=attempt, **FAST)
    c = run_experiment([Variant("first", first, cpu, inputs), Variant("second", second, cpu, inputs)], config)
    verdict = c.comparison("second", "latency").verdict
    assert verdict in (Verdict.EQUIVALENT, Verdict.INCONCLUSIVE), c.comparison("second", "latency").reason


def test_simulated_comparison_is_exact_and_matches_the_cost_model():
    spec = bundled_spec("edge")
    hal = sim_hal(spec)
    sim = hal.device("simasic:0")

    def inputs(n):
        return Inputs(
            [(sim.to_device(torch.randn(n, 256)), sim.to_device(torch.randn(256, n))) for _ in range(4)]
        )

    a = Variant("n64", torchhal.ops.matmul, sim, inputs(64), hal=hal)
    b = Variant("n320", torchhal.ops.matmul, sim, inputs(320), hal=hal)
    same = Variant("n64-again", torchhal.ops.matmul, sim, inputs(64), hal=hal)
    config = ExperimentConfig(baseline="n64", metrics=("latency", "memory"), warmup=1, repetitions=6)
    result = run_experiment([a, b, same], config)
    c = result.comparison("n320", "latency")
    expected = (
        matmul_cost(spec, 320, 256, 320, DType.FP32).time_s
        / matmul_cost(spec, 64, 256, 64, DType.FP32).time_s
    )
    assert c.test == "exact" and c.verdict is Verdict.REGRESSED
    assert c.ratio == pytest.approx(expected, rel=1e-9)
    memory = result.comparison("n320", "memory")
    assert memory.shift == 320 * 320 * 4 - 64 * 64 * 4 and memory.verdict is Verdict.REGRESSED
    assert result.comparison("n64-again", "latency").verdict is Verdict.EQUIVALENT


def test_quality_against_a_reference_variant():
    hal = cpu_hal()
    cpu = hal.device("cpu")
    inputs = Inputs([(torch.randn(64, 256), torch.rand(256) + 0.5) for _ in range(8)])

    def scaled(x, w):
        return rms_norm_reference(x, w) * 1.001

    variants = [
        Variant("reference", rms_norm_reference, cpu, inputs),
        Variant("copy", lambda x, w: rms_norm_reference(x, w).clone(), cpu, inputs),
        Variant("scaled", scaled, cpu, inputs),
        *dtype_variants(rms_norm_reference, cpu, inputs, [torch.bfloat16]),
    ]
    config = ExperimentConfig(
        baseline="reference",
        reference="reference",
        metrics=("quality",),
        thresholds={"quality": {"absolute": 1e-5}},
    )
    result = run_experiment(variants, config)
    assert result.comparison("copy", "quality").verdict is Verdict.EQUIVALENT
    np.testing.assert_allclose(result.samples("scaled", "quality"), 1e-3, rtol=1e-3)
    assert result.comparison("scaled", "quality").verdict is Verdict.REGRESSED
    bf16 = result.comparison("bfloat16", "quality")
    assert bf16.test == "mann-whitney" and bf16.verdict is Verdict.REGRESSED
    # each bf16 error is the relative L2 error of the bf16 output against the fp32 reference output
    x, w = inputs.sets[2]
    ref = rms_norm_reference(x, w).double()
    out = rms_norm_reference(x.bfloat16(), w.bfloat16()).double()
    expected = float(torch.linalg.vector_norm(out - ref) / torch.linalg.vector_norm(ref))
    assert result.samples("bfloat16", "quality")[2] == pytest.approx(expected, rel=1e-12)


def test_output_errors_match_independent_computations():
    r = torch.randn(7, 33)
    y = r + 0.01 * torch.randn(7, 33)
    assert output_error(y, r, "max_abs", "t") == pytest.approx(float((y - r).abs().max()))
    assert output_error(y, r, "rel_l2", "t") == pytest.approx(float(torch.norm(y - r) / torch.norm(r)))
    kl = F.kl_div(
        F.log_softmax(y.double(), -1), F.log_softmax(r.double(), -1), log_target=True, reduction="batchmean"
    )
    assert output_error(y.double(), r.double(), "kl", "t") == pytest.approx(float(kl), rel=1e-10)
    assert output_error((y, 2 * y), (r, 2 * r), "max_abs", "t") == pytest.approx(
        2 * float((y - r).abs().max())
    )
    with pytest.raises(InvalidArgumentError, match=r"output shapes \[\(7, 33\)\] differ"):
        output_error(y, r[:, :5], "rel_l2", "t")
    with pytest.raises(InvalidArgumentError, match="NaN or inf"):
        output_error(y.index_fill(0, torch.tensor([1]), math.nan), r, "rel_l2", "t")
    with pytest.raises(InvalidArgumentError, match="reference output is all zeros"):
        output_error(y, torch.zeros_like(r), "rel_l2", "t")


def test_pareto_front_on_a_hand_built_table():
    points = {
        "cheap-slow": {"cost": 1.0, "latency": 10.0},
        "dear-fast": {"cost": 5.0, "latency": 1.0},
        "balanced": {"cost": 2.0, "latency": 4.0},
        "dominated": {"cost": 3.0, "latency": 5.0},  # balanced is cheaper and faster
        "tie-with-balanced": {"cost": 2.0, "latency": 4.0},
        "worst": {"cost": 6.0, "latency": 11.0},
    }
    objectives = {"cost": "min", "latency": "min"}
    assert pareto_front(points, objectives) == ["cheap-slow", "dear-fast", "balanced", "tie-with-balanced"]
    assert pareto_front(points, {"cost": "max"}) == ["worst"]
    with pytest.raises(InvalidArgumentError, match=r"objective senses must be 'min' or 'max'"):
        pareto_front(points, {"cost": "lowest"})
    with pytest.raises(
        InvalidArgumentError, match=r"point 'x' has no value for objective\(s\) \['latency'\]"
    ):
        pareto_front({"x": {"cost": 1.0}}, objectives)


def test_cost_per_million_items():
    row = cost_row("v", "cpu", 1.0, 10, {"cpu": 3.6})  # 10 items per ms: 10 000 items/s
    assert row.throughput == pytest.approx(1e4)
    assert row.cost_per_million_items == pytest.approx(3.6 / 3600 * 1e6 / 1e4)
    assert cost_row("v", "cpu", 1.0, 10, {"cpu": 3.6, "v": 7.2}).price_key == "v"
    with pytest.raises(InvalidArgumentError, match=r"no price for variant 'v' \(device 'cpu'\)"):
        cost_row("v", "cpu", 1.0, 10, {"gpu": 1.0})


def test_experiment_prices_and_front():
    hal = cpu_hal()
    cpu = hal.device("cpu")
    inputs = _square(160)
    variants = [
        Variant("small", _mm_small, cpu, inputs, items_per_call=4),
        Variant("large", _mm_large, cpu, inputs, items_per_call=4),
    ]
    config = ExperimentConfig(baseline="small", metrics=("latency",), prices={"cpu": 0.5}, **FAST)
    result = run_experiment(variants, config)
    by_name = {r.variant: r for r in result.cost}
    for name in ("small", "large"):
        median = float(np.median(result.samples(name, "latency")))
        assert by_name[name].cost_per_million_items == pytest.approx(0.5 / 3600 * 1e6 / (4e3 / median))
    assert result.pareto == ["small"]  # same price, faster


def test_interrupted_experiment_resumes_without_remeasuring(tmp_path):
    hal = cpu_hal()
    cpu = hal.device("cpu")
    inputs = _square(64)
    config = ExperimentConfig(baseline="a", metrics=("latency",), warmup=2, repetitions=6, flush_every=3)
    path = tmp_path / "samples.sqlite"

    def variants(fail_at):
        return [
            Variant("a", Counting(_mm_large), cpu, inputs),
            Variant("b", Counting(_mm_large, fail_at), cpu, inputs),
        ]

    # b's 5th call (2 warm-up calls, then samples) fails while 2 samples wait unread in the batch
    first = variants(fail_at=5)
    with SampleStore(path) as store, pytest.raises(RuntimeError, match="planted failure"):
        run_experiment(first, config, store=store)
    with sqlite3.connect(path) as db:
        saved = dict(((v, k), value) for v, k, value in db.execute("SELECT variant, key, value FROM samples"))
    finished = len(saved)
    assert finished == 5  # the first batch of 3 and the 2 pending at the failure

    second = variants(fail_at=None)
    with SampleStore(path) as store:
        result = run_experiment(second, config, store=store)
    m = result.measurement
    assert m is not None and m.resumed == finished
    remaining = 12 - finished
    refills = math.ceil(remaining / 3) - 1
    assert second[0].fn.calls + second[1].fn.calls == 2 * config.warmup + remaining + refills
    for (variant, key), value in saved.items():
        round_index = int(key.removeprefix("round:"))
        v = m.variants[variant]
        assert v.latency_ms[list(v.rounds).index(round_index)] == pytest.approx(
            json.loads(value)["latency_ms"]
        )


def test_bad_experiment_input_is_refused_with_the_value(tmp_path):
    hal = cpu_hal()
    cpu = hal.device("cpu")
    inputs = _square(16)
    v = [Variant("a", _mm_large, cpu, inputs), Variant("b", _mm_large, cpu, inputs)]
    with pytest.raises(InvalidArgumentError, match=r"unknown metric 'speed'; known metrics"):
        ExperimentConfig(baseline="a", metrics=("speed",))
    with pytest.raises(InvalidArgumentError, match="'quality' needs a threshold"):
        ExperimentConfig(baseline="a", metrics=("quality",), reference="a")
    with pytest.raises(InvalidArgumentError, match="'quality' needs `reference`"):
        ExperimentConfig(baseline="a", metrics=("quality",), thresholds={"quality": 0.1})
    with pytest.raises(InvalidArgumentError, match=r"baseline 'c' is not a variant; variants: \['a', 'b'\]"):
        run_experiment(v, ExperimentConfig(baseline="c"))
    with pytest.raises(InvalidArgumentError, match="needs at least 2 variants"):
        run_experiment(v[:1], ExperimentConfig(baseline="a"))
    with pytest.raises(InvalidArgumentError, match=r"alpha must lie strictly between 0 and 0\.5, got 0\.7"):
        ExperimentConfig(baseline="a", alpha=0.7)
    with pytest.raises(ConfigurationError, match="does not exist"):
        SampleStore(tmp_path / "missing" / "samples.sqlite")
    four = [Variant(name, _mm_large, cpu, _square(16, sets=4)) for name in ("a", "b")]
    uneven = Variant("c", _mm_large, cpu, _square(16, sets=2))
    quality = ExperimentConfig(
        baseline="a", reference="a", metrics=("quality",), thresholds={"quality": {"absolute": 0.1}}
    )
    with pytest.raises(InvalidArgumentError, match=r"another number of sets: \{'c': 2\}"):
        run_experiment([*four, uneven], quality)


@pytest.mark.parametrize(
    ("field", "value", "minimum"),
    [
        ("seed", -1, 0),
        ("seed", 1.5, 0),
        ("repetitions", -3, 1),
        ("repetitions", "many", 1),
        ("warmup", -1, 0),
        ("inner", 0, 1),
        ("flush_every", True, 1),
        ("n_resamples", 99, 100),
    ],
)
def test_config_refuses_bad_counts_and_seeds_before_any_run(field, value, minimum):
    """A negative seed once ran every phase and only then failed inside numpy, naming no field."""
    with pytest.raises(InvalidArgumentError) as info:
        ExperimentConfig(baseline="a", **{field: value})
    assert str(info.value) == f"{field} must be an integer >= {minimum}, got {value!r}"


def test_config_refuses_more_resamples_than_the_comparison_holds_before_any_run():
    """A count above the bootstrap's cap once ran every phase and failed only in the comparison."""
    with pytest.raises(InvalidArgumentError, match=r"n_resamples must be at most 10,000,000, got 20,000,000"):
        ExperimentConfig(baseline="a", n_resamples=20_000_000)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("metrics", "latency", "metrics must be a list of metric names, got the string 'latency'"),
        ("alpha", "0.05", "alpha must lie strictly between 0 and 0.5, got '0.05'"),
        ("alpha", True, "alpha must lie strictly between 0 and 0.5, got True"),
    ],
)
def test_config_refuses_a_string_where_a_list_or_number_belongs(field, value, message):
    """metrics='latency' became seven one-letter metrics; alpha='0.05' a TypeError from '<'."""
    with pytest.raises(InvalidArgumentError) as info:
        ExperimentConfig(baseline="a", **{field: value})
    assert str(info.value) == message


def test_compare_refuses_bad_samples_naming_them():
    latency, thr = METRICS["latency"], Threshold(relative=0.05)
    good = np.random.default_rng().uniform(1.0, 2.0, 10)
    with pytest.raises(InvalidArgumentError, match=f"need at least {MIN_SAMPLES} values, got 3"):
        compare(good[:3], good, metric=latency, threshold=thr, variant="x")
    bad = good.copy()
    bad[4] = math.inf
    with pytest.raises(InvalidArgumentError, match="samples of 'x' must be finite; index 4 is inf"):
        compare(bad, good, metric=latency, threshold=thr, variant="x")
    with pytest.raises(InvalidArgumentError, match="both samples have zero variance"):
        compare(np.full(6, 1.5), np.full(6, 1.5), metric=latency, threshold=thr)
    with pytest.raises(
        InvalidArgumentError, match=r"a relative threshold of 0\.05 is 0 for a baseline median of 0"
    ):
        compare(good, np.zeros(10), metric=METRICS["memory"], threshold=thr)
    with pytest.raises(InvalidArgumentError, match="must be > 0; index 0 is -1"):
        compare(np.concatenate([[-1.0], good]), good, metric=latency, threshold=thr, variant="x")
