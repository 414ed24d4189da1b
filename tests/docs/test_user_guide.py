"""The Python blocks of docs/user-guide.md, run as they are written, and what each one claims.

Each test takes its block from the guide itself (never a copy kept here) by a marker the block
contains, runs it, and checks what it computed: op outputs against the op's reference on the
inputs the block made, gradients against autograd through the references, devices, selections,
counters, spans, caches and statistics against what the guide's text says of them. The spec of
section 11 (a TOML block) runs through `torchhal ab` too. A block without a test fails
`test_every_python_block_has_a_test`.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import torchhal
from tests.docs.snippets import README, USER_GUIDE, assert_matches_reference, block_with, fenced_blocks
from torchhal import HardwareAbstractionLayer, telemetry
from torchhal.hal_core import RejectionReason
from torchhal.testing import tolerance

# one marker per python block of the guide, in the guide's order
DEVICES = "for diag in hal.diagnostics:"
USE = 'with hal.use("simasic:0") as dev:  # ops on CPU tensors'
OPS = "ops.linear_cross_entropy(hidden, lm_head, target)"
COMPILE = "@torch.compile(fullgraph=True)"
AUTOCAST = "with torch.autocast("
MODULES = "thnn.Attention("
PATCH = "torchhal.kernels.patch(model)"
CHECKPOINT = "torchhal.kernels.checkpoint(block, x, w)"
SELECT = 'for device in ("cpu", "simasic:0"):'
DISABLE = "disable_kernels="
FALLBACK = 'hal.kernels.register("rms_norm", "broken"'
TELEMETRY = 'telemetry.configure(exporter="memory"'
PROFILE = 'hal.profile("simasic:0")'
COMMUNICATOR = "hal.communicator("
TRAINING = "thd.train("
EXPERIMENT = "run_experiment(variants"
MARKERS = (
    DEVICES,
    USE,
    OPS,
    COMPILE,
    AUTOCAST,
    MODULES,
    PATCH,
    CHECKPOINT,
    SELECT,
    DISABLE,
    FALLBACK,
    TELEMETRY,
    PROFILE,
    COMMUNICATOR,
    TRAINING,
    EXPERIMENT,
)

_OWN_VARIABLES = (
    "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD",
    "TORCHHAL_STRICT_PLUGINS",
    "TORCHHAL_DISABLE_KERNELS",
    "TORCHHAL_AUTOTUNE",
    "TORCHHAL_SELECTION_TIMING",
    "TORCHHAL_OTEL_EXPORTER",
    "TORCHHAL_LOG_LEVEL",
    "TORCHHAL_LOG_FORMAT",
    "TORCHHAL_SIMASIC_SPEC",
    "TORCHHAL_SIMASIC_DEVICES",
)


@pytest.fixture
def guide_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The CPU and one simulated ASIC (the bundled edge spec); every cache in a temp dir, the
    default HAL made afresh from this environment and dropped afterwards."""
    monkeypatch.setenv("TORCHHAL_PLUGINS", "simasic")
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # Settings(...) reads no TORCHHAL_CACHE_DIR
    for name in _OWN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    torchhal.ops.set_default_hal(None)
    yield tmp_path
    torchhal.ops.set_default_hal(None)
    if dist.is_initialized():  # a block that failed half-way leaves no process group to the next test
        dist.destroy_process_group()


def run(marker: str) -> dict[str, Any]:
    """Execute the guide's block containing `marker`; its globals afterwards."""
    ns: dict[str, Any] = {"__name__": "user_guide_block"}
    exec(compile(block_with(USER_GUIDE, marker), str(USER_GUIDE), "exec"), ns)
    return ns


def reference(op: str) -> Any:
    return HardwareAbstractionLayer().kernels.op(op).reference


def leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().clone().requires_grad_() for t in tensors]


def test_every_python_block_has_a_test():
    blocks = fenced_blocks(USER_GUIDE)
    owners = [[m for m in MARKERS if m in block] for block in blocks]
    assert all(len(o) == 1 for o in owners), f"blocks without exactly one marker: {owners}"
    assert [o[0] for o in owners] == list(MARKERS)


def test_readme_links_the_guide():
    assert "`docs/user-guide.md`" in README.read_text(encoding="utf-8")


def test_devices_block_ranks_the_real_cpu_first_and_explains_every_plugin(guide_env, capsys):
    ns = run(DEVICES)
    hal, choice, best = ns["hal"], ns["choice"], ns["best"]
    assert {d.id for d in hal.devices()} == {"cpu", "simasic:0"}
    assert best is choice.device is hal.best_device(ns["DeviceRequirements"](dtypes={"bf16"}))
    assert best.id == "cpu"  # real before simulated, as the ranking bullet says
    lines = choice.explain().splitlines()
    assert lines[0].startswith("cpu: chosen: real device")
    assert lines[1].startswith("simasic:0: eligible: simulated device")
    status = {d.name: (d.status.value, d.stage) for d in hal.diagnostics}
    assert status["simasic"] == ("loaded", "discover")
    assert status["nvidia"] == ("skipped", "allowlist")  # the allowlist, as the text says
    printed = capsys.readouterr().out
    assert "simasic:0 Simulated ASIC" in printed and "simulated" in printed


def test_use_block_runs_on_the_simulated_asic_inside_and_the_cpu_outside(guide_env, capsys):
    ns = run(USE)
    hal, dev, x, w, y, z = (ns[n] for n in ("hal", "dev", "x", "w", "y", "z"))
    assert dev.id == "simasic:0"
    # the ledger holds x, w and y; z, made outside the block, is not the simulated device's
    assert dev.memory_info().used_bytes == x.nbytes + w.nbytes + y.nbytes
    assert_matches_reference(hal, "rms_norm", y, x, w, 1e-6)
    assert_matches_reference(hal, "rms_norm", z, x, w, 1e-6)
    simulated = float(re.search(r"([\d.]+) ms of simulated time", capsys.readouterr().out)[1])
    assert simulated > 0


def test_ops_block_matches_the_references_forward_and_backward(guide_env):
    ns = run(OPS)
    q, k, v, cos, sin = (ns[n] for n in ("q", "k", "v", "cos", "sin"))
    hidden, lm_head, target, loss = (ns[n] for n in ("hidden", "lm_head", "target", "loss"))
    hal = HardwareAbstractionLayer()

    rope = reference("rope")
    got = (ns["q_rot"], ns["k_rot"])
    plain = rope(q.detach(), k.detach(), cos, sin)
    truth = rope(q.detach().double(), k.detach().double(), cos.double(), sin.double())
    for g, r, t in zip(got, plain, truth, strict=True):
        assert tolerance.compare(g.detach(), r, t).ok
    attention_args = (ns["q_rot"].detach(), ns["k_rot"].detach(), v.detach(), True, None, (15, 0))
    assert_matches_reference(hal, "attention", ns["out"].detach(), *attention_args)
    loss_args = (hidden.detach(), lm_head.detach(), target, None, -100, 0.0, "mean")
    assert_matches_reference(hal, "linear_cross_entropy", loss.detach(), *loss_args)
    assert loss.dtype == torch.float32

    # the same chain through plain torch: rotate-half rope, masked SDPA with GQA, cross-entropy
    q2, k2, v2, w2 = leaves(q, k, v, lm_head)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

    i = torch.arange(q.shape[2])
    mask = (i[None, :] <= i[:, None]) & (i[None, :] >= i[:, None] - 15)
    out = F.scaled_dot_product_attention(rotate(q2), rotate(k2), v2, attn_mask=mask, enable_gqa=True)
    logits = out.transpose(1, 2).reshape(hidden.shape) @ w2.T
    expected = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for got_grad, want in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad), (lm_head.grad, w2.grad)):
        torch.testing.assert_close(got_grad, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # inductor compiles the graph: about 10 s on the 2-core machine
def test_compile_block_traces_and_matches_eager_references(guide_env):
    ns = run(COMPILE)
    x, w, gate, up, y = (ns[n] for n in ("x", "w", "gate", "up", "y"))
    x2, w2 = leaves(x, w)
    expected = reference("rms_norm")(x2, w2, 1e-6) + reference("swiglu")(gate, up)
    expected.sum().backward()
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-4, atol=1e-5)


def test_autocast_block_casts_matmul_and_leaves_the_cpu_norm_alone(guide_env, capsys):
    ns = run(AUTOCAST)
    a, b, c, x, w, y = (ns[n] for n in ("a", "b", "c", "x", "w", "y"))
    assert (c.dtype, y.dtype) == (torch.bfloat16, torch.float32)
    assert capsys.readouterr().out.split() == ["torch.bfloat16", "torch.float32"]  # as the comment says
    hal = HardwareAbstractionLayer()
    assert_matches_reference(hal, "matmul", c, a.bfloat16(), b.bfloat16())
    assert_matches_reference(hal, "rms_norm", y, x, w, 1e-6)


def test_modules_block_computes_what_torch_and_hugging_face_compute(guide_env):
    ns = run(MODULES)
    norm, attn, rotary, mlp = (ns[n] for n in ("norm", "attn", "rotary", "mlp"))
    x, h, positions, attended, y = (ns[n] for n in ("x", "h", "positions", "attended", "y"))
    torch.testing.assert_close(h, torch.nn.RMSNorm(64, eps=1e-6)(x))
    batch, seq, _ = h.shape

    def heads(t: torch.Tensor, n: int) -> torch.Tensor:
        return t.view(batch, seq, n, 16).transpose(1, 2)

    cos, sin = (t.unsqueeze(1) for t in rotary(h, positions))

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return t * cos + torch.cat([-t[..., 8:], t[..., :8]], -1) * sin

    q, k, v = heads(attn.q_proj(h), 4), heads(attn.k_proj(h), 2), heads(attn.v_proj(h), 2)
    out = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True, enable_gqa=True)
    expected = attn.o_proj(out.transpose(1, 2).reshape(batch, seq, 64))
    torch.testing.assert_close(attended, expected, rtol=1e-5, atol=1e-5)
    mid = x + attended
    z = norm(mid)
    expected_y = mid + mlp.down_proj(F.silu(mlp.gate_proj(z)) * mlp.up_proj(z))
    torch.testing.assert_close(y, expected_y, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # imports transformers: about 10 s
def test_patch_block_fuses_the_loss_and_keeps_transformers_value(guide_env):
    transformers = pytest.importorskip("transformers")
    ns = run(PATCH)
    model, config, ids, out, report = (ns[n] for n in ("model", "config", "ids", "out", "report"))
    assert out.logits is None
    counts = {kind: report.count(kind) for kind in ("rms_norm", "mlp", "attention", "loss")}
    assert counts == {"rms_norm": 5, "mlp": 2, "attention": 2, "loss": 1}
    assert report.attn_implementation[1] == "torchhal"
    assert [left.kind for left in report.left] == ["rotary_embedding"]
    assert model.lm_head.weight.grad is not None
    plain = transformers.LlamaForCausalLM(config)
    plain.load_state_dict(model.state_dict())  # same parameter names: the state dict loads as it is
    expected = plain(input_ids=ids, labels=ids)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-5)
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (2, 16, 128)  # eval mode: transformers' forward


def test_checkpoint_block_recomputes_on_the_simulated_asic(guide_env, capsys):
    ns = run(CHECKPOINT)
    x, w = ns["x"], ns["w"]
    x2, w2 = leaves(x, w)
    expected = reference("swiglu")(reference("rms_norm")(x2, w2, 1e-6), x2)
    expected.sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-5, atol=1e-5)
    # the simulated clock moved during backward: the recompute and backward ran on simasic:0
    assert float(re.search(r"([\d.]+) ms of simulated time", capsys.readouterr().out)[1]) > 0


def test_select_block_chooses_as_the_text_says(guide_env, capsys):
    ns = run(SELECT)
    hal, x, w = ns["hal"], ns["x"], ns["w"]
    assert ns["selection"].candidate.qualified_name == "simasic/simasic"  # the block's last device
    cpu = hal.kernels.select("rms_norm", hal.device("cpu"), x, w, 1e-6)
    assert cpu.candidate.qualified_name == "torchhal/aten"
    reasons = {r.candidate: r.reason for r in cpu.rejected}
    assert reasons["torchhal/triton"] is RejectionReason.FEATURE
    assert reasons["torchhal/reference"] is RejectionReason.OUTRANKED
    printed = capsys.readouterr().out
    assert "rms_norm on cpu" in printed and "rms_norm on simasic:0" in printed


def test_disable_block_falls_to_the_reference_and_ignores_the_environment(guide_env):
    ns = run(DISABLE)
    hal, x, w = ns["hal"], ns["x"], ns["w"]
    assert hal.settings.plugins is None  # TORCHHAL_PLUGINS=simasic was not read by Settings(...)
    selection = hal.kernels.select("rms_norm", hal.device("cpu"), x, w, 1e-6)
    assert selection.candidate.qualified_name == "torchhal/reference"
    assert {r.candidate: r.reason for r in selection.rejected}["torchhal/aten"] is RejectionReason.DISABLED


def test_fallback_block_counts_logs_and_keeps_the_answer(guide_env, capsys):
    key = "torchhal.kernel.fallbacks,candidate=mine/broken,op=rms_norm"
    before = telemetry.counts().get(key, 0)
    ns = run(FALLBACK)
    hal, x, w, y = ns["hal"], ns["x"], ns["w"], ns["y"]
    assert_matches_reference(hal, "rms_norm", y, x, w, 1e-6)
    assert hal.report()["kernel_fallbacks"] == {"rms_norm:mine/broken": 1}  # once: the 2nd call went straight
    assert telemetry.counts()[key] - before == 1
    captured = capsys.readouterr()
    assert "{'rms_norm:mine/broken': 1}" in captured.out  # what the block's comment shows
    assert "mine/broken: failed (RuntimeError: illegal memory access)" in captured.out
    assert "kernel failed, falling back" in captured.err


def test_telemetry_block_exports_spans_and_json_logs(guide_env):
    ns = run(TELEMETRY)
    names = {span.name for span in ns["spans"]}
    assert {"torchhal.discovery", "torchhal.plugin.load", "torchhal.kernel.select"} <= names
    lines = ns["logs"].getvalue().splitlines()
    assert lines and all(json.loads(line)["logger"].startswith("torchhal") for line in lines)
    assert "discovery done" in [json.loads(line)["event"] for line in lines]


def test_profile_block_measures_once_then_reads_the_cache(guide_env):
    ns = run(PROFILE)
    profile = ns["profile"]
    assert profile.device_id == "simasic:0" and profile.simulated
    assert all(rate > 0 for rate in profile.matmul_tflops.values()) and profile.matmul_tflops
    cached = guide_env / "cache" / "profiles" / f"{profile.fingerprint}.json"
    assert json.loads(cached.read_text())["device_id"] == "simasic:0"
    again = HardwareAbstractionLayer().profile("simasic:0")  # another HAL: from the cache
    assert again.measured_at == profile.measured_at


def test_communicator_block_reduces_gathers_and_tears_down(guide_env, capsys):
    ns = run(COMMUNICATOR)
    assert ns["comm"].backend == "gloo"
    torch.testing.assert_close(ns["total"], torch.arange(4.0))  # the sum over one rank
    torch.testing.assert_close(ns["gathered"], torch.ones(2, 3))
    assert not dist.is_initialized()  # destroy() took the default group it made
    assert capsys.readouterr().out.startswith("gloo 0 1 ")


def test_training_block_trains_accumulates_and_checkpoints(guide_env):
    ns = run(TRAINING)
    stats, info, workdir = ns["stats"], ns["info"], Path(ns["workdir"])
    assert [s.step for s in stats] == [0, 1, 2, 3]
    # tokens: the first tensor's rows (8) over 2 micro-batches a step
    assert all(s.tokens == 16 and math.isfinite(s.loss) and s.grad_norm is not None for s in stats)
    assert ns["prepared"].strategy == "ddp" and ns["prepared"].policy.name == "fp32"
    assert info.step == 4 and info.path == workdir / "checkpoints" / "step_4"
    assert (info.path / "manifest.json").is_file()
    assert not dist.is_initialized()  # ctx.shutdown()


def test_experiment_block_finds_the_datacenter_design_faster(guide_env):
    ns = run(EXPERIMENT)
    comparison = ns["comparison"]
    assert comparison.verdict.value == "improved"
    assert comparison.ratio < 1  # lower latency than the edge baseline
    assert [(c.variant, c.metric) for c in ns["result"].comparisons] == [("datacenter", "latency")]


def test_spec_block_runs_under_torchhal_ab_and_resumes(guide_env):
    from typer.testing import CliRunner

    from torchhal.cli import app

    spec = guide_env / "guide.toml"
    spec.write_text(block_with(USER_GUIDE, "[[variants]]", language="toml"), encoding="utf-8")
    out = guide_env / "out"
    runner = CliRunner()
    args = ["ab", str(spec), "--out", str(out), "--no-plots", "--gate"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    result = json.loads((out / "result.json").read_text())
    verdicts = {(c["variant"], c["metric"]): c["verdict"] for c in result["comparisons"]}
    assert verdicts == {("datacenter", "latency"): "improved", ("datacenter", "throughput"): "improved"}
    assert result["resumed_samples"] == 0
    assert sorted(result["pareto_front"]) == ["datacenter", "edge"]
    assert (out / "report.md").is_file() and (out / "samples.sqlite").is_file()
    second = runner.invoke(app, args)
    assert second.exit_code == 0, second.output
    assert json.loads((out / "result.json").read_text())["resumed_samples"] == 2 * 10  # every sample
