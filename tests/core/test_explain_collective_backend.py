"""`DeviceChoice.explain()` says what met a collective backend requirement: `rccl` is met by
torch's `nccl` on AMD devices, which the explanation did not say."""

from __future__ import annotations

from torchhal_amd.adapter import AmdAdapter
from torchhal_amd.recorded import RecordedRocmProbe
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe

from tests.plugins.facts import load
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


def _hal() -> HardwareAbstractionLayer:
    """The recorded MI300X and H100 hosts, with the built-in CPU."""
    return HardwareAbstractionLayer(
        adapters=[
            AmdAdapter(probe=RecordedRocmProbe(load("amd-mi300x"))),
            NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h100-sxm"))),
        ],
        settings=NO_AUTOLOAD,
    )


def _lines(explanation: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in explanation.splitlines())


def test_rccl_on_an_mi300x_says_it_is_torchs_nccl():
    hal = _hal()
    choice = hal.choose_device(DeviceRequirements(collective_backend="rccl"))
    lines = _lines(choice.explain())
    amd = [d.id for d in hal.devices() if d.capabilities.vendor == "amd"]
    assert amd and choice.device.id in amd
    for dev_id in amd:
        assert lines[dev_id].endswith("; collective 'rccl': RCCL, torch's 'nccl' on this amd device"), lines[
            dev_id
        ]
    for dev in hal.devices():  # the rest are refused, saying why (unchanged)
        if dev.id not in amd:
            assert lines[dev.id].startswith("rejected: collective backend 'rccl' (RCCL"), lines[dev.id]


def test_a_declared_backend_is_said_to_be_declared():
    hal = _hal()
    lines = _lines(hal.choose_device(DeviceRequirements(collective_backend="nccl")).explain())
    gpus = [d.id for d in hal.devices() if d.capabilities.vendor in ("amd", "nvidia")]
    for dev_id in gpus:
        assert lines[dev_id].endswith("; collective 'nccl': declared"), lines[dev_id]
    assert lines["cpu"].startswith("rejected: collective backend 'nccl' not in ['gloo']")


def test_no_collective_requirement_adds_nothing():
    explanation = _hal().choose_device().explain()
    assert "collective" not in explanation
