"""Edges of the simulated ASIC's costs found in review:

- an upload (`Device.to_device` of a host tensor) was charged as a copy within device memory,
  2 × bytes / memory bandwidth, ignoring the declared host link (26× too cheap on `edge`);
- an op's results were charged only after the reference had computed them on the host, so an
  output beyond the simulated capacity was computed in full first, and one beyond host memory
  failed in the host allocator (KernelFailedError) rather than as DeviceOutOfMemoryError;
- a collective cost for world_size 0 divided by zero or came out below the launch overhead;
- a spec with a subnormal clock or bandwidth validated, then broke discovery or every op with
  errors that named no spec field.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torchhal_simasic import kernels, workloads
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.cost import _RING_TRAFFIC, collective_time_s
from torchhal_simasic.spec import SPEC_ENV, SimASICSpec, bundled_spec, spec_from_env

import torchhal
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import ConfigurationError, DeviceOutOfMemoryError, InvalidArgumentError, telemetry
from torchhal.hal_core.settings import Settings
from torchhal.testing import run_conformance

LAUNCH = 1e-6  # the tiny spec's launch overhead
BANDWIDTH = 1e11  # the tiny spec's memory bandwidth
SMALLEST_NORMAL = sys.float_info.min


# --- copies: within device memory, or across the host link --------------------------------


def test_an_upload_is_charged_over_the_host_link(sim_hal, tiny):
    dev = sim_hal(tiny(host_link_bytes_per_s=1e9)).device("simasic:0")
    clock, ledger = dev.adapter.state(0).clock, dev.adapter.state(0).ledger
    host = torch.randn(250)
    stored = dev.to_device(host)
    assert torch.equal(stored, host)
    assert ledger.used == 1000
    assert clock.now() == pytest.approx(1000 / 1e9 + LAUNCH, rel=1e-12)  # not 2 × 1000 / 1e11 + launch


def test_a_download_crosses_the_link_and_a_device_copy_stays_in_memory(sim_hal, tiny):
    dev = sim_hal(tiny(host_link_bytes_per_s=1e9)).device("simasic:0")
    clock = dev.adapter.state(0).clock
    src = dev.empty((250,), torch.float32).normal_()
    dst = dev.empty((250,), torch.float32)
    dev.copy_(dst, src)
    assert torch.equal(dst, src)
    assert clock.now() == pytest.approx(2 * 1000 / BANDWIDTH + LAUNCH, rel=1e-12)
    start = clock.now()
    dev.copy_(dst[50:], src[:200])  # views of device tensors are on the device too
    assert clock.now() - start == pytest.approx(2 * 800 / BANDWIDTH + LAUNCH, rel=1e-9)
    host = torch.empty(250)
    start = clock.now()
    dev.copy_(host, src)
    assert torch.equal(host, src)
    assert clock.now() - start == pytest.approx(1000 / 1e9 + LAUNCH, rel=1e-9)


def test_a_tensor_of_another_simulated_device_comes_over_the_link(sim_hal, tiny):
    hal = sim_hal(tiny(host_link_bytes_per_s=2e9, devices=2))
    first, second = hal.device("simasic:0"), hal.device("simasic:1")
    on_first = first.to_device(torch.randn(500))
    start = second.adapter.state(1).clock.now()
    on_second = second.to_device(on_first)
    assert torch.equal(on_second, on_first)
    assert second.adapter.state(1).clock.now() - start == pytest.approx(2000 / 2e9 + LAUNCH, rel=1e-9)
    start = second.adapter.state(1).clock.now()
    again = second.to_device(on_second)  # already on this device: a copy in its memory
    assert torch.equal(again, on_second)
    assert second.adapter.state(1).clock.now() - start == pytest.approx(
        2 * 2000 / BANDWIDTH + LAUNCH, rel=1e-9
    )


def test_a_link_faster_than_memory_is_bound_by_the_memory(sim_hal, tiny):
    dev = sim_hal(tiny(host_link_bytes_per_s=1e12)).device("simasic:0")
    dev.to_device(torch.randn(250))
    assert dev.adapter.state(0).clock.now() == pytest.approx(1000 / BANDWIDTH + LAUNCH, rel=1e-12)


def test_the_edge_spec_uploads_at_its_pcie_link():
    """The reviewer's case on the bundled edge spec (3.94 GB/s PCIe 3.0 × 4, 34.1 GB/s memory)."""
    spec = bundled_spec("edge")
    hal = HardwareAbstractionLayer(
        adapters=[SimASICAdapter(spec)], settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    )
    dev = hal.device("simasic:0")
    nbytes = 1 << 20
    dev.to_device(torch.randn(nbytes // 4))
    seconds = dev.adapter.state(0).clock.now()
    assert seconds == pytest.approx(nbytes / 3.94e9 + 5e-6, rel=1e-12)
    assert seconds > 4 * (2 * nbytes / spec.memory_bandwidth_bytes_per_s + 5e-6)


def test_without_a_link_an_upload_is_charged_its_memory_side_said_once_and_counted(sim_hal, capsys):
    dev = sim_hal().device("simasic:0")  # the tiny spec declares no host link
    counted = "torchhal.simasic.unlinked_transfers,device=simasic:0,direction=upload"
    before = telemetry.counts().get(counted, 0)
    dev.to_device(torch.randn(250))
    dev.to_device(torch.randn(250))
    assert dev.adapter.state(0).clock.now() == pytest.approx(2 * (1000 / BANDWIDTH + LAUNCH), rel=1e-12)
    assert telemetry.counts()[counted] == before + 2
    logged = capsys.readouterr().err
    assert logged.count("simulated host transfers are charged only their device-memory side") == 1


# --- results charged before they are computed ----------------------------------------------


class MatmulSpy:
    """Stands in for torch.matmul: records the ledger's use at each call, then computes (or,
    with `refuse`, raises instead: an output that must never be computed)."""

    def __init__(self, ledger: Any, refuse: bool = False) -> None:
        self.real = torch.matmul
        self.ledger, self.refuse = ledger, refuse
        self.used_at_calls: list[int] = []

    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        self.used_at_calls.append(self.ledger.used)
        if self.refuse:
            raise RuntimeError(f"matmul of {tuple(a.shape)} and {tuple(b.shape)} was computed")
        return self.real(a, b)


def test_an_output_beyond_capacity_is_refused_before_it_is_computed(sim_hal, monkeypatch):
    hal = sim_hal()
    dev = hal.device("simasic:0")
    state = dev.adapter.state(0)
    keep = dev.empty((200_000,), torch.float32)  # 800,000 of the 1 MiB
    spy = MatmulSpy(state.ledger)
    monkeypatch.setattr(torch, "matmul", spy)
    a, b = torch.randn(300, 2), torch.randn(2, 300)  # a 360,000-byte product
    with pytest.raises(DeviceOutOfMemoryError) as caught, hal.use(dev):
        torchhal.ops.matmul(a, b)
    assert (caught.value.requested, caught.value.used, caught.value.capacity) == (360_000, 800_000, 1 << 20)
    assert spy.used_at_calls == []  # nothing computed
    assert state.ledger.used == 800_000 and state.ledger.peak == 800_000
    assert state.clock.now() == 0.0
    assert hal.report()["kernel_fallbacks"] == {}
    del keep


def test_an_output_beyond_host_memory_is_the_devices_out_of_memory(sim_hal, monkeypatch):
    """4 TiB of product: DeviceOutOfMemoryError naming it, never the host allocator's failure."""
    hal = sim_hal()
    dev = hal.device("simasic:0")
    state = dev.adapter.state(0)
    spy = MatmulSpy(state.ledger, refuse=True)
    monkeypatch.setattr(torch, "matmul", spy)
    a, b = torch.randn(1 << 20, 1), torch.randn(1, 1 << 20)
    with (
        pytest.raises(DeviceOutOfMemoryError, match=r"requested 4398046511104 bytes with 0 of 1048576"),
        hal.use(dev),
    ):
        torchhal.ops.matmul(a, b)
    assert spy.used_at_calls == []
    assert state.ledger.used == 0 and state.clock.now() == 0.0


def test_the_reservation_is_held_while_computing_and_given_back_on_failure(sim_hal, monkeypatch):
    hal = sim_hal()
    dev = hal.device("simasic:0")
    ledger, clock = dev.adapter.state(0).ledger, dev.adapter.state(0).clock
    spy = MatmulSpy(ledger)
    monkeypatch.setattr(torch, "matmul", spy)
    a, b = torch.randn(37, 11), torch.randn(11, 23)
    with hal.use(dev):
        out = torchhal.ops.matmul(a, b)
    assert spy.used_at_calls == [37 * 23 * 4]  # charged before the host computed it
    assert ledger.used == 37 * 23 * 4 == out.untyped_storage().nbytes()
    del out

    failing = MatmulSpy(ledger, refuse=True)
    monkeypatch.setattr(torch, "matmul", failing)
    start = clock.now()
    with pytest.raises(torchhal.hal_core.KernelFailedError, match="was computed"), hal.use(dev):
        torchhal.ops.matmul(torch.randn(5, 3), torch.randn(3, 7))
    assert failing.used_at_calls[0] == 5 * 7 * 4  # the simasic candidate's reservation
    assert ledger.used == 0 and clock.now() == start


def test_a_missed_estimate_is_warned_once_counted_and_the_ledger_holds_the_real_size(
    sim_hal, monkeypatch, capsys
):
    monkeypatch.setitem(workloads.OUTPUT_BYTES, "matmul", lambda **_: 8)  # before registration
    monkeypatch.setattr(kernels, "_missed", set())
    hal = sim_hal()
    dev = hal.device("simasic:0")
    ledger = dev.adapter.state(0).ledger
    counted = "torchhal.simasic.output_estimates_missed,op=matmul"
    before = telemetry.counts().get(counted, 0)
    with hal.use(dev):
        first = torchhal.ops.matmul(torch.randn(9, 4), torch.randn(4, 5))
        second = torchhal.ops.matmul(torch.randn(9, 4), torch.randn(4, 5))
    assert ledger.used == 2 * 9 * 5 * 4
    assert telemetry.counts()[counted] == before + 2
    logged = capsys.readouterr().err
    assert logged.count("simasic estimated this op's results at another size than they took") == 1
    assert "estimated_bytes=8" in logged and "held_bytes=180" in logged
    del first, second


def test_every_ops_estimate_is_its_results_storage_on_the_conformance_inputs(monkeypatch):
    """The kit's inputs for every op (odd shapes, every layout it tries): each estimate exact."""
    estimated: dict[str, int] = {}

    def recording(op: str, estimate: Callable[..., int]) -> Callable[..., int]:
        def record(**arguments: Any) -> int:
            estimated[op] = estimated.get(op, 0) + 1
            return estimate(**arguments)

        return record

    assert workloads.OUTPUT_BYTES.keys() == workloads.WORKLOADS.keys()
    for op, estimate in list(workloads.OUTPUT_BYTES.items()):
        monkeypatch.setitem(workloads.OUTPUT_BYTES, op, recording(op, estimate))
    missed_before = {k: v for k, v in telemetry.counts().items() if "output_estimates_missed" in k}
    report = run_conformance(SimASICAdapter(bundled_spec("edge")))
    assert report.ok
    assert sorted(estimated) == sorted(workloads.WORKLOADS)
    missed = {k: v for k, v in telemetry.counts().items() if "output_estimates_missed" in k}
    assert missed == missed_before


# --- collectives -------------------------------------------------------------------------


@pytest.mark.parametrize("collective", sorted(_RING_TRAFFIC))
def test_a_collective_of_no_ranks_is_refused_naming_world_size(tiny: Callable[..., SimASICSpec], collective):
    spec = tiny(host_link_bytes_per_s=1e9)
    with pytest.raises(
        InvalidArgumentError, match=rf"{collective} cost: world_size must be an integer >= 1.*got 0"
    ):
        collective_time_s(spec, collective, 1000, 0)
    assert collective_time_s(spec, collective, 0, 1) == pytest.approx(LAUNCH, rel=1e-12)


def test_charge_collective_of_no_ranks_leaves_the_clock(tiny):
    adapter = SimASICAdapter(tiny(host_link_bytes_per_s=1e9))
    with pytest.raises(InvalidArgumentError, match="world_size must be an integer >= 1"):
        adapter.charge_collective(0, "all_reduce", 4096, 0)
    assert adapter.state(0).clock.now() == 0.0


# --- rates the cost model divides by -----------------------------------------------------

RATES = ("clock_hz", "memory_bandwidth_bytes_per_s", "host_link_bytes_per_s")


@pytest.mark.parametrize("field", RATES)
def test_a_subnormal_rate_is_refused_naming_the_field_and_the_smallest_normal_one_works(tiny, field):
    for value in (1e-310, 1e-320, 5e-324, SMALLEST_NORMAL / 2):
        with pytest.raises(
            ConfigurationError,
            match=rf"field '{field}': must be at least 2.2250738585072014e-308.*got {value!r}",
        ):
            tiny(**{field: value})
    spec = tiny(**{field: SMALLEST_NORMAL, "devices": 2})  # the bound itself: valid and discovered
    hal = HardwareAbstractionLayer(
        adapters=[SimASICAdapter(spec)], settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
    )
    caps = hal.device("simasic:0").capabilities
    assert caps.declared_peaks is not None
    assert caps.declared_peaks.memory_bandwidth_gbps > 0
    assert min(caps.declared_peaks.tflops.values()) > 0
    assert len(hal.topology().links) == 1


@pytest.mark.parametrize(
    ("field", "value"), [("clock_hz", "1e-310"), ("memory_bandwidth_bytes_per_s", "1e-320")]
)
def test_a_spec_file_with_a_subnormal_rate_is_refused_at_validation(tiny, tmp_path: Path, field, value):
    """The reviewer's files: they validated, then failed discovery or every op."""
    from tests.simasic.tiny import TINY

    lines = [
        f"{key} = {value if key == field else _toml(TINY[key])}"
        for key in TINY
        if key != "macs_per_cell_per_cycle"
    ]
    lines += [
        "[macs_per_cell_per_cycle]",
        *(f"{d} = {m}" for d, m in TINY["macs_per_cell_per_cycle"].items()),
    ]
    path = tmp_path / "spec.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(
        ConfigurationError, match=rf"spec {path}: field '{field}': must be at least .*got {value}"
    ):
        spec_from_env({SPEC_ENV: str(path)})


def _toml(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)
