"""rank_order on recorded and typed topologies: ranks of one fast-link island end up consecutive."""

from __future__ import annotations

import random

import pytest
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe
from torchhal_nvidia.topology import links_from_smi, parse_topo_matrix

from tests.plugins.facts import load
from torchhal.distributed import rank_order
from torchhal.distributed.mesh import order_from_placements, placement
from torchhal.hal_core import InvalidArgumentError, LinkType, Topology

# An 8-GPU host typed in `nvidia-smi topo -m` layout: two NVLink islands of four (NV12 inside
# each), PCIe between GPUs of one CPU socket's half (NODE) and across sockets (SYS).
EIGHT_GPU_SMI = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tCPU Affinity\x1b[0m\n"
    "GPU0\t X \tNV12\tNV12\tNV12\tNODE\tNODE\tSYS\tSYS\t0-31\n"
    "GPU1\tNV12\t X \tNV12\tNV12\tNODE\tNODE\tSYS\tSYS\t0-31\n"
    "GPU2\tNV12\tNV12\t X \tNV12\tSYS\tSYS\tNODE\tNODE\t0-31\n"
    "GPU3\tNV12\tNV12\tNV12\t X \tSYS\tSYS\tNODE\tNODE\t0-31\n"
    "GPU4\tNODE\tNODE\tSYS\tSYS\t X \tNV12\tNV12\tNV12\t32-63\n"
    "GPU5\tNODE\tNODE\tSYS\tSYS\tNV12\t X \tNV12\tNV12\t32-63\n"
    "GPU6\tSYS\tSYS\tNODE\tNODE\tNV12\tNV12\t X \tNV12\t32-63\n"
    "GPU7\tSYS\tSYS\tNODE\tNODE\tNV12\tNV12\tNV12\t X \t32-63\n\nLegend:\n"
)


def gpu(i: int) -> str:
    return f"cuda:{i}"


@pytest.fixture
def eight_gpus() -> Topology:
    links = links_from_smi(parse_topo_matrix(EIGHT_GPU_SMI), {i: i for i in range(8)}, gpu, 25.0)
    return Topology(devices=tuple(gpu(i) for i in range(8)), links=tuple(links))


@pytest.fixture
def h200_pair() -> Topology:
    return NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h200x2"))).topology()


def test_recorded_h200_pair_is_one_island_in_device_order(h200_pair):
    assert h200_pair.islands() == [(gpu(0), gpu(1))]
    assert rank_order(h200_pair, [gpu(0), gpu(1)]) == (0, 1)
    assert rank_order(h200_pair, [gpu(1), gpu(0)]) == (1, 0)  # the rank on cuda:0 comes first


def test_interleaved_launch_on_two_nvlink_islands_becomes_island_contiguous(eight_gpus):
    assert eight_gpus.islands() == [tuple(gpu(i) for i in range(4)), tuple(gpu(i) for i in range(4, 8))]
    devices = [gpu(i) for i in (0, 4, 1, 5, 2, 6, 3, 7)]  # rank r on cuda:devices[r]
    order = rank_order(eight_gpus, devices)
    assert order == (0, 2, 4, 6, 1, 3, 5, 7)
    for row in (order[:4], order[4:]):  # the inner dimension of a (2, 4) mesh
        assert _all_nvlink(eight_gpus, [devices[r] for r in row])


def test_any_assignment_of_ranks_keeps_each_inner_group_of_four_on_nvlink(eight_gpus):
    seed = random.randrange(2**31)
    rng = random.Random(seed)
    for _ in range(50):
        devices = [gpu(i) for i in rng.sample(range(8), 8)]
        order = rank_order(eight_gpus, devices)
        assert sorted(order) == list(range(8)), f"seed {seed}"
        for start in (0, 4):
            assert _all_nvlink(eight_gpus, [devices[r] for r in order[start : start + 4]]), f"seed {seed}"


def test_hosts_come_first_in_order_of_appearance_then_islands(eight_gpus):
    devices = [gpu(i) for i in range(8)] * 2
    hosts = ["node-b"] * 8 + ["node-a"] * 8
    hosts[3], hosts[11] = hosts[11], hosts[3]  # rank 3 on node-a's cuda:3, rank 11 on node-b's cuda:3
    order = rank_order(eight_gpus, devices, hosts)
    assert order == (0, 1, 2, 11, 4, 5, 6, 7, 8, 9, 10, 3, 12, 13, 14, 15)


def test_devices_outside_the_topology_come_last_in_rank_order(h200_pair):
    assert rank_order(h200_pair, ["cpu", gpu(1), "cpu", gpu(0)]) == (3, 1, 0, 2)
    assert placement(h200_pair, "cpu") == ("", 1, 2)


def test_order_from_placements_breaks_ties_by_rank():
    assert order_from_placements([("h", 0, 0)] * 3) == (0, 1, 2)


def test_hosts_must_name_every_rank(h200_pair):
    with pytest.raises(InvalidArgumentError, match="hosts has 1 entries, devices_per_rank 2"):
        rank_order(h200_pair, [gpu(0), gpu(1)], ["a"])


def _all_nvlink(topology: Topology, devices: list[str]) -> bool:
    return all(
        (link := topology.link(a, b)) is not None and link.type is LinkType.NVLINK
        for i, a in enumerate(devices)
        for b in devices[i + 1 :]
    )
