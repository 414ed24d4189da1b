"""The NVIDIA adapter on recorded H100, H200 (2-GPU, NVLink) and A100 facts, the nvidia-smi
capture, and the live runtime (absent on this CPU build; present on the GPU machine)."""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.datasheets import SKUS, sku_for
from torchhal_nvidia.probe import CudaProbe, record
from torchhal_nvidia.recorded import RecordedCudaProbe
from torchhal_nvidia.topology import links_from_smi, parse_topo_matrix

from tests.plugins.facts import SMI_CAPTURE, count, load
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal.hal_core import DType, Feature, HealthStatus, LinkType, UnsupportedError
from torchhal.hal_core.settings import Settings

HOPPER_DTYPES = {
    DType.FP64,
    DType.FP32,
    DType.TF32,
    DType.BF16,
    DType.FP16,
    DType.FP8_E4M3,
    DType.FP8_E5M2,
    DType.INT8,
}
NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


def adapter(facts: dict) -> NvidiaAdapter:
    return NvidiaAdapter(probe=RecordedCudaProbe(facts))


# -- absence, and builds that are not this adapter's ------------------------------------------


@pytest.mark.skipif(
    torch.version.cuda is not None, reason="this torch is a CUDA build; absence needs a CPU build"
)
def test_live_probe_reports_a_cpu_build_of_torch():
    result = NvidiaAdapter().probe()
    assert not result.available
    assert result.reason == f"torch {torch.__version__} was built without CUDA"


@pytest.mark.skipif(
    torch.version.cuda is not None, reason="this torch is a CUDA build; absence needs a CPU build"
)
def test_live_hal_lists_no_cuda_device_and_says_why():
    hal = HardwareAbstractionLayer(adapters=[NvidiaAdapter()], settings=NO_AUTOLOAD)
    assert [d.id for d in hal.devices()] == ["cpu"]
    (diag,) = [d for d in hal.diagnostics if d.name == "nvidia" and d.stage == "probe"]
    assert diag.status.value == "absent" and "built without CUDA" in diag.reason


def test_declines_a_rocm_build():
    result = NvidiaAdapter(probe=RecordedCudaProbe(load("amd-mi300x"))).probe()
    assert not result.available
    assert result.reason.startswith("torch.version.hip is set (6.2.41133-dd7f95766): this is a ROCm build")
    assert "amd adapter" in result.reason


def test_cuda_build_without_a_gpu_says_what_to_check():
    facts = load("nvidia-h100-sxm")
    facts["available"] = False
    result = adapter(facts).probe()
    assert not result.available and result.runtime_version == "13.0"
    assert "torch.cuda.is_available() is False" in result.reason and "nvidia-smi" in result.reason


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="pynvml is installed here")
def test_live_probe_says_how_to_get_nvml():
    assert CudaProbe().nvml() == {
        "available": False,
        "reason": "pynvml is not installed (pip install 'torchhal-nvidia[nvml]')",
    }


# -- capabilities, checked against the real devices' known facts --------------------------------


def test_h100_sxm_capabilities():
    (caps,) = adapter(load("nvidia-h100-sxm")).discover()
    assert (caps.name, caps.arch, caps.compute_units, caps.simd_width) == (
        "NVIDIA H100 80GB HBM3",
        "sm_90",
        132,
        32,
    )
    assert caps.device_type == "cuda" and caps.vendor == "nvidia"
    assert 79 * 2**30 < caps.memory_bytes < 80 * 2**30  # 80 GB of HBM3, as the driver reports it
    assert caps.dtypes == HOPPER_DTYPES
    assert caps.features == {
        Feature.TENSOR_CORES,
        Feature.FP8,
        Feature.GRAPHS,
        Feature.DEVICE_EVENTS,
        Feature.TRITON,
        Feature.ECC,
    }
    assert caps.collective_backends == ("nccl", "gloo")
    # cuDNN 9.19 was recorded; whether the build had FlashAttention was not (no flash-attention)
    assert caps.kernel_backends == ("cublas", "cudnn", "triton", "cudnn-attention")
    assert caps.shared_memory_per_block_bytes == 227 * 1024  # the opt-in maximum on sm_90
    assert caps.l2_cache_bytes == 50 * 2**20
    assert caps.uuid == "GPU-81c4e271-5333-6e61-4c4b-e3fd481427dc"
    assert caps.pci_bus_id == "00000000:00:06.0" and caps.driver_version == "580.159.04"


@pytest.mark.parametrize(
    ("major", "libraries", "expected"),
    [
        (9, {"cudnn": 91002, "flash_attention": True}, ("flash-attention", "cudnn-attention")),
        (8, {"cudnn": 90100, "flash_attention": False}, ("cudnn-attention",)),
        (8, {"cudnn": 8902, "flash_attention": True}, ("flash-attention",)),  # cuDNN 8: no fused attention
        (7, {"cudnn": 91002, "flash_attention": True}, ()),  # Volta: neither SDPA kernel
    ],
)
def test_sdpa_attention_backends_follow_architecture_build_and_cudnn(major, libraries, expected):
    facts = load("nvidia-h100-sxm")
    facts["libraries"] = {"triton": False, **libraries}
    facts["devices"][0]["properties"]["major"] = major
    (caps,) = adapter(facts).discover()
    assert caps.kernel_backends == ("cublas", "cudnn", *expected)


def test_the_adapter_registers_sdpa_candidates_that_only_its_devices_accept():
    facts = load("nvidia-h100-sxm")
    facts["libraries"] = {"cudnn": 91002, "triton": False, "flash_attention": True}
    hal = HardwareAbstractionLayer(adapters=[adapter(facts)], settings=NO_AUTOLOAD)
    q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
    out, lse = torch.randn_like(q), torch.randn(1, 2, 16)
    for op, args in (
        ("attention", (q, q, q)),
        ("attention_forward", (q, q, q)),
        ("attention_backward", (out, q, q, q, out, lse)),
    ):
        names = {c.qualified_name for c in hal.kernels.candidates(op)}
        assert {"nvidia/sdpa_flash", "nvidia/sdpa_cudnn"} <= names, op
        rejected = {r.candidate: r for r in hal.kernels.select(op, hal.device("cpu"), *args).rejected}
        assert "does not list kernel backend 'flash-attention'" in rejected["nvidia/sdpa_flash"].detail
        assert "does not list kernel backend 'cudnn-attention'" in rejected["nvidia/sdpa_cudnn"].detail


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_training_pair_binds_to_this_torchs_private_aten_schemas(backend, causal):
    """The training pair calls ATen's private ops behind SDPA by position, and their schemas are
    not a public API. On meta tensors the calls run through this torch's schema and meta
    functions, so a release that moves an argument fails here, on the CPU, not on the GPU."""
    from torchhal_nvidia import sdpa

    forward = getattr(sdpa, f"sdpa_{backend}_forward")
    backward = getattr(sdpa, f"sdpa_{backend}_backward")
    seq_k = 16 if causal else 24
    q = torch.empty(2, 4, 16, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 2, seq_k, 64, dtype=torch.bfloat16, device="meta")  # GQA: two q heads a kv head
    out, lse = forward(q, k, k, causal=causal, scale=0.1)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (q.shape, q.dtype, (2, 4, 16), torch.float32)
    dq, dk, dv = backward(torch.empty_like(out), q, k, k, out, lse, causal=causal, scale=0.1)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, k.shape)
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype


def test_h100_declared_peaks_are_the_sxm_datasheet_dense_figures():
    (caps,) = adapter(load("nvidia-h100-sxm")).discover()
    peaks = caps.declared_peaks
    assert peaks is not None and "datasheet" in peaks.source and "H100 SXM" in peaks.source
    assert peaks.tflops[DType.BF16] == 989.5 and peaks.tflops[DType.FP8_E4M3] == 1979
    assert peaks.memory_bandwidth_gbps == 3350


def test_h200_pair_capabilities():
    devices = adapter(load("nvidia-h200x2")).discover()
    assert [d.index for d in devices] == [0, 1]
    for caps in devices:
        assert (caps.name, caps.arch, caps.compute_units) == ("NVIDIA H200", "sm_90", 132)
        assert 139 * 2**30 < caps.memory_bytes < 141 * 2**30  # 141 GB of HBM3e
        assert caps.dtypes == HOPPER_DTYPES
        assert Feature.P2P in caps.features and Feature.ECC in caps.features
        assert caps.declared_peaks is not None and caps.declared_peaks.memory_bandwidth_gbps == 4800
        assert caps.l2_cache_bytes == 60 * 2**20
    assert [d.pci_bus_id for d in devices] == ["00000000:00:06.0", "00000000:00:07.0"]


def test_a100_without_nvml_reports_only_what_was_recorded():
    devices = adapter(load("nvidia-a100-sxm4-80gb")).discover()
    assert len(devices) == 4
    caps = devices[0]
    assert (caps.arch, caps.compute_units, caps.simd_width) == ("sm_80", 108, 32)
    assert caps.dtypes == {
        DType.FP64,
        DType.FP32,
        DType.TF32,
        DType.BF16,
        DType.FP16,
        DType.INT8,
    }  # no fp8 before sm_89
    assert caps.features == {Feature.TENSOR_CORES, Feature.GRAPHS, Feature.DEVICE_EVENTS, Feature.P2P}
    assert caps.kernel_backends == ("cublas",)
    assert caps.shared_memory_per_block_bytes == 49152  # no opt-in figure was recorded: the default limit
    assert caps.uuid is None and caps.driver_version is None
    assert [d.pci_bus_id for d in devices] == [
        "00000000:68:00.0",
        "00000000:9E:00.0",
        "00000000:C2:00.0",
        "00000000:D4:00.0",
    ]
    assert caps.declared_peaks is not None and caps.declared_peaks.memory_bandwidth_gbps == 2039


@pytest.mark.parametrize(
    ("major", "minor", "fp8", "bf16", "tensor_cores"),
    [
        (7, 0, False, False, True),
        (7, 5, False, False, True),
        (8, 6, False, True, True),
        (8, 9, True, True, True),
        (6, 1, False, False, False),
        (10, 0, True, True, True),
    ],
)
def test_dtype_and_feature_rules_follow_compute_capability(major, minor, fp8, bf16, tensor_cores):
    facts = load("nvidia-h100-sxm")
    facts["devices"][0]["properties"].update(major=major, minor=minor)
    (caps,) = adapter(facts).discover()
    assert caps.arch == f"sm_{major}{minor}"
    assert (DType.FP8_E4M3 in caps.dtypes, DType.FP8_E5M2 in caps.dtypes, Feature.FP8 in caps.features) == (
        fp8,
    ) * 3
    assert (DType.BF16 in caps.dtypes, DType.TF32 in caps.dtypes) == (bf16, bf16)
    assert (Feature.TENSOR_CORES in caps.features) is tensor_cores
    assert not caps.dtypes & {DType.FP8_E4M3_FNUZ, DType.FP8_E5M2_FNUZ}  # fnuz is AMD's encoding


@pytest.mark.parametrize(
    ("name", "tensor_cores"),
    [
        ("NVIDIA GeForce GTX 1660 SUPER", False),  # TU116
        ("NVIDIA GeForce GTX 1650", False),  # TU117
        ("NVIDIA GeForce GTX 1630", False),  # TU117
        ("NVIDIA T400 4GB", False),  # TU117, the workstation and mobile parts outside GTX 16
        ("NVIDIA T500", False),
        ("NVIDIA T550 Laptop GPU", False),
        ("NVIDIA T600", False),
        ("NVIDIA T1000 8GB", False),
        ("NVIDIA T1200 Laptop GPU", False),
        ("Quadro T1000", False),
        ("Quadro T2000", False),
        ("NVIDIA GeForce MX450", False),
        ("NVIDIA GeForce MX550", False),
        ("NVIDIA GeForce RTX 2080 Ti", True),  # TU102: sm_75 with tensor cores
        ("Tesla T4", True),  # TU104
        ("Quadro RTX 4000", True),  # TU104
        ("NVIDIA TITAN RTX", True),  # TU102
    ],
)
def test_turing_tu116_and_tu117_parts_have_no_tensor_cores(name, tensor_cores):
    facts = load("nvidia-h100-sxm")
    facts["devices"][0]["properties"].update(name=name, major=7, minor=5)
    (caps,) = adapter(facts).discover()
    assert caps.arch == "sm_75" and (Feature.TENSOR_CORES in caps.features) is tensor_cores


def test_unknown_sku_gets_no_declared_peaks():
    facts = load("nvidia-h100-sxm")
    facts["devices"][0]["properties"]["name"] = "NVIDIA GeForce RTX 4090"
    (caps,) = adapter(facts).discover()
    assert caps.declared_peaks is None


def test_datasheet_table_is_declared_and_sourced():
    for sku in SKUS:
        assert "datasheet" in sku.peaks.source
        assert sku.peaks.memory_bandwidth_gbps and all(v > 0 for v in sku.peaks.tflops.values())
        assert sku.peaks.tflops[DType.BF16] == sku.peaks.tflops[DType.FP16]
    assert sku_for("NVIDIA H200").nvlink_per_link_gbps() == 25.0  # 900 GB/s over 18 links, both directions
    assert sku_for("NVIDIA B200").nvlink_per_link_gbps() == 50.0
    assert sku_for("NVIDIA L4").nvlink_per_link_gbps() is None


# -- health, memory, timers ---------------------------------------------------------------------


def test_h100_health_from_nvml_is_ok():
    report = adapter(load("nvidia-h100-sxm")).health(0)
    assert report.status is HealthStatus.OK
    assert (report.temperature_c, report.ecc_errors, report.utilization_pct) == (39, 0, 0)
    assert "slowdown threshold 89 C" in report.messages[0]


def test_uncorrected_ecc_errors_degrade_health():
    facts = load("nvidia-h200x2")
    errors = random.randint(1, 10_000)
    facts["devices"][1]["nvml_health"]["ecc_uncorrected_volatile"] = errors
    probe = adapter(facts)
    report = probe.health(1)
    assert report.status is HealthStatus.DEGRADED and report.ecc_errors == errors
    assert report.messages == (f"{errors} uncorrected ECC error(s)",)
    assert probe.health(0).status is HealthStatus.OK


def test_temperature_at_the_slowdown_threshold_degrades_health():
    facts = load("nvidia-h200x2")
    slowdown = facts["devices"][0]["nvml"]["slowdown_temperature_c"]
    hot = slowdown + random.randint(0, 10)
    facts["devices"][0]["nvml_health"]["temperature_c"] = hot
    report = adapter(facts).health(0)
    assert report.status is HealthStatus.DEGRADED and report.temperature_c == hot
    assert f"temperature {hot} C is at or above the slowdown threshold {slowdown} C" in report.messages


def test_health_without_nvml_is_unknown_and_says_why():
    report = adapter(load("nvidia-a100-sxm4-80gb")).health(2)
    assert report.status is HealthStatus.UNKNOWN
    assert report.messages == (
        "no health readings: NVML facts were not recorded for this fixture",
        "ECC not declared, its mode unread: NVML unavailable: NVML facts were not recorded for this fixture",
    )


def test_memory_info_is_what_the_runtime_reported():
    facts = load("nvidia-h200x2")
    info = adapter(facts).memory_info(1)
    recorded = facts["devices"][1]["memory"]
    assert (info.total_bytes, info.free_bytes, info.used_bytes) == (recorded["total"], recorded["free"], 0)
    assert info.total_bytes == facts["devices"][1]["properties"]["total_memory"]


def test_unrecorded_memory_is_refused_not_invented():
    with pytest.raises(UnsupportedError, match="memory of device 0 was not recorded"):
        adapter(load("nvidia-a100-sxm4-80gb")).memory_info(0)


def test_recorded_probe_refuses_device_actions():
    nvidia = adapter(load("nvidia-h100-sxm"))
    with pytest.raises(UnsupportedError, match="cannot synchronize"):
        nvidia.synchronize(0)
    with pytest.raises(UnsupportedError, match="records no events"):
        nvidia.timer(0).mark()


# -- topology -----------------------------------------------------------------------------------


def test_h200_topology_from_nvml_nvswitch_links():
    topo = adapter(load("nvidia-h200x2")).topology()
    assert topo.devices == ("cuda:0", "cuda:1")
    (link,) = topo.links
    assert (link.type, link.count, link.source) == (LinkType.NVLINK, 18, "nvml")
    assert link.bandwidth_gbps == 18 * 25.0  # NV18 at the H200 datasheet's 900 GB/s over 18 links
    assert topo.link("cuda:1", "cuda:0") == topo.link("cuda:0", "cuda:1") == link
    assert topo.islands() == [("cuda:0", "cuda:1")]


def test_nvml_switch_links_need_nvlink_p2p():
    facts = load("nvidia-h200x2")
    facts["devices"][0]["nvml"]["p2p_status_nvlink"]["1"] = 5  # NVML_P2P_STATUS_NOT_SUPPORTED
    (link,) = adapter(facts).topology().links
    assert link.type is LinkType.PCIE and link.count is None  # common ancestor 30: a host bridge


def test_direct_gpu_nvlinks_are_counted_per_peer():
    facts = load("nvidia-h200x2")
    links = random.randint(1, 18)
    for me, peer in ((0, 1), (1, 0)):
        nvml = facts["devices"][me]["nvml"]
        peer_bus = facts["devices"][peer]["nvml"]["pci_bus_id"]
        for i, link in enumerate(nvml["nvlinks"]):
            link.update(remote_device_type="gpu", remote_pci_bus_id=peer_bus, active=i < links)
    (link,) = adapter(facts).topology().links
    assert (link.type, link.count, link.bandwidth_gbps) == (LinkType.NVLINK, links, links * 25.0)


def test_nvidia_smi_capture_is_parsed_through_its_escape_codes():
    text = SMI_CAPTURE.read_text()
    assert "\x1b[4m" in text  # the capture keeps the terminal's underline codes
    assert parse_topo_matrix(text) == {(0, 1): "NV18", (1, 0): "NV18"}  # the P2P matrix below is not read


def test_nvidia_smi_capture_with_tabs_turned_to_spaces_parses_the_same():
    """A capture pasted from a terminal or a ticket has spaces where the tool printed tabs."""
    text = SMI_CAPTURE.read_text().expandtabs(8)
    assert "\t" not in text
    assert parse_topo_matrix(text) == {(0, 1): "NV18", (1, 0): "NV18"}


def test_topology_falls_back_to_nvidia_smi_without_nvml():
    facts = load("nvidia-h200x2")
    facts["nvml"] = {"available": False, "reason": "pynvml is not installed"}
    for device in facts["devices"]:
        device["nvml"] = device["nvml_health"] = None
    facts["nvidia_smi"]["topo"] = SMI_CAPTURE.read_text()
    before = count("torchhal.topology.fallbacks,adapter=nvidia,source=nvidia-smi")
    topo = adapter(facts).topology()
    (link,) = topo.links
    assert (link.a, link.b, link.type, link.count, link.source) == (
        "cuda:0",
        "cuda:1",
        LinkType.NVLINK,
        18,
        "nvidia-smi",
    )
    assert link.bandwidth_gbps == 450.0
    assert count("torchhal.topology.fallbacks,adapter=nvidia,source=nvidia-smi") == before + 1


def test_smi_links_map_nvidia_smi_indices_onto_torch_indices():
    """A 4-GPU matrix typed in nvidia-smi's layout; torch sees only GPUs 1 and 3, as cuda:0 and cuda:1."""
    text = (
        "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\x1b[0m\n"
        "GPU0\t X \tPIX\tNODE\tSYS\t0-7\n"
        "GPU1\tPIX\t X \tNV4\tSYS\t0-7\n"
        "GPU2\tNODE\tNV4\t X \tPHB\t0-7\n"
        "GPU3\tSYS\tSYS\tPHB\t X \t8-15\n\nLegend:\n"
    )
    cells = parse_topo_matrix(text)
    assert len(cells) == 12 and cells[(1, 2)] == cells[(2, 1)] == "NV4"
    everyone = links_from_smi(cells, {0: 0, 1: 1, 2: 2, 3: 3}, lambda i: f"cuda:{i}", None)
    kinds = {(lk.a, lk.b): (lk.type, lk.count) for lk in everyone}
    assert kinds == {
        ("cuda:0", "cuda:1"): (LinkType.PCIE, None),
        ("cuda:0", "cuda:2"): (LinkType.PCIE, None),
        ("cuda:0", "cuda:3"): (LinkType.HOST, None),
        ("cuda:1", "cuda:2"): (LinkType.NVLINK, 4),
        ("cuda:1", "cuda:3"): (LinkType.HOST, None),
        ("cuda:2", "cuda:3"): (LinkType.PCIE, None),
    }
    (seen,) = links_from_smi(cells, {1: 0, 3: 1}, lambda i: f"cuda:{i}", None)
    assert (seen.a, seen.b, seen.type) == ("cuda:0", "cuda:1", LinkType.HOST)


def test_asymmetric_smi_matrix_keeps_the_weaker_entry():
    text = "\tGPU0\tGPU1\nGPU0\t X \tNV12\nGPU1\tPHB\t X \n"
    (link,) = links_from_smi(parse_topo_matrix(text), {0: 0, 1: 1}, lambda i: f"cuda:{i}", 25.0)
    assert link.type is LinkType.PCIE


def test_topology_without_nvml_or_nvidia_smi_lists_devices_and_counts_it():
    before = count("torchhal.topology.fallbacks,adapter=nvidia,source=none")
    topo = adapter(load("nvidia-a100-sxm4-80gb")).topology()
    assert topo.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3") and topo.links == ()
    assert count("torchhal.topology.fallbacks,adapter=nvidia,source=none") == before + 1


# -- the HAL, and the recording round trip --------------------------------------------------------


def test_hal_built_with_recorded_adapter_lists_cuda_devices():
    hal = HardwareAbstractionLayer(adapters=[adapter(load("nvidia-h200x2"))], settings=NO_AUTOLOAD)
    assert [d.id for d in hal.devices()] == ["cuda:0", "cuda:1", "cpu"]
    assert hal.device("cuda:1").capabilities.pci_bus_id == "00000000:00:07.0"
    assert hal.best_device(DeviceRequirements(dtypes=frozenset({DType.FP8_E4M3}))).id == "cuda:0"
    assert hal.topology().link("cuda:0", "cuda:1").count == 18
    assert hal.report()["devices"][0]["declared_peaks"]["source"].startswith("NVIDIA H200")


@pytest.mark.parametrize("name", ["nvidia-h100-sxm", "nvidia-h200x2"])
def test_live_recordings_replay_exactly(name):
    facts = load(name)
    assert record(RecordedCudaProbe(facts), facts["source"]) == facts


# -- on a GPU (the device machine) ---------------------------------------------------------------

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.version.hip is not None,
    reason="needs an NVIDIA GPU and a CUDA build",
)


@pytest.mark.gpu
@needs_cuda
def test_live_adapter_matches_torch():
    nvidia = NvidiaAdapter()
    assert nvidia.probe().available
    devices = nvidia.discover()
    assert len(devices) == torch.cuda.device_count()
    for caps in devices:
        props = torch.cuda.get_device_properties(caps.index)
        assert caps.name == props.name and caps.compute_units == props.multi_processor_count
        assert caps.arch == f"sm_{props.major}{props.minor}" and caps.memory_bytes == props.total_memory
        free, total = torch.cuda.mem_get_info(caps.index)
        info = nvidia.memory_info(caps.index)
        assert info.total_bytes == total and abs(info.free_bytes - free) < 2**30
        assert nvidia.health(caps.index).status in (
            HealthStatus.OK,
            HealthStatus.DEGRADED,
            HealthStatus.UNKNOWN,
        )


@pytest.mark.gpu
@needs_cuda
def test_live_event_timer_times_device_work():
    nvidia = NvidiaAdapter()
    a = torch.randn(4096, 4096, device="cuda:0")
    timer = nvidia.timer(0)
    start = timer.mark()
    for _ in range(10):
        a = a @ a.T / 4096
    end = timer.mark()
    nvidia.synchronize(0)
    elapsed = timer.elapsed_ms(start, end)
    assert 0 < elapsed < 10_000
    assert torch.isfinite(a).all()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two NVIDIA GPUs"
)
def test_live_topology_agrees_with_nvidia_smi():
    nvidia = NvidiaAdapter()
    from_nvml = nvidia.topology()
    smi = NvidiaAdapter(probe=_without_nvml(CudaProbe())).topology()
    assert from_nvml.devices == smi.devices
    for link in smi.links:
        other = from_nvml.link(link.a, link.b)
        assert other is not None and (other.type, other.count) == (link.type, link.count)


def _without_nvml(probe: CudaProbe) -> CudaProbe:
    probe.nvml = lambda: {"available": False, "reason": "switched off by the test"}  # type: ignore[method-assign]
    probe.nvml_device = lambda index: None  # type: ignore[method-assign]
    return probe
