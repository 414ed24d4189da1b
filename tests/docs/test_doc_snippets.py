"""The Python snippets of README.md and docs/adapter-authoring.md, run as they are written.

A user copies these first; each test takes the block from the document itself (never a copy
kept here), runs it, and checks what it computed against the op's reference on the inputs the
snippet made, and that it ran where the text says.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.docs.snippets import GUIDE, README, assert_matches_reference, block_with
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import Unsupported


@pytest.fixture
def simasic_env(monkeypatch, tmp_path):
    """The CPU and one simulated ASIC (the bundled edge spec), caches in a temp dir."""
    monkeypatch.setenv("TORCHHAL_PLUGINS", "simasic")
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "TORCHHAL_SIMASIC_SPEC", "TORCHHAL_SIMASIC_DEVICES"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("adapter", [None, "simasic"])
def test_readme_quickstart_runs_its_op_on_the_chosen_device(simasic_env, adapter):
    """As written, and with the requirement naming the simulated ASIC: the op must run on the
    device the snippet chose. Before the snippet entered `hal.use(dev)`, ops.rms_norm went
    through another HAL (the default one) to the CPU, and simasic:0 never saw the call."""
    code = block_with(README, "choose_device")
    if adapter is not None:
        requirement = 'DeviceRequirements(dtypes={"bf16"})'
        assert requirement in code, "the README's requirement changed: update this test"
        code = code.replace(requirement, f'DeviceRequirements(dtypes={{"bf16"}}, adapter="{adapter}")')
    ns: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), ns)
    hal, dev, x, w, y = ns["hal"], ns["dev"], ns["x"], ns["w"], ns["y"]
    if adapter is not None:
        assert dev.adapter.name == adapter
        # the simulated ledger holds x, w and the op's output y, all alive here
        assert dev.memory_info().used_bytes == x.nbytes + w.nbytes + y.nbytes
    assert y.dtype == torch.bfloat16 and y.device == dev.torch_device
    assert_matches_reference(hal, "rms_norm", y, x, w, 1e-6)


def test_guide_hook_snippet_hands_each_call_a_fresh_adapter():
    from torchhal_simasic.adapter import SimASICAdapter

    ns: dict[str, Any] = {"SimASICAdapter": SimASICAdapter}
    exec(compile(block_with(GUIDE, "def torchhal_adapters"), str(GUIDE), "exec"), ns)
    first, second = ns["torchhal_adapters"](), ns["torchhal_adapters"]()
    assert [type(a) for a in first] == [type(a) for a in second] == [SimASICAdapter]
    assert first[0] is not second[0]


def test_guide_register_snippet_adds_a_bound_candidate_that_outranks_the_host_ones(monkeypatch, tmp_path):
    """The snippet's keywords are the registry's, `bind` is called with the chosen device's
    capabilities, and priority 100 puts the candidate above the built-in host candidates."""
    monkeypatch.setenv("TORCHHAL_DISABLE_PLUGIN_AUTOLOAD", "1")  # no simasic: the snippet adds it
    monkeypatch.setenv("TORCHHAL_CACHE_DIR", str(tmp_path / "cache"))
    hal = HardwareAbstractionLayer()
    cpu = hal.device("cpu")
    reference = hal.kernels.op("matmul").reference
    bound_for: list[Any] = []

    def predicate(caps: Any, signature: Any) -> Unsupported | None:
        return None if signature.dtype == torch.float32 else Unsupported("dtype", f"{signature.dtype}")

    def bind(caps: Any) -> Any:
        bound_for.append(caps)
        return reference

    ns = {"registry": hal.kernels, "unbound_fn": reference, "predicate": predicate, "bind": bind}
    exec(compile(block_with(GUIDE, "registry.register("), str(GUIDE), "exec"), ns)
    a, b = torch.randn(17, 33), torch.randn(33, 9)
    selection = hal.kernels.select("matmul", cpu, a, b)
    assert selection.candidate.qualified_name == "simasic/simasic", selection.explain()
    out = hal.dispatch("matmul", a, b)
    assert [caps.adapter for caps in bound_for] == ["cpu"]
    assert_matches_reference(hal, "matmul", out, a, b)


def test_guide_exploration_snippet_prints_the_modelled_time(simasic_env, capsys):
    hal = HardwareAbstractionLayer()
    q, k, v = (torch.randn(2, 4, 37, 64, dtype=torch.bfloat16) for _ in range(3))
    ns: dict[str, Any] = {"hal": hal, "q": q, "k": k, "v": v}
    exec(compile("import torchhal\n" + block_with(GUIDE, 'hal.use("simasic:0")'), str(GUIDE), "exec"), ns)
    printed = float(capsys.readouterr().out.strip())
    assert printed > 0  # simulated milliseconds: the device clock moved by the op's cost
    assert_matches_reference(hal, "attention", ns["out"], q, k, v, True, None, None)
