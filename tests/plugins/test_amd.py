"""The AMD adapter on recorded MI300X, MI250X (one GCD) and Radeon RX 7900 XTX facts, and on the
live runtime (absent on this CPU build).

None of the sourced recordings carries amdsmi facts, so the amdsmi paths (health, xGMI links)
are driven with readings a test writes in amdsmi's documented shapes; each such test says so.
"""

from __future__ import annotations

import copy
import io
import random

import pytest
import torch
from torchhal_amd.adapter import AmdAdapter, GfxTarget
from torchhal_amd.datasheets import SKUS
from torchhal_amd.probe import record
from torchhal_amd.recorded import RecordedRocmProbe

from tests.plugins.facts import count, load
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DType, Feature, HealthStatus, LinkType, UnsupportedError, telemetry
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
FNUZ = {DType.FP8_E4M3_FNUZ, DType.FP8_E5M2_FNUZ}
OCP_FP8 = {DType.FP8_E4M3, DType.FP8_E5M2}


def adapter(facts: dict) -> AmdAdapter:
    return AmdAdapter(probe=RecordedRocmProbe(facts))


ECC_BLOCKS = 0b111  # UMC, SDMA and GFX: ECC on, in amdsmi_get_gpu_ecc_enabled's bit-mask shape


def with_amdsmi(facts: dict, *, temperature: int, critical: int, ecc: int) -> dict:
    """Give every device amdsmi readings (test inputs in amdsmi's shapes: get_temp_metric integers,
    get_gpu_ecc_enabled's bit mask, get_gpu_total_ecc_count and get_gpu_activity dictionaries)."""
    facts["amdsmi"] = {"available": True, "reason": "amdsmi initialised"}
    for device in facts["devices"]:
        device["amdsmi"] = {
            "uuid": "test-uuid",
            "bdf": "0000:0c:00.0",
            "driver_version": "test-driver",
            "temperature_hotspot_critical": critical,
            "ecc_enabled_blocks": ECC_BLOCKS,
        }
        device["amdsmi_health"] = {
            "temperature_hotspot": temperature,
            "ecc_uncorrectable": ecc,
            "ecc_correctable": 0,
            "gfx_activity_pct": 0,
        }
    return facts


# -- absence, and builds that are not this adapter's ------------------------------------------


@pytest.mark.skipif(torch.version.hip is not None, reason="this torch is a ROCm build; absence needs another")
def test_live_probe_reports_a_build_without_rocm():
    result = AmdAdapter().probe()
    assert not result.available
    built = f"a CUDA build (CUDA {torch.version.cuda})" if torch.version.cuda else "built without ROCm"
    assert result.reason.startswith(
        f"torch {torch.__version__} is {built}: AMD GPUs need a ROCm build of torch"
    )


def test_declines_a_cuda_build():
    result = AmdAdapter(probe=RecordedRocmProbe(load("nvidia-h100-sxm"))).probe()
    assert not result.available
    assert result.reason.startswith(
        "torch 2.11.0+cu130 is a CUDA build (CUDA 13.0): AMD GPUs need a ROCm build"
    )
    assert "nvidia adapter" in result.reason


def test_rocm_build_without_a_gpu_says_what_to_check():
    facts = load("amd-mi300x")
    facts["available"] = False
    result = adapter(facts).probe()
    assert not result.available and result.runtime_version == "6.2.41133-dd7f95766"
    assert "torch.cuda.is_available() is False" in result.reason and "amd-smi" in result.reason


def test_present_rocm_runtime():
    result = adapter(load("amd-mi300x")).probe()
    assert result.available and result.reason == "ROCm/HIP 6.2.41133-dd7f95766 runtime"


# -- capabilities, checked against the real devices' known facts --------------------------------


def test_mi300x_capabilities():
    (caps,) = adapter(load("amd-mi300x")).discover()
    assert (caps.name, caps.arch, caps.compute_units, caps.simd_width) == (
        "AMD Instinct MI300X",
        "gfx942",
        304,
        64,
    )
    assert caps.device_type == "cuda" and caps.vendor == "amd"
    assert caps.memory_bytes == 196592 * 2**20  # 192 GB of HBM3 as ROCm reports it
    assert caps.dtypes == {DType.FP64, DType.FP32, DType.TF32, DType.BF16, DType.FP16, DType.INT8} | FNUZ
    assert not caps.dtypes & OCP_FP8  # MI300X computes fp8 in the fnuz encoding only
    assert caps.features == {Feature.TENSOR_CORES, Feature.FP8, Feature.GRAPHS, Feature.DEVICE_EVENTS}
    assert caps.collective_backends == ("nccl", "gloo")
    assert caps.kernel_backends == ("rocblas",)  # no libraries were recorded
    assert caps.uuid == "66333330-6463-3464-3030-646565323262" and caps.pci_bus_id is None
    peaks = caps.declared_peaks
    assert peaks is not None and "MI300X data sheet" in peaks.source
    assert peaks.tflops[DType.BF16] == 1307.4 and peaks.tflops[DType.FP8_E4M3_FNUZ] == 2614.9
    assert DType.FP8_E4M3 not in peaks.tflops and peaks.memory_bandwidth_gbps == 5300


def test_mi250x_gcd_capabilities():
    (caps,) = adapter(load("amd-mi250x")).discover()
    assert (caps.arch, caps.compute_units, caps.simd_width) == ("gfx90a", 110, 64)
    assert caps.memory_bytes == 64 * 2**30 - 16 * 2**20  # one GCD's 64 GB, as ROCm reports it
    assert caps.dtypes == {DType.FP64, DType.FP32, DType.BF16, DType.FP16, DType.INT8}
    assert Feature.TENSOR_CORES in caps.features and Feature.FP8 not in caps.features
    assert caps.shared_memory_per_block_bytes == 65536
    peaks = caps.declared_peaks
    assert peaks is not None and "halved" in peaks.source and peaks.tflops[DType.BF16] == 191.5


def test_rx7900xtx_counts_compute_units_not_work_group_processors():
    (caps,) = adapter(load("amd-rx7900xtx")).discover()
    assert (caps.arch, caps.compute_units, caps.simd_width) == ("gfx1100", 96, 32)
    assert caps.memory_bytes == 24560 * 2**20  # 24 GB
    assert caps.dtypes == {DType.FP64, DType.FP32, DType.BF16, DType.FP16, DType.INT8}
    assert Feature.TENSOR_CORES in caps.features  # WMMA
    assert caps.declared_peaks is None
    assert caps.pci_bus_id == "0000:2d:00.0" and caps.l2_cache_bytes == 6 * 2**20


def test_cu_mode_makes_hip_count_compute_units():
    facts = load("amd-rx7900xtx")
    facts["runtime"]["GPU_ENABLE_WGP_MODE"] = "0"
    facts["devices"][0]["properties"]["multi_processor_count"] = 96  # what HIP reports in CU mode
    (caps,) = adapter(facts).discover()
    assert caps.compute_units == 96


def test_reported_warp_size_wins_over_the_family_default():
    facts = load("amd-mi300x")
    facts["devices"][0]["properties"]["warp_size"] = 32
    (caps,) = adapter(facts).discover()
    assert caps.simd_width == 32


@pytest.mark.parametrize(
    ("arch", "wave", "bf16", "fp8", "tf32", "matrix"),
    [
        ("gfx906", 64, False, set(), False, False),
        ("gfx908", 64, True, set(), False, True),  # MI100: bf16 MFMA (92.3 TFLOP/s)
        ("gfx90a:sramecc+:xnack-", 64, True, set(), False, True),
        ("gfx942:sramecc+:xnack-", 64, True, FNUZ, True, True),
        ("gfx950", 64, True, OCP_FP8, False, True),
        ("gfx1030", 32, False, set(), False, False),
        ("gfx1100", 32, True, set(), False, True),
        ("gfx1201", 32, True, OCP_FP8, False, True),
    ],
)
def test_gfx_target_rules(arch, wave, bf16, fp8, tf32, matrix):
    target = GfxTarget(arch)
    dtypes = target.dtypes()
    assert (64 if not target.rdna else 32) == wave
    assert (DType.BF16 in dtypes, DType.TF32 in dtypes, target.matrix_cores) == (bf16, tf32, matrix)
    assert dtypes & (FNUZ | OCP_FP8) == fp8


def test_unknown_gcn_arch_name_is_refused_with_the_value():
    with pytest.raises(UnsupportedError, match="gcnArchName 'sm_90' is not a gfx target"):
        GfxTarget("sm_90")


def test_datasheet_table_is_declared_and_sourced():
    for name, sku in SKUS.items():
        assert name.startswith("AMD Instinct") and "data sheet" in sku.peaks.source
        assert sku.peaks.memory_bandwidth_gbps and all(v > 0 for v in sku.peaks.tflops.values())
        assert sku.compute_units > 0
    assert {name: sku.compute_units for name, sku in SKUS.items()} == {
        "AMD Instinct MI300X": 304,
        "AMD Instinct MI250X": 110,  # one GCD of the package's 220
        "AMD Instinct MI210": 104,
    }


@pytest.mark.parametrize(
    ("fixture", "partition_cus"),
    [("amd-mi300x", 38), ("amd-mi300x", 76), ("amd-mi300x", 152), ("amd-mi250x", 55)],
)
def test_a_partition_of_a_datasheet_sku_declares_no_peaks(fixture, partition_cus):
    """An MI300X in CPX mode is eight devices of 38 CUs each under the package's name: the
    package's peaks on each declared eight times its throughput."""
    telemetry.configure(log_level="info", log_stream=(stream := io.StringIO()))  # reset after the test
    facts = load(fixture)
    full = facts["devices"][0]["properties"]["multi_processor_count"]
    facts["devices"][0]["properties"]["multi_processor_count"] = partition_cus
    (caps,) = adapter(facts).discover()
    assert caps.compute_units == partition_cus and caps.declared_peaks is None
    said = stream.getvalue()
    assert "no declared peaks" in said and f"compute_units={partition_cus}" in said
    assert f"data_sheet_compute_units={full}" in said


# -- health, memory, topology -------------------------------------------------------------------


def test_health_without_amdsmi_is_unknown_and_says_why():
    report = adapter(load("amd-mi300x")).health(0)
    assert report.status is HealthStatus.UNKNOWN
    assert report.messages == (
        "no health readings: amdsmi facts were not recorded for this fixture",
        "ECC not declared, its state unread: amdsmi unavailable: "
        "amdsmi facts were not recorded for this fixture",
    )


def test_health_ok_from_amdsmi_readings_in_degrees():
    temperature = random.randint(25, 90)
    facts = with_amdsmi(load("amd-mi300x"), temperature=temperature, critical=105, ecc=0)
    report = adapter(facts).health(0)
    assert report.status is HealthStatus.OK and report.temperature_c == temperature and report.ecc_errors == 0


def test_health_reads_millidegrees_as_amdsmi_documents_them():
    milli = random.randint(25_000, 90_000)
    facts = with_amdsmi(load("amd-mi300x"), temperature=milli, critical=105_000, ecc=0)
    assert adapter(facts).health(0).temperature_c == milli / 1000


def test_uncorrectable_ecc_or_critical_temperature_degrade_health():
    errors = random.randint(1, 1000)
    facts = with_amdsmi(load("amd-mi300x"), temperature=50, critical=105, ecc=errors)
    report = adapter(facts).health(0)
    assert report.status is HealthStatus.DEGRADED and report.messages == (
        f"{errors} uncorrectable ECC error(s)",
    )
    hot = with_amdsmi(load("amd-mi300x"), temperature=105 + random.randint(0, 5), critical=105, ecc=0)
    report = adapter(hot).health(0)
    assert report.status is HealthStatus.DEGRADED
    assert "at or above the critical temperature 105 C" in report.messages[0]


def test_amdsmi_identity_replaces_torch_facts():
    facts = with_amdsmi(load("amd-rx7900xtx"), temperature=40, critical=100, ecc=0)
    (caps,) = adapter(facts).discover()
    assert (caps.uuid, caps.pci_bus_id, caps.driver_version) == ("test-uuid", "0000:0c:00.0", "test-driver")


def test_memory_info_translates_the_runtime_figures():
    facts = load("amd-mi250x")
    total = facts["devices"][0]["properties"]["total_memory"]
    free, allocated = random.randint(0, total), random.randint(0, 2**34)
    facts["devices"][0]["memory"] = {"free": free, "total": total, "allocated": allocated}
    info = adapter(facts).memory_info(0)
    assert (info.total_bytes, info.free_bytes, info.used_bytes) == (total, free, allocated)


def test_unrecorded_memory_is_refused_not_invented():
    with pytest.raises(UnsupportedError, match="memory of device 0 was not recorded"):
        adapter(load("amd-mi300x")).memory_info(0)


def test_topology_without_amdsmi_lists_devices_and_counts_it():
    before = count("torchhal.topology.fallbacks,adapter=amd,source=none")
    topo = adapter(load("amd-mi300x")).topology()
    assert topo.devices == ("cuda:0",) and topo.links == ()
    assert count("torchhal.topology.fallbacks,adapter=amd,source=none") == before + 1


def eight_mi300x(links: dict[tuple[int, int], dict]) -> dict:
    """Eight MI300X devices with amdsmi link facts: test inputs in amdsmi_topo_get_link_type /
    get_minmax_bandwidth shapes; pairs not given are XGMI."""
    facts = load("amd-mi300x")
    facts["devices"] = [copy.deepcopy(facts["devices"][0]) for _ in range(8)]
    facts["amdsmi"] = {"available": True, "reason": "amdsmi initialised"}
    xgmi = {"type_name": "AMDSMI_LINK_TYPE_XGMI", "hops": 1, "weight": 15, "max_bandwidth_mb_s": 64_000}
    for i, device in enumerate(facts["devices"]):
        device["amdsmi_links"] = {str(j): links.get((i, j), xgmi) for j in range(8) if j != i}
    return facts


def test_xgmi_links_from_amdsmi():
    bandwidth = random.choice([48_000, 64_000, 100_000])
    xgmi = {"type_name": "XGMI", "hops": 1, "weight": 15, "max_bandwidth_mb_s": bandwidth}
    facts = eight_mi300x({(2, 5): xgmi, (5, 2): xgmi})
    topo = adapter(facts).topology()
    assert len(topo.links) == 28 and all(
        lk.type is LinkType.XGMI and lk.source == "amdsmi" for lk in topo.links
    )
    assert topo.link("cuda:5", "cuda:2").bandwidth_gbps == bandwidth / 1000
    assert topo.islands() == [tuple(f"cuda:{i}" for i in range(8))]


def test_pcie_links_and_disagreeing_directions():
    pcie = {"type_name": "PCIEXPRESS", "hops": 2, "weight": 40, "max_bandwidth_mb_s": 0}
    remote = {"type_name": "AMDSMI_LINK_TYPE_PCIE", "hops": 3, "weight": 72, "max_bandwidth_mb_s": 0}
    facts = eight_mi300x({(0, 1): pcie, (1, 0): pcie, (0, 7): remote, (7, 0): remote, (3, 4): pcie})
    topo = adapter(facts).topology()
    assert (topo.link("cuda:0", "cuda:1").type, topo.link("cuda:0", "cuda:1").bandwidth_gbps) == (
        LinkType.PCIE,
        None,
    )
    assert topo.link("cuda:7", "cuda:0").type is LinkType.HOST  # three hops: across CPU sockets
    assert topo.link("cuda:3", "cuda:4").type is LinkType.PCIE  # XGMI one way, PCIe back: the slower


def test_unknown_link_type_leaves_the_pair_unlinked_and_counts_it():
    odd = {"type_name": "AMDSMI_LINK_TYPE_UNKNOWN", "hops": 0, "weight": 0, "max_bandwidth_mb_s": 0}
    before = count("torchhal.topology.unknown_codes,adapter=amd,code=AMDSMI_LINK_TYPE_UNKNOWN")
    topo = adapter(eight_mi300x({(0, 6): odd, (6, 0): odd})).topology()
    assert topo.link("cuda:0", "cuda:6") is None and len(topo.links) == 27
    assert count("torchhal.topology.unknown_codes,adapter=amd,code=AMDSMI_LINK_TYPE_UNKNOWN") == before + 1


def test_recorded_probe_refuses_device_actions():
    amd = adapter(load("amd-mi250x"))
    with pytest.raises(UnsupportedError, match="cannot synchronize"):
        amd.synchronize(0)
    with pytest.raises(UnsupportedError, match="records no events"):
        amd.timer(0).mark()


# -- the HAL, and the recording round trip --------------------------------------------------------


def test_hal_built_with_recorded_adapter_lists_cuda_devices():
    hal = HardwareAbstractionLayer(adapters=[adapter(load("amd-mi300x"))], settings=NO_AUTOLOAD)
    assert [d.id for d in hal.devices()] == ["cuda:0", "cpu"]
    device = hal.device("cuda:0")
    assert device.capabilities.arch == "gfx942"
    assert device.capabilities.supports_dtype(torch.float8_e4m3fnuz)
    assert not device.capabilities.supports_dtype(torch.float8_e4m3fn)


def test_record_and_replay_agree_on_every_fact():
    """A complete set of facts (the MI300X recording plus test-written memory, amdsmi and link
    readings) comes back unchanged through RecordedRocmProbe and record()."""
    facts = with_amdsmi(eight_mi300x({}), temperature=41, critical=105, ecc=0)
    facts["libraries"] = {"miopen": 30200, "triton": True}
    facts["peer_access"] = [[i, j] for i in range(8) for j in range(8) if i != j]
    for device in facts["devices"]:
        device["memory"] = {"free": random.randint(0, 2**37), "total": 196592 * 2**20, "allocated": 0}
    assert record(RecordedRocmProbe(facts), facts["source"]) == facts
