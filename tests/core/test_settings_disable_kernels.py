"""TORCHHAL_DISABLE_KERNELS may not name the reference: it is every op's ground truth and last
fallback. Before, `reference` (or `torchhal/reference`) was accepted without a word and disabled
it for every op: an op that no other candidate computes on a device (swiglu on the CPU) then
failed on every call with "no candidate supports", and a fast kernel that raised had nothing to
fall back to. `rms_norm/reference` (an op's reference, as a user may write it) names no candidate
there either (names are unique per provider and no provider may register one named reference).
"""

from __future__ import annotations

import json

import pytest
import torch

import torchhal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import ConfigurationError, telemetry


@pytest.mark.parametrize("value", ["reference", "torchhal/reference", "triton, rms_norm/reference"])
def test_disabling_the_reference_is_refused_naming_setting_value_and_constraint(settings, value):
    with pytest.raises(ConfigurationError) as caught:
        settings(disable_kernels=value)
    message = str(caught.value)
    assert f"TORCHHAL_DISABLE_KERNELS={value!r}" in message
    assert "cannot be disabled" in message and "fallback" in message


def test_a_hal_reading_the_environment_refuses_it(monkeypatch):
    monkeypatch.setenv("TORCHHAL_DISABLE_KERNELS", "reference")
    with pytest.raises(ConfigurationError, match=r"TORCHHAL_DISABLE_KERNELS='reference'.*cannot be disabled"):
        HardwareAbstractionLayer()


def test_other_candidates_are_still_disabled(settings, capsys):
    """Names that merely contain the word are candidates' names, judged as before; the names the
    unknown-name warning offers leave the reference out."""
    telemetry.configure(log_format="json")
    hal = HardwareAbstractionLayer(
        settings=settings(disable_plugin_autoload="1", disable_kernels="aten,reference2")
    )
    x, w = torch.randn(3, 16), torch.randn(16)
    selection = hal.kernels.select("rms_norm", hal.device("cpu"), x, w, 1e-6)
    assert selection.candidate.name == "reference"
    assert any(r.candidate == "torchhal/aten" and r.reason.value == "disabled" for r in selection.rejected)
    torch.testing.assert_close(hal.dispatch("rms_norm", x, w, 1e-6), torchhal.ops.rms_norm(x, w))
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    (line,) = (x for x in lines if x["event"] == "TORCHHAL_DISABLE_KERNELS names no kernel candidate")
    assert line["names"] == ["reference2"] and "torchhal/aten" in line["known"]
    assert not {"reference", "torchhal/reference"} & set(line["known"])
