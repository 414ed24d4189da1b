"""Communicator.create in this process: argument errors (no group is made) and a world of one.

A one-rank gloo group through a FileStore is enough to check wrapping, the backend check and
ownership; every such test destroys the group it made.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import (
    CollectiveError,
    ConfigurationError,
    DeviceCapabilities,
    DType,
    HealthReport,
    HealthStatus,
    MemoryInfo,
    ProbeResult,
    Topology,
    UnsupportedError,
    VendorAdapter,
    telemetry,
)
from torchhal.hal_core.collectives import Communicator

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RecordedXPUAdapter(VendorAdapter):
    """Recorded facts of Intel Max 1550 GPUs: enough to choose a backend, never to run on."""

    name = "recorded-xpu"
    vendor = "intel"
    priority = 10

    def __init__(self, count: int = 1) -> None:
        self.count = count

    def probe(self) -> ProbeResult:
        return ProbeResult(available=True, reason="recorded facts")

    def discover(self) -> Sequence[DeviceCapabilities]:
        return [
            DeviceCapabilities(
                vendor="intel",
                adapter=self.name,
                device_type="xpu",
                index=i,
                name="Intel Data Center GPU Max 1550 (recorded)",
                arch="xe-hpc",
                compute_units=128,
                simd_width=16,
                memory_bytes=128 * 2**30,
                dtypes=frozenset({DType.FP32, DType.BF16}),
                collective_backends=("xccl",),
            )
            for i in range(self.count)
        ]

    def synchronize(self, index: int) -> None:
        raise AssertionError("recorded device: never run on")

    def memory_info(self, index: int) -> MemoryInfo:
        raise AssertionError("recorded device: never run on")

    def health(self, index: int) -> HealthReport:
        return HealthReport(status=HealthStatus.UNKNOWN)

    def topology(self) -> Topology:
        return Topology(devices=tuple(f"xpu:{i}" for i in range(self.count)))

    def collective_backend(self) -> str:
        return "xccl"


@pytest.fixture
def no_group(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No default group and no torchrun variables; any group a test makes is destroyed after it."""
    if dist.is_initialized():
        pytest.skip("another test left a default process group in this process; these tests need none")
    for name in TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def hal(monkeypatch: pytest.MonkeyPatch) -> HardwareAbstractionLayer:
    monkeypatch.setenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "1")
    return HardwareAbstractionLayer()


def test_env_rendezvous_names_every_missing_variable(no_group: None, hal: HardwareAbstractionLayer) -> None:
    with pytest.raises(
        ConfigurationError, match=r"through env://: rank, world_size, MASTER_ADDR, MASTER_PORT not given"
    ):
        Communicator.create(hal)
    assert not dist.is_initialized()


def test_store_needs_rank_and_world_size(
    no_group: None, hal: HardwareAbstractionLayer, tmp_path: Path
) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(ConfigurationError, match=r"through store: rank, world_size not given"):
        Communicator.create(hal, store=store)
    with pytest.raises(ConfigurationError, match=r"init_method and store: give one, not both"):
        Communicator.create(hal, store=store, init_method=(tmp_path / "f").as_uri(), rank=0, world_size=1)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"world_size": "2", "rank": 0}, r"world_size must be an int, got str '2'"),
        ({"world_size": 1, "rank": True}, r"rank must be an int, got bool True"),
        ({"world_size": 1, "rank": 0, "timeout": 5}, r"timeout must be a positive datetime.timedelta, got 5"),
        (
            {"world_size": 1, "rank": 0, "timeout": timedelta(0)},
            r"timeout must be a positive .* got datetime",
        ),
        ({"world_size": 1, "rank": 0, "timeout": timedelta(seconds=-1)}, r"timeout must be a positive"),
    ],
)
def test_argument_types_and_timeout_are_checked_before_any_group(
    no_group: None, hal: HardwareAbstractionLayer, tmp_path: Path, arguments: dict, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        Communicator.create(hal, init_method=(tmp_path / "rendezvous").as_uri(), **arguments)
    assert not dist.is_initialized()


def test_bad_rank_values_are_refused(
    no_group: None, hal: HardwareAbstractionLayer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = (tmp_path / "rendezvous").as_uri()
    with pytest.raises(
        ConfigurationError, match=r"rank must be in \[0, world_size\) .* got rank 2, world_size 2"
    ):
        Communicator.create(hal, rank=2, world_size=2, init_method=url)
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ConfigurationError, match=r"RANK must be an integer, got 'zero'"):
        Communicator.create(hal, world_size=1, init_method=url)
    assert not dist.is_initialized()


@pytest.mark.skipif(
    getattr(torch.accelerator.current_accelerator(), "type", None) == "xpu",
    reason="the recorded XPUs would be bound to the real XPU runtime here",
)
def test_local_rank_picks_the_device_of_that_index(
    no_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "1")
    xpu_hal = HardwareAbstractionLayer(adapters=[RecordedXPUAdapter(count=2)])
    url = (tmp_path / "rendezvous").as_uri()
    monkeypatch.setenv("LOCAL_RANK", "1")
    # Recorded devices, no XPU runtime: binding the chosen device fails, and the error names it.
    with pytest.raises(ConfigurationError, match=r"device xpu:1: torch's accelerator is \S+, not xpu"):
        Communicator.create(xpu_hal, rank=0, world_size=1, init_method=url)
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(
        ConfigurationError, match=r"local rank 5: .* \['xpu:0', 'xpu:1'\], so at most 2 processes"
    ):
        Communicator.create(xpu_hal, rank=0, world_size=1, init_method=url)
    assert not dist.is_initialized()


def test_owner_initialises_and_destroys_the_default_group(
    no_group: None, hal: HardwareAbstractionLayer, tmp_path: Path
) -> None:
    url = (tmp_path / "rendezvous").as_uri()
    with Communicator.create(hal, rank=0, world_size=1, init_method=url) as comm:
        assert dist.is_initialized() and dist.get_backend() == "gloo"
        assert (comm.rank, comm.world_size, comm.backend) == (0, 1, "gloo")
        x = torch.rand(5, 3) + 0.5
        torch.testing.assert_close(comm.all_gather(x), x, rtol=0, atol=0)
    assert not dist.is_initialized()
    with pytest.raises(CollectiveError, match=r"all_reduce: this communicator was destroyed"):
        comm.all_reduce(x)


def test_wrapping_checks_the_group_serves_the_device(
    no_group: None, hal: HardwareAbstractionLayer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist.init_process_group("gloo", init_method=(tmp_path / "rendezvous").as_uri(), rank=0, world_size=1)
    xpu_hal = HardwareAbstractionLayer(adapters=[RecordedXPUAdapter()])
    with pytest.raises(
        ConfigurationError,
        match=r"backend 'cpu:gloo,cuda:gloo' serves xpu tensors with None, but device xpu:0 needs 'xccl'",
    ):
        Communicator.create(xpu_hal, device="xpu:0")
    wrapper = Communicator.create(hal)
    assert wrapper.backend == "gloo" and wrapper.rank == 0
    wrapper.destroy()
    assert dist.is_initialized(), "a wrapper does not destroy the group it wrapped"


def test_a_timeout_given_for_an_existing_group_is_said_not_applied(
    no_group: None, hal: HardwareAbstractionLayer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group's timeout is fixed when it is made: wrapping one with another timeout ignored it
    without a word, and `comm.timeout` then named the group's."""
    made = timedelta(seconds=37)
    dist.init_process_group(
        "gloo", init_method=(tmp_path / "rendezvous").as_uri(), rank=0, world_size=1, timeout=made
    )
    counted = "torchhal.collective.timeout_not_applied"
    before = telemetry.counts().get(counted, 0)
    same = Communicator.create(hal, timeout=made)
    assert same.timeout == made and telemetry.counts().get(counted, 0) == before
    other = Communicator.create(hal, timeout=timedelta(seconds=5))
    assert other.timeout == made and telemetry.counts()[counted] == before + 1
    assert "timeout given for a process group that exists" in capsys.readouterr().err


def test_host_all_gather_of_a_group_without_a_host_backend_runs_on_the_device_warned(
    no_group: None, hal: HardwareAbstractionLayer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """A group of a device backend alone (a user's `init_process_group("xccl")`) has no host side:
    the gather runs on the device in fp32, which devices declare far more often than fp64 (fp64,
    which many refuse, failed `train()`'s first agreement), warned and counted."""
    from torchhal.hal_core import collectives

    collectives._say_gathered_on_device.cache_clear()
    url = (tmp_path / "rendezvous").as_uri()
    with Communicator.create(hal, rank=0, world_size=1, init_method=url) as comm:
        monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "xpu:xccl")
        monkeypatch.setattr(type(comm.device), "require_dtype", _refuse_all_but_fp32)
        key = "torchhal.collective.host_gather_on_device,backend=gloo"
        before = telemetry.counts().get(key, 0)
        value = float(torch.randint(1, 2**20, ()).item())
        assert comm.host_all_gather(value) == [value]
        assert telemetry.counts()[key] == before + 1
    assert "host_all_gather runs on the device" in capsys.readouterr().err
    collectives._say_gathered_on_device.cache_clear()


def _refuse_all_but_fp32(device: object, dtype: torch.dtype, *, what: str) -> None:
    if dtype != torch.float32:
        raise UnsupportedError(f"{what}: dtype {dtype} is not supported")
