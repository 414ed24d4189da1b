"""Kernel registry: selection with typed rejections, caching, fallback, dispatch through ops."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch

import torchhal
from tests.core.adapters import FakeAdapter, fake_caps
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import (
    DType,
    InvalidArgumentError,
    KernelFailedError,
    KernelRegistry,
    RejectionReason,
    TorchHALError,
    UnknownOpError,
    Unsupported,
    UnsupportedError,
    telemetry,
)
from torchhal.kernels import attention, rms_norm


@pytest.fixture
def hal(settings):
    return HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))


def test_rms_norm_candidates_match_reference(hal):
    x, w = torch.randn(13, 123), torch.randn(123)
    sel = hal.kernels.select("rms_norm", hal.device("cpu"), x, w)
    assert sel.candidate.name == "aten"
    ref = rms_norm.reference(x.double(), w.double())
    torch.testing.assert_close(
        hal.kernels.call("rms_norm", hal.device("cpu"), x, w).double(), ref, atol=1e-5, rtol=1e-5
    )


def test_attention_selection_explains_typed_rejections(hal):
    cpu = hal.device("cpu")
    q, k, v = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 16)
    sel = hal.kernels.select("attention", cpu, q, k, v, causal=True)
    assert sel.candidate.name == "reference"
    reasons = {r.candidate: r.reason for r in sel.rejected}
    assert reasons["torchhal/sdpa"] is RejectionReason.SHAPE
    assert "seq_q == seq_k" in sel.explain()
    square = torch.randn(2, 4, 11, 16)
    assert hal.kernels.select("attention", cpu, square, k, v, causal=True).candidate.name == "sdpa"


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (True, (3, 0)), (False, (2, 4))])
def test_attention_dispatch_matches_fp64_reference(hal, causal, window):
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    out = hal.kernels.call("attention", hal.device("cpu"), q, k, v, causal=causal, window=window)
    ref = attention.reference(q.double(), k.double(), v.double(), causal=causal, window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_selection_is_cached_per_device_and_signature(hal):
    cpu = hal.device("cpu")
    x, w = torch.randn(4, 32), torch.randn(32)
    first = hal.kernels.select("rms_norm", cpu, x, w)
    assert hal.kernels.select("rms_norm", cpu, torch.randn(9, 32), w) is first  # rows are not in the key
    assert hal.kernels.select("rms_norm", cpu, torch.randn(4, 64), torch.randn(64)) is not first


def test_failing_candidate_falls_back_logged_counted_traced(hal, capsys):
    telemetry.configure(exporter="memory", log_level="warning")
    calls = []

    def broken(x, weight, eps=1e-6):
        calls.append(1)
        raise RuntimeError("kernel launch failed")

    hal.kernels.register("rms_norm", "broken", broken, provider="test", priority=100)
    cpu = hal.device("cpu")
    x, w = torch.randn(5, 8), torch.randn(8)
    out = hal.kernels.call("rms_norm", cpu, x, w)
    torch.testing.assert_close(out, rms_norm.reference(x, w))
    assert hal.kernels.fallback_counts == {"rms_norm:test/broken": 1}
    assert telemetry.counts()["torchhal.kernel.fallbacks,candidate=test/broken,op=rms_norm"] == 1
    spans = [
        s for s in telemetry.memory_exporter().get_finished_spans() if s.name == "torchhal.kernel.fallback"
    ]
    assert spans and spans[0].attributes["candidate"] == "test/broken"
    assert "kernel failed, falling back" in capsys.readouterr().err
    # demoted for this signature: the next call does not try the broken kernel again
    hal.kernels.call("rms_norm", cpu, x, w)
    assert len(calls) == 1
    sel = hal.kernels.select("rms_norm", cpu, x, w)
    assert any(r.reason is RejectionReason.FAILED and r.candidate == "test/broken" for r in sel.rejected)


def test_fallbacks_are_counted_per_op(hal):
    """One candidate name (a provider's `triton`, say) serves several ops: its counts name the op."""

    def broken(*args, **kwargs):
        raise RuntimeError("kernel launch failed")

    for op in ("rms_norm", "layer_norm"):
        hal.kernels.register(op, "broken", broken, provider="test", priority=100)
    cpu = hal.device("cpu")
    x, w, b = torch.randn(5, 8), torch.randn(8), torch.randn(8)
    hal.kernels.call("rms_norm", cpu, x, w)
    hal.kernels.call("layer_norm", cpu, x, w, b)
    hal.kernels.call("layer_norm", cpu, torch.randn(3, 16), torch.randn(16), torch.randn(16))
    assert hal.kernels.fallback_counts == {"rms_norm:test/broken": 1, "layer_norm:test/broken": 2}


def test_every_candidate_failing_raises_with_all_reasons(hal):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    hal.kernels.define_op("double", broken, signature=lambda x: (x.dtype,))
    with pytest.raises(KernelFailedError, match=r"every candidate failed.*reference"):
        hal.kernels.call("double", hal.device("cpu"), torch.randn(3))


def test_unknown_op_lists_defined_ops(hal):
    with pytest.raises(UnknownOpError, match=r"unknown op 'nope'.*rms_norm"):
        hal.kernels.call("nope", hal.device("cpu"), torch.randn(3))


def test_bad_input_names_op_and_constraint(hal):
    cpu = hal.device("cpu")
    with pytest.raises(
        InvalidArgumentError, match="rms_norm: x's last dimension must equal weight's length 8"
    ):
        hal.kernels.call("rms_norm", cpu, torch.randn(4, 7), torch.randn(8))
    with pytest.raises(
        InvalidArgumentError, match="attention: heads_q must be a multiple of heads_kv, got 3 and 2"
    ):
        hal.kernels.call(
            "attention", cpu, torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
        )
    with pytest.raises(InvalidArgumentError, match="q must have 4 dimensions"):
        hal.kernels.call(
            "attention", cpu, torch.randn(3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
        )


def test_dtype_the_device_does_not_declare_is_refused(settings):
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter([fake_caps(dtypes=frozenset({DType.BF16}))])],
        settings=settings(disable_plugin_autoload="1"),
    )
    with pytest.raises(
        UnsupportedError, match=r"op 'rms_norm' on acme:0: dtype torch.float32 is not supported.*bf16"
    ):
        hal.kernels.call("rms_norm", hal.device("acme:0"), torch.randn(2, 4), torch.randn(4))


def test_predicate_rejection_and_disable_setting(settings):
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1", disable_kernels="aten"))
    hal.kernels.register(
        "rms_norm",
        "wide-only",
        rms_norm.reference,
        provider="test",
        supports=lambda caps, sig: (
            None if sig.hidden >= 1024 else Unsupported(RejectionReason.SHAPE, "hidden < 1024")
        ),
        priority=50,
    )
    sel = hal.kernels.select("rms_norm", hal.device("cpu"), torch.randn(2, 64), torch.randn(64))
    reasons = {r.candidate: r.reason for r in sel.rejected}
    assert reasons["test/wide-only"] is RejectionReason.SHAPE
    assert reasons["torchhal/aten"] is RejectionReason.DISABLED
    assert sel.candidate.name == "reference"


def test_bind_specialises_per_device(settings):
    seen = []

    def bind(caps):
        seen.append(caps.simd_width)
        return lambda x, weight, eps=1e-6: rms_norm.reference(x, weight, eps) * 1.0

    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter([fake_caps(0, simd_width=16), fake_caps(1, simd_width=64)])],
        settings=settings(disable_plugin_autoload="1"),
    )
    hal.kernels.register("rms_norm", "bound", rms_norm.reference, provider="test", priority=99, bind=bind)
    x, w = torch.randn(3, 8), torch.randn(8)
    for dev in ("acme:0", "acme:1", "acme:0"):
        hal.kernels.call("rms_norm", hal.device(dev), x, w)
    assert seen == [16, 64]


def test_ops_dispatch_through_default_hal_and_use(settings):
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter([fake_caps(dtypes=frozenset({DType.BF16}))])],
        settings=settings(disable_plugin_autoload="1"),
    )
    torchhal.ops.set_default_hal(hal)
    try:
        x, w = torch.randn(3, 8), torch.randn(8)
        torch.testing.assert_close(torchhal.ops.rms_norm(x, w), rms_norm.reference(x, w))
        with hal.use("acme:0"), pytest.raises(UnsupportedError, match="acme:0"):
            torchhal.ops.rms_norm(x, w)  # fp32 on a bf16-only device: refused, never converted
    finally:
        torchhal.ops.set_default_hal(None)


def _slow(x, weight, eps=1e-6):
    time.sleep(0.002)
    return rms_norm.reference(x, weight, eps)


def _tuned_hal(settings, cache_dir):
    """A HAL that measures its selections, with a preferred candidate that is slower than the rest."""
    hal = HardwareAbstractionLayer(
        settings=settings(disable_plugin_autoload="1", autotune="on", cache_dir=str(cache_dir))
    )
    hal.kernels.register("rms_norm", "slow-but-preferred", _slow, provider="test", priority=1000)
    return hal


def _select_rms_norm(hal, x, w):
    return hal.kernels.select("rms_norm", hal.device("cpu"), x, w)


def test_measured_selection_picks_the_fastest_and_persists(settings, tmp_path, capsys):
    x, w = torch.randn(8, 256), torch.randn(256)
    sel = _select_rms_norm(_tuned_hal(settings, tmp_path), x, w)
    assert sel.candidate.name != "slow-but-preferred"
    times = dict(sel.timings_ms)
    assert times["test/slow-but-preferred"] >= 2.0 > times[sel.candidate.qualified_name]
    assert sel.fallbacks  # the slower valid candidates stay as fallbacks
    again = _select_rms_norm(_tuned_hal(settings, tmp_path), x, w)
    assert again.candidate.qualified_name == sel.candidate.qualified_name and again.timings_ms == ()
    (saved,) = (tmp_path / "selections").glob("*.json")
    saved.write_text(saved.read_text()[:-7])  # a torn write: measured again, logged, rewritten
    telemetry.configure(log_level="warning")
    capsys.readouterr()
    remeasured = _select_rms_norm(_tuned_hal(settings, tmp_path), x, w)
    assert remeasured.timings_ms and "cached kernel selections unusable" in capsys.readouterr().err
    assert json.loads(saved.read_text())


def test_persisted_selections_are_measured_again_after_an_upgrade(settings, tmp_path, monkeypatch, capsys):
    """A winner is only as good as the code that won. The file keyed winners by device, driver and
    torch only, so one measured before an upgrade of torchhal, a vendor plugin or Triton (a faster
    kernel, a candidate changed) was kept for good."""
    import importlib.metadata

    from torchhal.hal_core import hal as hal_module

    x, w = torch.randn(8, 256), torch.randn(256)
    assert _select_rms_norm(_tuned_hal(settings, tmp_path), x, w).timings_ms
    (saved,) = (tmp_path / "selections").glob("*.json")
    code = json.loads(saved.read_text())["code"]
    assert code["torchhal"] == importlib.metadata.version("torchhal")  # the core's kernels competed
    assert _select_rms_norm(_tuned_hal(settings, tmp_path), x, w).timings_ms == ()  # same code: kept

    upgraded = {**code, "torchhal": code["torchhal"] + ".post1"}
    monkeypatch.setattr(hal_module, "code_versions", lambda distributions: upgraded)
    telemetry.configure(log_level="info", log_format="json")
    capsys.readouterr()
    assert _select_rms_norm(_tuned_hal(settings, tmp_path), x, w).timings_ms  # measured again
    lines = [json.loads(raw) for raw in capsys.readouterr().err.splitlines()]
    (changed,) = [
        x for x in lines if x["event"].startswith("cached kernel selections were measured with other")
    ]
    assert changed["measured_with"] == code and changed["now"] == upgraded
    assert json.loads(saved.read_text())["code"] == upgraded  # rewritten with the code that won now

    saved.write_text(json.dumps(json.loads(saved.read_text())["winners"]))  # the earlier flat format
    capsys.readouterr()
    assert _select_rms_norm(_tuned_hal(settings, tmp_path), x, w).timings_ms
    assert "cached kernel selections unusable" in capsys.readouterr().err


def test_a_remembered_winner_stands_only_against_the_contenders_it_beat(settings, tmp_path):
    """A winner measured while a candidate was disabled, or while one raised, was reused once that
    candidate was back in the running, without measuring it (the key was op and signature only)."""
    x, w = torch.randn(8, 256), torch.randn(256)
    raised = []

    def flaky(x, weight, eps=1e-6):
        if not raised:
            raised.append(True)
            raise RuntimeError("a transient failure while measured")
        return rms_norm.reference(x, weight, eps)

    def make_hal(**env):
        hal = HardwareAbstractionLayer(
            settings=settings(disable_plugin_autoload="1", autotune="on", cache_dir=str(tmp_path), **env)
        )
        hal.kernels.register("rms_norm", "slow-but-preferred", _slow, provider="test", priority=1000)
        hal.kernels.register("rms_norm", "flaky", flaky, provider="test", priority=5)
        return hal

    first = _select_rms_norm(make_hal(disable_kernels="slow-but-preferred"), x, w)
    assert dict(first.timings_ms)["test/flaky"] == float("inf")
    again = _select_rms_norm(make_hal(), x, w)  # slow-but-preferred enabled again, flaky recovered
    assert {name for name, _ in again.timings_ms} == {
        "test/slow-but-preferred",
        "test/flaky",
        "torchhal/aten",
    }
    assert all(ms < float("inf") for _, ms in again.timings_ms)
    assert _select_rms_norm(make_hal(), x, w).timings_ms == ()  # the same contenders: remembered


def test_hals_sharing_a_cache_keep_each_others_winners(settings, tmp_path):
    """Each HAL rewrote the file from its own table, read when it first needed it: a winner another
    HAL saved after that was lost."""
    shapes = {"a": (8, 128), "b": (8, 256), "c": (8, 512)}
    inputs = {k: (torch.randn(*shape), torch.randn(shape[1])) for k, shape in shapes.items()}
    early, late = _tuned_hal(settings, tmp_path), _tuned_hal(settings, tmp_path)
    assert _select_rms_norm(early, *inputs["c"]).timings_ms  # early reads the (empty) file now
    assert _select_rms_norm(late, *inputs["a"]).timings_ms
    assert _select_rms_norm(early, *inputs["b"]).timings_ms  # saved with late's "a"
    fresh = _tuned_hal(settings, tmp_path)
    assert all(_select_rms_norm(fresh, *inputs[k]).timings_ms == () for k in shapes)


def test_code_versions_reads_metadata_and_names_what_has_none():
    import importlib.metadata

    from torchhal.hal_core.tuning import code_versions

    versions = code_versions(["torchhal", "no-such-distribution-here"])
    assert versions["torchhal"] == torchhal.__version__ and versions["no-such-distribution-here"] == "unknown"
    # the dev install has Triton (its interpreter runs the kernel tests), as the "triton" wheel
    assert versions["triton"] == importlib.metadata.version("triton")
    assert set(versions) == {"torchhal", "no-such-distribution-here", "triton"}


def test_auto_tuning_leaves_the_cpu_to_priority(hal):
    x, w = torch.randn(8, 64), torch.randn(64)
    assert hal.kernels.select("rms_norm", hal.device("cpu"), x, w).timings_ms == ()


def test_use_routes_ops_through_the_hal_that_owns_the_device(settings):
    other = HardwareAbstractionLayer(
        adapters=[FakeAdapter([fake_caps(dtypes=frozenset({DType.FP32}))])],
        settings=settings(disable_plugin_autoload="1"),
    )
    seen = []
    other.kernels.register(
        "rms_norm",
        "acme",
        lambda x, w, eps=1e-6: seen.append(1) or rms_norm.reference(x, w, eps),
        provider="acme",
        supports=lambda caps, sig: (
            None if caps.adapter == "acme" else Unsupported(RejectionReason.DEVICE, "acme only")
        ),
        priority=100,
    )
    x, w = torch.randn(3, 8), torch.randn(8)
    torchhal.ops.rms_norm(x, w)  # the default HAL: no acme device there
    assert seen == []
    with other.use("acme:0"):
        torchhal.ops.rms_norm(x, w)
    assert seen == [1]


def test_out_of_memory_in_a_kernel_is_raised_not_fallen_back(hal):
    from torchhal.hal_core import DeviceOutOfMemoryError

    def oom(x, weight, eps=1e-6):
        raise DeviceOutOfMemoryError("acme:0", requested=2**30, used=2**32, capacity=2**32)

    hal.kernels.register("rms_norm", "oom", oom, provider="test", priority=100)
    with pytest.raises(DeviceOutOfMemoryError, match="requested 1073741824 bytes"):
        hal.kernels.call("rms_norm", hal.device("cpu"), torch.randn(2, 4), torch.randn(4))
    assert hal.kernels.fallback_counts == {}


def _count_validations(hal, op="rms_norm"):
    """Wrap `op`'s signature so the returned list grows by one per validation."""
    calls = []
    opdef = hal.kernels.op(op)

    def counting(*args):
        calls.append(1)
        return opdef.signature(*args)

    hal.kernels._ops[op] = type(opdef)(opdef.name, opdef.reference, counting, opdef.doc)
    return calls


def test_seen_arguments_skip_validation_but_new_layouts_are_validated(hal):
    calls = _count_validations(hal)
    cpu = hal.device("cpu")
    w = torch.randn(32)
    for _ in range(3):
        hal.kernels.call("rms_norm", cpu, torch.randn(6, 32), w)
    assert len(calls) == 1  # same dtypes, shapes, strides, devices: validated once
    hal.kernels.call("rms_norm", cpu, torch.randn(32, 6).t(), w)
    assert len(calls) == 2  # new strides: validated again
    with pytest.raises(InvalidArgumentError):
        hal.kernels.call("rms_norm", cpu, torch.randn(6, 31), w)  # new shape, and invalid: refused


def test_keyword_calls_are_validated_every_time_and_fall_back(hal):
    def broken(x, weight, eps=1e-6):
        raise RuntimeError("kernel launch failed")

    hal.kernels.register("rms_norm", "broken", broken, provider="test", priority=100)
    cpu = hal.device("cpu")
    x, w = torch.randn(5, 8), torch.randn(8)
    torch.testing.assert_close(
        hal.kernels.call("rms_norm", cpu, x, w, eps=1e-5), rms_norm.reference(x, w, 1e-5)
    )
    assert hal.kernels.fallback_counts == {"rms_norm:test/broken": 1}
    assert hal.kernels._seen["rms_norm"].entries == {}  # keyword calls leave the memo alone
    with pytest.raises(InvalidArgumentError):
        hal.kernels.call("rms_norm", cpu, torch.randn(5, 7), w, eps=1e-5)


def test_seen_arguments_are_keyed_by_layout_for_tensor_subclasses_and_by_value_for_scalars(hal):
    calls = _count_validations(hal)
    cpu = hal.device("cpu")
    x, w = torch.randn(6, 32), torch.nn.Parameter(torch.randn(32), requires_grad=False)
    hal.kernels.call("rms_norm", cpu, x, w, 1e-6)
    hal.kernels.call("rms_norm", cpu, x, w, 1e-6)
    assert len(calls) == 1
    hal.kernels.call("rms_norm", cpu, x, w, 1e-5)
    assert len(calls) == 2  # a new scalar: validated again
    hal.kernels.call("rms_norm", cpu, x, w, 1)
    hal.kernels.call("rms_norm", cpu, x, w, 1.0)
    assert len(calls) == 4  # equal values of another type (1 == 1.0 == True hash alike): validated
    with pytest.raises(InvalidArgumentError, match="eps"):
        hal.kernels.call("rms_norm", cpu, x, w, True)  # == the 1.0 just seen, but a bool: refused
    w.resize_(31)  # the same Parameter object, a new shape: validated again, and refused
    with pytest.raises(InvalidArgumentError):
        hal.kernels.call("rms_norm", cpu, x, w, 1e-6)


def test_alternating_layouts_are_each_validated_once_and_keep_their_own_selection(hal):
    """The memo checks its recent layouts first: switching layouts must never reuse the other's
    hit. fp64 arguments select a marker candidate, so a hit reused across layouts shows in the output."""
    calls = _count_validations(hal)

    def fp64_only(caps, sig):
        return None if sig.dtype == torch.float64 else Unsupported(RejectionReason.DTYPE, "fp64 only")

    hal.kernels.register(
        "rms_norm", "marker", lambda x, w, eps: torch.full_like(x, 7.0), provider="test", supports=fp64_only,
        priority=100,
    )  # fmt: skip
    cpu = hal.device("cpu")
    x32, w32 = torch.randn(6, 32), torch.randn(32)
    x64, w64 = x32.double(), w32.double()
    validated = []
    for _ in range(3):
        torch.testing.assert_close(
            hal.kernels.call("rms_norm", cpu, x32, w32, 1e-6), rms_norm.reference(x32, w32)
        )
        torch.testing.assert_close(
            hal.kernels.call("rms_norm", cpu, x64, w64, 1e-6), torch.full_like(x64, 7.0)
        )
        validated.append(len(calls))
    assert validated[1] == validated[2]  # once both selections exist, neither layout is validated again


def test_cycling_layouts_are_validated_once_each_and_then_found_by_their_guards(hal):
    """Qwen3's pattern: hidden, q-head and k-head norms in turn, every layer."""
    calls = _count_validations(hal)
    cpu = hal.device("cpu")
    layouts = [(torch.randn(6, 32), torch.randn(32)), (torch.randn(6, 8), torch.randn(8)),
               (torch.randn(2, 8), torch.randn(8))]  # fmt: skip
    for _ in range(4):
        for x, w in layouts:
            torch.testing.assert_close(
                hal.kernels.call("rms_norm", cpu, x, w, 1e-6), rms_norm.reference(x, w)
            )
    assert len(calls) == 3
    guards = [guard for guard, _ in hal.kernels._seen["rms_norm"].recent]
    last_first = [g.admits(hal.kernels._route_of(cpu), (x, w, 1e-6)) for g in guards]  # call()'s route
    assert last_first == [True, False, False]


def test_a_layout_seen_outside_inference_mode_gets_its_own_guard_inside_it(hal):
    """Inference tensors carry other dispatch keys, so the guard made outside refuses them; the
    key still finds the layout (no validation) and a guard made inside serves the later calls."""
    calls = _count_validations(hal)
    cpu = hal.device("cpu")
    x, w = torch.randn(6, 32), torch.randn(32)
    hal.kernels.call("rms_norm", cpu, x, w, 1e-6)
    with torch.inference_mode():
        xi, wi = x.clone(), w.clone()
        for _ in range(3):
            torch.testing.assert_close(
                hal.kernels.call("rms_norm", cpu, xi, wi, 1e-6), rms_norm.reference(x, w)
            )
    assert len(calls) == 1
    assert len(hal.kernels._seen["rms_norm"].recent) == 2


def test_one_tensor_passed_twice_is_memoised_by_its_key_alone(hal):
    """torch's tensor guard refuses a tensor object seen twice, so such calls get no guard."""
    calls = _count_validations(hal, "attention")
    cpu = hal.device("cpu")
    q = torch.randn(1, 2, 8, 16)
    for _ in range(3):
        torch.testing.assert_close(
            hal.kernels.call("attention", cpu, q, q, q, True, None, None),
            attention.reference(q, q, q, True, None, None),
        )
    assert len(calls) == 1
    assert hal.kernels._seen["attention"].recent == ()


def test_a_nested_tensor_after_a_guarded_layout_raises_instead_of_aborting():
    """torch's C++ tensor check reads strides, which a strided nested tensor does not have: called
    on one it aborts the process. The guard screens nested tensors out first. In a subprocess,
    so that a regression fails this test rather than killing the run."""
    code = """if True:
        import warnings; warnings.simplefilter("ignore")
        import torch, torchhal
        x, w = torch.randn(2, 8), torch.randn(8)
        torchhal.ops.rms_norm(x, w)
        torchhal.ops.rms_norm(x, w)  # now held by a guard
        nested = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)])
        try:
            torchhal.ops.rms_norm(nested, w)
        except torchhal.hal_core.UnsupportedError as exc:
            print("raised:", exc)
    """
    env = {**os.environ, "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "raised: rms_norm: x is a nested tensor" in done.stdout


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_nested_tensor_is_refused_by_name(hal, requires_grad):
    """A nested tensor has no sizes or strides to key: validated, and refused naming op and argument
    (before, torch's own 'NestedTensorImpl doesn't support sizes' came out of the memo's key)."""
    torchhal.ops.set_default_hal(hal)
    try:
        nested = torch.nested.nested_tensor(
            [torch.randn(2, 8), torch.randn(3, 8)], requires_grad=requires_grad
        )
        w = torch.randn(8)
        with pytest.raises(UnsupportedError, match=r"rms_norm(_forward)?: x is a nested tensor"):
            torchhal.ops.rms_norm(nested, w)
        with pytest.raises(UnsupportedError, match=r"attention(_forward)?: k is a nested tensor"):
            torchhal.ops.attention(torch.randn(1, 2, 3, 8), nested, nested)
        with pytest.raises(UnsupportedError, match=r"linear_cross_entropy(_forward)?: hidden is a nested"):
            torchhal.ops.linear_cross_entropy(nested, torch.randn(5, 8), torch.randint(0, 5, (2,)))
    finally:
        torchhal.ops.set_default_hal(None)


class _GuardsWithoutCheck:
    """A TensorGuards whose `check` went away (renamed, say)."""

    def __init__(self, *tensors, **dims):
        pass


@pytest.mark.parametrize(
    "module", [None, types.SimpleNamespace(TensorGuards=_GuardsWithoutCheck)], ids=["missing", "changed"]
)
def test_without_a_working_tensor_guard_every_call_is_keyed_and_that_is_logged(
    hal, monkeypatch, capsys, module
):
    from torchhal.hal_core import dispatch_memo

    monkeypatch.setattr(dispatch_memo, "_TENSOR_GUARDS", None)
    monkeypatch.setitem(sys.modules, "torch._C._dynamo.guards", module)  # None: the import fails
    telemetry.configure(log_level="warning")
    calls = _count_validations(hal)
    cpu = hal.device("cpu")
    x, w = torch.randn(6, 32), torch.randn(32)
    for _ in range(3):
        torch.testing.assert_close(hal.kernels.call("rms_norm", cpu, x, w, 1e-6), rms_norm.reference(x, w))
    assert len(calls) == 1  # the memo still holds the layout, found by its key
    assert hal.kernels._seen["rms_norm"].recent == ()
    assert "TensorGuards is missing or changed" in capsys.readouterr().err


class _EqualToAnything:
    def __eq__(self, other):
        return True

    __hash__ = object.__hash__


@pytest.mark.parametrize(
    ("scale", "message"),
    [(_EqualToAnything(), "scale must be a finite number"), (torch.tensor([0.5, 0.5]), "scale")],
    ids=["equal-to-anything", "tensor"],
)
def test_an_odd_scalar_after_a_guarded_layout_is_still_refused_by_the_signature(hal, scale, message):
    """A guard compares scalar types before values, so neither an object whose == says yes
    nor a tensor (whose == is element-wise) in scale's place gets past it; the signature refuses
    them, and no candidate is demoted for it."""
    cpu = hal.device("cpu")
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    for _ in range(2):
        hal.kernels.call("attention", cpu, q, k, v, True, None, None)
    with pytest.raises(InvalidArgumentError, match=message):
        hal.kernels.call("attention", cpu, q, k, v, True, scale, None)
    assert hal.kernels.fallback_counts == {}


def test_a_tensor_in_a_float_slot_after_a_guarded_layout_is_refused_by_the_signature(hal):
    """Compared by value, a two-element eps would raise torch's "ambiguous" RuntimeError."""
    cpu = hal.device("cpu")
    x, w = torch.randn(6, 32), torch.randn(32)
    for _ in range(2):
        hal.kernels.call("rms_norm", cpu, x, w, 1e-6)
    with pytest.raises(InvalidArgumentError, match="eps"):
        hal.kernels.call("rms_norm", cpu, x, w, torch.tensor([1e-6, 1e-6]))


def test_fake_tensors_get_no_guard_no_selection_and_no_kernel(hal):
    """A FakeTensor's sizes may be symbolic, and the C++ check of one aborts the process on a
    data-dependent size: such calls get no guard. Nor do they reach a kernel (which would raise on
    their memory and be demoted for real calls) or the selection: the reference propagates shapes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def kernel(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        x.untyped_storage().data_ptr()  # reads memory, as a Triton kernel does
        return rms_norm.reference(x, w, eps)

    hal.kernels.register("rms_norm", "raw", kernel, provider="test", priority=100)
    cpu = hal.device("cpu")
    with FakeTensorMode():
        x, w = torch.randn(6, 32), torch.randn(32)
        for _ in range(2):
            assert hal.kernels.call("rms_norm", cpu, x, w, 1e-6).shape == (6, 32)
    assert hal.kernels._seen["rms_norm"].recent == ()
    assert hal.kernels._cache["rms_norm"] == {} and hal.kernels.fallback_counts == {}
    x, w = torch.randn(6, 32), torch.randn(32)
    assert hal.kernels.select("rms_norm", cpu, x, w, 1e-6).candidate.qualified_name == "test/raw"


def test_more_layouts_than_the_recent_ones_reuse_their_guards_instead_of_making_new(hal, monkeypatch):
    from torchhal.hal_core import dispatch_memo

    made = []
    make = dispatch_memo._guard
    monkeypatch.setattr(dispatch_memo, "_guard", lambda route, args: made.append(1) or make(route, args))
    cpu = hal.device("cpu")
    layouts = [(torch.randn(3, n), torch.randn(n)) for n in (8, 16, 24, 32, 40, 48)]  # six > four
    for _ in range(3):
        for x, w in layouts:
            torch.testing.assert_close(
                hal.kernels.call("rms_norm", cpu, x, w, 1e-6), rms_norm.reference(x, w)
            )
    assert len(made) == len(layouts)  # one guard per layout, made when it was first validated


def test_a_new_candidate_replaces_the_memos_last_hit(hal):
    cpu = hal.device("cpu")
    x, w = torch.randn(6, 32), torch.randn(32)
    hal.kernels.call("rms_norm", cpu, x, w, 1e-6)
    hal.kernels.call("rms_norm", cpu, x, w, 1e-6)  # now the memo's last hit
    hal.kernels.register("rms_norm", "doubled", lambda x, w, eps: 2 * x, provider="test", priority=100)
    torch.testing.assert_close(hal.kernels.call("rms_norm", cpu, x, w, 1e-6), 2 * x)


def test_ops_whose_signature_reads_contents_validate_every_call(settings):
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    calls = []
    hal.kernels.define_op(
        "scale_by_first",
        lambda t: t * t[0],
        signature=lambda t: calls.append(1) or (t.dtype, bool(t[0] > 0)),
        memoize=False,
    )
    t = torch.rand(4) + 0.1
    hal.kernels.call("scale_by_first", hal.device("cpu"), t)
    hal.kernels.call("scale_by_first", hal.device("cpu"), t)
    assert len(calls) == 2


def test_an_op_reading_contents_on_some_device_types_is_memoised_on_the_others(settings):
    """attention_varlen's signature reads its offsets on the CPU only (free there; a sync on an
    accelerator, where its kernels check them on the device): its calls elsewhere skip validation
    once seen, and on the CPU are validated every time. Meta tensors stand in for an accelerator."""
    hal = HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))
    seen_on = []
    hal.kernels.define_op(
        "double_on_host",
        lambda t: t * 2,
        signature=lambda t: seen_on.append(t.device.type) or (t.dtype, t.dim()),
        reads_values_on=("cpu",),
    )
    cpu = hal.device("cpu")
    host, meta = torch.randn(5), torch.empty(5, device="meta")
    for t in (host, host, meta, meta, meta, host):
        assert hal.kernels.call("double_on_host", cpu, t).device == t.device
    assert seen_on == ["cpu", "cpu", "meta", "cpu"]
    assert hal.kernels.op("double_on_host").reads_values_on == frozenset({"cpu"})


@pytest.mark.parametrize(
    "value", ["cpu", ["cpu", ""], [3], None], ids=["a-string", "empty", "not-a-string", "none"]
)
def test_reads_values_on_takes_device_type_names(hal, value):
    """A lone string would be read as the device types of its letters; None was a bare TypeError."""
    with pytest.raises(
        InvalidArgumentError, match="reads_values_on must be a collection of device type names"
    ):
        hal.kernels.define_op("bad", lambda t: t, signature=lambda t: t.dtype, reads_values_on=value)
    assert "bad" not in hal.kernels.ops()


def test_reads_values_on_keeps_what_a_generator_gives(hal):
    """Checked and kept from one pass: a generator was emptied by the check, and the op then
    memoised the CPU calls its signature reads values for."""
    seen = []
    hal.kernels.define_op(
        "first_positive",
        lambda t: t * (t[0] > 0),
        signature=lambda t: seen.append(1) or (t.dtype, bool(t[0] > 0)),
        reads_values_on=(kind for kind in ["cpu"]),
    )
    assert hal.kernels.op("first_positive").reads_values_on == frozenset({"cpu"})
    t = torch.rand(3) + 0.5
    for _ in range(2):
        hal.kernels.call("first_positive", hal.device("cpu"), t)
    assert len(seen) == 2


def test_dispatch_seen_runs_only_layouts_guarded_without_gradients(hal):
    """What the autograd glue asks first when gradients are on: it must answer NOT_SEEN (and run
    nothing) for a new layout, and for a seen one whose tensors required grad, since only a
    guard made from tensors that required none vouches that none does now."""
    from torchhal.hal_core.kernels import NOT_SEEN

    calls = _count_validations(hal)
    x, w = torch.randn(6, 32), torch.randn(32)
    assert hal.kernels.dispatch_seen("rms_norm", None, (x, w, 1e-6)) is NOT_SEEN
    assert calls == []  # not validated, not run
    hal.dispatch("rms_norm", x, w, 1e-6)
    x2, w2 = torch.randn(6, 32), torch.randn(32)
    torch.testing.assert_close(
        hal.kernels.dispatch_seen("rms_norm", None, (x2, w2, 1e-6)), rms_norm.reference(x2, w2)
    )
    assert len(calls) == 1
    assert hal.kernels.dispatch_seen("rms_norm", None, (x2, w2, 1e-5)) is NOT_SEEN  # another eps
    assert hal.kernels.dispatch_seen("rms_norm", None, (torch.randn(7, 32), w2, 1e-6)) is NOT_SEEN
    assert hal.kernels.dispatch_seen("rms_norm", hal.device("cpu"), (x2, w2, 1e-6)) is NOT_SEEN  # other route

    trained = torch.randn(32, requires_grad=True)
    with torch.no_grad():
        hal.dispatch("rms_norm", x2, trained, 1e-6)  # its guard holds requires_grad=True
    assert hal.kernels.dispatch_seen("rms_norm", None, (x2, trained, 1e-6)) is NOT_SEEN
    assert hal.kernels.dispatch_seen("rms_norm", None, (x2, w2, 1e-6)) is not NOT_SEEN


def test_dispatch_seen_falls_back_from_a_raising_kernel(hal):
    failing = []

    def flaky(x, w, eps):
        if failing:
            raise RuntimeError("kernel launch failed")
        return rms_norm.reference(x, w, eps)

    hal.kernels.register("rms_norm", "flaky", flaky, provider="test", priority=100)
    x, w = torch.randn(5, 8), torch.randn(8)
    hal.dispatch("rms_norm", x, w, 1e-6)
    failing.append(True)
    torch.testing.assert_close(
        hal.kernels.dispatch_seen("rms_norm", None, (x, w, 1e-6)), rms_norm.reference(x, w)
    )
    assert hal.kernels.fallback_counts == {"rms_norm:test/flaky": 1}


def test_a_layout_seen_without_gradients_still_differentiates_once_an_input_requires_grad(hal):
    """ops skip their requires_grad reads for a layout a guard holds as gradient-free: the same
    layout with a weight that requires grad must still go through autograd, with the right
    gradients."""
    torchhal.ops.set_default_hal(hal)
    try:
        x, w = torch.randn(6, 32), torch.randn(32)
        for _ in range(3):
            plain = torchhal.ops.rms_norm(x, w)
        assert plain.grad_fn is None
        weight = w.clone().requires_grad_()
        out = torchhal.ops.rms_norm(x, weight)
        assert out.grad_fn is not None
        grad = torch.randn_like(out)
        out.backward(grad)
        ref_weight = w.clone().requires_grad_()
        rms_norm.reference(x, ref_weight).backward(grad)
        torch.testing.assert_close(weight.grad, ref_weight.grad)
    finally:
        torchhal.ops.set_default_hal(None)


def test_ops_follow_a_new_default_hal(hal, settings):
    """ops bind the default HAL's dispatchers on first use; replacing the default must drop them."""

    class Doubling:
        @staticmethod
        @torchhal.hal_core.hookimpl
        def torchhal_register_kernels(registry):
            registry.register("rms_norm", "doubling", lambda x, w, eps: 2 * x, provider="test", priority=1e9)

    other = HardwareAbstractionLayer(plugins=[Doubling], settings=settings(disable_plugin_autoload="1"))
    x, w = torch.randn(6, 32), torch.randn(32)
    torchhal.ops.set_default_hal(hal)
    try:
        for _ in range(2):
            torch.testing.assert_close(torchhal.ops.rms_norm(x, w), rms_norm.reference(x, w))
        torchhal.ops.set_default_hal(other)
        torch.testing.assert_close(torchhal.ops.rms_norm(x, w), 2 * x)
        with torch.no_grad():
            torch.testing.assert_close(torchhal.ops.rms_norm(x, w), 2 * x)
    finally:
        torchhal.ops.set_default_hal(None)


def test_a_window_of_bools_is_refused_after_the_same_window_of_ints(hal):
    """(True, 0) == (1, 0) and they hash alike: keyed by value alone, a window of bools would reuse
    the validation of a window of ints."""
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    for _ in range(2):
        hal.dispatch("attention", q, k, v, True, None, (1, 0))
    with pytest.raises(InvalidArgumentError, match="window must be"):
        hal.dispatch("attention", q, k, v, True, None, (True, 0))


def test_a_layout_seen_under_no_grad_with_a_parameter_differentiates_once_gradients_are_on(hal):
    """Inference under no_grad with a Parameter leaves a guard made from a tensor that requires
    grad; with gradients on, ops must not run the plain op from it."""
    torchhal.ops.set_default_hal(hal)
    try:
        x, weight = torch.randn(6, 32), torch.nn.Parameter(torch.randn(32))
        with torch.no_grad():
            for _ in range(3):
                assert torchhal.ops.rms_norm(x, weight).grad_fn is None
        out = torchhal.ops.rms_norm(x, weight)
        assert out.grad_fn is not None
        grad = torch.randn_like(out)
        out.backward(grad)
        reference = weight.detach().clone().requires_grad_()
        rms_norm.reference(x, reference).backward(grad)
        torch.testing.assert_close(weight.grad, reference.grad)
    finally:
        torchhal.ops.set_default_hal(None)


def test_a_bound_dispatcher_runs_on_the_native_device_inside_a_use_block_and_leaves_the_memo_right(settings):
    """`HAL.dispatcher` has no route: inside the HAL's own use() block it must neither run on the
    use() device nor file that device's selection where unrouted calls will find it."""
    hal = HardwareAbstractionLayer(
        adapters=[FakeAdapter([fake_caps(dtypes=frozenset({DType.BF16}))])],
        settings=settings(disable_plugin_autoload="1"),
    )
    call = hal.dispatcher("rms_norm")
    x, w = torch.randn(3, 8), torch.randn(8)
    with hal.use("acme:0"):
        with pytest.raises(UnsupportedError, match="acme:0"):
            hal.dispatch("rms_norm", x, w, 1e-6)  # routed: fp32 on a bf16-only device
        torch.testing.assert_close(call(x, w, 1e-6), rms_norm.reference(x, w))  # unrouted: the CPU
    for _ in range(2):
        torch.testing.assert_close(hal.dispatch("rms_norm", x, w, 1e-6), rms_norm.reference(x, w))


def test_racing_first_calls_make_one_default_hal(monkeypatch):
    made = []
    real_init = HardwareAbstractionLayer.__init__

    def slow_init(self, *args, **kwargs):
        made.append(self)
        time.sleep(0.05)  # widen the window between checking for a default and setting it
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(HardwareAbstractionLayer, "__init__", slow_init)
    torchhal.ops.set_default_hal(None)
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            hals = list(pool.map(lambda _: torchhal.ops.default_hal(), range(4)))
        assert len(made) == 1
        assert all(h is hals[0] for h in hals)
    finally:
        torchhal.ops.set_default_hal(None)


def test_all_or_nothing_keeps_a_block_that_returns_and_undoes_one_that_raises():
    registry = KernelRegistry()
    registry.define_op("double", lambda x: 2 * x, signature=lambda x: type(x))
    before = registry.candidates("double")
    with pytest.raises(RuntimeError, match="half-way"), registry.all_or_nothing():
        registry.register("double", "fast", lambda x: x + x, provider="p")
        registry.define_op("triple", lambda x: 3 * x, signature=lambda x: type(x))
        raise RuntimeError("hook failed half-way")
    assert registry.ops() == ("double",) and registry.candidates("double") == before
    with registry.all_or_nothing():
        registry.register("double", "fast", lambda x: x + x, provider="p")
    assert [c.name for c in registry.candidates("double")] == ["fast", "reference"]


def _picking_registry():
    """An op that reads its argument's contents: an out-of-range index fails in every candidate."""
    registry = KernelRegistry()
    registry.define_op("pick", lambda x, i: x[i], signature=lambda x, i: (x.dtype, x.dim()), memoize=False)
    return registry


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(priority=float("nan")), "priority must be a finite number, got nan"),
        (dict(priority=float("inf")), "priority must be a finite number, got inf"),
        (dict(priority="high"), "priority must be a finite number, got 'high'"),
        (dict(priority=True), "priority must be a finite number, got True"),
        (dict(fn=42), "fn must be callable, got 42"),
        (dict(supports="shape"), "supports must be callable or None, got 'shape'"),
    ],
    ids=["nan", "inf", "string", "bool", "fn", "supports"],
)
def test_register_refuses_what_would_break_the_ops_order(change, message):
    """A NaN priority made the order inconsistent (1000 lost to 100); a string raised after the
    append and left the list unsorted, so every later register of the op raised too."""
    registry = _picking_registry()
    args = dict(fn=lambda x, i: x[i], provider="p", priority=5.0) | change
    with pytest.raises(InvalidArgumentError, match=rf"candidate 'p/bad' of op 'pick': {message}"):
        registry.register("pick", "bad", **args)
    registry.register("pick", "good", lambda x, i: x[i], provider="p", priority=1)  # not poisoned
    assert [c.name for c in registry.candidates("pick")] == ["good", "reference"]


def test_two_providers_may_name_their_candidates_alike(hal):
    """Names were unique per op, so an adapter's `aten` or `triton` clashed with the core's and the
    whole plugin was refused, although the conformance kit (which has no core candidates) passed it."""
    hal.kernels.register("rms_norm", "aten", rms_norm.reference, provider="acme", priority=-1)
    assert {"torchhal/aten", "acme/aten"} <= {c.qualified_name for c in hal.kernels.candidates("rms_norm")}
    with pytest.raises(TorchHALError, match="already has a candidate named 'acme/aten'"):
        hal.kernels.register("rms_norm", "aten", rms_norm.reference, provider="acme")


def test_a_broken_predicate_or_bind_turns_its_own_candidate_down(hal, capsys):
    """A predicate returning a bool or raising, and a bind raising, came out of select as bare
    AttributeError, KeyError or ZeroDivisionError, with no fallback; Unsupported took a string
    reason and failed later on `.value`."""
    telemetry.configure(log_level="warning", log_format="json")
    capsys.readouterr()
    x, w = torch.randn(4, 16), torch.randn(16)

    def raising(caps, sig):
        raise KeyError("hidden")

    hal.kernels.register(
        "rms_norm", "yes", rms_norm.reference, provider="t", supports=lambda c, s: True, priority=13
    )
    hal.kernels.register(
        "rms_norm", "raises", rms_norm.reference, provider="t", supports=raising, priority=12
    )
    hal.kernels.register(
        "rms_norm", "bind", rms_norm.reference, provider="t", bind=lambda caps: 1 / 0, priority=11
    )
    hal.kernels.register(
        "rms_norm", "no", rms_norm.reference, provider="t",
        supports=lambda c, s: Unsupported("shape", "too narrow"), priority=14,
    )  # fmt: skip
    sel = hal.kernels.select("rms_norm", hal.device("cpu"), x, w)
    assert sel.candidate.qualified_name == "torchhal/aten"
    torch.testing.assert_close(
        hal.kernels.call("rms_norm", hal.device("cpu"), x, w), rms_norm.reference(x, w)
    )
    reasons = {r.candidate: (r.reason, r.detail) for r in sel.rejected}
    assert reasons["t/yes"] == (
        RejectionReason.FAILED,
        "its predicate raised TypeError: returned True, not an Unsupported or None",
    )
    assert reasons["t/raises"] == (RejectionReason.FAILED, "its predicate raised KeyError: 'hidden'")
    assert reasons["t/bind"] == (
        RejectionReason.FAILED,
        "its bind raised ZeroDivisionError: division by zero",
    )
    assert reasons["t/no"] == (RejectionReason.SHAPE, "too narrow")
    assert {hal.kernels.fallback_counts[f"rms_norm:{n}"] for n in ("t/yes", "t/raises", "t/bind")} == {1}
    logged = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    assert sorted(x["part"] for x in logged if x["event"] == "kernel candidate broken") == [
        "its bind", "its predicate", "its predicate",
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'bogus' is not a valid RejectionReason"):
        Unsupported("bogus", "a reason no selection knows")


def test_when_every_candidate_fails_nothing_is_demoted(hal):
    """An index out of range fails in every candidate: the arguments, not the kernel. Before, the
    first candidate was demoted and counted for the signature's valid calls too."""
    registry = _picking_registry()
    registry.register("pick", "fast", lambda x, i: x[i], provider="p", priority=1)
    cpu = hal.device("cpu")
    x = torch.randn(5)
    with pytest.raises(KernelFailedError, match=r"every candidate failed \(so no kernel was demoted"):
        registry.call("pick", cpu, x, 7)
    assert registry.fallback_counts == {}
    assert registry.select("pick", cpu, x, 2).candidate.qualified_name == "p/fast"


def test_a_selection_made_while_a_candidate_is_registered_is_not_cached(hal):
    """register cleared the cache while a selection was judging the old list; that selection then
    cached its choice, hiding the new candidate until clear_cache()."""
    registry = hal.kernels
    x, w = torch.randn(3, 8), torch.randn(8)
    better = []

    def registers_meanwhile(caps, sig):
        if not better:  # the first judging registers a better candidate, as another thread could
            better.append(
                registry.register("rms_norm", "better", rms_norm.reference, provider="t", priority=99)
            )
        return None

    registry.register(
        "rms_norm", "judged", rms_norm.reference, provider="t", supports=registers_meanwhile, priority=50
    )
    assert registry.select("rms_norm", hal.device("cpu"), x, w).candidate.qualified_name == "t/judged"
    assert registry.select("rms_norm", hal.device("cpu"), x, w).candidate.qualified_name == "t/better"


def test_an_outranked_candidate_says_by_what(hal):
    sel = hal.kernels.select("rms_norm", hal.device("cpu"), torch.randn(2, 8), torch.randn(8))
    hal.kernels.register(
        "rms_norm", "twin", rms_norm.reference, provider="t", priority=sel.candidate.priority
    )
    sel = hal.kernels.select("rms_norm", hal.device("cpu"), torch.randn(2, 8), torch.randn(8))
    details = {r.candidate: r.detail for r in sel.rejected if r.reason is RejectionReason.OUTRANKED}
    assert details["torchhal/reference"] == f"priority -inf < {sel.candidate.priority}"
    equal = next(name for name in ("t/twin", "torchhal/aten") if name != sel.candidate.qualified_name)
    chosen = sel.candidate
    assert details[equal] == (
        f"priority {chosen.priority}, as {chosen.qualified_name}'s: ranked after it by name and provider"
    )
