"""The experiment side of evaluation at its edges: names, spec fields, the store's file, the monitor's
split checks, sharded metrics and the CLI, probed the way an A/B user would hit them."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from markdown_it import MarkdownIt
from typer.testing import CliRunner

import torchhal
from tests.evaluation.helpers import Counting, cpu_hal, sim_hal
from tests.evaluation.test_cli import CALLABLES
from tests.evaluation.test_stats_assignment import polya_log_bayes_factor
from torchhal.evaluation.cli import EXIT_BAD_INPUT, EXIT_FAILED, app
from torchhal.evaluation.distributed import evaluate_sharded
from torchhal.evaluation.experiment import ExperimentConfig, run_experiment
from torchhal.evaluation.harness import Variant, measure
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.monitor import LiveMonitor, MonitorDecision
from torchhal.evaluation.report import to_markdown, write_json
from torchhal.evaluation.spec import load_spec
from torchhal.evaluation.stats import sequential_sample_ratio_mismatch
from torchhal.evaluation.stats.assignment import SRM_CONCENTRATION
from torchhal.evaluation.store import SampleStore
from torchhal.evaluation.variants import dtype_variants
from torchhal.hal_core import ConfigurationError, InvalidArgumentError

runner = CliRunner()
QUALITY = {"absolute": 1e-2}


def _ab(*args: str):
    result = runner.invoke(app, list(args), env={"COLUMNS": "240"})
    result.text = " ".join(result.output.split())
    return result


def _spec(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _planted(baseline: str = "base", slow: str = "rms_norm_slow") -> str:
    return CALLABLES.format(baseline=baseline, slow=slow).replace("repetitions = 10", "repetitions = 5")


def _scaled(factor: float):
    def scaled(x: torch.Tensor) -> torch.Tensor:
        return x * factor

    return scaled


# --- experiments -------------------------------------------------------------------------------


def test_quality_refuses_two_variants_of_one_name():
    """Quality errors are kept by name: the second 'b' overwrote the first's and both were
    reported with the error of the exact one (0.0) although one was 1% off."""
    cpu = cpu_hal().device("cpu")
    inputs = Inputs([(torch.randn(8, 8),) for _ in range(5)])
    variants = [
        Variant("a", _scaled(1.0), cpu, inputs),
        Variant("b", _scaled(1.01), cpu, inputs),
        Variant("b", _scaled(1.0), cpu, inputs),
    ]
    config = ExperimentConfig(
        baseline="a", reference="a", metrics=("quality",), thresholds={"quality": QUALITY}
    )
    with pytest.raises(InvalidArgumentError, match=r"variant names must be distinct; repeated: \['b'\]"):
        run_experiment(variants, config)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", 5, "name must be a non-empty string, got 5"),
        ("name", "  ", "name must be a non-empty string, got '  '"),
        ("baseline", None, "baseline must be a non-empty string, got None"),
        ("reference", 3, "reference must be a variant name (a string), got 3"),
    ],
)
def test_config_names_are_text(field, value, message):
    """The CLI and the reports print these as text: an int name crashed rich's escape()."""
    kwargs = {"baseline": "a", field: value}
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        ExperimentConfig(**kwargs)


def test_threshold_keys_of_mixed_types_are_named():
    """YAML keys may be numbers: sorting the unknown ones raised TypeError."""
    with pytest.raises(InvalidArgumentError, match=r"thresholds for unknown metric\(s\) \['speed', 7\]"):
        ExperimentConfig(baseline="a", thresholds={7: 0.1, "speed": 0.1})


# --- harness -----------------------------------------------------------------------------------


def test_a_failing_variant_is_named_and_the_samples_before_it_are_kept(tmp_path):
    """The exception goes on as it is, with a note naming the variant and input set (before, it
    named neither, and the CLI's 'failed:' line did not say which variant)."""
    cpu = cpu_hal().device("cpu")
    inputs = Inputs([(torch.randn(32, 32),) for _ in range(3)])
    good = Variant("good", Counting(_scaled(2.0)), cpu, inputs)
    # bad's calls: warm-up, r0, refill, r1, r2, refill, r3, then r4 (round 4: input set 4 mod 3 = 1)
    bad = Variant("bad", Counting(_scaled(2.0), fail_at=8), cpu, inputs)
    path = tmp_path / "s.sqlite"
    with SampleStore(path) as store, pytest.raises(RuntimeError, match="planted failure") as failed:
        measure([good, bad], warmup=1, repetitions=6, flush_every=2, store=store)
    assert failed.value.__notes__ == [f"in variant 'bad' ({bad.description}) on input set 1"]
    with sqlite3.connect(path) as db:
        saved = dict(db.execute("SELECT variant, COUNT(*) FROM samples GROUP BY variant").fetchall())
    assert saved == {"good": 5, "bad": 4}  # rounds 0-4 of good (r4 pending at the failure), 0-3 of bad


def test_the_timer_synchronizes_the_device_through_the_hal(monkeypatch):
    """Host timing of asynchronous work is only right after a synchronize: each sample's two marks
    call the adapter's synchronize for the variant's device."""
    hal = cpu_hal()
    cpu = hal.device("cpu")
    calls: list[int] = []
    real = cpu.adapter.synchronize
    monkeypatch.setattr(cpu.adapter, "synchronize", lambda index: (calls.append(index), real(index))[1])
    measure(Variant("v", _scaled(3.0), cpu, Inputs.fixed(torch.randn(64, 64))), warmup=0, repetitions=5)
    assert len(calls) == 2 * 5 and set(calls) == {cpu.index}


# --- reports -----------------------------------------------------------------------------------


def test_markdown_shows_user_strings_verbatim_and_json_round_trips(tmp_path):
    """A '|' in a variant name split its table row, a backtick ended its code span early and a
    newline in the experiment's name started a second heading."""
    hal = sim_hal("edge")
    sim = hal.device("simasic:0")
    inputs = Inputs(
        [(sim.to_device(torch.randn(48, 64)), sim.to_device(torch.randn(64, 40))) for _ in range(4)]
    )
    built = dtype_variants(torchhal.ops.matmul, sim, inputs, [torch.float32, torch.bfloat16], hal=hal)
    names = ["fp32 | ref", "bf16 `fast`"]
    variants = [dataclasses.replace(v, name=n) for v, n in zip(built, names, strict=True)]
    title = "kernels\n# not a heading"
    config = ExperimentConfig(
        name=title,
        baseline=names[0],
        reference=names[0],
        metrics=("latency", "quality"),
        thresholds={"quality": QUALITY},
        prices={"simasic:0": 2.0},
        warmup=1,
        repetitions=4,
    )
    result = run_experiment(variants, config)

    tokens = MarkdownIt("commonmark").enable("table").parse(to_markdown(result))
    headings = [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]
    assert headings[0] == "A/B experiment: kernels\\n# not a heading"
    assert "not a heading" not in " ".join(headings[1:])
    rows: list[list[str]] = []
    for i, t in enumerate(tokens):
        if t.type == "tr_open":
            rows.append([])
        elif t.type == "inline" and tokens[i - 1].type == "td_open":
            rows[-1].append("".join(c.content for c in t.children or [] if c.type == "code_inline"))
    body = [r for r in rows if r]
    assert body and all(len(r) == 7 for r in body)  # every table here has 7 columns
    shown = {cell for r in body for cell in r if cell}
    assert shown == set(names)
    codes = [
        c.content for t in tokens if t.type == "inline" for c in t.children or [] if c.type == "code_inline"
    ]
    assert codes.count(names[0]) >= 4 and codes.count(names[1]) >= 4  # baseline line, tables, bullets

    data = json.loads(write_json(result, tmp_path / "r.json").read_text())
    assert data["config"]["name"] == title and list(data["variants"]) == names
    for name in names:
        np.testing.assert_array_equal(
            data["variants"][name]["samples"]["latency_ms"], result.samples(name, "latency")
        )
        np.testing.assert_array_equal(
            data["variants"][name]["samples"]["quality_error"], result.samples(name, "quality")
        )


# --- sample store ------------------------------------------------------------------------------


def test_a_store_of_another_schema_is_refused_when_opened(tmp_path):
    """CREATE TABLE IF NOT EXISTS kept the foreign table; the first write then failed with sqlite's
    'table samples has 2 columns but 6 values were supplied', naming no file."""
    path = tmp_path / "other.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE samples (a, b)")
    with pytest.raises(
        ConfigurationError, match=r"other\.sqlite: table 'samples' has columns \['a', 'b'\], expected"
    ):
        SampleStore(path)


def test_a_damaged_store_is_refused_when_opened(tmp_path):
    """A damaged page opened fine and failed part-way through a resume with sqlite's 'database
    disk image is malformed', naming no file."""
    path = tmp_path / "s.sqlite"
    with SampleStore(path) as store:
        store.put_many("e", [("v", f"round:{i}", {"latency_ms": float(i)}) for i in range(3000)])
    with sqlite3.connect(path) as db:
        page = db.execute("PRAGMA page_size").fetchone()[0]
        pages = db.execute("PRAGMA page_count").fetchone()[0]
    data = bytearray(path.read_bytes())
    middle = pages // 2 * page
    data[middle : middle + page] = b"\xa5" * page  # 0xa5 is no b-tree page type
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigurationError, match=r"sample store .*s\.sqlite: .*(damaged|malformed)"):
        SampleStore(path)


# --- monitor -----------------------------------------------------------------------------------


def _monitor(**kwargs):
    args = dict(control="old", candidate="new", higher_is_better=False, threshold=Threshold(relative=0.05))
    return LiveMonitor(**{**args, **kwargs})


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ((-1.0, 2.0), "weight of the control must be a finite number > 0, got -1.0"),
        ((1.0, math.nan), "weight of the candidate must be a finite number > 0, got nan"),
        ((1.0, 0.0), "weight of the candidate must be a finite number > 0, got 0.0"),
        ((math.inf, 1.0), "weight of the control must be a finite number > 0, got inf"),
        (("a", 1.0), "weight of the control must be a finite number > 0, got 'a'"),
    ],
)
def test_bad_weights_are_refused_before_any_traffic(weights, message):
    """They were accepted, then failed at the first assign() or status(), mid-traffic."""
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        _monitor(weights=weights)


def test_an_arm_that_gets_no_traffic_is_a_sample_ratio_mismatch():
    """A broken router sending every request to the control was never flagged: the check
    needed units in both arms, so the monitor said 'continue' forever. The p-value is 1/BF,
    the Bayes factor built as Pólya's urn predicts each unit."""
    monitor = _monitor()
    monitor.observe_many("old", np.random.default_rng().normal(10.0, 1.0, 200))
    status = monitor.status()
    assert status.decision is MonitorDecision.ROLL_BACK and "sample ratio mismatch" in status.reason
    expected = -polya_log_bayes_factor([0] * 200, [0.5, 0.5], SRM_CONCENTRATION)
    assert status.srm_p_value == pytest.approx(math.exp(expected), rel=1e-9, abs=0.0)


def _flags_at(weights, n_control: int, n_candidate: int) -> bool:
    """Whether one look at these counts, the first the monitor takes, rolls the split back."""
    monitor = _monitor(weights=weights)
    monitor.observe_many("old", [1.0] * n_control)
    monitor.observe_many("new", [1.0] * n_candidate)
    srm = monitor.status().srm_p_value
    return srm is not None and srm < monitor.srm_alpha


@pytest.mark.parametrize("weights", [(0.5, 0.5), (0.9, 0.1), (0.99, 0.01)])
def test_a_sound_split_looked_at_after_every_unit_rolls_back_at_most_srm_alpha(weights):
    """Exactly, by enumerating the counts, with a look after each of 100 units: the per-look exact
    binomial test rolled back 0.0071 of sound 50:50 splits (0.0040 at 90:10, 0.0017 at 99:1)
    against srm_alpha = 0.001, and 0.028 by 10,000 units. The monitor keeps the smallest p of
    its looks, so a path is rolled back at its first flagged count: the enumeration absorbs there."""
    share = weights[1] / sum(weights)
    alive, rolled_back = np.array([1.0]), 0.0
    for n in range(1, 101):
        step = np.zeros(n + 1)
        step[:-1] += alive * (1.0 - share)
        step[1:] += alive * share
        hit = np.array([_flags_at(weights, n - k, k) for k in range(n + 1)])
        rolled_back += step[hit].sum()
        step[hit] = 0.0
        alive = step
    assert rolled_back <= 0.001


def test_the_monitor_keeps_the_smallest_srm_p_value_of_its_looks():
    """The p-value is anytime-valid only as the minimum over looks; a split flagged once stays
    flagged when later units even it out."""
    rng = np.random.default_rng()
    monitor = _monitor(weights=(0.8, 0.2))
    smallest, counts = 1.0, [0, 0]
    for _ in range(300):
        arm = int(rng.uniform() < 0.2)
        monitor.observe(("old", "new")[arm], float(rng.normal(10.0, 1.0)))
        counts[arm] += 1
        smallest = min(smallest, sequential_sample_ratio_mismatch(counts, [0.8, 0.2]).p_value)
        assert monitor.status().srm_p_value == smallest
    monitor.observe_many("new", rng.normal(10.0, 1.0, 400))  # broken: flagged
    flagged = monitor.status()
    assert flagged.decision is MonitorDecision.ROLL_BACK and flagged.srm_p_value < 1e-6
    monitor.observe_many("old", rng.normal(10.0, 1.0, 4 * flagged.n_candidate - flagged.n_control))  # 80:20
    later = monitor.status()
    assert later.decision is MonitorDecision.ROLL_BACK and later.srm_p_value == flagged.srm_p_value
    assert sequential_sample_ratio_mismatch([later.n_control, later.n_candidate], [0.8, 0.2]).p_value == 1.0


def test_assignment_is_the_same_in_another_process_and_follows_the_weights():
    monitor = _monitor(weights=(0.7, 0.3), salt="sweep18")
    ids = [f"user-{i}" for i in range(4000)]
    here = [monitor.assign(u) for u in ids]
    code = (
        "import sys; from torchhal.evaluation.stats import assign\n"
        "print(''.join('c' if assign(f'user-{i}', ['old', 'new'], [0.7, 0.3], 'sweep18') == 'new' "
        "else 'o' for i in range(4000)))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=Path(__file__).resolve().parents[2],
        check=True,
    ).stdout.strip()
    assert other == "".join("c" if a == "new" else "o" for a in here)
    n_new = here.count("new")
    chi2 = (n_new - 1200) ** 2 / 1200 + (4000 - n_new - 2800) ** 2 / 2800
    assert chi2 < 10.83  # p > 0.001 for one degree of freedom


# --- sharded evaluation ------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, "0.5", [0.5]])
def test_a_metric_without_a_number_is_refused_by_name(value):
    """None in a mapping crashed float() with a TypeError naming neither variant, item nor metric."""
    items = [torch.randn(4) for _ in range(3)]

    def evaluate(item):
        return {"acc": 1.0, "loss": value if item is items[2] else 0.1}

    with pytest.raises(
        InvalidArgumentError,
        match=rf"variant 'v' on item 2 must return a number for metric 'loss', got {re.escape(repr(value))}",
    ):
        evaluate_sharded({"v": evaluate}, items, ["acc", "loss"], name="sweep18")


# --- spec files and the CLI --------------------------------------------------------------------


def test_workload_kwargs_may_be_named_count(tmp_path):
    """They were spread into Inputs.generate(make, count, **kwargs): 'got multiple values for count'."""
    spec = _spec(tmp_path, _planted().replace("input_sets = 3", "input_sets = 3\nkwargs = { count = 3 }"))
    loaded = load_spec(spec, cpu_hal())
    assert [v.inputs.kwargs for v in loaded.variants] == [{"count": 3}, {"count": 3}]
    assert len(loaded.variants[0].inputs) == 3


def test_yaml_keys_that_are_numbers_are_named(tmp_path):
    pytest.importorskip("yaml")
    spec = _spec(tmp_path, "1: x\nfoo: y\nexperiment: {baseline: a}\n", "spec.yaml")
    with pytest.raises(ConfigurationError, match=r"unknown key\(s\) \['foo', 1\]"):
        load_spec(spec, cpu_hal())


def test_cli_prints_variant_names_as_text_not_markup(tmp_path):
    """'[bold]slow[/x]' made rich raise MarkupError after the whole run: exit 1, no result table."""
    spec = _spec(tmp_path, _planted().replace('name = "slow"', 'name = "[bold]slow[/x]"'))
    result = _ab(str(spec), "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == 0, result.output
    assert "[bold]slow[/x]" in result.text


def test_cli_name_that_is_not_text_exits_2(tmp_path):
    spec = _spec(tmp_path, _planted().replace('name = "planted"', "name = 5"))
    result = _ab(str(spec), "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == EXIT_BAD_INPUT
    assert f"spec {spec}: [experiment]: name must be a non-empty string, got 5" in result.text


def test_cli_out_that_is_a_file_or_a_damaged_store_exits_2(tmp_path):
    spec = _spec(tmp_path, _planted())
    afile = tmp_path / "afile"
    afile.write_text("mine")
    result = _ab(str(spec), "--out", str(afile), "--no-plots")
    assert (
        result.exit_code == EXIT_BAD_INPUT and f"--out {afile}: exists and is not a directory" in result.text
    )
    assert afile.read_text() == "mine"
    out = tmp_path / "out"
    out.mkdir()
    (out / "samples.sqlite").write_bytes(b"not sqlite " * 100)
    result = _ab(str(spec), "--out", str(out), "--no-plots")
    assert result.exit_code == EXIT_BAD_INPUT
    assert f"sample store {out / 'samples.sqlite'}: not a usable sqlite file" in result.text


def test_cli_failure_names_the_variant(tmp_path):
    spec = _spec(tmp_path, _planted(slow="broken"))
    result = _ab(str(spec), "--out", str(tmp_path / "out"), "--no-plots")
    assert result.exit_code == EXIT_FAILED
    assert (
        "planted failure in a variant (in variant 'slow' (callable tests.evaluation.helpers:broken"
        in result.text
    )


@pytest.mark.parametrize(("table", "seen"), [({"relative": "abc"}, "'abc'"), ({"relative": True}, "True")])
def test_a_threshold_table_is_held_to_the_threshold_rules(table, seen):
    """{relative = "abc"} was a bare ValueError from float(); {relative = true} became 1.0 (100%)."""
    with pytest.raises(InvalidArgumentError, match=rf"a threshold must be a finite number >= 0, got {seen}"):
        Threshold.parse(table, "latency")
    assert Threshold.parse({"absolute": 2}, "latency") == Threshold(absolute=2)


def test_prices_that_are_not_a_table_are_named():
    """`prices = "x"` in a spec was an AttributeError ('str' object has no attribute 'items')."""
    from torchhal.evaluation.cost import check_prices

    with pytest.raises(InvalidArgumentError, match=r"prices must be a table of device id or variant name"):
        check_prices("x")  # type: ignore[arg-type]
    assert check_prices({"cuda:0": 3}) == {"cuda:0": 3.0}
