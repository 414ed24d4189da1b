"""The vendor adapters and the HAL's device choice: readings that never
came, links amdsmi or nvidia-smi could not give, gfx908's bf16, and the order of tied devices."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
from torchhal_amd.adapter import AmdAdapter, GfxTarget
from torchhal_amd.recorded import RecordedRocmProbe
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe

from tests.plugins.facts import SMI_CAPTURE, count, load
from tests.plugins.test_amd import eight_mi300x, with_amdsmi
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal.hal_core import DType, HealthStatus, LinkType
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


# -- health: a reading that did not come is not a good one --------------------------------------


@pytest.mark.parametrize(
    "missing", [("temperature_c",), ("ecc_uncorrected_volatile",), ("temperature_c", "ecc")]
)
def test_nvml_health_names_what_it_could_not_read(missing):
    facts = load("nvidia-h200x2")
    health = facts["devices"][1]["nvml_health"]
    for key in missing:
        health["ecc_uncorrected_volatile" if key == "ecc" else key] = None
    report = NvidiaAdapter(RecordedCudaProbe(facts)).health(1)
    temperature_read = health["temperature_c"] is not None
    ecc_read = health["ecc_uncorrected_volatile"] is not None
    # OK only on a check that was made; nothing read is UNKNOWN, as with NVML absent
    assert report.status is (HealthStatus.OK if temperature_read or ecc_read else HealthStatus.UNKNOWN)
    assert ("no uncorrected ECC errors" in report.messages) is ecc_read
    (unread,) = [m for m in report.messages if m.startswith("NVML did not report: ")]
    assert ("uncorrected ECC count" in unread) is not ecc_read
    assert ("temperature" in unread) is not temperature_read
    assert report.ecc_errors == health["ecc_uncorrected_volatile"]


def test_nvml_health_without_a_slowdown_threshold_does_not_claim_the_temperature_is_below_it():
    facts = load("nvidia-h100-sxm")
    facts["devices"][0]["nvml"]["slowdown_temperature_c"] = None
    hot = random.randint(60, 120)
    facts["devices"][0]["nvml_health"]["temperature_c"] = hot
    report = NvidiaAdapter(RecordedCudaProbe(facts)).health(0)
    assert report.status is HealthStatus.OK and report.temperature_c == hot  # the ECC check passed
    assert report.messages == ("no uncorrected ECC errors", "NVML did not report: slowdown threshold")


def test_amdsmi_health_names_what_it_could_not_read():
    facts = with_amdsmi(load("amd-mi300x"), temperature=random.randint(30, 80), critical=105, ecc=0)
    facts["devices"][0]["amdsmi_health"]["ecc_uncorrectable"] = None
    report = AmdAdapter(RecordedRocmProbe(facts)).health(0)
    assert report.status is HealthStatus.OK and report.ecc_errors is None
    assert not any("no uncorrectable ECC errors" in m for m in report.messages)
    assert report.messages[-1] == "amdsmi did not report: uncorrectable ECC count"
    facts["devices"][0]["amdsmi_health"]["temperature_hotspot"] = None
    report = AmdAdapter(RecordedRocmProbe(facts)).health(0)
    assert report.status is HealthStatus.UNKNOWN
    assert report.messages == ("amdsmi did not report: hotspot temperature, uncorrectable ECC count",)


# -- AMD topology ------------------------------------------------------------------------------------

PCIE = {"type_name": "AMDSMI_LINK_TYPE_PCIE", "hops": 1, "weight": 40, "max_bandwidth_mb_s": 0}
HOST = {"type_name": "AMDSMI_LINK_TYPE_PCIE", "hops": 3, "weight": 72, "max_bandwidth_mb_s": 0}
XGMI = {"type_name": "AMDSMI_LINK_TYPE_XGMI", "hops": 1, "weight": 15, "max_bandwidth_mb_s": 64_000}
SLOWEST_FIRST = [(HOST, LinkType.HOST), (PCIE, LinkType.PCIE), (XGMI, LinkType.XGMI)]


@pytest.mark.parametrize(("one", "other"), list(itertools.permutations(SLOWEST_FIRST, 2)))
def test_amd_directions_that_disagree_keep_the_slower_link(one, other):
    a, b = random.sample(range(8), 2)
    facts = eight_mi300x({(a, b): one[0], (b, a): other[0]})
    link = AmdAdapter(RecordedRocmProbe(facts)).topology().link(f"cuda:{a}", f"cuda:{b}")
    slower = min(one, other, key=SLOWEST_FIRST.index)
    assert link.type is slower[1]


def test_amd_device_amdsmi_lacks_leaves_only_its_pairs_unlinked():
    facts = eight_mi300x({})
    lost = random.randrange(8)
    # amdsmi has no handle at the PCI address torch reports for one device: it has no link
    # facts, and its peers none towards it (what RocmProbe.amdsmi_links records then)
    facts["devices"][lost]["amdsmi_links"] = None
    for device in facts["devices"]:
        (device["amdsmi_links"] or {}).pop(str(lost), None)
    before = count("torchhal.topology.unread_pairs,adapter=amd")
    topo = AmdAdapter(RecordedRocmProbe(facts)).topology()
    linked = {frozenset((int(lk.a[5:]), int(lk.b[5:]))) for lk in topo.links}
    unlinked = {frozenset(p) for p in itertools.combinations(range(8), 2)} - linked
    assert unlinked == {frozenset((lost, j)) for j in range(8) if j != lost}
    assert all(lk.type is LinkType.XGMI for lk in topo.links)
    assert count("torchhal.topology.unread_pairs,adapter=amd") == before + len(unlinked)


def test_gfx908_computes_bf16_on_its_matrix_cores():
    assert DType.BF16 in GfxTarget("gfx908:sramecc+:xnack-").dtypes()
    assert DType.BF16 not in GfxTarget("gfx906").dtypes()  # no matrix cores


# -- NVIDIA topology from nvidia-smi: what it cannot say is said -------------------------------------


def without_nvml(facts: dict) -> dict:
    facts["nvml"] = {"available": False, "reason": "pynvml is not installed"}
    for device in facts["devices"]:
        device["nvml"] = device["nvml_health"] = None
    return facts


@pytest.mark.parametrize(
    "breakage",
    ["no matrix", "torch without pci ids", "smi lists other gpus"],
    ids=lambda b: b.replace(" ", "-"),
)
def test_nvidia_smi_pairs_it_says_nothing_about_are_logged_and_counted(breakage, capsys):
    facts = without_nvml(load("nvidia-h200x2"))
    facts["nvidia_smi"]["topo"] = SMI_CAPTURE.read_text()
    if breakage == "no matrix":
        facts["nvidia_smi"]["topo"] = "Failed to initialize NVML: Driver/library version mismatch\n"
    elif breakage == "torch without pci ids":
        for device in facts["devices"]:
            for key in ("pci_bus_id", "pci_device_id", "pci_domain_id"):
                del device["properties"][key]
    else:
        facts["nvidia_smi"]["bus_ids"] = {"0": "00000000:00:08.0", "1": "00000000:00:09.0"}
    before = count("torchhal.topology.unread_pairs,adapter=nvidia")
    topo = NvidiaAdapter(RecordedCudaProbe(facts)).topology()
    assert topo.devices == ("cuda:0", "cuda:1") and topo.links == ()
    assert count("torchhal.topology.unread_pairs,adapter=nvidia") == before + 1
    assert "nvidia-smi topo -m says nothing about these pairs" in capsys.readouterr().err


def test_nvidia_smi_capture_that_covers_every_pair_warns_of_nothing_unread(capsys):
    facts = without_nvml(load("nvidia-h200x2"))
    facts["nvidia_smi"]["topo"] = SMI_CAPTURE.read_text()
    before = count("torchhal.topology.unread_pairs,adapter=nvidia")
    (link,) = NvidiaAdapter(RecordedCudaProbe(facts)).topology().links
    assert (link.type, link.count) == (LinkType.NVLINK, 18)
    assert count("torchhal.topology.unread_pairs,adapter=nvidia") == before
    assert "says nothing" not in capsys.readouterr().err


def test_fallback_from_nvml_names_the_devices_nvml_does_not_know(capsys):
    facts = load("nvidia-h200x2")
    facts["devices"][1]["nvml"] = None  # e.g. a UUID NVML does not list
    NvidiaAdapter(RecordedCudaProbe(facts)).topology()
    out = capsys.readouterr().err
    assert "topology from nvidia-smi instead of NVML" in out and "NVML knows no device of the UUID" in out
    assert "cuda:1" in out


# -- the HAL's device choice -----------------------------------------------------------------------


def test_tied_devices_rank_by_index_not_by_the_ids_string_order():
    facts = load("nvidia-h100-sxm")
    n = random.randint(11, 16)
    facts["devices"] = [copy.deepcopy(facts["devices"][0]) for _ in range(n)]
    hal = HardwareAbstractionLayer(adapters=[NvidiaAdapter(RecordedCudaProbe(facts))], settings=NO_AUTOLOAD)
    choice = hal.choose_device(DeviceRequirements(device_type="cuda"))
    assert [r.device.id for r in choice.ranking if r.eligible] == [f"cuda:{i}" for i in range(n)]
    assert choice.device.id == "cuda:0"


def test_an_unreadable_nvidia_smi_bus_id_leaves_only_that_gpu_unlinked(capsys):
    """A row nvidia-smi printed malformed (here of a GPU this process does not see) raised out of
    topology(), losing the links of every GPU."""
    facts = without_nvml(load("nvidia-h200x2"))
    facts["nvidia_smi"]["topo"] = SMI_CAPTURE.read_text()
    facts["nvidia_smi"]["bus_ids"]["2"] = "[N/A]"
    before = count("torchhal.topology.unread_bus_ids,adapter=nvidia")
    (link,) = NvidiaAdapter(RecordedCudaProbe(facts)).topology().links
    assert (link.type, link.count) == (LinkType.NVLINK, 18)
    assert count("torchhal.topology.unread_bus_ids,adapter=nvidia") == before + 1
    assert "[N/A]" in capsys.readouterr().err
