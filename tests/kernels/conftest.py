"""Fixtures for the kernel tests: a HAL whose CPU device runs Triton through its interpreter,
the ops' public functions built by the autograd glue, and the FlashAttention-style tolerance.

TRITON_INTERPRET is set only while triton's library and the kernel modules are imported (triton
decides at `@triton.jit` time whether a function is interpreted; its library is imported when
this file is, before any test could import triton, e.g. through torch.compile), while `triton_hal`
discovers its devices (the CPU adapter declares the TRITON feature only then) and during the
tests that use it. It is restored afterwards, so HALs made by other test directories in the same
pytest process see the environment they expect. On a machine with a GPU the kernel modules are
left to compile for it (the GPU tests in gpu/ need that) and the interpreter tests skip, unless
TRITON_INTERPRET=1 is set for the whole process.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import pkgutil
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torchhal.kernels
from torchhal.hal_core import DeviceNotFoundError, Feature, hookimpl
from torchhal.hal_core.hal import HardwareAbstractionLayer
from torchhal.hal_core.settings import Settings
from torchhal.kernels import layer_norm, matmul, plugin, rms_norm, rope, swiglu
from torchhal.kernels.autograd import AutogradSpec, DifferentiableOp
from torchhal.testing import tolerance

OP_MODULES = (rms_norm, layer_norm, swiglu, rope)
TEST_NAMESPACE = "torchhal_test"  # custom ops of the tests, apart from torchhal.ops' "torchhal::<op>"


class RowOpKernels:
    """Registers this directory's op modules that the core's OP_MODULES does not list (yet)."""

    @staticmethod
    @hookimpl
    def torchhal_register_kernels(registry: Any) -> None:
        for module in OP_MODULES:
            if module not in plugin.OP_MODULES:
                module.register(registry)


def make_hal(*, interpret: bool) -> HardwareAbstractionLayer:
    """A HAL with the row ops, discovered with or without the Triton interpreter."""
    with pytest.MonkeyPatch.context() as env:
        if interpret:
            env.setenv("TRITON_INTERPRET", "1")
        else:
            env.delenv("TRITON_INTERPRET", raising=False)
        hal = HardwareAbstractionLayer(
            plugins=[RowOpKernels], settings=Settings(disable_plugin_autoload=True)
        )
        hal.devices()  # discovery reads TRITON_INTERPRET now
    return hal


def _interpreter_unavailable() -> str | None:
    """Why this process cannot run the Triton kernels through the interpreter, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return "a GPU is present, so this process compiles Triton kernels for it; set TRITON_INTERPRET=1"
    return None


def _import_triton_interpreted(modules: list[str]) -> str | None:
    """Import those of `modules` that exist with the interpreter on; None, or which one is compiled."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TRITON_INTERPRET", "1")
        from triton.runtime.jit import JITFunction

        for name in modules:
            if importlib.util.find_spec(name) is None:  # e.g. gluon, in a triton that has none
                continue
            module = importlib.import_module(name)
            compiled = [k for k, v in vars(module).items() if isinstance(v, JITFunction)]
            if compiled:
                return f"{name} was imported before TRITON_INTERPRET=1 was set ({compiled[0]} is compiled)"
    return None


# Before any test runs (torch.compile imports triton too): triton's own @jit library (tl.sum,
# tl.sigmoid, ...) and the part it imports at the first launch, interpreted.
_TRITON_LIBRARY = ["triton.language.standard", "triton.experimental.gluon"]
_WHY_NO_INTERPRETER = _interpreter_unavailable() or _import_triton_interpreted(_TRITON_LIBRARY)


@pytest.fixture(scope="session")
def triton_hal() -> HardwareAbstractionLayer:
    """A HAL whose CPU device declares Triton and runs the kernels through the interpreter (fp32)."""
    kernels = [f"torchhal.kernels.{m.name}" for m in pkgutil.iter_modules(torchhal.kernels.__path__)]
    why_not = _WHY_NO_INTERPRETER or _import_triton_interpreted([k for k in kernels if ".triton_" in k])
    if why_not is not None:
        pytest.skip(f"Triton interpreter tests: {why_not}")
    return make_hal(interpret=True)


@pytest.fixture(scope="session")
def gpu_hal() -> HardwareAbstractionLayer:
    """The HAL with every installed plugin, for the GPU tests: its cuda:0 must declare Triton."""
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    # autotune off: these tests check the Triton candidates themselves, whatever is fastest
    hal = HardwareAbstractionLayer(plugins=[RowOpKernels], settings=Settings(autotune="off"))
    try:
        device = hal.device_for_tensor(torch.empty(0, device="cuda"))
    except DeviceNotFoundError:
        pytest.skip("no HAL device for cuda:0: the torchhal-nvidia plugin is not installed")
    if Feature.TRITON not in device.capabilities.features:
        pytest.skip(f"{device.id} does not declare Triton (is triton installed?)")
    return hal


def bound_candidate(hal: HardwareAbstractionLayer, op: str, name: str, *args: Any) -> Callable[..., Any]:
    """Candidate `name` of `op` bound to the device of `args[0]`, after its predicate accepted `args`;
    called directly, so neither measured selection nor fallback can stand in for it."""
    device = hal.device_for_tensor(args[0])
    candidate = next(c for c in hal.kernels.candidates(op) if c.name == name)
    verdict = candidate.supports(device.capabilities, hal.kernels.signature(op, *args))
    assert verdict is None, f"{op}/{name} turned down {device.id}: {verdict}"
    return candidate.bind(device.capabilities) if candidate.bind is not None else candidate.fn


@pytest.fixture
def candidate() -> Callable[..., Callable[..., Any]]:
    return bound_candidate


@pytest.fixture(scope="session")
def plain_hal() -> HardwareAbstractionLayer:
    """A HAL whose CPU device has no Triton: references and ATen candidates only."""
    return make_hal(interpret=False)


@pytest.fixture(autouse=True)
def _kernel_test_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Keeps TRITON_INTERPRET=1 through tests that run the interpreter (triton imports parts of itself
    at the first launch and reads it then), and fails a test in which a kernel raised and fell back
    to the reference, since the reference would pass the comparison."""
    if "triton_hal" in request.fixturenames:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    names = ("triton_hal", "plain_hal", "gpu_hal")
    hals = [request.getfixturevalue(n) for n in names if n in request.fixturenames]
    before = [dict(h.kernels.fallback_counts) for h in hals]
    yield
    for hal, counts in zip(hals, before, strict=True):
        assert hal.kernels.fallback_counts == counts, f"kernels fell back: {hal.kernels.fallback_counts}"


def _dispatching(
    hal: HardwareAbstractionLayer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[str, str]]]:
    """torchhal.ops dispatches through `hal` (its CPU device); yields the (op, candidate) of every call."""
    calls: list[tuple[str, str]] = []
    cpu = hal.device("cpu")
    dispatch = hal.dispatch  # what torchhal.ops calls: hal.dispatch(op, *args)

    def spy(op: str, *args: Any) -> Any:
        calls.append((op, hal.kernels.select(op, cpu, *args).candidate.name))
        return dispatch(op, *args)

    monkeypatch.setattr(hal, "dispatch", spy)
    with hal.use(cpu):
        yield calls


@pytest.fixture
def on_triton(
    triton_hal: HardwareAbstractionLayer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[str, str]]]:
    """torchhal.ops (and the nn modules and patched models on it) on the Triton candidates through
    the interpreter (fp32); yields the (op, candidate) of every dispatch."""
    yield from _dispatching(triton_hal, monkeypatch)


@pytest.fixture
def on_plain(
    plain_hal: HardwareAbstractionLayer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[list[tuple[str, str]]]:
    """The same on references, ATen and SDPA candidates: for module logic (caches, fallbacks), fast."""
    yield from _dispatching(plain_hal, monkeypatch)


class RowOps:
    """The ops' public functions as torchhal.ops makes them, dispatching through `self.hal`."""

    def __init__(self) -> None:
        self.hal: HardwareAbstractionLayer | None = None
        self.matmul = DifferentiableOp(matmul.AUTOGRAD, self.dispatch, namespace=TEST_NAMESPACE)
        self.rms_norm = DifferentiableOp(rms_norm.AUTOGRAD, self.dispatch, namespace=TEST_NAMESPACE)
        self.layer_norm = DifferentiableOp(layer_norm.AUTOGRAD, self.dispatch, namespace=TEST_NAMESPACE)
        self.swiglu = DifferentiableOp(swiglu.SWIGLU_AUTOGRAD, self.dispatch, namespace=TEST_NAMESPACE)
        self.geglu = DifferentiableOp(swiglu.GEGLU_AUTOGRAD, self.dispatch, namespace=TEST_NAMESPACE)
        self.rope = DifferentiableOp(rope.AUTOGRAD, self.dispatch, namespace=TEST_NAMESPACE)

    def dispatch(self, op: str, first: torch.Tensor, *args: Any) -> Any:
        assert self.hal is not None, "use the `ops` or `plain_ops` fixture"
        return self.hal.dispatch(op, first, *args)


_ROW_OPS = RowOps()  # custom ops are process-wide: made once


def _bound_ops(hal: HardwareAbstractionLayer) -> Iterator[RowOps]:
    _ROW_OPS.hal = hal
    yield _ROW_OPS
    _ROW_OPS.hal = None


@pytest.fixture
def ops(triton_hal: HardwareAbstractionLayer) -> Iterator[RowOps]:
    yield from _bound_ops(triton_hal)


@pytest.fixture
def plain_ops(plain_hal: HardwareAbstractionLayer) -> Iterator[RowOps]:
    yield from _bound_ops(plain_hal)


@pytest.fixture
def gpu_ops(gpu_hal: HardwareAbstractionLayer) -> Iterator[RowOps]:
    yield from _bound_ops(gpu_hal)


@pytest.fixture
def fresh_ops() -> Iterator[RowOps]:
    """The ops on a HAL of this test's own (no Triton), free to register extra candidates on."""
    yield from _bound_ops(make_hal(interpret=False))


def assert_out_and_lse_within_pytorch_error(
    out: torch.Tensor,
    lse: torch.Tensor,
    reference_forward: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    inputs: tuple[torch.Tensor, ...],
    rest: tuple[Any, ...],
) -> None:
    """An attention forward's (out, lse) against `reference_forward(*inputs, *rest)` in fp64 under
    the rule; a query that sees no key has lse -inf and output 0 (dense rows, or packed tokens)."""
    same_out, same_lse = reference_forward(*inputs, *rest)
    truth_out, truth_lse = reference_forward(*(t.double() for t in inputs), *rest)
    assert_within_pytorch_error("output", out, same_out, truth_out, 2.0)
    seen = torch.isfinite(truth_lse)
    assert torch.equal(torch.isneginf(lse), ~seen)
    rows = out if out.shape[:-1] == lse.shape else out.transpose(0, 1)  # packed: (tokens, heads, dim)
    assert torch.count_nonzero(rows[~seen]) == 0
    if seen.any():  # no query sees a key (e.g. one sequence without keys): nothing more to compare
        assert_within_pytorch_error("lse", lse[seen], same_lse[seen], truth_lse[seen], 2.0)


@contextlib.contextmanager
def new_memory_as_nan() -> Iterator[None]:
    """New tensors filled with NaN (torch's deterministic mode fills uninitialised memory): a row a
    kernel was meant to write and did not shows, where fresh memory would often read as zeros."""
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic)


def assert_within_pytorch_error(
    what: str, got: torch.Tensor, same_precision: torch.Tensor, truth: torch.Tensor, factor: float
) -> None:
    """FlashAttention's rule: |got - truth| <= factor * |PyTorch in got's dtype - truth| + floor.

    The floor is torchhal.testing.tolerance's: about two ulps at the data's scale, plus 64 fp32 ulps
    of max|truth| in fp32, where a correct kernel summing in another order than PyTorch may differ
    by O(sqrt(n)) ulps while PyTorch's own error happens to be tiny.
    """
    assert got.dtype == same_precision.dtype and got.shape == truth.shape, f"{what}: {got.dtype} {got.shape}"
    truth = truth.double()
    error = (got.double() - truth).abs().max().item()
    base = (same_precision.double() - truth).abs().max().item()
    bound = factor * base + tolerance.floor(truth, got.dtype)
    assert error <= bound, (
        f"{what}: error {error:.3g} > {factor} x PyTorch's {base:.3g} + floor = {bound:.3g}"
    )


@pytest.fixture
def check_error() -> Callable[..., None]:
    """assert_within_pytorch_error, for tests that hold whole models to the rule (test_patch)."""
    return assert_within_pytorch_error


def _run_with_grads(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    grads: tuple[torch.Tensor, ...],
    wrt: tuple[int, ...],
    dtype: Any,
) -> tuple[tuple[torch.Tensor, ...], list[torch.Tensor]]:
    leaves = [
        a.detach().to(dtype or a.dtype).requires_grad_(i in wrt) if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    ]
    out = fn(*leaves)
    outs = tuple(out) if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [g.to(o.dtype) for g, o in zip(grads, outs, strict=True)])
    return outs, [leaves[i].grad for i in wrt]


def assert_op_within_pytorch_error(
    fn: Callable[..., Any],
    reference: Callable[..., Any],
    args: tuple[Any, ...],
    grads: tuple[torch.Tensor, ...],
    wrt: tuple[int, ...],
) -> None:
    """Outputs (2x) and the gradients of inputs `wrt` (3x) of `fn` against the reference in fp64,
    bounded by the error of the reference computed with autograd in the inputs' own dtype."""
    got, got_grads = _run_with_grads(fn, args, grads, wrt, None)
    same, same_grads = _run_with_grads(reference, args, grads, wrt, None)
    truth, truth_grads = _run_with_grads(reference, args, grads, wrt, torch.float64)
    for i, (g, s, t) in enumerate(zip(got, same, truth, strict=True)):
        assert_within_pytorch_error(f"output {i}", g, s, t, 2.0)
    for i, g, s, t in zip(wrt, got_grads, same_grads, truth_grads, strict=True):
        assert_within_pytorch_error(f"gradient of input {i}", g, s, t, 3.0)


@pytest.fixture
def check_op() -> Callable[..., None]:
    return assert_op_within_pytorch_error


def assert_kernels_within_pytorch_error(
    spec: AutogradSpec,
    forward: Callable[..., Any],
    backward: Callable[..., Any],
    reference: Callable[..., Any],
    args: tuple[Any, ...],
    grads: tuple[torch.Tensor, ...],
) -> None:
    """A forward and a backward kernel called directly (no autograd, no registry) against the
    reference under the same rule as `assert_op_within_pytorch_error`."""
    out = forward(*args)
    got = tuple(out) if isinstance(out, tuple) else (out,)
    got_grads = backward(*grads, *spec.context(args, got))
    same, same_grads = _run_with_grads(reference, args, grads, spec.differentiable, None)
    truth, truth_grads = _run_with_grads(reference, args, grads, spec.differentiable, torch.float64)
    for i, (g, s, t) in enumerate(zip(got[: spec.outputs], same, truth, strict=True)):
        assert_within_pytorch_error(f"output {i}", g, s, t, 2.0)
    for i, g, s, t in zip(spec.differentiable, got_grads, same_grads, truth_grads, strict=True):
        assert_within_pytorch_error(f"gradient of input {i}", g, s, t, 3.0)


@pytest.fixture
def check_kernels() -> Callable[..., None]:
    return assert_kernels_within_pytorch_error
