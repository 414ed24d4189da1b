"""Memory figures a platform cannot give are "unknown" (`MemoryInfo.unknown`), not a 0 read as a
measurement: by the CPU adapter on Windows and macOS, by the profile's sizing, by requirements."""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch
from pydantic import ValidationError
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import parse_spec

from tests.core.test_profile_fits_free_memory import _largest_fitting_n
from tests.simasic.tiny import TINY
from torchhal import DeviceRequirements, HardwareAbstractionLayer
from torchhal.hal_core import DType, InvalidArgumentError, MemoryInfo, telemetry
from torchhal.hal_core.adapters import cpu
from torchhal.hal_core.settings import Settings

MiB = 2**20


@pytest.fixture(autouse=True)
def fresh_warnings():
    cpu._unreadable.cache_clear()  # said once per process: each test starts unsaid
    yield
    cpu._unreadable.cache_clear()


def test_unknown_figures_are_named_zero_and_read_as_none():
    total = random.randint(2**30, 2**40)
    used = random.randint(1, total // 2)
    info = MemoryInfo(total_bytes=total, free_bytes=0, used_bytes=used, unknown={"free"})
    assert (info.known("total"), info.known("free"), info.known("used")) == (total, None, used)
    assert info.model_dump(mode="json")["unknown"] == ["free"]
    assert MemoryInfo(total_bytes=total, free_bytes=0, used_bytes=used).known("free") == 0  # a measured 0
    with pytest.raises(
        ValidationError, match=rf"used_bytes must be 0 when 'unknown' names 'used', got {used}"
    ):
        MemoryInfo(total_bytes=total, free_bytes=0, used_bytes=used, unknown={"used"})
    with pytest.raises(ValidationError, match=r"unknown\.0\n.*'total', 'free' or 'used'.*input_value='peak'"):
        MemoryInfo(total_bytes=total, free_bytes=0, used_bytes=used, unknown={"peak"})
    with pytest.raises(InvalidArgumentError, match=r"figure must be one of .*got 'peak'"):
        info.known("peak")  # type: ignore[arg-type]


def test_windows_cpu_gives_no_memory_figure(monkeypatch):
    """No os.sysconf: every figure was 0, indistinguishable from a measured 0."""
    monkeypatch.delattr(os, "sysconf")
    info = cpu.CPUAdapter().memory_info(0)
    assert info.unknown == {"total", "free", "used"}
    assert (info.known("total"), info.known("free"), info.known("used")) == (None, None, None)


def test_macos_cpu_gives_total_only(monkeypatch):
    """No SC_AVPHYS_PAGES and no /proc: free and used were 0 (used silently, with no log or count)."""
    names = {k: v for k, v in os.sysconf_names.items() if k != "SC_AVPHYS_PAGES"}
    monkeypatch.setattr(os, "sysconf_names", names)

    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", path)

    monkeypatch.setattr(cpu, "open", no_proc, raising=False)
    key = "torchhal.cpu.unreadable,figure=resident set"
    before = telemetry.counts().get(key, 0)
    adapter = cpu.CPUAdapter()
    info = adapter.memory_info(0)
    assert info.unknown == {"free", "used"}
    assert info.known("total") == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    adapter.memory_info(0)
    assert telemetry.counts()[key] == before + 1  # said once, however often asked


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and SC_AVPHYS_PAGES (Linux)")
def test_linux_cpu_knows_every_figure():
    info = cpu.CPUAdapter().memory_info(0)
    assert info.unknown == frozenset()
    assert 0 < info.known("used") < info.known("total")  # type: ignore[operator]


def test_a_device_of_unstated_memory_is_not_said_to_have_0_bytes():
    caps = cpu.CPUAdapter().discover()[0].model_copy(update={"memory_bytes": 0})
    need = random.randint(1, 2**40)
    failures = DeviceRequirements(min_memory_bytes=need).failures(caps)
    assert failures == [f"memory unknown (the adapter does not state it), {need} required"]


class _Unstated(SimASICAdapter):
    """A simulated device whose runtime does not give the figures named in `unknown`."""

    unknown: frozenset[str] = frozenset()
    declared_memory = True

    def memory_info(self, index):
        info = super().memory_info(index)
        return info.model_copy(update={f"{f}_bytes": 0 for f in self.unknown} | {"unknown": self.unknown})

    def discover(self):
        return [
            c if self.declared_memory else c.model_copy(update={"memory_bytes": 0})
            for c in super().discover()
        ]


def _profile(tmp_path, adapter):
    env = {"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHHAL_CACHE_DIR": str(tmp_path)}
    return HardwareAbstractionLayer(adapters=[adapter], settings=Settings.from_env(env)).profile("simasic:0")


@pytest.mark.parametrize("unknown", [{"free"}, {"total", "free"}])
def test_profile_with_free_memory_unknown_fits_the_capacity(tmp_path, unknown):
    """Fitted to the 0 read as free, every matmul ran at n = 16: a launch, not the device."""
    memory = random.randint(2 * MiB, 3 * MiB - 1)
    adapter = _Unstated(parse_spec({**TINY, "memory_bytes": memory}, "test"))
    adapter.unknown = frozenset(unknown)
    key = "torchhal.profile.memory_unknown,device=simasic:0"
    before = telemetry.counts().get(key, 0)
    prof = _profile(tmp_path, adapter)
    assert not [n for n in prof.notes if "not measured" in n], prof.notes
    for dtype, tdtype in ((DType.FP32, torch.float32), (DType.BF16, torch.bfloat16)):
        assert prof.matmul_sizes[dtype] == _largest_fitting_n(memory, tdtype.itemsize)
    assert f"free memory unknown: matmul and copy sizes fitted to total memory ({memory} bytes)" in prof.notes
    assert telemetry.counts()[key] == before + 1


def test_profile_with_no_memory_figure_takes_host_sizes(tmp_path):
    """Nothing to fit to: the host's laptop sizes (n <= 512 simulated, a 64 MiB copy), said so,
    rather than the 1 GiB copy of an accelerator, which failed the whole profile here."""
    adapter = _Unstated(parse_spec({**TINY, "memory_bytes": random.randint(160, 200) * MiB}, "test"))
    adapter.unknown, adapter.declared_memory = frozenset({"total", "free", "used"}), False
    prof = _profile(tmp_path, adapter)
    assert prof.copy_bytes == 64 * MiB
    assert prof.matmul_sizes == {DType.FP32: 512, DType.BF16: 512}
    assert (
        "free and total memory unknown: matmul and copy at the host's sizes, not fitted to memory"
        in prof.notes
    )


def test_the_choice_says_memory_not_stated_not_0_gib(monkeypatch, tmp_path):
    """Without os.sysconf (Windows) the host's capacity is 0, which read "0.0 GiB" (the demo and
    `torchhal info` print `memory_text` too)."""
    monkeypatch.delattr(os, "sysconf")
    monkeypatch.setenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path))
    (host,) = HardwareAbstractionLayer().devices()
    assert host.capabilities.memory_text == "memory not stated"
    explained = "cpu: chosen: real device; adapter 'cpu' priority 0; no declared peak; memory not stated"
    assert HardwareAbstractionLayer().choose_device().explain() == explained


def test_info_says_memory_not_stated_for_the_host_without_sysconf(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from torchhal.cli import app

    monkeypatch.delattr(os, "sysconf")
    monkeypatch.setenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path))
    result = CliRunner().invoke(app, ["info"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    words = " ".join(result.output.split())  # the table may fold the cell
    assert "memory not stated" in words and "0.0 GiB" not in result.output, result.output
