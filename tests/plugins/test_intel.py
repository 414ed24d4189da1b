"""The Intel adapter on recorded Data Center GPU Max 1550 facts (both stacks of one card), and on
the live runtime (absent on this CPU build)."""

from __future__ import annotations

import random

import pytest
import torch
from torchhal_intel.adapter import IntelAdapter, architecture
from torchhal_intel.probe import record
from torchhal_intel.recorded import RecordedXpuProbe
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe

from tests.plugins.facts import load
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DType, Feature, HealthStatus, UnsupportedError
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


def adapter(facts: dict) -> IntelAdapter:
    return IntelAdapter(probe=RecordedXpuProbe(facts))


@pytest.mark.skipif(getattr(torch.version, "xpu", None) is not None, reason="this torch is an XPU build")
def test_live_probe_reports_a_build_without_xpu():
    result = IntelAdapter().probe()
    assert not result.available
    assert result.reason == (
        f"torch {torch.__version__} was built without XPU support (torch.version.xpu is None): "
        "install an XPU build of torch"
    )


def test_xpu_build_without_a_gpu_says_what_to_check():
    facts = load("intel-max1550")
    facts["available"] = False
    result = adapter(facts).probe()
    assert not result.available and result.runtime_version == "20260000"
    assert "torch.xpu.is_available() is False" in result.reason and "sycl-ls" in result.reason


def test_max1550_stacks():
    devices = adapter(load("intel-max1550")).discover()
    assert [d.index for d in devices] == [0, 1]
    for caps in devices:
        assert (caps.device_type, caps.arch, caps.vendor) == ("xpu", "xe-hpc", "intel")
        assert caps.compute_units == 64  # Xe cores per stack (128 on the card)
        assert caps.simd_width == 32  # widest sub-group of [16, 32]
        assert caps.memory_bytes == 65520 * 2**20  # one stack's 64 GB of HBM2e
        assert caps.dtypes == {DType.FP64, DType.FP32, DType.TF32, DType.BF16, DType.FP16, DType.INT8}
        assert caps.features == {Feature.TENSOR_CORES, Feature.DEVICE_EVENTS}  # nothing else was recorded
        assert caps.collective_backends == ("xccl", "gloo") and caps.kernel_backends == ("onednn",)
        assert caps.l2_cache_bytes == 192 * 2**20 and caps.shared_memory_per_block_bytes == 128 * 1024
        assert caps.declared_peaks is None and caps.driver_version == "1.6.33578+51"
    assert [d.uuid for d in devices] == [
        "d47ef340-79ec-b1ea-0000-000000000001",
        "d47ef340-79ec-b1ea-0000-000000000002",
    ]


def test_device_properties_decide_matrix_engines_and_precision():
    facts = load("intel-max1550")
    props = facts["devices"][0]["properties"]
    props.update(has_subgroup_matrix_multiply_accumulate=False, has_fp64=False, has_fp16=False)
    facts["libraries"] = {"triton": True, "graphs": True}
    facts["peer_access"] = [[0, 1], [1, 0]]
    first, second = adapter(facts).discover()
    assert first.dtypes == {DType.FP32, DType.BF16, DType.INT8}
    assert first.features == {Feature.DEVICE_EVENTS, Feature.GRAPHS, Feature.P2P, Feature.TRITON}
    assert first.kernel_backends == ("onednn", "triton")
    assert Feature.TENSOR_CORES in second.features and DType.TF32 in second.dtypes


@pytest.mark.parametrize(
    ("name", "arch"),
    [
        ("Intel(R) Data Center GPU Max 1100", "xe-hpc"),
        ("Intel(R) Data Center GPU Flex 170", "xe-hpg"),
        ("Intel(R) Arc(TM) A770 Graphics", "xe-hpg"),
        ("Intel(R) Arc(TM) Pro A60 Graphics", "xe-hpg"),
        ("Intel(R) Arc(TM) B580 Graphics", "xe2-hpg"),
    ],
)
def test_architecture_from_the_product_line(name, arch):
    assert architecture({"name": name}) == arch


def test_unknown_product_line_is_named_by_its_pci_device_id():
    device_id = random.randint(0x4000, 0xFFFF)
    assert (
        architecture({"name": "Intel(R) Graphics", "device_id": device_id}) == f"intel-gpu-{device_id:#06x}"
    )
    assert architecture({"name": "Intel(R) Graphics"}) == "intel-gpu"


def test_health_is_unknown_and_points_at_xpu_smi():
    report = adapter(load("intel-max1550")).health(1)
    assert report.status is HealthStatus.UNKNOWN and "xpu-smi" in report.messages[0]


def test_topology_lists_the_stacks_without_inventing_links():
    topo = adapter(load("intel-max1550")).topology()
    assert topo.devices == ("xpu:0", "xpu:1") and topo.links == ()


def test_memory_info_translates_the_runtime_figures():
    facts = load("intel-max1550")
    total = facts["devices"][1]["properties"]["total_memory"]
    free, allocated = random.randint(0, total), random.randint(0, 2**33)
    facts["devices"][1]["memory"] = {"free": free, "total": total, "allocated": allocated}
    info = adapter(facts).memory_info(1)
    assert (info.total_bytes, info.free_bytes, info.used_bytes) == (total, free, allocated)
    with pytest.raises(UnsupportedError, match="memory of device 0 was not recorded"):
        adapter(facts).memory_info(0)


def test_recorded_probe_refuses_device_actions():
    intel = adapter(load("intel-max1550"))
    with pytest.raises(UnsupportedError, match="cannot synchronize"):
        intel.synchronize(0)
    with pytest.raises(UnsupportedError, match="records no events"):
        intel.timer(1).mark()


def test_hal_with_recorded_intel_and_nvidia_adapters():
    nvidia = NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h200x2")))
    hal = HardwareAbstractionLayer(adapters=[adapter(load("intel-max1550")), nvidia], settings=NO_AUTOLOAD)
    assert [d.id for d in hal.devices()] == [
        "cuda:0",
        "cuda:1",
        "xpu:0",
        "xpu:1",
        "cpu",
    ]  # priority 100, then 90
    assert hal.device("xpu:1").torch_device == torch.device("xpu", 1)
    assert hal.topology().devices == ("cuda:0", "cuda:1", "xpu:0", "xpu:1", "cpu")


def test_record_and_replay_agree_on_every_fact():
    facts = load("intel-max1550")
    facts["libraries"] = {"triton": False, "graphs": True}
    facts["peer_access"] = [[0, 1], [1, 0]]
    for device in facts["devices"]:
        device["memory"] = {"free": random.randint(0, 2**36), "total": 65520 * 2**20, "allocated": 0}
    assert record(RecordedXpuProbe(facts), facts["source"]) == facts
