"""CudaProbe's NVML readings when one GPU's NVML calls fail (e.g. NVML_ERROR_GPU_IS_LOST).

torch.cuda answers from the recorded H200 pair; NVML is a fake `pynvml` module written for the
test (NVML's function names, handles standing in as the UUID strings), in which every reading
but the identity ones is "Not Supported" and one GPU's identity call raises."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.probe import CudaProbe

from tests.plugins.facts import count, load
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import LinkType
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


class NVMLError(Exception):
    pass


def fake_pynvml(facts: dict[str, Any], lost_uuid: str, failing: str) -> types.ModuleType:
    """NVML that knows the recorded GPUs by UUID; `failing` ("uuid" or "pci") raises for `lost_uuid`."""
    bus = {d["nvml"]["uuid"]: d["nvml"]["pci_bus_id"] for d in facts["devices"]}
    nv = types.ModuleType("pynvml")
    nv.NVMLError = NVMLError
    nv.NVML_NVLINK_MAX_LINKS = 18
    nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = nv.NVML_TEMPERATURE_GPU = 0
    nv.NVML_P2P_CAPS_INDEX_NVLINK = nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED = nv.NVML_VOLATILE_ECC = 0
    nv.nvmlInit = lambda: None
    nv.nvmlSystemGetDriverVersion = lambda: "580.159.04"
    nv.nvmlDeviceGetHandleByUUID = lambda uuid: uuid

    def identity(kind: str, answer: Any) -> Any:
        def read(handle: str) -> Any:
            if handle == lost_uuid and failing == kind:
                raise NVMLError("GPU is lost")
            return answer(handle)

        return read

    nv.nvmlDeviceGetUUID = identity("uuid", lambda h: h)
    nv.nvmlDeviceGetPciInfo = identity("pci", lambda h: types.SimpleNamespace(busId=bus[h]))

    def unsupported(*args: Any) -> Any:
        raise NVMLError("Not Supported")

    for name in (
        "nvmlDeviceGetEccMode",
        "nvmlDeviceGetTemperatureThreshold",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetP2PStatus",
        "nvmlDeviceGetTopologyCommonAncestor",
    ):
        setattr(nv, name, unsupported)
    return nv


class ReplayedTorchProbe(CudaProbe):
    """The live probe's NVML code; torch.cuda and nvidia-smi answer from the recording."""

    def __init__(self, facts: dict[str, Any]) -> None:
        super().__init__()
        self.facts = facts

    def runtime(self) -> dict[str, Any]:
        return self.facts["runtime"]

    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.facts["devices"])

    def properties(self, index: int) -> dict[str, Any]:
        return self.facts["devices"][index]["properties"]

    def libraries(self) -> dict[str, Any]:
        return self.facts["libraries"]

    def can_access_peer(self, index: int, peer: int) -> bool:
        return True

    def nvidia_smi_topology(self) -> dict[str, Any]:
        return self.facts["nvidia_smi"]


@pytest.mark.parametrize("failing", ["uuid", "pci"])
@pytest.mark.parametrize("lost", [0, 1])
def test_a_gpu_nvml_cannot_identify_lacks_only_its_own_nvml_facts(failing, lost, monkeypatch, capsys):
    facts = load("nvidia-h200x2")
    lost_uuid = facts["devices"][lost]["nvml"]["uuid"]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(facts, lost_uuid, failing))
    adapter = NvidiaAdapter(ReplayedTorchProbe(facts))
    unidentified = count("torchhal.nvml.unidentified_devices,adapter=nvidia")
    smi_fallbacks = count("torchhal.topology.fallbacks,adapter=nvidia,source=nvidia-smi")

    hal = HardwareAbstractionLayer(adapters=[adapter], settings=NO_AUTOLOAD)
    assert [d.id for d in hal.devices()] == ["cuda:0", "cuda:1", "cpu"]  # the other GPU was lost too
    other = 1 - lost
    assert adapter.runtime_probe.nvml_device(lost) is None
    assert adapter.runtime_probe.nvml_device(other)["uuid"] == facts["devices"][other]["nvml"]["uuid"]
    for index in (lost, other):  # NVML's identity or, for the lost GPU, torch's: the same values
        caps = hal.device(f"cuda:{index}").capabilities
        assert caps.uuid == facts["devices"][index]["nvml"]["uuid"]
        assert caps.pci_bus_id == facts["devices"][index]["nvml"]["pci_bus_id"]
    assert count("torchhal.nvml.unidentified_devices,adapter=nvidia") == unidentified + 1

    (link,) = adapter.topology().links  # from nvidia-smi, as for any GPU without NVML facts
    assert (link.type, link.count) == (LinkType.NVLINK, 18)
    assert count("torchhal.topology.fallbacks,adapter=nvidia,source=nvidia-smi") == smi_fallbacks + 1
    err = capsys.readouterr().err
    assert "NVML could not identify this GPU" in err and f"device={lost}" in err
    assert ("'UUID'" if failing == "uuid" else "'PCI info'") in err
    assert f"could not identify, ['cuda:{lost}']" in err
