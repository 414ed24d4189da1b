"""Spec files an author gets slightly wrong: each is refused naming the file or field, never read
as something else."""

from __future__ import annotations

import json

import pytest
from torchhal_simasic.spec import load_spec

from tests.simasic.tiny import TINY
from torchhal.hal_core import ConfigurationError, DeclaredPeaks, DType


def test_a_dtype_listed_twice_is_refused_by_name(tiny):
    """["fp32", "fp32", "bf16"] was read as {fp32, bf16}: the set kept one without a word."""
    with pytest.raises(ConfigurationError) as err:
        tiny(dtypes=["fp32", "fp32", "bf16"])
    assert (
        "field 'dtypes': each dtype must be listed once, ['fp32'] are listed more than once, "
        "got ['fp32', 'fp32', 'bf16']"
    ) in str(err.value)
    assert tiny(dtypes=["bf16", "fp32"]).dtypes == tiny().dtypes  # order is free; only repeats go


def test_a_json_key_given_twice_is_refused(tmp_path):
    """json.loads keeps the last of a repeated key: this file was an 8-row array."""
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(TINY).replace('"rows": 4', '"rows": 4, "rows": 8'))
    with pytest.raises(ConfigurationError, match=f"spec {path}: key 'rows' appears more than once"):
        load_spec(path)
    inner = tmp_path / "inner.json"  # a nested object's keys too
    inner.write_text(json.dumps(TINY).replace('"fp32": 1', '"fp32": 1, "fp32": 3'))
    with pytest.raises(ConfigurationError, match="key 'fp32' appears more than once"):
        load_spec(inner)


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_file_that_is_not_utf8_is_a_configuration_error(tmp_path, suffix):
    """It raised UnicodeDecodeError, a bare traceback that a failed probe does not name."""
    path = tmp_path / f"spec{suffix}"
    path.write_bytes(b'name = "caf\xe9"\n')  # Latin-1, as an editor on another system may save
    with pytest.raises(
        ConfigurationError, match=f"spec {path}: must be UTF-8 text, got byte 0xe9 at offset 11"
    ):
        load_spec(path)


def test_tf32_is_refused_as_a_mode_the_simulator_does_not_model(tiny):
    """A tf32 MAC rate went into the declared peaks, but every fp32 matmul was charged at the
    fp32 rate: `torchhal profile` reported that rate as the tf32 figure beside a peak 4x it."""
    with pytest.raises(ConfigurationError, match=r"spec test: dtypes: tf32 is not modelled .*, got tf32"):
        tiny(dtypes=["fp32", "bf16", "tf32"], macs_per_cell_per_cycle={"fp32": 1, "bf16": 2, "tf32": 4})
    with pytest.raises(
        ConfigurationError, match=r"macs_per_cell_per_cycle: tf32 is not modelled .*, got tf32"
    ):
        tiny(macs_per_cell_per_cycle={"fp32": 1, "tf32": 4})


def test_a_spec_whose_peak_overflows_is_refused_naming_the_clock(tiny):
    """Each factor finite, the product not: an infinite declared peak ranked the device first and
    made every op's simulated time 0."""
    with pytest.raises(
        ConfigurationError,
        match=r"clock_hz: rows x cols x MACs x clock must give a finite fp32 peak, got 4 x 4 x 1 x 1e\+308",
    ):
        tiny(clock_hz=1e308)
    assert tiny(clock_hz=1e12).peak_flops_per_s(DType.FP32) == 2 * 16 * 1e12


def test_declared_peaks_are_finite_and_positive():
    """Datasheet figures follow the measured ones' rule: an inf, 0 or negative peak is refused."""
    for bad in (
        {"tflops": {"bf16": float("inf")}},
        {"tflops": {"bf16": 0.0}},
        {"memory_bandwidth_gbps": -1.0},
    ):
        with pytest.raises(ValueError, match=r"finite number|greater than 0"):
            DeclaredPeaks(source="test sheet", **bad)
