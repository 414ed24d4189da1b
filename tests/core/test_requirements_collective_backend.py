"""DeviceRequirements' collective backend on recorded devices.

A user asking for `rccl` means AMD's library, which torch runs under the backend name `nccl` on
ROCm builds, the name the AMD adapter declares: `rccl` was refused on every AMD device.
"""

from __future__ import annotations

import pytest
from torchhal_amd.adapter import AmdAdapter
from torchhal_amd.recorded import RecordedRocmProbe
from torchhal_intel.adapter import IntelAdapter
from torchhal_intel.recorded import RecordedXpuProbe
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe

from tests.core.adapters import fake_caps
from tests.plugins.facts import load
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal.hal_core import NoDeviceMatchesError
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


def mi300x():
    (caps,) = AmdAdapter(probe=RecordedRocmProbe(load("amd-mi300x"))).discover()
    return caps


def h100():
    (caps, *_) = NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h100-sxm"))).discover()
    return caps


def max1550():
    (caps, *_) = IntelAdapter(probe=RecordedXpuProbe(load("intel-max1550"))).discover()
    return caps


def test_rccl_is_met_by_an_amd_device_that_declares_torchs_nccl():
    caps = mi300x()
    assert "nccl" in caps.collective_backends and "rccl" not in caps.collective_backends
    assert DeviceRequirements(collective_backend="rccl").failures(caps) == []
    assert DeviceRequirements(collective_backend="nccl").failures(caps) == []  # torch's name, as before


def test_rccl_is_refused_on_nvidia_and_intel_saying_what_each_declares():
    """NVIDIA's nccl is NCCL, not RCCL: the reason says what rccl would need."""
    need = "collective backend 'rccl' (RCCL, torch's 'nccl' on amd devices) not available"
    assert DeviceRequirements(collective_backend="rccl").failures(h100()) == [
        f"{need}: this 'nvidia' device declares ['nccl', 'gloo']"
    ]
    assert DeviceRequirements(collective_backend="rccl").failures(max1550()) == [
        f"{need}: this 'intel' device declares ['xccl', 'gloo']"
    ]
    assert DeviceRequirements(collective_backend="nccl").failures(max1550()) == [
        "collective backend 'nccl' not in ['xccl', 'gloo']"
    ]


def test_a_device_that_declares_rccl_itself_meets_it():
    """A third-party adapter may name the library; rccl is not kept for the amd vendor only."""
    caps = fake_caps(collective_backends=("rccl", "gloo"))
    assert DeviceRequirements(collective_backend="rccl").failures(caps) == []
    assert DeviceRequirements(collective_backend="nccl").failures(caps) == [
        "collective backend 'nccl' not in ['rccl', 'gloo']"
    ]


def test_best_device_for_rccl_is_the_mi300x_and_the_error_names_why_not():
    amd = HardwareAbstractionLayer(
        adapters=[AmdAdapter(probe=RecordedRocmProbe(load("amd-mi300x")))], settings=NO_AUTOLOAD
    )
    chosen = amd.best_device(DeviceRequirements(collective_backend="rccl", device_type="cuda"))
    assert chosen.capabilities.name == "AMD Instinct MI300X"

    nvidia = HardwareAbstractionLayer(
        adapters=[NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h100-sxm")))], settings=NO_AUTOLOAD
    )
    with pytest.raises(NoDeviceMatchesError) as err:
        nvidia.best_device(DeviceRequirements(collective_backend="rccl", device_type="cuda"))
    assert "cuda:0: collective backend 'rccl' (RCCL, torch's 'nccl' on amd devices) not available" in str(
        err.value
    )


@pytest.mark.parametrize("name", ["NCCL", "Nccl", "RCCL"])
def test_backend_names_in_any_case_as_torch_distributed_takes_them(name):
    """torch.distributed lower-cases backend names; "NCCL" was refused by every device."""
    assert DeviceRequirements(collective_backend=name).collective_backend == name.lower()
    assert DeviceRequirements(collective_backend=name).failures(mi300x()) == []
