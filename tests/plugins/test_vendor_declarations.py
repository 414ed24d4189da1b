"""What the vendor adapters declare from what they read, and what they say where a reading is
missing: amdsmi that fails to load or lacks a name, NVML links and ECC modes left unread, the
device names ROCm reports, AMD's and Intel's ECC and tf32, Intel's unknown links, and errors
for facts a recording lacks.

torch facts come from the recordings in tests/fixtures/probes; amdsmi is a stand-in module
written for the tests (amdsmi's function names and return shapes), and NVML facts are the
recorded H200 pair's with single fields changed, each test saying which."""

from __future__ import annotations

import enum
import sys
import types
from typing import Any

import pytest
from torchhal_amd.adapter import AmdAdapter
from torchhal_amd.datasheets import SKUS as AMD_SKUS
from torchhal_amd.datasheets import sku_for as amd_sku_for
from torchhal_amd.probe import RocmProbe
from torchhal_amd.recorded import RecordedRocmProbe
from torchhal_intel.adapter import IntelAdapter
from torchhal_intel.recorded import RecordedXpuProbe
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe
from torchhal_nvidia.topology import bus_id

from tests.plugins.facts import count, load
from tests.plugins.test_amd import with_amdsmi
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal.hal_core import DType, Feature, InvalidArgumentError, LinkType, UnsupportedError
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
ECC = DeviceRequirements(features=frozenset({Feature.ECC}))


# -- amdsmi that fails to load, or lacks names an older release did not have ---------------------


class ReplayedTorchRocmProbe(RocmProbe):
    """The live probe's amdsmi code; torch.cuda answers from the MI300X recording, at a PCI address."""

    def __init__(self) -> None:
        super().__init__()
        self.facts = load("amd-mi300x")
        self.facts["devices"][0]["properties"].update(pci_domain_id=0, pci_bus_id=0x0C, pci_device_id=0)

    def runtime(self) -> dict[str, Any]:
        return self.facts["runtime"]

    def available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def properties(self, index: int) -> dict[str, Any]:
        return self.facts["devices"][index]["properties"]

    def libraries(self) -> dict[str, Any]:
        return {"miopen": None, "triton": False}

    def can_access_peer(self, index: int, peer: int) -> bool:
        return False


class AmdSmiException(Exception):
    pass


def fake_amdsmi(*, sensor: str = "HOTSPOT", lacking: tuple[str, ...] = ()) -> types.ModuleType:
    """amdsmi answering for one MI300X at 0000:0c:00.0: hotspot 45 C of a critical 105 C, ECC on in
    UMC, SDMA and GFX. `sensor` names the temperature enum's hotspot member (older releases call it
    JUNCTION); `lacking` are functions this release does not have."""
    smi = types.ModuleType("amdsmi")
    smi.AmdSmiException = AmdSmiException
    smi.AmdSmiTemperatureType = enum.IntEnum("AmdSmiTemperatureType", {"EDGE": 0, sensor: 1})
    smi.AmdSmiTemperatureMetric = enum.IntEnum("AmdSmiTemperatureMetric", {"CURRENT": 0, "CRITICAL": 5})
    temperatures = {(1, 0): 45, (1, 5): 105}
    functions = {
        "amdsmi_init": lambda: None,
        "amdsmi_get_processor_handle_from_bdf": lambda bdf: "gpu0" if bdf == "0000:0c:00.0" else None,
        "amdsmi_get_gpu_device_uuid": lambda h: "amdsmi-uuid",
        "amdsmi_get_gpu_device_bdf": lambda h: "0000:0c:00.0",
        "amdsmi_get_gpu_driver_info": lambda h: {"driver_version": "6.8.5"},
        "amdsmi_get_temp_metric": lambda h, s, m: temperatures[(int(s), int(m))],
        "amdsmi_get_gpu_ecc_enabled": lambda h: 0b111,
        "amdsmi_get_gpu_total_ecc_count": lambda h: {"uncorrectable_count": 0, "correctable_count": 0},
        "amdsmi_get_gpu_activity": lambda h: {"gfx_activity": 3},
    }
    for name, fn in functions.items():
        if name not in lacking:
            setattr(smi, name, fn)
    return smi


def amdsmi_package(tmp_path: Any, body: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An importable `amdsmi` package whose __init__ runs `body`, first on sys.path."""
    (tmp_path / "amdsmi").mkdir()
    (tmp_path / "amdsmi" / "__init__.py").write_text(body)
    monkeypatch.delitem(sys.modules, "amdsmi", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.parametrize(
    ("body", "raised"),
    [
        # the generated wrapper binding a function of a libamd_smi.so it could not load
        ("_libraries = {}\namdsmi_init = _libraries['libamd_smi.so'].amdsmi_init\n", "KeyError"),
        ("raise OSError('libamd_smi.so: cannot open shared object file')\n", "OSError"),  # unguarded CDLL
        (
            "raise AttributeError('libamd_smi.so: undefined symbol: amdsmi_get_gpu_cper_entries')\n",
            "AttributeError",
        ),
        ("from .amdsmi_interface import *\n", "ModuleNotFoundError"),  # a broken installation
        ("def amdsmi_init():\n    raise RuntimeError('driver not loaded')\n", "RuntimeError"),
    ],
    ids=["KeyError", "OSError", "AttributeError", "broken-package", "init-raises"],
)
def test_an_amdsmi_that_fails_to_load_keeps_the_devices_and_says_why(
    body, raised, tmp_path, monkeypatch, capsys
):
    amdsmi_package(tmp_path, body, monkeypatch)
    before = count("torchhal.amdsmi.unavailable,adapter=amd")
    adapter = AmdAdapter(ReplayedTorchRocmProbe())
    hal = HardwareAbstractionLayer(adapters=[adapter], settings=NO_AUTOLOAD)
    assert [d.id for d in hal.devices()] == ["cuda:0", "cpu"]
    reason = adapter.runtime_probe.amdsmi()["reason"]
    assert not adapter.runtime_probe.amdsmi()["available"]
    assert reason.startswith(("amdsmi failed to load: ", "amdsmi did not initialise: ")) and raised in reason
    assert count("torchhal.amdsmi.unavailable,adapter=amd") == before + 1
    assert "amdsmi unavailable" in capsys.readouterr().err
    assert adapter.health(0).status.value == "unknown"


def test_an_amdsmi_not_installed_is_said_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", None)  # import amdsmi raises ModuleNotFoundError
    assert RocmProbe().amdsmi()["reason"].startswith("amdsmi is not installed (pip install")


def test_an_amdsmi_release_that_names_the_hotspot_junction_reads_the_same_sensor(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(sensor="JUNCTION"))
    adapter = AmdAdapter(ReplayedTorchRocmProbe())
    (caps,) = adapter.discover()
    assert (caps.uuid, caps.driver_version) == ("amdsmi-uuid", "6.8.5")
    report = adapter.health(0)
    assert report.status.value == "ok" and report.temperature_c == 45
    assert "below the critical temperature 105 C" in report.messages[0]


@pytest.mark.parametrize(
    "missing",
    ["amdsmi_get_processor_handle_from_bdf", "amdsmi_get_temp_metric", "amdsmi_get_gpu_ecc_enabled"],
)
def test_an_amdsmi_release_without_a_function_leaves_its_readings_unread_and_says_so(
    missing, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi(lacking=(missing,)))
    before = count(f"torchhal.amdsmi.missing_api,adapter=amd,missing={missing}")
    adapter = AmdAdapter(ReplayedTorchRocmProbe())
    (caps,) = adapter.discover()
    adapter.health(0)
    assert count(f"torchhal.amdsmi.missing_api,adapter=amd,missing={missing}") == before + 1  # said once
    err = capsys.readouterr().err
    assert "the installed amdsmi lacks this" in err and missing in err
    # without a handle nothing is read, and without the ECC reading ECC is not claimed
    assert (Feature.ECC in caps.features) is (missing == "amdsmi_get_temp_metric")
    if missing == "amdsmi_get_temp_metric":
        assert (
            "amdsmi did not report: hotspot temperature, critical temperature" in adapter.health(0).messages
        )


# -- F5: AMD ECC, declared where amdsmi reports it enabled -----------------------------------------


@pytest.mark.parametrize(
    ("blocks", "declared"),
    [(0b111, True), (0b001, True), (0b110, False), (0, False)],  # bit 0: UMC, the memory's ECC
)
def test_amd_ecc_is_declared_where_amdsmi_reports_it_on_in_the_memory_controllers(blocks, declared):
    facts = with_amdsmi(load("amd-mi300x"), temperature=45, critical=105, ecc=0)
    facts["devices"][0]["amdsmi"]["ecc_enabled_blocks"] = blocks
    (caps,) = AmdAdapter(RecordedRocmProbe(facts)).discover()
    assert (Feature.ECC in caps.features) is declared
    assert (ECC.failures(caps) == []) is declared


def test_amd_ecc_live_reading_is_declared(monkeypatch):
    monkeypatch.setitem(sys.modules, "amdsmi", fake_amdsmi())
    (caps,) = AmdAdapter(ReplayedTorchRocmProbe()).discover()
    assert Feature.ECC in caps.features


def test_amd_ecc_state_unread_is_not_declared_and_is_said_and_counted(capsys):
    facts = with_amdsmi(load("amd-mi300x"), temperature=45, critical=105, ecc=0)
    facts["devices"][0]["amdsmi"]["ecc_enabled_blocks"] = None  # e.g. a VM guest
    before = count("torchhal.amdsmi.ecc_unread,adapter=amd")
    adapter = AmdAdapter(RecordedRocmProbe(facts))
    (caps,) = adapter.discover()
    assert Feature.ECC not in caps.features
    assert count("torchhal.amdsmi.ecc_unread,adapter=amd") == before + 1
    assert "ECC state unread" in capsys.readouterr().err
    assert adapter.health(0).messages[-1] == (
        "ECC not declared, its state unread: amdsmi did not report the ECC-enabled blocks "
        "(it does not on a VM guest)"
    )


# -- F4: the names ROCm 6.x and cloud guests report -----------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "name", "compute_units", "sheet", "declared"),
    [
        ("amd-mi250x", "AMD Instinct MI250X/MI250", 110, "AMD Instinct MI250X", True),  # ROCm 6.x
        ("amd-mi250x", "AMD Instinct MI250X/MI250", 104, "AMD Instinct MI250X", False),  # an MI250 GCD
        ("amd-mi300x", "AMD Instinct MI300X VF", 304, "AMD Instinct MI300X", True),  # an SR-IOV guest
        ("amd-mi300x", "AMD Instinct MI300X VF", 38, "AMD Instinct MI300X", False),  # one partition's VF
    ],
)
def test_amd_names_rocm_reports_find_their_data_sheet(fixture, name, compute_units, sheet, declared):
    """The compute units still decide: an MI250 GCD (104) has no entry of its own, so none."""
    assert amd_sku_for(name) is AMD_SKUS[sheet]
    facts = load(fixture)
    facts["devices"][0]["properties"].update(name=name, multi_processor_count=compute_units)
    (caps,) = AmdAdapter(RecordedRocmProbe(facts)).discover()
    assert caps.declared_peaks == (AMD_SKUS[sheet].peaks if declared else None)
    assert caps.name == name  # the device keeps the name the runtime gave it


# -- F2: NVML links it did not read are said, counted, and asked of nvidia-smi ----------------------


def h200_pair(breakage: str) -> dict:
    """The recorded H200 pair (NV18 through NVSwitches) with one NVML fact unread or malformed."""
    facts = load("nvidia-h200x2")
    for device in facts["devices"]:
        nvml = device["nvml"]
        if breakage in ("remote type unread", "remote type unknown"):
            for link in nvml["nvlinks"]:
                link["remote_device_type"] = None if breakage == "remote type unread" else "unknown"
        if breakage in ("p2p unread", "p2p and level unread"):
            nvml["p2p_status_nvlink"] = {k: None for k in nvml["p2p_status_nvlink"]}
        if breakage == "p2p and level unread":
            nvml["topology_common_ancestor"] = {k: None for k in nvml["topology_common_ancestor"]}
        if breakage == "remote bus id malformed":
            for link in nvml["nvlinks"]:
                link.update(remote_device_type="gpu", remote_pci_bus_id="[N/A]")
    return facts


BREAKAGES = [
    "remote type unread",
    "remote type unknown",
    "p2p unread",
    "p2p and level unread",
    "remote bus id malformed",
]


@pytest.mark.parametrize("breakage", BREAKAGES, ids=lambda b: b.replace(" ", "-"))
def test_nvml_links_left_unread_are_read_from_nvidia_smi(breakage, capsys):
    unread = count("torchhal.topology.unread_links,adapter=nvidia")
    fallbacks = count("torchhal.topology.fallbacks,adapter=nvidia,source=nvidia-smi")
    (link,) = NvidiaAdapter(RecordedCudaProbe(h200_pair(breakage))).topology().links
    assert (link.type, link.count, link.source) == (LinkType.NVLINK, 18, "nvidia-smi")
    assert count("torchhal.topology.unread_links,adapter=nvidia") == unread + 1
    assert count("torchhal.topology.fallbacks,adapter=nvidia,source=nvidia-smi") == fallbacks + 1
    err = capsys.readouterr().err
    assert "topology from nvidia-smi instead of NVML" in err and "cuda:0-cuda:1" in err


@pytest.mark.parametrize(
    ("breakage", "kept"),
    [
        ("remote type unread", LinkType.PCIE),
        ("p2p unread", LinkType.PCIE),
        ("p2p and level unread", None),
        ("remote bus id malformed", LinkType.PCIE),
    ],
    ids=lambda b: b.replace(" ", "-") if isinstance(b, str) else str(b),
)
def test_nvml_links_left_unread_without_nvidia_smi_keep_what_nvml_said_and_say_so(breakage, kept, capsys):
    facts = h200_pair(breakage)
    facts["nvidia_smi"] = {"topo": None, "bus_ids": {}, "reason": "nvidia-smi is not on PATH"}
    unread = count("torchhal.topology.unread_links,adapter=nvidia")
    topo = NvidiaAdapter(RecordedCudaProbe(facts)).topology()
    link = topo.link("cuda:0", "cuda:1")
    assert (link.type if link else None) is kept
    assert count("torchhal.topology.unread_links,adapter=nvidia") == unread + 1
    err = capsys.readouterr().err
    assert "NVML left these pairs' links unread and nvidia-smi did not answer" in err
    assert "cuda:0-cuda:1" in err and "nvidia-smi is not on PATH" in err


def test_nvlinks_to_a_gpu_this_process_does_not_see_are_not_unread():
    facts = load("nvidia-h200x2")
    for device in facts["devices"]:
        for link in device["nvml"]["nvlinks"]:
            link.update(remote_device_type="gpu", remote_pci_bus_id="00000000:00:08.0")
    unread = count("torchhal.topology.unread_links,adapter=nvidia")
    (link,) = NvidiaAdapter(RecordedCudaProbe(facts)).topology().links
    assert (link.type, link.source) == (LinkType.PCIE, "nvml")  # common ancestor 30: a host bridge
    assert count("torchhal.topology.unread_links,adapter=nvidia") == unread


def test_a_malformed_bus_id_is_named_with_the_form_expected():
    assert bus_id("0000:0c:00.0") == "00000000:0C:00.0"
    for text in ("[N/A]", None, "00000000:00"):
        with pytest.raises(ValueError, match=r"PCI bus id .* is not domain:bus:device\.function"):
            bus_id(text)


# -- F3: an ECC mode NVML did not read ----------------------------------------------------------------


def test_without_nvml_ecc_is_not_declared_and_that_is_said_counted_and_reported(capsys):
    facts = load("nvidia-h200x2")
    facts["nvml"] = {
        "available": False,
        "reason": "pynvml is not installed (pip install 'torchhal-nvidia[nvml]')",
    }
    for device in facts["devices"]:
        device["nvml"] = device["nvml_health"] = None
    unavailable = count("torchhal.nvml.unavailable,adapter=nvidia")
    ecc_unread = count("torchhal.nvml.ecc_unread,adapter=nvidia")
    adapter = NvidiaAdapter(RecordedCudaProbe(facts))
    devices = adapter.discover()
    assert all(Feature.ECC not in caps.features for caps in devices)  # not claimed without a reading
    assert count("torchhal.nvml.unavailable,adapter=nvidia") == unavailable + 1
    assert count("torchhal.nvml.ecc_unread,adapter=nvidia") == ecc_unread + 2
    err = capsys.readouterr().err
    assert "NVML unavailable" in err and "ECC is not declared" in err and "pynvml is not installed" in err
    assert adapter.health(1).messages[-1] == (
        "ECC not declared, its mode unread: NVML unavailable: pynvml is not installed "
        "(pip install 'torchhal-nvidia[nvml]')"
    )


@pytest.mark.parametrize("unread", ["ecc mode", "device"])
def test_an_ecc_mode_nvml_did_not_read_is_said_for_that_device_only(unread, capsys):
    facts = load("nvidia-h200x2")
    if unread == "ecc mode":  # nvmlDeviceGetEccMode raised
        facts["devices"][1]["nvml"]["ecc_mode_current"] = None
    else:  # NVML could not identify the GPU (a MIG instance, a lost GPU)
        facts["devices"][1]["nvml"] = facts["devices"][1]["nvml_health"] = None
    before = count("torchhal.nvml.ecc_unread,adapter=nvidia")
    adapter = NvidiaAdapter(RecordedCudaProbe(facts))
    first, second = adapter.discover()
    assert Feature.ECC in first.features and Feature.ECC not in second.features
    assert count("torchhal.nvml.ecc_unread,adapter=nvidia") == before + 1
    err = capsys.readouterr().err
    assert "ECC mode unread" in err and "cuda:1" in err and "cuda:0" not in err.split("ECC mode unread")[1]
    assert adapter.health(1).messages[-1].startswith("ECC not declared, its mode unread: NVML ")
    assert not any("ECC not declared" in m for m in adapter.health(0).messages)


# -- F6: Intel tf32, from the driver's tf32 DPAS where torch reports it ------------------------------


@pytest.mark.parametrize(
    ("name", "dpas", "tf32_dpas", "tf32"),
    [
        ("Intel(R) Arc(TM) A770 Graphics", True, False, False),  # Xe-HPG: XMX without tf32
        ("Intel(R) Data Center GPU Flex 170", True, None, False),  # a torch that does not report it
        ("Intel(R) Data Center GPU Max 1100", True, False, True),  # Xe-HPC computes tf32 (unreported)
        ("Intel(R) Data Center GPU Max 1550", True, None, True),
        ("Intel(R) Graphics", True, True, True),  # a part whose driver reports tf32 DPAS
        ("Intel(R) Data Center GPU Max 1550", False, True, False),  # no DPAS, no matrix engines
    ],
)
def test_intel_tf32_follows_the_reported_tf32_dpas_or_the_architecture(name, dpas, tf32_dpas, tf32, capsys):
    facts = load("intel-max1550")
    facts["devices"] = facts["devices"][:1]
    props = facts["devices"][0]["properties"]
    props.update(name=name, has_subgroup_matrix_multiply_accumulate=dpas)
    if tf32_dpas is not None:
        props["has_subgroup_matrix_multiply_accumulate_tensor_float32"] = tf32_dpas
    before = count("torchhal.intel.tf32_from_architecture,adapter=intel")
    (caps,) = IntelAdapter(RecordedXpuProbe(facts)).discover()
    assert (DType.TF32 in caps.dtypes) is tf32
    assert (Feature.TENSOR_CORES in caps.features) is dpas
    said = dpas and tf32_dpas is None
    assert count("torchhal.intel.tf32_from_architecture,adapter=intel") == before + said
    assert ("tf32 declared from the architecture" in capsys.readouterr().err) is said


# -- F8: Intel devices whose links nothing reports --------------------------------------------------------


def test_intel_links_nothing_reports_are_said_and_counted(capsys):
    before = count("torchhal.topology.fallbacks,adapter=intel,source=none")
    topo = IntelAdapter(RecordedXpuProbe(load("intel-max1550"))).topology()
    assert topo.devices == ("xpu:0", "xpu:1") and topo.links == ()
    assert count("torchhal.topology.fallbacks,adapter=intel,source=none") == before + 1
    assert "no links: torch.xpu reports peer access but not link types" in capsys.readouterr().err
    one = load("intel-max1550")
    one["devices"] = one["devices"][:1]
    IntelAdapter(RecordedXpuProbe(one)).topology()  # one device: no pair whose link is unknown
    assert count("torchhal.topology.fallbacks,adapter=intel,source=none") == before + 1


# -- F9: facts a recording lacks, named with the device, the field and the recording ------------------------


def test_an_rdna_recording_without_hips_wgp_setting_is_refused_by_name():
    facts = load("amd-rx7900xtx")
    facts["source"] = "a hand-sourced test recording"
    del facts["runtime"]["GPU_ENABLE_WGP_MODE"]
    with pytest.raises(InvalidArgumentError) as raised:
        AmdAdapter(RecordedRocmProbe(facts)).discover()
    message = str(raised.value)
    assert "cuda:0 in the recording 'a hand-sourced test recording'" in message
    assert "GPU_ENABLE_WGP_MODE" in message and "gfx1100" in message
    cdna = load("amd-mi300x")
    del cdna["runtime"]["GPU_ENABLE_WGP_MODE"]  # CDNA counts compute units itself: not needed
    assert AmdAdapter(RecordedRocmProbe(cdna)).discover()[0].compute_units == 304


def test_a_gcn_arch_name_that_is_not_a_gfx_target_is_refused_with_the_form_expected():
    facts = load("amd-mi300x")
    facts["source"] = "a test recording"
    facts["devices"][0]["properties"]["gcnArchName"] = "gfx12-generic"
    with pytest.raises(UnsupportedError) as raised:
        AmdAdapter(RecordedRocmProbe(facts)).discover()
    message = str(raised.value)
    assert "cuda:0 in the recording 'a test recording'" in message and "'gfx12-generic'" in message
    assert "expected gfx<major><minor><stepping>[:features]" in message


@pytest.mark.parametrize("sizes", [[], None, "missing"])
def test_an_intel_device_without_sub_group_sizes_is_refused_by_name(sizes):
    facts = load("intel-max1550")
    facts["source"] = "a test recording"
    props = facts["devices"][1]["properties"]
    if sizes == "missing":
        del props["sub_group_sizes"]
    else:
        props["sub_group_sizes"] = sizes
    with pytest.raises(InvalidArgumentError) as raised:
        IntelAdapter(RecordedXpuProbe(facts)).discover()
    message = str(raised.value)
    assert "xpu:1 in the recording 'a test recording'" in message
    assert f"sub_group_sizes {None if sizes == 'missing' else sizes!r}" in message
