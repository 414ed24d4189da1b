"""Spec files: bundled specs, malformed specs named field by field, TOML/JSON, env selection."""

from __future__ import annotations

import json

import pytest
from torchhal_simasic.spec import BUNDLED, bundled_spec, load_spec, spec_from_env

from tests.simasic.tiny import TINY
from torchhal.hal_core import ConfigurationError, DType


@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_specs_load(name):
    spec = bundled_spec(name)
    assert DType.FP64 not in spec.dtypes
    assert spec.macs_per_cell_per_cycle.keys() <= spec.dtypes


def test_h100_like_matches_the_datasheet_peaks():
    spec = bundled_spec("h100-like")
    assert spec.rows == 132
    assert spec.peak_flops_per_s(DType.BF16) == pytest.approx(989.4e12, rel=1e-3)
    assert spec.memory_bandwidth_bytes_per_s == 3.35e12
    assert spec.memory_bytes == 80_000_000_000


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"rows": 0}, "field 'rows': Input should be greater than or equal to 1, got 0"),
        ({"rows": True}, "field 'rows': Input should be a valid integer, got True"),
        ({"clock_hz": -1.0}, "field 'clock_hz': Input should be greater than 0, got -1.0"),
        (
            {"memory_bandwidth_bytes_per_s": float("inf")},
            "field 'memory_bandwidth_bytes_per_s': Input should be a finite number, got inf",
        ),
        (
            {"macs_per_cell_per_cycle": {"fp32": 0}},
            "field 'macs_per_cell_per_cycle.fp32': Input should be greater than or equal to 1, got 0",
        ),
        ({"dtypes": ["fp32", "fp128"]}, "field 'dtypes.1': Input should be"),
        (
            {"dtypes": ["bf16"]},
            "macs_per_cell_per_cycle: every dtype must also be listed in dtypes ['bf16'], got ['fp32']",
        ),
        (
            {"macs_per_cell_per_cycle": {}},
            "macs_per_cell_per_cycle: needs at least one dtype, got an empty table",
        ),
        ({"launch_overhead": 1e-6}, "field 'launch_overhead': Extra inputs are not permitted, got 1e-06"),
        ({"sram_bytes": None}, "field 'sram_bytes': Input should be a valid integer, got None"),
        ({"devices": 65}, "field 'devices': Input should be less than or equal to 64, got 65"),
    ],
)
def test_malformed_spec_names_field_constraint_and_value(tiny, changes, expected):
    with pytest.raises(ConfigurationError) as err:
        tiny(**changes)
    assert str(err.value).startswith("simulated ASIC spec test: ")
    assert expected in str(err.value)


FLOAT_FIELDS = ("clock_hz", "memory_bandwidth_bytes_per_s", "launch_overhead_s", "host_link_bytes_per_s")


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["800e6", True])
def test_float_fields_refuse_strings_and_bools(tiny, field, value):
    """Read leniently, "800e6" became 8e8 and true 1 Hz; the int fields already refused both."""
    with pytest.raises(ConfigurationError) as err:
        tiny(**{field: value})
    assert f"field {field!r}: Input should be a valid number, got {value!r}" in str(err.value)


def _toml(data):
    """A flat spec as TOML (JSON's scalars and lists are TOML's), its MAC table as a table."""
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if k != "macs_per_cell_per_cycle"]
    lines += [
        "[macs_per_cell_per_cycle]",
        *(f"{k} = {v}" for k, v in data["macs_per_cell_per_cycle"].items()),
    ]
    return "\n".join(lines) + "\n"


def test_float_fields_in_a_toml_file_are_strict(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(_toml({**TINY, "clock_hz": "800e6", "launch_overhead_s": True}))
    with pytest.raises(ConfigurationError) as err:
        load_spec(path)
    assert "field 'clock_hz': Input should be a valid number, got '800e6'" in str(err.value)
    assert "field 'launch_overhead_s': Input should be a valid number, got True" in str(err.value)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_float_fields_take_integers(tiny, field):
    """TOML and JSON write a whole number without a point; it is the same spec as the float."""
    spec = tiny(**{field: 3})
    assert type(getattr(spec, field)) is float
    assert spec == tiny(**{field: 3.0})
    assert spec.fingerprint() == tiny(**{field: 3.0}).fingerprint()


def test_missing_field_is_named(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({k: v for k, v in TINY.items() if k != "clock_hz"}))
    with pytest.raises(ConfigurationError, match=f"spec {path}: field 'clock_hz': required, but missing"):
        load_spec(path)


def test_toml_and_json_files_load_alike(tmp_path):
    toml = tmp_path / "tiny.toml"
    toml.write_text(_toml(TINY))
    jsn = tmp_path / "tiny.json"
    jsn.write_text(json.dumps(TINY))
    assert load_spec(toml) == load_spec(jsn)
    assert load_spec(jsn).macs_per_cell_per_cycle == {DType.FP32: 1, DType.BF16: 2}


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.toml", "rows = = 3", "not valid TOML"),
        ("bad.json", "{rows: 3", "not valid JSON"),
        ("list.json", "[1, 2]", "must be a JSON object, got list"),
        ("spec.yaml", "rows: 3", "file name must end in .toml or .json, got '.yaml'"),
    ],
)
def test_unreadable_spec_files(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigurationError, match=expected):
        load_spec(path)


def test_env_selects_bundled_spec_by_name_and_overrides_devices():
    spec = spec_from_env({"TORCHHAL_SIMASIC_SPEC": "h100-like", "TORCHHAL_SIMASIC_DEVICES": "3"})
    assert (spec.name, spec.devices) == ("h100-like-132x128", 3)
    assert spec_from_env({}).name == bundled_spec("edge").name


@pytest.mark.parametrize(("text", "devices"), [("64", 64), ("007", 7), (" 2 ", 2)])
def test_env_device_count_up_to_the_maximum(text, devices):
    assert spec_from_env({"TORCHHAL_SIMASIC_DEVICES": text}).devices == devices


def test_env_selects_spec_file_by_path(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    assert spec_from_env({"TORCHHAL_SIMASIC_SPEC": str(path)}).name == "tiny-4x4"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"TORCHHAL_SIMASIC_SPEC": "tpu-v9"},
            "TORCHHAL_SIMASIC_SPEC must name a bundled spec .* got 'tpu-v9'",
        ),
    ],
)
def test_bad_env_values_are_configuration_errors(env, expected):
    with pytest.raises(ConfigurationError, match=expected):
        spec_from_env(env)


@pytest.mark.parametrize(
    "text",
    [
        "two",
        "0",
        "000",
        "-2",
        "+2",
        "²",  # str.isdigit() admits it; int() refuses it without naming the variable
        "٣",  # a non-ASCII digit int() reads as 3
        "65",
        "400",  # 79,800 topology links: discovery took a second
        pytest.param("9" * 5000, id="5000-digits"),  # past int()'s 4300-digit limit
    ],
)
def test_bad_env_device_counts_name_the_variable_the_range_and_the_value(text):
    with pytest.raises(ConfigurationError) as err:
        spec_from_env({"TORCHHAL_SIMASIC_DEVICES": text})
    assert str(err.value) == f"TORCHHAL_SIMASIC_DEVICES must be an integer from 1 to 64, got {text!r}"
