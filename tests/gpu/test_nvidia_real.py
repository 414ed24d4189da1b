"""On a real NVIDIA GPU host: the adapter reports the hardware as nvidia-smi independently does."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DType, Feature, LinkType

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.version.hip is not None, reason="needs an NVIDIA GPU"
    ),
]


def smi(query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return [[field.strip() for field in line.split(",")] for line in out.strip().splitlines()]


@pytest.fixture(scope="module")
def hal():
    return HardwareAbstractionLayer()


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi as an independent witness")
def test_devices_match_nvidia_smi(hal):
    rows = smi("index,name,memory.total,compute_cap,uuid")
    cuda = [d for d in hal.devices() if d.capabilities.vendor == "nvidia"]
    assert [d.id for d in cuda] == [f"cuda:{i}" for i in range(len(rows))]
    for dev, (index, name, mem_mib, cap, uuid) in zip(cuda, rows, strict=True):
        caps = dev.capabilities
        assert caps.name == name
        assert caps.arch == "sm_" + cap.replace(".", "")
        assert abs(caps.memory_bytes - int(mem_mib) * 2**20) <= 0.02 * int(mem_mib) * 2**20
        assert caps.compute_units == torch.cuda.get_device_properties(int(index)).multi_processor_count
        if caps.uuid is not None:
            assert caps.uuid.removeprefix("GPU-") == uuid.removeprefix("GPU-")
        if caps.arch == "sm_90":
            assert caps.compute_units == 132
            assert {DType.BF16, DType.FP8_E4M3, DType.FP8_E5M2, DType.TF32} <= caps.dtypes
            assert Feature.TENSOR_CORES in caps.features and Feature.FP8 in caps.features
        assert caps.simd_width == 32
        assert caps.collective_backends[0] == "nccl"


def test_nvlink_peers_on_a_multi_gpu_host(hal):
    if torch.cuda.device_count() < 2:
        pytest.skip("a single GPU has no NVLink peers")
    topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, check=True).stdout
    link = hal.topology().link("cuda:0", "cuda:1")
    assert link is not None
    if " NV" in topo:
        assert link.type is LinkType.NVLINK and link.count is not None and link.count > 0
    assert hal.topology().link("cuda:1", "cuda:0") == link


def test_memory_moves_and_health_reads(hal):
    dev = hal.device("cuda:0")
    before = dev.memory_info().used_bytes
    t = dev.empty((256, 2**20), torch.float32).normal_()  # 1 GiB of random data
    dev.synchronize()
    assert dev.memory_info().used_bytes - before >= 2**30 * 0.99
    del t
    report = dev.health()
    assert report.status.value in {"ok", "degraded", "unknown"}


def test_event_timer_measures_device_work(hal):
    dev = hal.device("cuda:0")
    a = torch.randn(4096, 4096, device="cuda:0", dtype=torch.bfloat16)
    timer = dev.timer()
    start = timer.mark()
    for _ in range(10):
        a @ a
    ms = timer.elapsed_ms(start, timer.mark())
    assert 0.05 < ms < 1000


def test_measured_selection_records_the_code_that_competed(tmp_path):
    """On the GPU several attention candidates are valid, so the first call measures them; the
    winner is saved with the versions of the distributions whose kernels competed."""
    import importlib.metadata
    import json

    from torchhal.hal_core.settings import Settings

    settings = Settings.from_env({"TORCHHAL_CACHE_DIR": str(tmp_path), "TORCHHAL_AUTOTUNE": "on"})
    hal = HardwareAbstractionLayer(settings=settings)
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda:0", dtype=torch.bfloat16) for _ in range(3))
    selection = hal.kernels.select("attention", hal.device("cuda:0"), q, k, v, False, None, None)
    assert len(selection.timings_ms) > 1
    (saved,) = (tmp_path / "selections").glob("*.json")
    content = json.loads(saved.read_text())
    expected = {name: importlib.metadata.version(name) for name in ("torchhal", "torchhal-nvidia", "triton")}
    assert {name: content["code"].get(name) for name in expected} == expected
    assert [w["winner"] for w in content["winners"].values()] == [selection.candidate.qualified_name]
    assert content["winners"][next(iter(content["winners"]))]["contenders"] == sorted(
        dict(selection.timings_ms)
    )


def test_graph_replay_recomputes_on_new_inputs(hal):
    """The adapter's graph capture (measured selection's graph timing): one capture of a matmul,
    replays after the input changed in place give the new product, and a replay costs no host
    launch of its kernels."""
    dev = hal.device("cuda:0")
    a, b = (torch.randn(512, 512, device="cuda:0") for _ in range(2))
    out = torch.empty(512, 512, device="cuda:0")
    replay = dev.graph_replay(lambda: torch.matmul(a, b, out=out))
    fresh = torch.randn(512, 512, device="cuda:0")
    a.copy_(fresh)
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, fresh @ b)


def test_graph_replay_captures_on_the_device_it_is_asked_for(hal):
    """torch's default capture stream belongs to the device current at the first capture: a
    later capture of work on another GPU captured nothing. Each device captures on a stream of
    its own, whichever device is current."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    for index in (0, 1, 0):
        device = hal.device(f"cuda:{index}")
        a = torch.randn(256, 256, device=f"cuda:{index}")
        out = torch.empty_like(a)
        replay = device.graph_replay(lambda a=a, out=out: torch.mul(a, 3.0, out=out))
        fresh = torch.randn_like(a)
        a.copy_(fresh)
        replay()
        torch.cuda.synchronize(index)
        torch.testing.assert_close(out, fresh * 3.0)


@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability(0) != (9, 0),
    reason="the kernels' relative speeds asserted are an H100/H200's",
)
def test_graph_timed_selection_picks_what_a_graph_replays_fastest(tmp_path):
    """8 query rows per head against a 32k cache: per call back to back (eager timing) the split-KV
    kernel's two Triton launches cost more host time than its 54 µs on the GPU, and SDPA's flash
    kernel (134 µs on the GPU) won; replayed from a graph, the split-KV kernel is faster, and graph
    timing picks it."""
    from torchhal.hal_core.settings import Settings

    env = {
        "TORCHHAL_CACHE_DIR": str(tmp_path),
        "TORCHHAL_AUTOTUNE": "on",
        "TORCHHAL_SELECTION_TIMING": "graph",
    }
    hal = HardwareAbstractionLayer(settings=Settings.from_env(env))
    q = torch.randn(1, 32, 8, 128, device="cuda:0", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 8, 32768, 128, device="cuda:0", dtype=torch.bfloat16) for _ in range(2))
    selection = hal.kernels.select("attention", hal.device("cuda:0"), q, k, v, False, None, None)
    times = dict(selection.timings_ms)
    assert selection.candidate.qualified_name == "torchhal/triton_decode", times
    assert times["torchhal/triton_decode"] < 0.6 * times["nvidia/sdpa_flash"], times
    (saved,) = (tmp_path / "selections").glob("*.json")
    assert all(key.endswith("|graph") for key in json.loads(saved.read_text())["winners"])


def test_a_first_call_inside_a_callers_capture_selects_without_timing(tmp_path):
    """Selection meets a signature first inside the caller's graph capture: timing there would
    synchronise and invalidate the capture. The capture succeeds with the priority candidate, its
    replay computes the op, and the first call after it measures."""
    import torchhal
    from torchhal.hal_core.settings import Settings
    from torchhal.kernels import attention

    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda:0", dtype=torch.bfloat16) for _ in range(3))
    warm = HardwareAbstractionLayer(settings=Settings(autotune="on", cache_dir=tmp_path / "warm"))
    warm.kernels.call("attention", warm.device("cuda:0"), q, k, v, False, None, None)  # kernels compiled
    hal = HardwareAbstractionLayer(settings=Settings(autotune="on", cache_dir=tmp_path / "fresh"))
    torchhal.ops.set_default_hal(hal)
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            out = torchhal.ops.attention(q, k, v)
        fresh = torch.randn_like(q)
        q.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        expected = attention.reference(fresh.float(), k.float(), v.float()).to(torch.bfloat16)
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
        after = hal.kernels.select("attention", hal.device("cuda:0"), q, k, v, False, None, None)
        assert not after.provisional and len(after.timings_ms) > 1
    finally:
        torchhal.ops.set_default_hal(None)


def test_an_uncapturable_candidate_leaves_the_callers_stream_and_later_captures_whole(tmp_path):
    """Under graph timing a candidate that reads a value back on the host cannot be captured: it
    measures inf, the caller's current stream is the one it had, and a later capture works."""
    from torchhal.hal_core.settings import Settings
    from torchhal.kernels import rms_norm

    def host_sync(x, weight, eps=1e-6):
        float(x.sum().item())  # illegal while capturing
        return rms_norm.reference(x, weight, eps)

    env = {
        "TORCHHAL_CACHE_DIR": str(tmp_path),
        "TORCHHAL_AUTOTUNE": "on",
        "TORCHHAL_SELECTION_TIMING": "graph",
    }
    hal = HardwareAbstractionLayer(settings=Settings.from_env(env))
    hal.kernels.register("rms_norm", "host_sync", host_sync, provider="test", priority=1000)
    x, w = torch.randn(64, 256, device="cuda:0"), torch.randn(256, device="cuda:0")
    before = torch.cuda.current_stream(0)
    selection = hal.kernels.select("rms_norm", hal.device("cuda:0"), x, w)
    assert torch.cuda.current_stream(0) == before
    times = dict(selection.timings_ms)
    assert times["test/host_sync"] == float("inf") and selection.candidate.name != "host_sync", times
    out = torch.empty_like(x)
    replay = hal.device("cuda:0").graph_replay(lambda: out.copy_(x * 2))
    replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, x * 2)


def test_cudnn_training_pair_declines_deterministic_calls_without_a_demotion():
    """Under torch.use_deterministic_algorithms(True) the direct cuDNN backward ran
    non-deterministically without a word; declined per call, cuDNN serves the layout again once
    the mode is off (a demotion kept it off for good)."""
    hal = HardwareAbstractionLayer()
    device = hal.device("cuda:0")
    cudnn = next(
        (c for c in hal.kernels.candidates("attention_forward") if c.qualified_name == "nvidia/sdpa_cudnn"),
        None,
    )
    if cudnn is None:
        pytest.skip("this GPU's adapter registers no cuDNN attention candidate")
    hal.kernels.disabled = frozenset(
        c.qualified_name
        for c in hal.kernels.candidates("attention_forward")
        if c.name not in ("sdpa_cudnn", "reference")
    )  # cuDNN first, the reference after it
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    expected, _ = hal.kernels.call("attention_forward", device, q, k, v)
    assert (
        hal.kernels.select("attention_forward", device, q, k, v).candidate.qualified_name
        == "nvidia/sdpa_cudnn"
    )
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        out, _ = hal.kernels.call("attention_forward", device, q, k, v)
    finally:
        torch.use_deterministic_algorithms(was)
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    assert hal.kernels.fallback_counts == {"attention_forward:nvidia/sdpa_cudnn": 1}
    assert (
        hal.kernels.select("attention_forward", device, q, k, v).candidate.qualified_name
        == "nvidia/sdpa_cudnn"
    )
