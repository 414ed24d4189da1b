"""The profile cache: a cached profile is used; an unusable one is a logged miss, measured again."""

from __future__ import annotations

import json

import pytest

from tests.core.adapters import FakeAdapter
from tests.core.test_capabilities import measured
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import SCHEMA_VERSION, telemetry
from torchhal.hal_core import profile as profile_module


@pytest.fixture
def hal(settings, tmp_path):
    return HardwareAbstractionLayer(
        adapters=[FakeAdapter()], settings=settings(disable_plugin_autoload="1", cache_dir=str(tmp_path))
    )


@pytest.fixture
def measurements(monkeypatch, hal):
    """Replaces the micro-benchmarks (seconds of work) with a record of each device measured."""
    done: list[str] = []

    def measure(_hal, device):
        done.append(device.id)
        return measured(fingerprint=profile_module.fingerprint(device), device_id=device.id)

    monkeypatch.setattr(profile_module, "measure", measure)
    return done


def test_a_cached_profile_is_read_not_measured(hal, measurements):
    first = hal.profile("acme:0")
    fresh = HardwareAbstractionLayer(adapters=[FakeAdapter()], settings=hal.settings)
    assert fresh.profile("acme:0") == first
    assert measurements == ["acme:0"]


@pytest.mark.parametrize(
    ("stale", "reason"),
    [
        (lambda doc: json.dumps({**doc, "schema_version": 0}), "reads schema_version 1, got 0"),
        (lambda doc: json.dumps(doc)[:40], "Invalid JSON"),  # a truncated file
        (lambda doc: json.dumps({**doc, "copy_bytes": "lots"}), "copy_bytes: "),
        # what no measurement writes: numbers as strings, NaN, infinite, zero and negative figures
        (
            lambda doc: json.dumps({**doc, "copy_bytes": "1048576"}),
            "copy_bytes: Input should be a valid integer",
        ),
        (lambda doc: json.dumps({**doc, "matmul_tflops": {"fp32": float("nan")}}), "matmul_tflops.fp32: "),
        (lambda doc: json.dumps({**doc, "launch_latency_us": float("inf")}), "launch_latency_us: "),
        (lambda doc: json.dumps({**doc, "copy_bandwidth_gbps": -2.0}), "copy_bandwidth_gbps: "),
        (lambda doc: json.dumps({**doc, "matmul_sizes": {"fp32": 0}}), "matmul_sizes.fp32: "),
        # a rate without its size: `torchhal profile` crashed printing it (KeyError)
        (
            lambda doc: json.dumps({**doc, "matmul_sizes": {}}),
            "matmul_tflops and matmul_sizes must name the same dtypes",
        ),
        (
            lambda doc: json.dumps({k: v for k, v in doc.items() if k != "schema_version"}),
            "no schema_version",
        ),
        (lambda doc: json.dumps({**doc, "device_id": "acme:7"}), "a record of another device"),
        (lambda doc: json.dumps({**doc, "fingerprint": "fedcba9876543210"}), "a record of another device"),
    ],
    ids=[
        "old-schema-version",
        "torn",
        "invalid-field",
        "number-as-string",
        "nan",
        "infinite",
        "negative",
        "zero-size",
        "rate-without-size",
        "no-schema-version",
        "other-device-id",
        "other-fingerprint",
    ],
)
def test_an_unusable_cached_profile_is_measured_again_and_logged(hal, measurements, capsys, stale, reason):
    device = hal.device("acme:0")
    path = profile_module.cache_path(hal.settings.cache_dir, device)
    path.parent.mkdir(parents=True)
    doc = measured(fingerprint=profile_module.fingerprint(device)).model_dump(mode="json")
    path.write_text(stale(doc))
    telemetry.configure(log_format="json")

    got = hal.profile(device)

    assert measurements == ["acme:0"] and got.schema_version == SCHEMA_VERSION
    assert json.loads(path.read_text())["schema_version"] == SCHEMA_VERSION  # the cache is replaced
    (line,) = (json.loads(raw) for raw in capsys.readouterr().err.splitlines())
    assert (line["level"], line["event"]) == ("warning", "cached profile unusable; measuring again")
    assert line["path"] == str(path) and reason in line["reason"]


def test_a_cache_dir_that_cannot_be_written_keeps_the_measurement(settings, tmp_path, monkeypatch, capsys):
    """TORCHHAL_CACHE_DIR a file: the profile measured, then the write raised and it was lost; so
    was an op's result when measured selection stored its winner. Now both are logged and kept."""
    from torchhal.hal_core.tuning import Tuner

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter()], settings=settings(disable_plugin_autoload="1", cache_dir=str(blocked))
    )
    done: list[str] = []
    monkeypatch.setattr(
        profile_module,
        "measure",
        lambda _hal, device: done.append(device.id) or measured(device_id=device.id),
    )
    telemetry.configure(log_format="json")

    got = hal.profile("acme:0")
    Tuner(blocked).remember(
        hal.device("acme:0"), "rms_norm", ("sig",), "torchhal/triton", ["torchhal/triton"]
    )

    assert done == ["acme:0"] and got.device_id == "acme:0"
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    written = [x for x in lines if x["event"] == "cache not written; check TORCHHAL_CACHE_DIR"]
    assert len(written) == 2 and all("NotADirectoryError" in x["error"] for x in written)


def test_concurrent_writers_never_leave_a_reader_half_a_file(tmp_path):
    """Every writer used `<name>.tmp`: two processes writing one cache file truncated each other's
    temporary file, so the rename could publish half of one. Each writer now has its own."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "selections" / "shared.json"
    writer = textwrap.dedent(f"""
        import json, sys
        from pathlib import Path
        from torchhal.hal_core.profile import write_cached
        text = json.dumps({{"writer": sys.argv[1], "padding": "x" * 200_000}})
        for _ in range(150):
            assert write_cached(Path({str(path)!r}), text)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", writer, name]) for name in ("a", "b")]
    torn = 0
    while any(p.poll() is None for p in procs):
        if path.exists():
            try:
                json.loads(path.read_text())
            except ValueError:
                torn += 1
    assert [p.wait() for p in procs] == [0, 0]
    assert torn == 0 and json.loads(path.read_text())["writer"] in {"a", "b"}
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind


def test_launch_latency_stands_beside_a_plain_torch_copy(settings, tmp_path, monkeypatch):
    """Every measured figure has its plain-torch peer from the same run; launch latency had none."""
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1", cache_dir=str(tmp_path)))

    def no_matmul(*args, **kwargs):  # the matmul sweep takes seconds; this test is about the copies
        raise RuntimeError("matmul left out of this test")

    monkeypatch.setattr(profile_module, "_matmul_rates", no_matmul)
    prof = profile_module.measure(hal, hal.device("cpu"))
    assert prof.direct_launch_latency_us is not None
    # both are one-element copies on the host: the same order of magnitude, not a constant
    assert 0.1 < prof.launch_latency_us / prof.direct_launch_latency_us < 10
    assert prof.direct_copy_bandwidth_gbps is not None and not prof.matmul_tflops


def test_a_peer_that_fails_leaves_the_hals_figure_with_a_note(settings, tmp_path, monkeypatch):
    """A dtype only a plugin's kernel multiplies: torch.matmul raising lost the HAL's figure too."""
    import torch

    from torchhal.hal_core import DType

    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1", cache_dir=str(tmp_path)))
    hal.kernels.register("matmul", "operator", lambda a, b: a @ b, provider="test", priority=1e9)

    def refuses(*args, **kwargs):
        raise RuntimeError("no matmul for this dtype here")

    monkeypatch.setattr(torch, "matmul", refuses)
    n, rate, peer, problem = profile_module._matmul_rates(hal, hal.device("cpu"), DType.FP32, max_n=64)
    assert n > 0 and rate > 0 and peer is None
    assert problem == "RuntimeError: no matmul for this dtype here"


def test_another_thread_count_or_schema_version_is_another_profile(hal, monkeypatch):
    """The CPU's compute units are torch's threads: a profile measured under OMP_NUM_THREADS=1 was
    served to a full-core run. And an older torchhal sharing the cache replaced a newer one's
    profile (a file of another schema version is a miss, measured again and written over)."""
    device = hal.device("cpu")
    first = profile_module.fingerprint(device)
    wider = device.capabilities.model_copy(update={"compute_units": device.capabilities.compute_units + 1})
    monkeypatch.setattr(device, "capabilities", wider)
    assert profile_module.fingerprint(device) != first
    monkeypatch.setattr(
        device, "capabilities", wider.model_copy(update={"compute_units": wider.compute_units - 1})
    )
    assert profile_module.fingerprint(device) == first
    monkeypatch.setattr(profile_module, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    assert profile_module.fingerprint(device) != first


def test_a_profile_that_lost_a_figure_to_out_of_memory_is_measured_again(hal, monkeypatch):
    """Such a profile is "not cached, the next run measures again" (its note): the HAL kept it
    in memory and served it, gap included, for the rest of its life."""
    done: list[str] = []

    def measure(_hal, device):
        done.append(device.id)
        notes = (
            [f"matmul bf16 not measured: MemoryError ({profile_module.PASSING})"] if len(done) == 1 else []
        )
        return measured(fingerprint=profile_module.fingerprint(device), device_id=device.id, notes=notes)

    monkeypatch.setattr(profile_module, "measure", measure)
    first = hal.profile("acme:0")
    second = hal.profile("acme:0")
    assert profile_module.passing_losses(first) == ["bf16"] and not profile_module.passing_losses(second)
    assert hal.profile("acme:0") is second  # the whole profile is kept
    assert done == ["acme:0", "acme:0"]
