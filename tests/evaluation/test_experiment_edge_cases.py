"""Experiments at their edges, each pinned by the values it once got wrong:
equal input sets sharing one stored quality error (and sharded value), default arguments and
address-bearing bound objects in the code digest, torch's global settings missing from the
environment fingerprint, a spec argument's dtype replaced by the variant's, a price table and a
relative threshold that failed only after every sample, the CLI's exit codes, the plot colours."""

from __future__ import annotations

import functools
import json
import math
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import torchhal.ops
from tests.evaluation.helpers import Counting, cpu_hal, sim_hal
from torchhal.evaluation import fingerprint
from torchhal.evaluation.cli import EXIT_BAD_INPUT, EXIT_FAILED, app
from torchhal.evaluation.compare import Verdict
from torchhal.evaluation.distributed import evaluate_sharded
from torchhal.evaluation.experiment import ExperimentConfig, run_experiment
from torchhal.evaluation.fingerprint import code_digest, environment_fingerprint
from torchhal.evaluation.harness import Variant, measure
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.plots import available as plots_available
from torchhal.evaluation.quality import measure_quality
from torchhal.evaluation.report import to_json
from torchhal.evaluation.spec import load_spec
from torchhal.evaluation.stats import holm
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import ConfigurationError, DeviceOutOfMemoryError, InvalidArgumentError, telemetry

ROOT = Path(__file__).resolve().parents[2]
RESUMED = "torchhal.evaluation.resumed_with_unversioned_code"
UNKEYED = "torchhal.evaluation.unkeyed_bound_values"


# 1. stored quality errors and sharded values keyed by content alone ---------------------------


class _Drifting:
    """An output that differs on every call: t + 1e-3 · (call number)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return t + 1e-3 * self.calls


def test_equal_quality_input_sets_are_measured_and_stored_one_by_one(tmp_path, monkeypatch) -> None:
    """Eight equal sets shared one stored row: the candidate ran once, its error copied to all
    eight, and the fresh run counted 7 'resumed' errors."""
    monkeypatch.setattr(fingerprint, "git_state", lambda cwd=None: {"commit": None, "dirty": None})
    cpu = cpu_hal().device("cpu")
    x = torch.arange(1.0, 17.0, dtype=torch.float64).reshape(4, 4)
    inputs = Inputs([(x,)] * 8)
    candidate = _Drifting()
    variants = [Variant("ref", lambda t: t, cpu, inputs), Variant("cand", candidate, cpu, inputs)]
    expected = np.array([1e-3 * k * 4 / float(torch.linalg.vector_norm(x)) for k in range(1, 9)])
    before = telemetry.counts().get(RESUMED, 0)
    with SampleStore(tmp_path / "samples.sqlite") as store:
        errors = measure_quality(variants, "ref", store=store)
        (experiment,) = {row[0] for row in store._db.execute("select experiment from samples")}
        assert store.count(experiment) == 16
    assert candidate.calls == 8
    np.testing.assert_allclose(errors["cand"], expected, rtol=1e-9)
    assert telemetry.counts().get(RESUMED, 0) == before  # nothing was resumed
    with SampleStore(tmp_path / "samples.sqlite") as store:
        again = measure_quality(variants, "ref", store=store)
    assert candidate.calls == 8  # every set's own error came back from the store
    np.testing.assert_array_equal(again["cand"], errors["cand"])


def test_equal_sharded_items_are_evaluated_and_stored_one_by_one(tmp_path) -> None:
    counter = {"calls": 0}

    def evaluate(item: float) -> float:
        counter["calls"] += 1
        return item * counter["calls"]

    items = [2.0, 2.0, 2.0]
    with SampleStore(tmp_path / "samples.sqlite") as store:
        first = evaluate_sharded({"v": evaluate}, items, ["m"], name="dup", store=store)
        again = evaluate_sharded({"v": evaluate}, items, ["m"], name="dup", store=store)
    assert (first.computed, first.cached) == (3, 0)
    np.testing.assert_array_equal(first.column("v"), [2.0, 4.0, 6.0])
    assert (again.computed, again.cached) == (0, 3)
    np.testing.assert_array_equal(again.column("v"), [2.0, 4.0, 6.0])


# 2. code digest: default arguments; bound objects whose repr is an address ----------------------


def _defined(source: str, name: str = "f"):
    namespace: dict = {"__name__": "variants_under_edit"}
    exec(source, namespace)  # the test's own source, standing for an edited file
    return namespace[name]


def test_code_digest_sees_default_arguments() -> None:
    """`block=64` -> `block=4096` kept the key, so the edited variant resumed the old samples."""
    positional = [_defined(f"def f(x, block={b}):\n    return x * block\n") for b in (64, 64, 4096)]
    assert code_digest(positional[0]) == code_digest(positional[1]) != code_digest(positional[2])
    keyword = [_defined(f"def f(x, *, block={b}):\n    return x * block\n") for b in (64, 64, 4096)]
    assert code_digest(keyword[0]) == code_digest(keyword[1]) != code_digest(keyword[2])
    call = [
        _defined(f"class C:\n    def __call__(self, x, scale={s}):\n        return x * scale\n", "C")()
        for s in (2.0, 3.0)
    ]
    assert code_digest(call[0]) != code_digest(call[1])


def test_an_edited_default_argument_is_measured_anew(tmp_path) -> None:
    cpu = cpu_hal().device("cpu")
    path = tmp_path / "samples.sqlite"
    results = []
    for block in (64, 64, 4096):
        fn = _defined(f"def f(x, block={block}):\n    return x.sum() * block\n")
        with SampleStore(path) as store:
            variant = Variant("v", fn, cpu, Inputs.fixed(torch.ones(8)), description="k")
            results.append(measure(variant, warmup=0, repetitions=5, store=store))
    assert [r.resumed for r in results] == [0, 5, 0]
    assert results[0].experiment == results[1].experiment != results[2].experiment


_ACROSS_PROCESSES = r"""
import functools, sys
sys.path.insert(0, {root!r})
from torchhal.evaluation.fingerprint import code_digest
class Cfg:
    def __init__(self, block): self.block = block
def kernel(x, cfg): return x * cfg.block
def helper(x): return x
def apply(x, fn): return fn(x)
print(code_digest(functools.partial(kernel, cfg=Cfg(64))), code_digest(functools.partial(apply, fn=helper)))
"""


def test_code_digest_of_bound_objects_is_the_same_in_every_process() -> None:
    """A bound object without a __repr__ (and a bound function) hashed its memory address: a new
    key in every process, so an interrupted run never resumed."""
    code = _ACROSS_PROCESSES.format(root=str(ROOT))
    outputs = [
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT, timeout=120
        ).stdout.split()
        for _ in range(2)
    ]
    assert len(outputs[0]) == 2 and all(len(d) == 16 for d in outputs[0])
    assert outputs[0] == outputs[1]


class _Config:  # no __repr__: the default one holds the object's address
    def __init__(self, block: int) -> None:
        self.block = block


class _Tokenizer:
    pass


def _kernel(x: torch.Tensor, cfg: object) -> torch.Tensor:
    return x


def test_a_bound_object_counts_by_its_type_warned_once_per_type(monkeypatch, capsys) -> None:
    monkeypatch.setattr(fingerprint, "_unkeyed_types_warned", set(), raising=False)
    before = telemetry.counts().get(UNKEYED, 0)
    first = code_digest(functools.partial(_kernel, cfg=_Config(64)))
    # only the type is in the key: another value of it is the documented gap (as closure values)
    assert code_digest(functools.partial(_kernel, cfg=_Config(4096))) == first
    assert code_digest(functools.partial(_kernel, cfg=_Tokenizer())) != first
    assert code_digest(functools.partial(_kernel, cfg=64)) != first
    assert telemetry.counts().get(UNKEYED, 0) == before + 3
    err = capsys.readouterr().err
    assert err.count("a bound object's value is not part of the experiment key") == 2
    assert f"{__name__}._Config" in err and f"{__name__}._Tokenizer" in err


# 3. torch's global settings in the environment fingerprint ---------------------------------------


# every switch the tests below flip, put back by setattr (the legacy getters raise once the
# per-backend API of torch 2.9 was used, so nothing here reads them back)
FLIPPED = [
    ("cudnn", "benchmark"),
    ("cudnn", "deterministic"),
    ("cuda.matmul", "fp32_precision"),
    ("mkldnn.matmul", "fp32_precision"),
    ("", "fp32_precision"),
]


def _backend(path: str):
    owner = torch.backends
    for part in filter(None, path.split(".")):
        owner = getattr(owner, part)
    return owner


@pytest.fixture
def restored_torch_settings():
    saved = [(_backend(path), name, getattr(_backend(path), name)) for path, name in FLIPPED]
    threads = torch.get_num_threads()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    for owner, name, value in reversed(saved):  # the general precision first, then each backend's
        setattr(owner, name, value)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _nvidia_device():
    from torchhal_nvidia.adapter import NvidiaAdapter
    from torchhal_nvidia.recorded import RecordedCudaProbe

    from tests.plugins.facts import load
    from torchhal import HardwareAbstractionLayer
    from torchhal.hal_core.settings import Settings

    adapter = NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h200x2")))
    no_autoload = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    hal = HardwareAbstractionLayer(adapters=[adapter], settings=no_autoload)
    return hal.device("cuda:0")


def _toggled(value: str, a: str, b: str) -> str:
    return b if value == a else a


def test_the_fingerprint_follows_torch_global_settings(restored_torch_settings) -> None:
    cpu, gpu = cpu_hal().device("cpu"), _nvidia_device()
    torch.set_num_threads(1)
    base = environment_fingerprint([cpu, gpu])
    settings = base["torch_settings"]
    assert settings["num_threads"] == 1
    assert settings["fp32_precision"] == torch.backends.fp32_precision
    assert settings["deterministic_algorithms"] is torch.are_deterministic_algorithms_enabled()
    nvidia, host = settings["adapters"]["nvidia"], settings["adapters"]["cpu"]
    assert nvidia["cudnn.benchmark"] is torch.backends.cudnn.benchmark
    assert nvidia["cuda.matmul.fp32_precision"] == torch.backends.cuda.matmul.fp32_precision
    assert host["mkldnn.matmul.fp32_precision"] == torch.backends.mkldnn.matmul.fp32_precision
    assert not any(key.startswith(("cuda", "cudnn")) for key in host)  # they cannot change a CPU result
    digests = {base["digest"]}
    matmul, onednn, general = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul, torch.backends
    changes = [
        lambda: torch.set_num_threads(2),
        lambda: torch.set_float32_matmul_precision("medium"),  # legacy: sets each backend's
        lambda: torch.use_deterministic_algorithms(not torch.are_deterministic_algorithms_enabled()),
        lambda: setattr(torch.backends.cudnn, "benchmark", not torch.backends.cudnn.benchmark),
        lambda: setattr(torch.backends.cudnn, "deterministic", not torch.backends.cudnn.deterministic),
        lambda: setattr(matmul, "fp32_precision", _toggled(matmul.fp32_precision, "tf32", "ieee")),
        lambda: setattr(onednn, "fp32_precision", _toggled(onednn.fp32_precision, "bf16", "ieee")),
        lambda: setattr(general, "fp32_precision", _toggled(general.fp32_precision, "tf32", "ieee")),
    ]
    for change in changes:  # each one on top of the last: every step is a new environment
        change()
        digests.add(environment_fingerprint([cpu, gpu])["digest"])
    assert len(digests) == len(changes) + 1
    assert not torch.cuda.is_initialized()  # read from flags only


def test_a_cpu_fingerprint_ignores_the_cuda_switches(restored_torch_settings) -> None:
    cpu = cpu_hal().device("cpu")
    before = environment_fingerprint([cpu])["digest"]
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    matmul = torch.backends.cuda.matmul
    matmul.fp32_precision = _toggled(matmul.fp32_precision, "tf32", "ieee")
    assert environment_fingerprint([cpu])["digest"] == before


def legacy_getter_raises() -> str:
    """What torch's legacy precision getter does in a process that used the per-backend API."""
    raise RuntimeError("you have used mix of the legacy and new APIs to set the matmul precision")


def test_the_fingerprint_reads_the_per_backend_precision_api(restored_torch_settings, monkeypatch) -> None:
    """From torch 2.9 the legacy getters may raise once a caller used the per-backend API
    (`torch.backends.cuda.matmul.fp32_precision = "tf32"`, torch's advice); the fingerprint used them."""
    monkeypatch.setattr(torch, "get_float32_matmul_precision", legacy_getter_raises)
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    settings = environment_fingerprint([cpu_hal().device("cpu"), _nvidia_device()])["torch_settings"]
    assert settings["adapters"]["nvidia"]["cuda.matmul.fp32_precision"] == "tf32"
    assert settings["float32_matmul_precision"] == "unreadable: mixed legacy and per-backend settings"


def test_the_fingerprint_records_the_legacy_level_inductor_reads(restored_torch_settings) -> None:
    """Inductor still reads torch's legacy fp32 matmul level (flex attention's precision); with
    the per-backend flags put back by hand it can differ from them and change compiled code."""
    cpu = cpu_hal().device("cpu")
    torch.set_float32_matmul_precision("highest")
    before = environment_fingerprint([cpu])
    assert before["torch_settings"]["float32_matmul_precision"] == "highest"
    matmuls = (torch.backends.cuda.matmul, torch.backends.mkldnn.matmul)
    per_backend = [m.fp32_precision for m in matmuls]
    torch.set_float32_matmul_precision("high")
    for matmul, value in zip(matmuls, per_backend, strict=True):  # only the legacy level differs now
        matmul.fp32_precision = value
    after = environment_fingerprint([cpu])
    assert after["torch_settings"]["float32_matmul_precision"] == "high"
    assert after["torch_settings"]["adapters"] == before["torch_settings"]["adapters"]
    assert after["digest"] != before["digest"]
    torch.set_float32_matmul_precision("highest")
    for matmul, value in zip(matmuls, per_backend, strict=True):
        matmul.fp32_precision = value


# 4. a spec argument's own dtype ----------------------------------------------------------------

SPEC = """
[experiment]
baseline = "a"
[workload]
device = "cpu"
{workload_dtype}
args = [{{shape = [4, 8], dtype = "float64"}}, [8], {{shape = [8], dtype = "int64"}}]
[[variants]]
name = "a"
callable = "tests.evaluation.helpers:rms_norm_reference"
{variant_dtype}
[[variants]]
name = "b"
callable = "tests.evaluation.helpers:rms_norm_reference"
"""


def _load(tmp_path: Path, workload_dtype: str = "", variant_dtype: str = ""):
    path = tmp_path / "spec.toml"
    path.write_text(SPEC.format(workload_dtype=workload_dtype, variant_dtype=variant_dtype))
    return path, load_spec(path, cpu_hal())


def test_an_argument_keeps_its_declared_dtype(tmp_path) -> None:
    """The variant's default float32 replaced float64 (and any declared dtype) silently."""
    _, loaded = _load(tmp_path)
    for variant in loaded.variants:
        assert [t.dtype for t in variant.inputs.sets[0]] == [torch.float64, torch.float32, torch.int64]
    assert loaded.variants[0].description.endswith("in torch.float32 (args[0] torch.float64 as declared)")
    _, same = _load(tmp_path, workload_dtype='dtype = "float64"')  # agreeing: nothing to refuse
    assert [t.dtype for t in same.variants[0].inputs.sets[0]] == [torch.float64, torch.float64, torch.int64]
    assert same.variants[0].description.endswith("on cpu in torch.float64")


def test_an_undeclared_floating_argument_takes_the_variant_dtype(tmp_path) -> None:
    text = SPEC.replace('{{shape = [4, 8], dtype = "float64"}}', "[4, 8]")
    path = tmp_path / "spec.toml"
    path.write_text(text.format(workload_dtype='dtype = "float16"', variant_dtype='dtype = "bfloat16"'))
    loaded = load_spec(path, cpu_hal())
    assert [t.dtype for t in loaded.variants[0].inputs.sets[0]] == [
        torch.bfloat16,
        torch.bfloat16,
        torch.int64,
    ]
    assert [t.dtype for t in loaded.variants[1].inputs.sets[0]] == [torch.float16, torch.float16, torch.int64]


@pytest.mark.parametrize(
    ("workload_dtype", "variant_dtype", "source"),
    [
        ('dtype = "bfloat16"', "", "[workload] dtype"),
        ("", 'dtype = "bfloat16"', "variants[0] dtype"),
    ],
)
def test_an_explicit_dtype_against_a_declared_one_is_refused(
    tmp_path, workload_dtype, variant_dtype, source
) -> None:
    path = tmp_path / "spec.toml"
    with pytest.raises(ConfigurationError) as info:
        _load(tmp_path, workload_dtype, variant_dtype)
    message = str(info.value)
    assert message == (
        f"spec {path}: variants[0] (a): [workload] args[0] declares dtype torch.float64 "
        f"(spec {path}: [workload] args[0].dtype), but the variant's dtype is torch.bfloat16 "
        f"(spec {path}: {source}); make them agree, or drop one of them"
    )


# 5. price table and a relative threshold of a zero median, before / instead of failing late --------


def test_a_missing_price_is_refused_before_any_call() -> None:
    cpu = cpu_hal().device("cpu")
    x = torch.randn(16, 16)
    fa, fb = Counting(lambda t: t @ t), Counting(lambda t: t @ t)
    variants = [Variant("a", fa, cpu, Inputs.fixed(x)), Variant("b", fb, cpu, Inputs.fixed(x))]
    config = ExperimentConfig(baseline="a", repetitions=20, prices={"a": 2.0, "cpu:0-typo": 1.0})
    with pytest.raises(InvalidArgumentError) as info:
        run_experiment(variants, config)
    assert (fa.calls, fb.calls) == (0, 0)  # it raised after 20 rounds of both
    assert str(info.value) == (
        "no price for variant(s) 'b' (device 'cpu'): give each a price by variant name or device id; "
        "the price table has ['a', 'cpu:0-typo']"
    )


def test_memory_of_a_baseline_that_keeps_nothing_is_inconclusive_not_an_error() -> None:
    """The default 5 % of a baseline median of 0 bytes raised after every sample, discarding the
    latency comparison too."""
    hal = sim_hal()
    sim = hal.device("simasic:0")
    inputs = Inputs(
        [(sim.to_device(torch.randn(64, 256)), sim.to_device(torch.randn(256, 64))) for _ in range(4)]
    )

    def result_dropped(x, w):
        torchhal.ops.matmul(x, w)
        return x

    variants = [
        Variant("base", result_dropped, sim, inputs, hal=hal),
        Variant("cand", torchhal.ops.matmul, sim, inputs, hal=hal),
    ]
    result = run_experiment(
        variants, ExperimentConfig(baseline="base", metrics=("latency", "memory"), repetitions=10)
    )
    latency, memory = result.comparison("cand", "latency"), result.comparison("cand", "memory")
    assert latency.verdict is Verdict.EQUIVALENT and latency.threshold > 0  # judged as before
    assert memory.verdict is Verdict.INCONCLUSIVE
    assert memory.median_baseline == 0.0 and memory.shift == memory.median_variant > 0
    assert math.isnan(memory.threshold) and math.isnan(memory.p_corrected)
    assert memory.threshold_spec == "0.05 relative"
    assert memory.reason.startswith(
        "no threshold: a relative threshold of 0.05 is 0 for a baseline median of 0 bytes, so no change "
        "can be judged beyond or within it"
    )
    data = json.loads(json.dumps(to_json(result), allow_nan=False))
    (stored,) = [c for c in data["comparisons"] if c["metric"] == "memory"]
    assert stored["threshold"] is None and stored["verdict"] == "inconclusive"


def test_comparisons_without_a_threshold_stay_out_of_the_corrected_family() -> None:
    cpu = cpu_hal().device("cpu")
    generator = torch.Generator().manual_seed(3)
    inputs = Inputs([(torch.randn(32, generator=generator),) for _ in range(8)])
    variants = [
        Variant("ref", lambda t: t * 2, cpu, inputs),
        Variant("base", lambda t: t + t, cpu, inputs),  # the reference's outputs: errors all 0
        Variant("cand", lambda t: t * 2.002, cpu, inputs),
    ]
    config = ExperimentConfig(
        baseline="base",
        reference="ref",
        metrics=("latency", "quality"),
        thresholds={"quality": Threshold(relative=0.1)},
        repetitions=20,
        n_resamples=1000,
    )
    result = run_experiment(variants, config)
    quality = [c for c in result.comparisons if c.metric == "quality"]
    latency = [c for c in result.comparisons if c.metric == "latency"]
    assert [c.variant for c in result.comparisons] == ["ref", "ref", "cand", "cand"]
    assert [c.verdict for c in quality] == [Verdict.INCONCLUSIVE] * 2
    assert quality[1].shift == pytest.approx(1e-3, rel=1e-4)  # float32 outputs
    adjusted = holm([c.p_beyond for c in latency], config.alpha).adjusted
    assert [c.p_corrected for c in latency] == list(adjusted)
    assert all(c.correction == "holm" for c in latency)


# 6, 7. CLI exit codes --------------------------------------------------------------------------


def fine(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


def out_of_memory(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    raise DeviceOutOfMemoryError("simasic:0", 1 << 30, 0, 512 << 20)


CLI_SPEC = """
[experiment]
name = "x"
baseline = "base"
metrics = ["latency"]
repetitions = 10
warmup = 1
n_resamples = 1000
{prices}
[workload]
device = "cpu"
args = [[16, 32], [32]]
input_sets = 2
[[variants]]
name = "base"
callable = "tests.evaluation.test_experiment_edge_cases:fine"
[[variants]]
name = "cand"
callable = "tests.evaluation.test_experiment_edge_cases:{cand}"
"""


def _ab(tmp_path: Path, *args: str, cand: str = "fine", prices: str = ""):
    spec = tmp_path / "spec.toml"
    spec.write_text(CLI_SPEC.format(cand=cand, prices=prices))
    result = CliRunner().invoke(
        app, [str(spec), "--out", str(tmp_path / "out"), "--no-plots", *args], env={"COLUMNS": "240"}
    )
    result.text = " ".join(result.output.split())
    return spec, result


def test_a_torchhal_error_from_a_variant_exits_as_a_failed_variant(tmp_path) -> None:
    _, result = _ab(tmp_path, cand="out_of_memory")
    assert result.exit_code == EXIT_FAILED, result.output
    assert "failed: DeviceOutOfMemoryError: simasic:0: out of memory" in result.text
    assert (
        "(in variant 'cand' (callable tests.evaluation.test_experiment_edge_cases:out_of_memory"
        in result.text
    )
    assert result.text.endswith(f"(finished samples are in {tmp_path / 'out' / 'samples.sqlite'})")


def test_a_torchhal_error_outside_the_variants_is_still_bad_input(tmp_path) -> None:
    _, result = _ab(tmp_path, prices='[prices]\nbase = 1.0\n"cpu:0-typo" = 2.0')
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    with sqlite3.connect(tmp_path / "out" / "samples.sqlite") as db:
        assert db.execute("select count(*) from samples").fetchone() == (0,)  # refused before measuring
    assert "error: no price for variant(s) 'cand' (device 'cpu')" in result.text


def test_gating_on_a_metric_that_is_not_measured_is_refused(tmp_path) -> None:
    spec, result = _ab(tmp_path, "--gate", "--gate-metric", "quality")
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert result.output.splitlines() == [
        f"error: --gate-metric: metric(s) ['quality'] not measured by {spec}; it measures ['latency']"
    ]
    assert not (tmp_path / "out").exists()  # refused before anything ran


# 8. plot colours --------------------------------------------------------------------------------


@pytest.mark.skipif(not plots_available(), reason="matplotlib (the 'plots' extra) is not installed")
def test_a_variant_has_one_colour_in_both_distribution_panels(tmp_path, monkeypatch) -> None:
    """A constant first variant drawn as a line left the next histogram at the axes' C0."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex

    import torchhal.evaluation.plots as plots

    samples = {"a": np.full(20, 1.0), "b": np.random.default_rng(0).normal(2.0, 0.1, 20)}
    result = SimpleNamespace(variants={"a": {}, "b": {}}, samples=lambda name, metric: samples[name])
    captured = {}

    def grab(plt_, fig, path):
        hist, cdf = fig.axes
        captured["hist"] = {line.get_label(): to_hex(line.get_color()) for line in hist.lines}
        captured["hist"]["b"] = to_hex(hist.containers[0].patches[0].get_facecolor()[:3])
        captured["cdf"] = {line.get_label(): to_hex(line.get_color()) for line in cdf.lines}
        plt_.close(fig)
        return path

    monkeypatch.setattr(plots, "_save", grab)
    plots._distributions(plt, result, "latency", tmp_path)
    assert captured["cdf"] == {"a": to_hex("C0"), "b": to_hex("C1")}
    assert captured["hist"] == {"a (every sample)": to_hex("C0"), "b": to_hex("C1")}
