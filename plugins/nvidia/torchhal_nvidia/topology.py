"""Links between NVIDIA GPUs, from NVML facts or from `nvidia-smi topo -m` as it prints.

Both paths give one undirected `Link` per connected pair, so the topology is symmetric by
construction; where the two directions of a pair disagree, the weaker one is kept and logged.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torchhal.hal_core import Link, LinkType, telemetry

log = telemetry.get_logger("torchhal.nvidia.topology")

_ESCAPES = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU = re.compile(r"GPU(\d+)$")
_NVLINK = re.compile(r"NV(\d+)$")
# nvidia-smi's legend: every path but SYS stays inside one CPU's PCIe hierarchy.
_PCIE_CODES = {"PIX", "PXB", "PHB", "NODE"}
_HOST_CODES = {"SYS", "SOC"}  # SOC is what older drivers printed for SYS
# nvmlGpuTopologyLevel_t: INTERNAL 0, SINGLE 10, MULTIPLE 20, HOSTBRIDGE 30, NODE 40, SYSTEM 50.
_NVML_HOST_LEVEL = 50
NVML_P2P_OK = 0

DeviceId = Callable[[int], str]


def bus_id(text: str | None) -> str:
    """A PCI bus id in NVML's form (`00000000:00:06.0`), whatever domain width it was given in;
    ValueError naming the text where it is not one."""
    try:
        domain, bus, devfn = (text or "").strip().split(":")
        return f"{int(domain, 16):08X}:{bus.upper()}:{devfn.upper()}"
    except ValueError:
        raise ValueError(
            f"PCI bus id {text!r} is not domain:bus:device.function in hex (such as 00000000:00:06.0)"
        ) from None


def torch_bus_id(props: Mapping[str, Any]) -> str | None:
    """The bus id of a device from torch's pci_* properties, when torch reports them."""
    try:
        return f"{props['pci_domain_id']:08X}:{props['pci_bus_id']:02X}:{props['pci_device_id']:02X}.0"
    except KeyError:
        return None


def parse_topo_matrix(text: str) -> dict[tuple[int, int], str]:
    """The GPU-to-GPU cells of the first matrix `nvidia-smi topo -m` prints, by nvidia-smi index.

    The tool underlines its header with terminal escape codes and appends legends and, on
    newer drivers, further matrices; only the first GPU block is read. Cells are split on any
    whitespace, not only the tool's tabs: copies pasted from terminals and tickets turn tabs into
    spaces, and no GPU-to-GPU cell holds a space.
    """
    lines = _ESCAPES.sub("", text).splitlines()
    header = next((i for i, line in enumerate(lines) if line.split() and _GPU.match(line.split()[0])), None)
    if header is None:
        return {}
    columns = lines[header].split()
    gpus = [int(m.group(1)) for m in map(_GPU.match, columns) if m]
    cells: dict[tuple[int, int], str] = {}
    for line in lines[header + 1 :]:
        row = line.split()
        match = _GPU.match(row[0]) if row else None
        if match is None:
            break  # end of the first matrix
        for column, code in zip(gpus, row[1 : 1 + len(gpus)], strict=False):
            if column != int(match.group(1)):
                cells[(int(match.group(1)), column)] = code
    return cells


def links_from_smi(
    cells: Mapping[tuple[int, int], str],
    to_torch: Mapping[int, int],
    device_id: DeviceId,
    per_link_gbps: float | None,
) -> list[Link]:
    """Links among the GPUs this process sees; `to_torch` maps nvidia-smi indices to torch's."""
    links = []
    for (a, b), code in sorted(cells.items()):
        if a > b or a not in to_torch or b not in to_torch:
            continue
        code = _weaker(code, cells.get((b, a), code), (a, b))
        link = _link_from_code(code, device_id(to_torch[a]), device_id(to_torch[b]), per_link_gbps)
        if link is not None:
            links.append(link)
    return links


def _link_from_code(code: str, a: str, b: str, per_link_gbps: float | None) -> Link | None:
    nvlink = _NVLINK.match(code)
    if nvlink:
        count = int(nvlink.group(1))
        bandwidth = None if per_link_gbps is None else per_link_gbps * count
        return Link(
            a=a, b=b, type=LinkType.NVLINK, count=count, bandwidth_gbps=bandwidth, source="nvidia-smi"
        )
    if code in _PCIE_CODES:
        return Link(a=a, b=b, type=LinkType.PCIE, source="nvidia-smi")
    if code in _HOST_CODES:
        return Link(a=a, b=b, type=LinkType.HOST, source="nvidia-smi")
    log.warning("unknown nvidia-smi connection code, pair left unlinked", code=code, a=a, b=b)
    telemetry.count("torchhal.topology.unknown_codes", adapter="nvidia", code=code)
    return None


def _weaker(code: str, reverse: str, pair: tuple[int, int]) -> str:
    if code == reverse:
        return code
    log.warning(
        "nvidia-smi matrix is not symmetric, keeping the weaker entry", pair=pair, codes=(code, reverse)
    )
    return min(code, reverse, key=_strength)


def _strength(code: str) -> int:
    nvlink = _NVLINK.match(code)
    return 100 + int(nvlink.group(1)) if nvlink else (1 if code in _PCIE_CODES else 0)


def links_from_nvml(
    devices: Sequence[Mapping[str, Any]], device_id: DeviceId, per_link_gbps: float | None
) -> tuple[list[Link], dict[str, str]]:
    """Links from each device's NVML facts: NVLinks to GPUs by remote bus id, or through
    NVSwitches (counted where NVML says NVLink P2P works), else the PCIe level.

    Also the pairs whose links NVML left unread, with why: an active NVLink whose far end it did
    not report (every pair of that GPU: the link may join any of them), a switch pair without a
    P2P answer, a pair without a common-ancestor level. Their links here are only what NVML did
    report (a PCIe level, or none), which may understate them: the caller says so or asks nvidia-smi.
    """
    index: dict[str, int] = {}
    unplaced: dict[int, str] = {}  # device -> why its NVLinks cannot be placed
    for i, dev in enumerate(devices):
        try:
            index[bus_id(dev["pci_bus_id"])] = i
        except ValueError as exc:
            unplaced[i] = f"its pci_bus_id: {exc}"
    direct = [Counter[int]() for _ in devices]
    switch = [0 for _ in devices]
    for i, dev in enumerate(devices):
        for link in dev["nvlinks"]:
            kind = link["remote_device_type"]
            if not link["active"] or kind == "ibmnpu":  # an NVLink to an IBM POWER CPU joins no GPU pair
                continue
            if kind == "switch":
                switch[i] += 1
            elif kind != "gpu":  # None (NVML did not answer) or "unknown": the far end is not known
                unplaced.setdefault(i, f"active NVLink {link['link']} has remote device type {kind!r}")
            else:
                try:  # no peer: a GPU this process does not see
                    peer = index.get(bus_id(link["remote_pci_bus_id"]))
                except ValueError as exc:
                    unplaced.setdefault(i, f"active NVLink {link['link']} to a GPU at remote {exc}")
                    continue
                if peer is not None:
                    direct[i][peer] += 1
    links: list[Link] = []
    unread: dict[str, str] = {}
    for a in range(len(devices)):
        for b in range(a + 1, len(devices)):
            why = [f"{device_id(x)}: {unplaced[x]}" for x in (a, b) if x in unplaced]
            count = min(direct[a][b], direct[b][a])
            if direct[a][b] != direct[b][a]:
                log.warning("NVML link counts differ by direction, keeping the smaller", a=a, b=b)
                telemetry.count("torchhal.topology.asymmetric_links", adapter="nvidia", source="nvml")
            p2p = _p2p_ok(devices, a, b) if switch[a] and switch[b] else False
            if p2p is None:
                why.append("NVLink P2P status through the NVSwitches unread")
            count += min(switch[a], switch[b]) if p2p else 0
            link = _nvml_link(devices, a, b, count, device_id, per_link_gbps)
            if link is None:
                why.append("no NVLink and no common-ancestor level")
            else:
                links.append(link)
            if why:
                unread[f"{device_id(a)}-{device_id(b)}"] = "; ".join(why)
    return links, unread


def _p2p_ok(devices: Sequence[Mapping[str, Any]], a: int, b: int) -> bool | None:
    """Whether NVML says NVLink P2P works both ways between a and b; None where it did not answer."""
    status = [devices[x]["p2p_status_nvlink"].get(str(y)) for x, y in ((a, b), (b, a))]
    return None if None in status else all(s == NVML_P2P_OK for s in status)


def _nvml_link(
    devices: Sequence[Mapping[str, Any]],
    a: int,
    b: int,
    count: int,
    device_id: DeviceId,
    per_link_gbps: float | None,
) -> Link | None:
    ida, idb = device_id(a), device_id(b)
    if count:
        bandwidth = None if per_link_gbps is None else per_link_gbps * count
        return Link(a=ida, b=idb, type=LinkType.NVLINK, count=count, bandwidth_gbps=bandwidth, source="nvml")
    level = devices[a]["topology_common_ancestor"].get(str(b))
    if level is None:
        return None
    return Link(
        a=ida, b=idb, type=LinkType.HOST if level >= _NVML_HOST_LEVEL else LinkType.PCIE, source="nvml"
    )
