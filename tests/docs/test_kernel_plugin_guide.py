"""docs/adapter-authoring.md §8, a plugin of kernels only, run as written.

The hook module and the kit snippet are the guide's own blocks, installed as a package
`acme_kernels` under the entry point its TOML block declares (a dist-info directory on sys.path,
no pip); each claim of the section is checked on the HALs a user would make.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import torchhal
from tests.docs.snippets import GUIDE, assert_matches_reference, block_with
from tests.testing.test_kit_failed_devices_and_hangs import add_entry_point
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import InvalidArgumentError, RejectionReason, UnknownOpError, telemetry
from torchhal.hal_core.plugins import Status
from torchhal.hal_core.settings import Settings
from torchhal.testing import CheckStatus, tolerance

HOOK_MARKER = "def add_rms_norm_reference("
ADDED = "defined op(s) add_rms_norm; added add_rms_norm/acme/fused, rms_norm/acme/fast"


def entry_point() -> tuple[str, str]:
    """(plugin name, module) of §8's TOML block."""
    toml = block_with(GUIDE, "acme_kernels", language="toml")
    found = re.fullmatch(r'\[project\.entry-points\."torchhal\.adapters"\]\n(\w+) = "([\w.]+)"\n', toml)
    assert found, f"§8's entry point block changed: {toml!r}"
    return found[1], found[2]


def forget_acme() -> None:
    for name in [m for m in sys.modules if m == "acme_kernels" or m.startswith("acme_kernels.")]:
        del sys.modules[name]


@pytest.fixture
def acme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """§8's plugin installed and not yet imported; yields the directory for the HALs' caches."""
    name, module = entry_point()
    assert (name, module) == ("acme", "acme_kernels.plugin")  # what the section's text calls them
    site = tmp_path / "site"
    package = site / "acme_kernels"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text(block_with(GUIDE, HOOK_MARKER))
    monkeypatch.syspath_prepend(str(site))
    add_entry_point(site, name, module)
    forget_acme()
    yield tmp_path
    forget_acme()


def make_hal(tmp_path: Path, **env: str) -> HardwareAbstractionLayer:
    """A HAL of these TORCHHAL_* settings only (the caller's environment left out)."""
    variables = {f"TORCHHAL_{k.upper()}": v for k, v in env.items()}
    settings = Settings.from_env({"TORCHHAL_CACHE_DIR": str(tmp_path / "cache"), **variables})
    return HardwareAbstractionLayer(settings=settings)


def diagnostic(hal: HardwareAbstractionLayer, name: str) -> Any:
    (found,) = [d for d in hal.diagnostics if d.name == name]
    return found


def rms_norm_inputs(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = int(torch.randint(17, 200, ()))
    return torch.randn(3, 5, hidden, dtype=dtype), torch.randn(hidden, dtype=dtype)


def test_the_plugin_is_listed_loaded_at_stage_kernels_with_what_it_added(acme, monkeypatch):
    """hal.diagnostics and `torchhal info` (its --json report) name the plugin, its distribution
    and what it defined and added."""
    from typer.testing import CliRunner

    from torchhal.cli import app

    hal = make_hal(acme, plugins="acme")
    diag = diagnostic(hal, "acme")
    assert (diag.status, diag.stage, diag.distribution) == (Status.LOADED, "kernels", "torchhal-test-acme")
    assert diag.reason == f"kernels only, no adapter: {ADDED}"
    kernels = hal.report()["kernels"]
    assert {"name": "fast", "provider": "acme", "priority": 50} in kernels["rms_norm"]
    assert [c["name"] for c in kernels["add_rms_norm"]] == ["fused", "reference"]

    monkeypatch.setenv("TORCHHAL_PLUGINS", "acme")
    monkeypatch.delenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(acme / "cache"))
    result = CliRunner().invoke(app, ["info", "--json"])
    assert result.exit_code == 0, result.output
    listed = [d for d in json.loads(result.output)["diagnostics"] if d["name"] == "acme"]
    assert listed == [diag.as_dict()]


def test_its_rms_norm_candidate_is_chosen_explained_and_declines_what_it_does_not_serve(acme):
    hal = make_hal(acme, plugins="acme,simasic")
    cpu, sim = hal.device("cpu"), hal.device("simasic:0")
    x, w = rms_norm_inputs()
    selection = hal.kernels.select("rms_norm", cpu, x, w)
    assert selection.candidate.qualified_name == "acme/fast", selection.explain()
    assert selection.timings_ms == ()  # the CPU has no timing events: ranked by priority, unmeasured
    assert "rejected torchhal/aten: outranked (priority 10 < 50)" in selection.explain()
    assert_matches_reference(hal, "rms_norm", hal.dispatch("rms_norm", x, w, 1e-6), x, w, 1e-6)

    wide = hal.kernels.select("rms_norm", cpu, x.double(), w.double())  # the text's example
    assert wide.candidate.qualified_name == "torchhal/aten"
    assert (
        "rejected acme/fast: dtype (computes in fp32, torch.float64 would lose precision)" in wide.explain()
    )

    simulated = hal.kernels.select("rms_norm", sim, x, w)  # the host kernel never takes simasic's calls
    assert simulated.candidate.qualified_name == "simasic/simasic"
    (declined,) = [r for r in simulated.rejected if r.candidate == "acme/fast"]
    assert declined.reason is RejectionReason.DEVICE


def test_measured_selection_times_it_against_the_core_candidate_and_remembers(acme):
    """On the CPU with TORCHHAL_AUTOTUNE=on, priority 50 does not decide: both are timed, and a
    later HAL on the same cache recalls the winner and says why the other lost."""
    x, w = rms_norm_inputs()
    first = make_hal(acme, plugins="acme", autotune="on")
    timed = first.kernels.select("rms_norm", first.device("cpu"), x, w)
    assert {name for name, _ in timed.timings_ms} == {"acme/fast", "torchhal/aten"}
    assert "  measured acme/fast: " in timed.explain()
    winner = timed.candidate.qualified_name
    (loser,) = {"acme/fast", "torchhal/aten"} - {winner}
    later = make_hal(acme, plugins="acme", autotune="on")
    recalled = later.kernels.select("rms_norm", later.device("cpu"), x, w)
    assert recalled.candidate.qualified_name == winner and recalled.timings_ms == ()
    said = f"rejected {loser}: outranked (measured slower than {winner} in an earlier run (remembered))"
    assert said in recalled.explain()
    assert_matches_reference(later, "rms_norm", recalled.fn(x, w), x, w)


def selections(op: str) -> list[tuple[str, str]]:
    """(device, candidate) of each selection of `op` traced so far (telemetry's memory exporter)."""
    return [
        (span.attributes["device"], span.attributes["torchhal.kernel.candidate"])
        for span in telemetry.memory_exporter().get_finished_spans()
        if span.name == "torchhal.kernel.select" and span.attributes["op"] == op
    ]


def test_torchhal_ops_reach_its_candidate_for_a_core_op(acme):
    hal = make_hal(acme, plugins="acme")
    telemetry.configure(exporter="memory")
    torchhal.ops.set_default_hal(hal)
    try:
        x, w = rms_norm_inputs()
        out = torchhal.ops.rms_norm(x, w)
    finally:
        torchhal.ops.set_default_hal(None)
    assert selections("rms_norm") == [("cpu", "acme/fast")]
    assert_matches_reference(hal, "rms_norm", out, x, w, 1e-6)


def test_disable_kernels_turns_the_candidate_off(acme):
    hal = make_hal(acme, plugins="acme", disable_kernels="acme/fast")
    x, w = rms_norm_inputs()
    selection = hal.kernels.select("rms_norm", hal.device("cpu"), x, w)
    assert selection.candidate.qualified_name == "torchhal/aten"
    assert "rejected acme/fast: disabled (listed in TORCHHAL_DISABLE_KERNELS)" in selection.explain()
    r = torch.randn_like(x)
    assert hal.kernels.select("add_rms_norm", hal.device("cpu"), x, r, w, 1e-6).candidate.name == "fused"


def test_an_allowlist_without_it_leaves_it_unimported(acme):
    hal = make_hal(acme, plugins="simasic")
    diag = diagnostic(hal, "acme")
    assert (diag.status, diag.stage) == (Status.SKIPPED, "allowlist")
    assert "acme_kernels" not in sys.modules
    assert "add_rms_norm" not in hal.kernels.ops()
    assert [c.qualified_name for c in hal.kernels.candidates("rms_norm") if c.provider == "acme"] == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_own_op_is_reached_through_hal_dispatch(acme, dtype, capsys):
    from torchhal_simasic import kernels as simasic_kernels

    telemetry.configure(exporter="memory", log_level="warning")
    simasic_kernels._say_uncosted.cache_clear()  # said once per process: this test starts unsaid
    capsys.readouterr()
    hal = make_hal(acme, plugins="acme,simasic")
    hal.devices()
    warned = [line for line in capsys.readouterr().err.splitlines() if "simasic has no cost" in line]
    assert len(warned) == 1 and "op=add_rms_norm" in warned[0]  # simasic says its devices won't charge it
    x, w = rms_norm_inputs(dtype)
    r = torch.randn_like(x)
    out = hal.dispatch("add_rms_norm", x, r, w, 1e-6)
    assert out.dtype == dtype and out.shape == x.shape
    assert_matches_reference(hal, "add_rms_norm", out, x, r, w, 1e-6)
    assert not hasattr(torchhal.ops, "add_rms_norm")  # torchhal.ops has only the core's ops

    with hal.use("simasic:0"):  # the use() device: the host candidate declines it, the reference runs
        on_sim = hal.dispatch("add_rms_norm", x, r, w, 1e-6)
    assert_matches_reference(hal, "add_rms_norm", on_sim, x, r, w, 1e-6)
    assert selections("add_rms_norm") == [("cpu", "acme/fused"), ("simasic:0", "torchhal/reference")]

    with pytest.raises(InvalidArgumentError, match=r"add_rms_norm: residual must have x's shape"):
        hal.dispatch("add_rms_norm", x, r[..., 1:], w, 1e-6)


def assert_gradients_match_the_reference(hal: HardwareAbstractionLayer, run: Any, dtype: torch.dtype) -> None:
    """`run(x, residual, weight, eps)`'s output and gradients on random inputs in `dtype`, each
    checked as kernels are, against the reference's own autograd in `dtype` and in fp64."""
    x, w = rms_norm_inputs()
    r, grad = torch.randn_like(x), torch.randn_like(x)
    reference = hal.kernels.op("add_rms_norm").reference

    def outputs(fn: Any, dtype: torch.dtype) -> list[torch.Tensor]:
        inputs = [t.to(dtype, copy=True).requires_grad_() for t in (x, r, w)]
        out = fn(*inputs, 1e-6)
        out.backward(grad.to(dtype))
        return [out.detach(), *(t.grad for t in inputs)]

    got = outputs(run, dtype)
    same_dtype, truth = outputs(reference, dtype), outputs(reference, torch.float64)
    for name, g, ref, true in zip(("out", "dx", "dresidual", "dweight"), got, same_dtype, truth, strict=True):
        result = tolerance.compare(g, ref, true)
        assert g.dtype == dtype and result.ok, f"{name}: {g.dtype} {result}"


def test_gradients_flow_through_its_torch_candidate(acme):
    """ "Gradients flow only where the chosen candidate is differentiable torch code": acme's
    fused candidate is; its gradients are checked as its outputs are, against the reference's."""
    hal = make_hal(acme, plugins="acme")
    x, w = rms_norm_inputs()
    assert hal.kernels.select("add_rms_norm", hal.device("cpu"), x, x, w, 1e-6).candidate.name == "fused"
    assert_gradients_match_the_reference(
        hal, lambda *args: hal.dispatch("add_rms_norm", *args), torch.float32
    )


@pytest.fixture
def acme_default(acme: Path) -> Iterator[HardwareAbstractionLayer]:
    """A HAL with §8's plugin and simasic, as the default HAL of torchhal.ops; traced."""
    hal = make_hal(acme, plugins="acme,simasic")
    telemetry.configure(exporter="memory")
    torchhal.ops.set_default_hal(hal)
    try:
        yield hal
    finally:
        torchhal.ops.set_default_hal(None)


def test_its_own_op_is_reached_through_torchhal_ops_dispatch(acme_default):
    """As the text says: the default HAL, or the innermost `hal.use(...)` one."""
    hal = acme_default
    x, w = rms_norm_inputs()
    r = torch.randn_like(x)
    out = torchhal.ops.dispatch("add_rms_norm", x, r, w, 1e-6)
    with hal.use("simasic:0"):
        on_sim = torchhal.ops.dispatch("add_rms_norm", x, r, w, 1e-6)
    assert selections("add_rms_norm") == [("cpu", "acme/fused"), ("simasic:0", "torchhal/reference")]
    for got in (out, on_sim):
        assert_matches_reference(hal, "add_rms_norm", got, x, r, w, 1e-6)
    with pytest.raises(UnknownOpError, match=r"^unknown op 'add_rms_nrom'; defined ops: add_rms_norm, "):
        torchhal.ops.dispatch("add_rms_nrom", x, r, w, 1e-6)


@functools.cache
def custom_op_wrapper() -> Any:
    """§8's `torch.library.custom_op` wrapper, defined once per process (torch keeps its ops)."""
    ns: dict[str, Any] = {}
    exec(compile(block_with(GUIDE, "@torch.library.custom_op("), str(GUIDE), "exec"), ns)
    return ns["add_rms_norm"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_custom_op_wrapper_matches_the_reference_eager_and_compiled(acme_default, dtype):
    """The wrapper calls the op through torchhal.ops.dispatch; its fake and its backward are
    right (torch's opcheck), and torch.compile(fullgraph=True) over it gives what the reference
    gives, gradients included, on the CPU."""
    hal, wrapper = acme_default, custom_op_wrapper()
    assert_gradients_match_the_reference(hal, wrapper, dtype)
    compiled = torch.compile(lambda *args: wrapper(*args), fullgraph=True, backend="aot_eager")
    assert_gradients_match_the_reference(hal, compiled, dtype)
    assert {c for _, c in selections("add_rms_norm")} == {"acme/fused"}  # through the registry
    x, w = rms_norm_inputs(dtype)
    inputs = [t.requires_grad_() for t in (x, torch.randn_like(x), w)]
    torch.library.opcheck(wrapper, (*inputs, 1e-6))
    with hal.use("simasic:0"):  # the wrapper honours use(), as the ops of torchhal.ops do
        on_sim = wrapper(x.detach(), inputs[1].detach(), w.detach(), 1e-6)
    assert selections("add_rms_norm")[-1] == ("simasic:0", "torchhal/reference")
    assert_matches_reference(hal, "add_rms_norm", on_sim, x.detach(), inputs[1].detach(), w.detach(), 1e-6)


def test_its_custom_op_wrapper_runs_the_candidates_with_autocast_off(acme_default, monkeypatch):
    """As torchhal.ops' own ops do: under autocast an op's answer must not depend on whether its
    candidate's torch calls are on autocast's lists."""
    hal, wrapper = acme_default, custom_op_wrapper()
    seen, dispatch = [], torchhal.ops.dispatch

    def spy(op: str, *args: Any) -> Any:
        seen.append(torch.is_autocast_enabled("cpu"))
        return dispatch(op, *args)

    monkeypatch.setattr(torchhal.ops, "dispatch", spy)
    x, w = rms_norm_inputs(torch.float32)
    residual = torch.randn_like(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = wrapper(x, residual, w, 1e-6)
    assert seen == [False]
    assert out.dtype == torch.float32
    assert_matches_reference(hal, "add_rms_norm", out, x, residual, w, 1e-6)


def test_its_custom_op_wrapper_backward_is_exact_in_fp64(acme_default):
    """gradcheck and gradgradcheck in fp64: a backward computed in fp32 was right only to ~2e-7."""
    wrapper = custom_op_wrapper()
    shapes = ((3, 17), (3, 17), (17,))  # small: gradcheck differentiates numerically, per element
    inputs = tuple(torch.randn(*shape, dtype=torch.float64, requires_grad=True) for shape in shapes)
    assert torch.autograd.gradcheck(lambda *a: wrapper(*a, 1e-6), inputs)
    assert torch.autograd.gradgradcheck(lambda *a: wrapper(*a, 1e-6), inputs)  # failed in fp32


def test_a_plugin_attaching_to_its_op_loads_whatever_its_name(acme):
    """The hooks run by plugin name: one sorting before acme found no add_rms_norm and failed whole
    at stage kernels. It is now run again after the others; one attaching to an op that no plugin
    defines still fails, naming the error."""
    site = acme / "site"
    hook = (
        "from torchhal.hal_core import hookimpl\n\n"
        "@hookimpl\ndef torchhal_register_kernels(registry):\n"
        "    reference = registry.op('{1}').reference\n"
        "    registry.register('{1}', 'mine', reference, provider='{0}')\n"
    )
    plugins = {"aardvark": "add_rms_norm", "zebra": "add_rms_norm", "nowhere": "no_such_op"}
    for name, op in plugins.items():
        (site / f"{name}_mod.py").write_text(hook.format(name, op))
        add_entry_point(site, name, f"{name}_mod")
    try:
        hal = make_hal(acme, plugins="aardvark,acme,zebra,nowhere")
        early, late, lost = (diagnostic(hal, name) for name in plugins)
    finally:
        for name in plugins:
            sys.modules.pop(f"{name}_mod", None)
    for attached in (early, late):
        assert (attached.status, attached.stage) == (Status.LOADED, "kernels")
        assert attached.reason == f"kernels only, no adapter: added add_rms_norm/{attached.name}/mine"
    assert (lost.status, lost.stage) == (Status.FAILED, "kernels")
    assert lost.reason.startswith("UnknownOpError: unknown op 'no_such_op'")
    providers = [c.provider for c in hal.kernels.candidates("add_rms_norm")]
    assert "zebra" in providers and "aardvark" in providers


def test_the_kit_snippet_certifies_its_candidates(acme):
    ns: dict[str, Any] = {}
    exec(compile(block_with(GUIDE, "class AcmeOnTheHost("), str(GUIDE), "exec"), ns)
    report = ns["report"]
    assert report.ok
    assert report.result("kernel.rms_norm/acme/fast").status is CheckStatus.PASSED
    own = report.result("kernel.add_rms_norm/acme/fused")  # on the examples its definition gives
    assert own.status is CheckStatus.PASSED, own.reason
    assert re.match(r"[1-9]\d* case\(s\) within tolerance, ", own.reason), own.reason
