"""The FSDP2 internals `train` reaches into, in one place, each guarded: what torch has no
public call for (a stopped step's unsharded gradients, the iteration state before torch 2.13,
the reduce dtype of gradients accumulated with sync off). Each reads what it needs with
`getattr` and says, through its caller, where torch moved it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from torchhal.hal_core import telemetry

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

log = telemetry.get_logger("torchhal.distributed.train")


def fsdp_groups(model: nn.Module) -> list[tuple[nn.Module, list[Any]]] | None:
    """Each FSDP2 parameter group of `model` (its FSDPParams) with the FSDP module that holds it;
    none for a model without; None where FSDP2's internals moved."""
    from torch.distributed.fsdp import FSDPModule

    found: list[tuple[nn.Module, list[Any]]] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch releases before the plural held one group (or None)
            single = getattr(state, "_fsdp_param_group", None)
            groups = None if single is None and not hasattr(state, "_fsdp_param_group") else [single]
        if groups is None:
            return None
        for group in groups:
            params = list(getattr(group, "fsdp_params", ())) if group is not None else []
            if not all(hasattr(p, "unsharded_accumulated_grad") for p in params):
                return None
            found.append((module, params))
    return found


def drop_unsharded_gradients(model: nn.Module) -> None:
    """FSDP2 keeps gradients in each parameter's unsharded gradient, out of the optimizer's reach:
    what backward accumulated with gradient sync off, and what a backward that stopped part-way
    made before its parameter groups' post-backward ran; the next synced backward reduces them
    with its own. torch has no public call that drops them (torch 2.13's `reset_iter_state`
    keeps both), so this clears them through FSDP2's internals; where those moved, says so
    (logged and counted)."""
    groups = fsdp_groups(model)
    if groups is None:
        log.warning(
            "train: cannot drop FSDP2's accumulated unsharded gradients in this torch version; "
            "rebuild the model before training it again",
            torch=torch.__version__,
        )
        telemetry.count("torchhal.train.undropped_gradients")
        return
    for param in (p for _, params in groups for p in params):
        param.unsharded_accumulated_grad = None
        unsharded = getattr(param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


def fsdp_no_sync(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context in which backward accumulates FSDP2's gradients without reducing them:
    `set_requires_gradient_sync(False)` on each FSDP module (the root may not be one), on again
    at exit, and then the fill below. A module whose parameters were never gathered (no forward
    has run it yet) is turned off only when its forward runs: torch's sync-off backward runs
    every group's post-backward, which reads each parameter's unsharded tensor, made at the
    group's first all-gather, so an optional tower absent from the first micro-batch raised
    "'FSDPParam' object has no attribute '_unsharded_param'"; with sync on, its post-backward
    finds no gradient and reduces nothing. A module that runs is gathered by then, and reduces
    once a step as the others do."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    held: dict[int, list[Any]] = {}
    groups = fsdp_groups(model)
    for module, params in groups or ():
        held.setdefault(id(module), []).extend(params)
    gathered: set[int] = set()  # once gathered, always: FSDP2 keeps the unsharded parameter object
    fill = _unused_gradient_fill(groups) if groups else None

    def is_gathered(module: nn.Module) -> bool:
        if id(module) not in gathered and all(
            hasattr(p, "_unsharded_param") for p in held.get(id(module), ())
        ):
            gathered.add(id(module))
        return id(module) in gathered

    def sync_off(module: nn.Module, args: object) -> None:  # a forward pre-hook, on FSDP modules
        cast(FSDPModule, module).set_requires_gradient_sync(False, recurse=False)

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        unseen = [m for m in sharded if not is_gathered(m)]
        for module in sharded:
            if module not in unseen:
                sync_off(module, ())
        hooks = [m.register_forward_pre_hook(sync_off) for m in unseen]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for module in sharded:
                module.set_requires_gradient_sync(True, recurse=False)
            if fill is not None:
                fill()

    return no_sync


def _unused_gradient_fill(groups: list[tuple[nn.Module, list[Any]]]) -> Callable[[], None]:
    """Under FSDP2 with a reduce dtype other than the compute dtype (bf16/fp16 compute, fp32
    reduction), backward with sync off keeps each used parameter's gradient upcast to the reduce
    dtype, and the synced backward reduces those together with the gradients it made itself, in
    the compute dtype, of parameters first used there (and, where unused parameters are reduced,
    zeros in the compute dtype): FSDP2 then raises "FSDP reduce-scatter expects uniform gradient
    dtype". So after each micro-batch with sync off, in each group holding an upcast gradient,
    each parameter still without one is given zeros in the reduce dtype, as an unused
    parameter's gradient; the synced backward adds its own to them. A group holding none reduces
    uniformly as it is, and gets nothing (a tower absent from the step holds no memory)."""
    upcast: list[list[Any]] | None = (
        None  # found at the first fill: FSDP2 sets reduce dtypes at its first forward
    )

    def fill() -> None:
        nonlocal upcast
        if upcast is None:
            upcast = [
                kept
                for _, params in groups
                if (
                    kept := [
                        p
                        for p in params
                        if getattr(p, "reduce_dtype", None) is not None
                        and not getattr(p, "is_dtensor", False)
                        and p.sharded_param.requires_grad
                    ]
                )
            ]
        for params in upcast:
            if all(p.unsharded_accumulated_grad is None for p in params):
                continue
            for param in params:
                unsharded = getattr(param, "_unsharded_param", None)  # made at its first forward
                if param.unsharded_accumulated_grad is None and unsharded is not None:
                    param.unsharded_accumulated_grad = torch.zeros(
                        unsharded.shape, dtype=param.reduce_dtype, device=unsharded.device
                    )

    return fill


def fsdp_reset(root: FSDPModule) -> Callable[[], None] | None:
    """What resets FSDP2's iteration state; a no-op where no iteration is open (torch before 2.13
    has no `reset_iter_state`, and its state is read to tell: a forward not yet backed, or a
    module or parameter group not back to IDLE)."""
    state = root._get_fsdp_state()
    if getattr(state, "_is_root", False) is None:
        return lambda: None  # no forward has run: no iteration can be open (and torch's reset raises)
    reset: Callable[[], None] | None = getattr(root, "reset_iter_state", None)
    if reset is not None:
        return reset
    context = getattr(state, "_state_ctx", None)
    states = getattr(context, "all_states", None)
    if context is None or states is None:
        return None  # internals moved: cannot tell, so say so
    groups = [g for state in states for g in getattr(state, "_fsdp_param_groups", ())]
    idle = [getattr(getattr(x, "_training_state", None), "name", None) == "IDLE" for x in [*states, *groups]]
    if getattr(context, "iter_forward_root", None) is None and all(idle):
        return lambda: None  # between iterations: nothing to reset
    return None
