"""profiled_throughput: the matmul rate of a device's MeasuredProfile, HeteroGroup.create's default.

Profiles are written where `hal.profile` reads them (the on-disk cache keyed by device
fingerprint), with fresh random figures per test for a CPU and a simulated ASIC, so each
assertion fails if the rate came from anywhere else (a re-measurement, the declared peak, the
plain-torch `direct_*` figures, another dtype's entry).
"""

from __future__ import annotations

import io
import random
from datetime import datetime, timedelta, timezone

import pytest
import torch
import torch.distributed as dist
from torchhal_simasic.adapter import SimASICAdapter
from torchhal_simasic.spec import bundled_spec

from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.hal_core import Device, DType, MeasuredProfile, UnsupportedError, telemetry
from torchhal.hal_core import profile as profile_module
from torchhal.hal_core.settings import Settings


@pytest.fixture(autouse=True)
def _no_rendezvous_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def make_hal(cache_dir) -> HardwareAbstractionLayer:
    settings = Settings.from_env(
        {"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1", "TORCHHAL_CACHE_DIR": str(cache_dir)}
    )
    return HardwareAbstractionLayer(adapters=[SimASICAdapter(bundled_spec("edge"))], settings=settings)


def cache_profile(
    hal: HardwareAbstractionLayer,
    device: Device,
    matmul: dict[DType, float],
    *,
    direct: dict[DType, float] | None = None,
    notes: tuple[str, ...] = (),
) -> MeasuredProfile:
    """A MeasuredProfile of `device` with these matmul figures, stored where `hal.profile` loads it."""
    profile = MeasuredProfile(
        fingerprint=profile_module.fingerprint(device),
        device_id=device.id,
        device_name=device.capabilities.name,
        simulated=device.simulated,
        matmul_tflops=matmul,
        matmul_sizes={d: random.choice((256, 512, 1024)) for d in matmul},
        copy_bandwidth_gbps=random.uniform(5.0, 50.0),
        copy_bytes=64 * 2**20,
        launch_latency_us=random.uniform(1.0, 20.0),
        direct_matmul_tflops=direct,
        measured_at=datetime.now(timezone.utc),
        torch_version=torch.__version__,
        notes=notes,
    )
    path = profile_module.cache_path(hal.settings.cache_dir, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(profile.model_dump_json())
    return profile


@pytest.fixture
def no_measuring(monkeypatch):
    """Fail loudly if a profile is measured instead of read from the cache."""

    def refuse(hal, device):
        raise AssertionError(f"{device.id} was measured; its cached profile was expected")

    monkeypatch.setattr(profile_module, "measure", refuse)


@pytest.fixture
def two_profiles(tmp_path, no_measuring):
    """A CPU and a simulated ASIC with cached profiles: the ASIC k_fp32 times (fp32) and k_bf16
    times (bf16) the CPU's rate, while the CPU's plain-torch figures would give other ratios."""
    hal = make_hal(tmp_path)
    cpu, asic = hal.device("cpu"), hal.device("simasic:0")
    k_fp32, k_bf16 = random.sample(range(2, 8), 2)  # two different ratios
    base32, base16 = random.uniform(0.05, 0.5), random.uniform(0.05, 0.5)
    cache_profile(
        hal,
        cpu,
        {DType.FP32: base32, DType.BF16: base16},
        direct={DType.FP32: base32 * 9.5, DType.BF16: base16 * 11.5},
    )
    cache_profile(hal, asic, {DType.FP32: base32 * k_fp32, DType.BF16: base16 * k_bf16})
    return hal, cpu, asic, {torch.float32: (base32, k_fp32), torch.bfloat16: (base16, k_bf16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rate_is_the_cached_profiles_matmul_figure_for_the_dtype(two_profiles, dtype):
    hal, cpu, asic, figures = two_profiles
    base, k = figures[dtype]
    assert thd.profiled_throughput(hal, cpu, dtype) == base
    assert thd.profiled_throughput(hal, asic, dtype) == pytest.approx(base * k, rel=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_batch_follows_the_profiled_ratio(two_profiles, dtype):
    hal, cpu, asic, figures = two_profiles
    _, k = figures[dtype]
    per_cpu = random.randint(2, 20)
    rates = [thd.profiled_throughput(hal, d, dtype) for d in (cpu, asic)]
    assert thd.split_batch((k + 1) * per_cpu, rates) == (per_cpu, k * per_cpu)


def test_hetero_group_create_defaults_to_the_profiled_rate(two_profiles, tmp_path):
    hal, _, asic, figures = two_profiles
    base, k = figures[torch.bfloat16]
    store = dist.FileStore(str(tmp_path / "store"), 1)
    ctx = thd.init(hal, device=asic, rank=0, world_size=1, store=store, timeout=timedelta(seconds=10))
    try:
        global_batch = random.randint(3, 40)
        group = thd.HeteroGroup.create(ctx, global_batch=global_batch, dtype=torch.bfloat16)
    finally:
        ctx.shutdown()
    assert group.throughputs == pytest.approx((base * k,), rel=1e-12)
    assert group.batch_sizes == (global_batch,)


def test_a_dtype_the_profile_did_not_measure_is_refused_with_what_it_measured(tmp_path, no_measuring):
    hal = make_hal(tmp_path)
    asic = hal.device("simasic:0")
    note = f"matmul bf16 not measured: RuntimeError: refused {random.randrange(10**6)}"
    cache_profile(hal, asic, {DType.FP32: random.uniform(0.5, 5.0)}, notes=(note,))
    with pytest.raises(
        UnsupportedError,
        match=r"throughput of simasic:0 in torch.bfloat16: its profile measured matmul only in \['fp32'\]",
    ) as info:
        thd.profiled_throughput(hal, asic, torch.bfloat16)
    assert note in str(info.value)
    with pytest.raises(UnsupportedError, match=r"in torch\.complex64"):  # a format the HAL does not track
        thd.profiled_throughput(hal, asic, torch.complex64)


def test_a_device_without_a_cached_profile_is_measured_once_then_read_back(tmp_path, monkeypatch):
    """The documented behaviour: `hal.profile` measures on a cache miss (saying so, since it is
    seconds of device work) and stores the result."""
    hal = make_hal(tmp_path)
    asic = hal.device("simasic:0")
    path = profile_module.cache_path(hal.settings.cache_dir, asic)
    assert not path.exists()
    telemetry.configure(log_level="info", log_stream=(stream := io.StringIO()))
    rate = thd.profiled_throughput(hal, asic, torch.float32)
    assert stream.getvalue().count("measuring device profile") == 1
    stored = MeasuredProfile.model_validate_json(path.read_text())
    assert stored.device_id == "simasic:0" and stored.simulated
    assert rate == stored.matmul_tflops[DType.FP32] > 0

    def refuse(hal, device):
        raise AssertionError(f"{device.id} was measured again")

    monkeypatch.setattr(profile_module, "measure", refuse)
    fresh = make_hal(tmp_path)  # a new HAL has no profile in memory: it reads the cached one
    assert thd.profiled_throughput(fresh, fresh.device("simasic:0"), torch.float32) == rate
    assert stream.getvalue().count("measuring device profile") == 1
