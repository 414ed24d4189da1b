"""init() and local_device() without starting a process group: device choice and argument errors."""

from __future__ import annotations

import pytest
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import bundled_spec

from tests.plugins.facts import load
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.hal_core import ConfigurationError
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})


def hal_with(*adapters) -> HardwareAbstractionLayer:
    return HardwareAbstractionLayer(adapters=adapters, settings=NO_AUTOLOAD)


@pytest.fixture(autouse=True)
def _no_rendezvous_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def test_local_rank_picks_its_gpu_among_the_recorded_h200_pair():
    hal = hal_with(NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h200x2"))))
    assert [thd.local_device(hal, r).id for r in (0, 1)] == ["cuda:0", "cuda:1"]
    with pytest.raises(
        ConfigurationError, match=r"local rank 2: adapter 'nvidia' has 2 matching device\(s\)"
    ):
        thd.local_device(hal, 2)


def test_host_memory_devices_are_shared_by_local_ranks():
    assert thd.local_device(hal_with(), 3).id == "cpu"
    spec = bundled_spec("datacenter")  # four simulated devices
    hal = hal_with(SimASICAdapter(spec))
    asics = DeviceRequirements(adapter="simasic")
    assert [thd.local_device(hal, r, asics).id for r in (0, 1, 5)] == ["simasic:0", "simasic:1", "simasic:1"]
    assert thd.local_device(hal, 1).id == "cpu"  # without requirements, a real device ranks first


def test_init_without_rendezvous_names_what_is_missing():
    with pytest.raises(ConfigurationError, match="rank, world_size, MASTER_ADDR, MASTER_PORT not given"):
        thd.init(hal_with(), device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefix": "gen/1"}, r"prefix must be a non-empty name without '/', got 'gen/1'"),
        ({"prefix": ""}, r"prefix must be a non-empty name without '/', got ''"),
        ({"prefix": "gen1", "init_method": "file:///tmp/x", "store": object()}, "give one, not both"),
        ({"local_rank": -1}, "local_rank must be >= 0, got -1"),
    ],
)
def test_bad_init_arguments_are_refused(kwargs, message):
    with pytest.raises(ConfigurationError, match=message):
        thd.init(hal_with(), device="cpu", rank=0, world_size=1, **kwargs)


def test_a_malformed_local_rank_variable_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "one")
    with pytest.raises(ConfigurationError, match="LOCAL_RANK must be an integer, got 'one'"):
        thd.init(hal_with(), device="cpu", rank=0, world_size=1)
