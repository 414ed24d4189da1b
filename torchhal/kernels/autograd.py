"""Autograd and torch.library glue, written once for every differentiable op.

A `DifferentiableOp` joins three registry ops (the plain op, its training forward, its
backward) into one public function with three paths:

- eager, no gradient needed: straight to `dispatch(spec.op, ...)`, a few µs of Python. With
  gradients on, `dispatch_seen(spec.op, ...)` is asked first: it runs the plain op on a layout
  whose guard already vouches that no tensor requires grad, so those calls skip reading each
  input's `requires_grad`;
- eager with autograd: a `torch.autograd.Function` whose forward dispatches `spec.forward` and
  whose backward dispatches `spec.backward`, so backward kernels are selected (and fall back)
  through the registry like any op, with the `hal.use(device)` block that was active at the
  forward active again (`_where_forward_ran`);
- under `torch.compile`: custom ops `<namespace>::<forward>` and `<namespace>::<backward>`,
  opaque to Dynamo (their fake implementations give output metadata), with `register_autograd`
  wiring the backward custom op, so `fullgraph=True` traces without a graph break.

Contract for the registry ops of a spec: `forward` returns the op's outputs followed by any
statistics the backward needs (`outputs` says how many are outputs); `backward` takes the
output gradients followed by `spec.context(inputs, forward results)` and returns one gradient
per input listed in `differentiable`. Every output is a fresh tensor (custom ops may not alias
their inputs) with the strides its fake implementation gives: contiguous, or for rope its
input's layout.
A backward that autograd records (`create_graph=True`: double backward, gradient penalties) runs
the op's reference backward (`spec.backward_reference`, differentiable torch ops) instead of the
registry's backward: a Triton backward's gradients have no grad_fn, so a penalty through them
lost its second-order term without a word. Logged once per op and counted.

Autocast, one rule for every path and candidate, each on the device types where torch's autocast
has a kernel for the op's aten counterpart `spec.aten_op` (asked of torch's dispatcher on the
first autocast call per device type, see `autocast_rule`): inputs listed in `spec.autocast` (the
ops whose torch counterparts autocast runs in lower precision: SDPA, matmul, lm_head's linear)
are cast to the autocast dtype, as autocast casts them (floating, not fp64); inputs listed in
`spec.autocast_fp32` (the norms) are cast to fp32 (CUDA and XPU autocast run them in fp32, CPU
autocast leaves them alone). Then the candidates run with autocast off, so each computes in the
dtypes it was given whichever candidate is chosen (an op's answer must not depend on its
candidate: a reference meeting autocast inside would cast the fp32 it asked for back down, where
a Triton kernel would not).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchhal.hal_core import ConfigurationError, UnsupportedError, telemetry
from torchhal.hal_core.hal import active_use, resumed_use
from torchhal.hal_core.kernels import NOT_SEEN

log = telemetry.get_logger("torchhal.kernels.autocast")
_autograd_log = telemetry.get_logger("torchhal.kernels.autograd")

_SAVED = object()  # marks a context slot whose tensor went through ctx.save_for_backward
# Bound once: every op call runs them. `_any_requires_grad` is what torch.library's own autograd
# glue (torch/_library/autograd.py) asks of every argument.
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_any_autocast = torch._C._is_any_autocast_enabled
_autocast_off = torch._C._DisableAutocast
# The device types autocast knows (torch.is_autocast_enabled raises for others, such as "meta"),
# asked once here: Dynamo in torch 2.11 cannot trace torch.amp.is_autocast_available. A
# PrivateUse1 backend renamed after torchhal is imported is not among them (its calls ignore autocast).
_AUTOCAST_DEVICE_TYPES = frozenset(
    name
    for name in (
        "cpu",
        "cuda",
        "xpu",
        "mps",
        "hpu",
        "ipu",
        "xla",
        "mtia",
        "maia",
        torch._C._get_privateuse1_backend_name(),
    )
    if torch.amp.is_autocast_available(name)
)
# Where torch's dispatcher cannot be asked (a torch without its private calls, or a first call
# on a device type while Dynamo traces, which cannot trace the question): the device types
# whose autocast runs layer_norm and rms_norm, the ops that declare `autocast_fp32`, in fp32 as
# of torch 2.13 (2.11's CUDA autocast still left rms_norm alone: the lists move, hence the asking).
_DOCUMENTED_FP32_DEVICE_TYPES = frozenset({"cuda", "xpu"})

Dispatch = Callable[..., Any]
"""`dispatch(op, *args)`: run registry op `op` on the device of its first tensor."""


class AutogradSpec(NamedTuple):
    """How one op differentiates: which registry ops run forward and backward, and what is saved."""

    op: str  # registry op for calls that need no gradient
    forward: str  # registry op for the training forward: outputs, then saved statistics
    backward: str  # registry op: (*output grads, *context) -> one grad per differentiable input
    forward_fake: Callable[..., Any]  # typed prototype of `forward`: schema from annotations, fake body
    backward_fake: Callable[..., Any]
    differentiable: tuple[int, ...]  # positions of the inputs that get gradients, in backward's order
    context: Callable[[Sequence[Any], Sequence[torch.Tensor]], tuple[Any, ...]]  # (inputs, results)
    outputs: int = 1  # leading results of `forward` that are the op's outputs
    # positions of the inputs autocast casts to its dtype, where torch's autocast casts `aten_op`
    autocast: tuple[int, ...] = ()
    # positions of the inputs autocast casts to fp32 where torch's autocast runs `aten_op` in fp32
    autocast_fp32: tuple[int, ...] = ()
    aten_op: str = ""  # the torch counterpart whose autocast kernels say where: "aten::layer_norm"
    # what a backward with create_graph=True runs, taking `backward`'s arguments: its reference,
    # made of differentiable torch ops, with any saved statistics recomputed from the inputs so
    # that autograd sees their dependence (None: such a backward is refused, as for
    # linear_cross_entropy, whose forward computes its gradients and keeps no inputs)
    backward_reference: Callable[..., Any] | None = None


class DifferentiableOp:
    """The public function of one op; see the module docstring for its three paths."""

    def __init__(
        self,
        spec: AutogradSpec,
        dispatch: Dispatch,
        dispatch_seen: Callable[[str, tuple[Any, ...]], Any] | None = None,
        *,
        namespace: str = "torchhal",
    ) -> None:
        """`dispatch_seen(op, args)`: `dispatch` for the argument tuple `args` if the guard of a
        recent layout, made from tensors that required no grad, admits it, else NOT_SEEN (see
        `KernelRegistry.dispatch_seen`); None: never seen."""
        self.spec = spec
        self._dispatch = dispatch
        self._plain = functools.partial(dispatch, spec.op)  # the no-gradient path, bound once
        self._plain_seen = functools.partial(dispatch_seen or _never_seen, spec.op)
        self._input_names = tuple(inspect.signature(spec.forward_fake).parameters)
        if (spec.autocast or spec.autocast_fp32) and not _missing_dispatcher_calls():
            torch_autocasts(spec.aten_op, "cpu")  # an aten op that does not exist is refused now
        # device type -> what autocast casts there (`autocast_rule`), asked on the first autocast
        # call on that device type, not here: a backend's autocast kernels (HPU, XLA, PrivateUse1)
        # are registered when its extension is imported, which may follow torchhal's import
        self._autocast_rules: dict[str, AutocastRule] = {}
        self._tensor_inputs = _tensor_parameters(spec.forward_fake, self._input_names)
        if not set(spec.differentiable) <= set(self._tensor_inputs):
            raise TypeError(
                f"{spec.op}: differentiable inputs {spec.differentiable} must be annotated torch.Tensor "
                f"in {spec.forward_fake.__name__}; tensor inputs found at {self._tensor_inputs}"
            )
        self._forward_op = self._custom_op(namespace, spec.forward, spec.forward_fake)
        self._custom_op(namespace, spec.backward, spec.backward_fake)
        self._forward_op.register_autograd(self._compiled_backward, setup_context=self._compiled_setup)
        self._traced_forward = getattr(getattr(torch.ops, namespace), spec.forward).default
        self._traced_backward = getattr(getattr(torch.ops, namespace), spec.backward).default
        self._function = _function_class(self)

    def __call__(self, *args: Any) -> Any:
        if _is_compiling():
            args = self._autocast_inputs(args)
            self._check_differentiable(args)
            return self._visible(_as_tuple(self._traced_forward(*args)))
        if _any_autocast():
            args = self._autocast_inputs(args)
            with _autocast_off():
                return self.__call__(*args)
        if _is_grad_enabled():
            result = self._plain_seen(args)  # a layout guarded before as needing no gradient
            if result is not NOT_SEEN:
                return result
            # Whether a tensor input requires grad. Only the positions typed as tensors: half
            # the time of torch's C check of every argument (~0.5 µs at attention's six). A
            # tensor in a number's place is refused by validation (eps, scale,
            # label_smoothing) or is a flag or an integer, which has no gradient.
            needs_grad = False
            try:
                for i in self._tensor_inputs:
                    a = args[i]
                    if a is not None and a.requires_grad:
                        needs_grad = True
                        break
            except (AttributeError, IndexError):  # no tensor where one belongs: torch checks all
                needs_grad = _any_requires_grad(*args)
            if needs_grad:
                self._check_differentiable(args)
                return self._visible(self._function.apply(*args))  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        return self._plain(*args)

    def _autocast_inputs(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """`args` with the `spec.autocast` inputs cast as autocast would cast them, where it is on
        for the first input's device type and torch's autocast casts the op's counterpart there;
        the `spec.autocast_fp32` ones to fp32 where torch's autocast runs it in fp32."""
        spec = self.spec
        if not (spec.autocast or spec.autocast_fp32) or not isinstance(args[0], torch.Tensor):
            return args
        device_type = args[0].device.type
        if device_type not in _AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
            return args
        rule = self._autocast_rules.get(device_type)
        if rule is None:
            rule = _asked_while_traced(spec, device_type)
            if not torch.compiler.is_compiling():
                self._autocast_rules[device_type] = rule
        cast, dtype = rule
        if not cast:
            return args
        dtype = dtype or torch.get_autocast_dtype(device_type)
        return tuple(a.to(dtype) if i in cast and _autocast_eligible(a) else a for i, a in enumerate(args))

    def _custom_op(self, namespace: str, op: str, fake: Callable[..., Any]) -> Any:
        # torch.library.custom_op replaces an op of the same name without a word, and when the
        # replaced one's library is collected its registrations go too: calls through the first
        # op's handles then crashed inside the dispatcher (segfaults under Dynamo's fake tensors)
        if hasattr(getattr(torch.ops, namespace), op):
            raise ConfigurationError(
                f"custom op {namespace}::{op} is already defined in this process: custom ops are "
                "process-wide, so make each DifferentiableOp once (or give another its own namespace)"
            )
        schema = torch.library.infer_schema(fake, mutates_args=())

        def impl(*args: Any) -> Any:
            return _without_autocast(self._dispatch, op, *args)

        custom = torch.library.custom_op(f"{namespace}::{op}", impl, mutates_args=(), schema=schema)
        custom.register_fake(fake)
        return custom

    def _check_differentiable(self, args: Sequence[Any]) -> None:
        if not torch.is_grad_enabled():
            return
        for pos, arg in enumerate(args):
            if isinstance(arg, torch.Tensor) and arg.requires_grad and pos not in self.spec.differentiable:
                wanted = ", ".join(self._input_names[i] for i in self.spec.differentiable)
                raise UnsupportedError(
                    f"{self.spec.op}: input {self._input_names[pos]!r} requires grad, but the op "
                    f"differentiates only with respect to {wanted}; detach it"
                )

    def _visible(self, results: tuple[torch.Tensor, ...]) -> Any:
        outputs = results[: self.spec.outputs]
        return outputs[0] if self.spec.outputs == 1 else outputs

    def _save(self, ctx: Any, inputs: Sequence[Any], results: tuple[torch.Tensor, ...]) -> None:
        context = self.spec.context(inputs, results)
        ctx.save_for_backward(*(c for c in context if isinstance(c, torch.Tensor)))
        ctx.torchhal_context = tuple(_SAVED if isinstance(c, torch.Tensor) else c for c in context)
        ctx.torchhal_inputs = len(inputs)

    def _restore(self, ctx: Any) -> list[Any]:
        tensors = iter(ctx.saved_tensors)
        return [next(tensors) if c is _SAVED else c for c in ctx.torchhal_context]

    def _input_grads(self, ctx: Any, grads: Any) -> tuple[torch.Tensor | None, ...]:
        out: list[torch.Tensor | None] = [None] * ctx.torchhal_inputs
        for pos, grad in zip(self.spec.differentiable, _as_tuple(grads), strict=True):
            out[pos] = grad
        return tuple(out)

    def _compiled_setup(self, ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        self._save(ctx, inputs, _as_tuple(output))

    def _compiled_backward(self, ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        context = self._restore(ctx)
        return self._input_grads(ctx, self._traced_backward(*grads[: self.spec.outputs], *context))


def _tensor_parameters(fake: Callable[..., Any], names: Sequence[str]) -> tuple[int, ...]:
    """Positions of `fake`'s parameters `names` annotated `torch.Tensor` or `torch.Tensor | None`."""
    hints = typing.get_type_hints(fake)
    tensor_types = (torch.Tensor, torch.Tensor | None)
    return tuple(i for i, name in enumerate(names) if hints.get(name) in tensor_types)


def _never_seen(op: str, args: tuple[Any, ...]) -> Any:
    return NOT_SEEN


def _function_class(op: DifferentiableOp) -> type[torch.autograd.Function]:
    """A torch.autograd.Function for `op` that dispatches forward and backward through the registry."""
    spec = op.spec

    # forward and setup_context apart, not forward(ctx, ...): torch.func's transforms (grad, vjp,
    # jacrev) take only Functions written this way
    def forward(*args: Any) -> tuple[torch.Tensor, ...]:
        return _as_tuple(op._dispatch(spec.forward, *args))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], results: tuple[torch.Tensor, ...]) -> None:
        ctx.torchhal_use = active_use()  # run right after forward, on its thread
        op._save(ctx, inputs, results)
        ctx.mark_non_differentiable(*results[spec.outputs :])
        # Autograd would hand backward a zero tensor for every result without a gradient, the
        # saved statistics included (for linear_cross_entropy, a weight-sized one); only the op's
        # own outputs get zeros, and only when one of them has no gradient.
        ctx.set_materialize_grads(False)
        ctx.torchhal_outputs = [(r.shape, r.dtype, r.device) for r in results[: spec.outputs]]

    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        context = op._restore(ctx)
        outputs = [
            torch.zeros(shape, dtype=dtype, device=device) if g is None else g
            for g, (shape, dtype, device) in zip(grads, ctx.torchhal_outputs, strict=False)
        ]
        with _where_forward_ran(ctx):
            if _is_grad_enabled():  # autograd records this backward: create_graph=True
                grads = _without_autocast(_recorded_backward, spec.op, spec, *outputs, *context)
            else:
                grads = _without_autocast(op._dispatch, spec.backward, *outputs, *context)
        return op._input_grads(ctx, grads)

    # made with type() so autograd names the backward node after the op (e.g. rms_norm_functionBackward)
    methods = {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
        # vmap over a transform that reaches the Function (per-sample gradients: vmap of grad)
        # runs forward and backward on batched tensors, as it runs torch's ops
        "generate_vmap_rule": True,
        "__doc__": _function_class.__doc__,
    }
    return type(f"{spec.op}_function", (torch.autograd.Function,), methods)


def _recorded_backward(op: str, spec: AutogradSpec, *args: Any) -> Any:
    """The op's reference backward, for a backward that autograd records (create_graph=True):
    the registry's backward kernels are not differentiable. Logged once per op, counted."""
    if spec.backward_reference is None:
        raise UnsupportedError(
            f"{op}: a backward with create_graph=True (double backward, a gradient penalty) is not "
            "supported: the op has no differentiable backward (its backward_reference is None)"
        )
    if op not in _RECORDED_BACKWARD_SAID:
        _RECORDED_BACKWARD_SAID.add(op)
        _autograd_log.warning(
            "backward with create_graph=True: the op's reference backward runs (differentiable torch "
            "ops), not its backward kernel, which autograd cannot differentiate",
            op=op,
        )
    telemetry.count("torchhal.kernels.recorded_backward_references", op=op)
    return spec.backward_reference(*args)


_RECORDED_BACKWARD_SAID: set[str] = set()
"""Ops whose reference backward under create_graph=True was logged (once per process)."""


def _where_forward_ran(ctx: Any) -> contextlib.AbstractContextManager[object]:
    """The `hal.use(device)` block that was active when the op's forward ran (or none), active
    again for its backward. Autograd runs a backward on a device's own thread (CUDA, XPU), or
    wherever `backward()` is called, and the block (a context variable) is not active there, or
    another is: the backward ops went through the default HAL (or that other block's), with its
    settings and kernels, and a simulated ASIC's backward ran on the CPU device. A forward that
    activation checkpointing recomputes keeps the block through `checkpointing.checkpoint` (and a
    patched Hugging Face model's gradient checkpointing); under torch.compile the backward
    custom op has no such hook."""
    use = ctx.torchhal_use
    if active_use() is use:
        return contextlib.nullcontext()
    return resumed_use(use)


def torch_autocasts(aten_op: str, device_type: str) -> bool:
    """Whether torch's autocast has a kernel of its own for `aten_op` ("aten::layer_norm") on
    `device_type`, i.e. casts its inputs there (its lists differ per device type: CUDA and XPU run
    layer_norm in fp32, CPU autocast leaves it alone). Asked of torch's dispatcher, so it follows
    the installed torch (and a PrivateUse1 backend's own autocast kernels) rather than a copy of
    its lists; a fallthrough registered for the op is no kernel (autocast passes it by). The
    dispatcher calls are private, so `autocast_rule` guards them."""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type), None)
    try:
        return (
            key is not None
            and bool(torch._C._dispatch_has_kernel_for_dispatch_key(aten_op, key))
            and not torch._C._dispatch_kernel_for_dispatch_key_is_fallthrough(aten_op, key)
        )
    except RuntimeError as exc:  # the dispatcher knows no such op
        raise ValueError(f"autocast counterpart {aten_op!r}: {exc}") from None


AutocastRule = tuple[tuple[int, ...], "torch.dtype | None"]
"""(input positions autocast casts, their dtype: None for the autocast dtype)."""


def autocast_rule(spec: AutogradSpec, device_type: str, *, ask: bool = True) -> AutocastRule:
    """What autocast on `device_type` casts for an op of `spec`: its `autocast_fp32` inputs to fp32
    where torch's autocast runs `spec.aten_op` in fp32 there (torch's "autocast to float32"
    policy), else its `autocast` inputs to the autocast dtype where torch's autocast casts
    `aten_op` there (lower precision), else nothing, as torch leaves its own call alone. Asked of
    torch's dispatcher; without asking (`ask=False`: while Dynamo traces) or where its private
    calls are missing (logged), the documented lists: fp32 on CUDA and XPU, lower precision on
    every device type."""
    missing = _missing_dispatcher_calls() if ask else ()
    if missing:
        log.warning(
            "torch's dispatcher cannot say where autocast casts this op; taking the documented lists",
            op=spec.aten_op,
            device_type=device_type,
            missing=[f"torch._C.{name}" for name in missing],
        )

    def casts(documented: bool) -> bool:
        return documented if missing or not ask else torch_autocasts(spec.aten_op, device_type)

    if spec.autocast_fp32 and casts(device_type in _DOCUMENTED_FP32_DEVICE_TYPES):
        return spec.autocast_fp32, torch.float32
    if spec.autocast and casts(True):
        return spec.autocast, None
    return (), None


_F = typing.TypeVar("_F", bound=Callable[..., Any])


def run_while_traced(fn: _F) -> _F:
    """Mark `fn` as `torch.compiler.assume_constant_result` marks it (its one line): Dynamo calls it
    itself while tracing and keeps its result as a constant of the graph. Without importing
    torch._dynamo here, which took `import torchhal.ops` from 0.35 to 2.2 s; tests hold the mark
    to the public decorator's."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@run_while_traced
def _asked_while_traced(spec: AutogradSpec, device_type: str) -> AutocastRule:
    """`autocast_rule`, which Dynamo cannot trace: asked while tracing, kept as a constant."""
    return autocast_rule(spec, device_type)


def _missing_dispatcher_calls() -> tuple[str, ...]:
    """The private dispatcher calls `torch_autocasts` makes that this torch lacks."""
    calls = (
        "_dispatch_key_for_device",
        "_dispatch_has_kernel_for_dispatch_key",
        "_dispatch_kernel_for_dispatch_key_is_fallthrough",
    )
    return tuple(name for name in calls if not hasattr(torch._C, name))


def _autocast_eligible(value: Any) -> bool:
    """What autocast casts: floating tensors other than fp64."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


def _without_autocast(dispatch: Dispatch, op: str, *args: Any) -> Any:
    """dispatch(op, *args) with autocast off, for calls reached with it on (a backward run inside
    an autocast block, a compiled graph's custom op)."""
    if _any_autocast():
        with _autocast_off():
            return dispatch(op, *args)
    return dispatch(op, *args)


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)
