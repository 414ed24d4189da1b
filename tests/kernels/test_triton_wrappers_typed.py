"""pyproject relaxes mypy's untyped-def checks for the modules that define @triton.jit kernels
(triton is untyped, and a kernel's pointer and tl.constexpr parameters have no Python type). Their
Python-side functions (launch wrappers, helpers) stay fully annotated: mypy no longer says so
there, this test does. Source only: nothing here imports triton."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[2]


def _relaxed_modules() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    overrides = config["tool"]["mypy"].get("overrides", [])
    return [m for o in overrides if o.get("disallow_untyped_defs") is False for m in o["module"]]


def _source(module: str) -> str:
    return (ROOT / (module.replace(".", "/") + ".py")).read_text()


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(ast.unparse(d).startswith("triton.jit") for d in node.decorator_list)


def test_the_relaxation_is_only_for_triton_kernel_modules():
    modules = _relaxed_modules()
    assert modules
    for module in modules:
        assert module.startswith("torchhal.kernels.triton_"), module
        assert "@triton.jit" in _source(module), f"{module} defines no kernel: drop it from the override"


def test_python_side_functions_stay_annotated():
    unannotated = []
    for module in _relaxed_modules():
        for node in ast.walk(ast.parse(_source(module))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or _is_kernel(node):
                continue
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
            missing = [p.arg for p in params if p.annotation is None and p.arg not in ("self", "cls")]
            if missing or node.returns is None:
                unannotated.append(f"{module}:{node.lineno} {node.name} (missing: {missing or 'return'})")
    assert not unannotated, unannotated
