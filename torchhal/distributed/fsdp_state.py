"""The FSDP2 internals `train` reaches into, in one place, each guarded: what torch has no
public call for (a stopped step's unsharded gradients, the iteration state before torch 2.13,
the reduce dtype of gradients accumulated with sync off). Each reads what it needs with
`getattr` and says, through its caller, where torch moved it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchhal.hal_core import telemetry

log = telemetry.get_logger("torchhal.distributed.train")


def fsdp_params(model: nn.Module) -> list[Any] | None:
    """Every FSDP2 parameter (torch's FSDPParam) of `model`'s FSDP modules, none for a model
    without; None where FSDP2's internals moved."""
    from torch.distributed.fsdp import FSDPModule

    found: list[Any] = []
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:  # torch releases before the plural held one group (or None)
            single = getattr(state, "_fsdp_param_group", None)
            groups = None if single is None and not hasattr(state, "_fsdp_param_group") else [single]
        params = [p for group in groups or () if group is not None for p in getattr(group, "fsdp_params", ())]
        if groups is None or not all(hasattr(p, "unsharded_accumulated_grad") for p in params):
            return None
        found += params
    return found


def drop_unsharded_gradients(model: nn.Module) -> None:
    """FSDP2 keeps gradients in each parameter's unsharded gradient, out of the optimizer's reach:
    what backward accumulated with gradient sync off, and what a backward that stopped part-way
    made before its parameter groups' post-backward ran; the next synced backward reduces them
    with its own. torch has no public call that drops them (torch 2.13's `reset_iter_state`
    keeps both), so this clears them through FSDP2's internals; where those moved, says so
    (logged and counted)."""
    params = fsdp_params(model)
    if params is None:
        log.warning(
            "train: cannot drop FSDP2's accumulated unsharded gradients in this torch version; "
            "rebuild the model before training it again",
            torch=torch.__version__,
        )
        telemetry.count("torchhal.train.undropped_gradients")
        return
    for param in params:
        param.unsharded_accumulated_grad = None
        unsharded = getattr(param, "_unsharded_param", None)
        if unsharded is not None:
            unsharded.grad = None


def unused_gradient_fill(model: nn.Module) -> Callable[[], None] | None:
    """Under FSDP2 with a reduce dtype other than the compute dtype (bf16/fp16 compute, fp32
    reduction), backward with sync off keeps each used parameter's gradient upcast to the reduce
    dtype, and the synced backward reduces those together with the gradients it made itself, in
    the compute dtype, of parameters first used there (and, where unused parameters are reduced,
    zeros in the compute dtype): FSDP2 then raises "FSDP reduce-scatter expects uniform gradient
    dtype". So after each micro-batch with sync off, each parameter still without an upcast
    gradient is given zeros in the reduce dtype, as an unused parameter's gradient; the synced
    backward adds its own to them. Nothing to do where no parameter upcasts (fp32, uncast units)."""
    params = fsdp_params(model)
    if not params:
        return None  # no FSDP2 parameters, or its internals moved: torch's own error stands
    upcast: list[Any] | None = None  # found at the first fill: FSDP2 sets reduce dtypes at its first forward

    def fill() -> None:
        nonlocal upcast
        if upcast is None:
            upcast = [
                p
                for p in params
                if getattr(p, "reduce_dtype", None) is not None
                and not getattr(p, "is_dtensor", False)
                and p.sharded_param.requires_grad
            ]
        for param in upcast:
            unsharded = getattr(param, "_unsharded_param", None)  # made at its first forward
            if param.unsharded_accumulated_grad is None and unsharded is not None:
                param.unsharded_accumulated_grad = torch.zeros(
                    unsharded.shape, dtype=param.reduce_dtype, device=unsharded.device
                )

    return fill


def fsdp_reset(root: nn.Module) -> Callable[[], None] | None:
    """What resets FSDP2's iteration state; a no-op where no iteration is open (torch before 2.13
    has no `reset_iter_state`, and its state is read to tell: a forward not yet backed, or a
    module or parameter group not back to IDLE)."""
    reset = getattr(root, "reset_iter_state", None)
    if reset is not None:
        return reset
    context = getattr(root._get_fsdp_state(), "_state_ctx", None)
    states = getattr(context, "all_states", None)
    if context is None or states is None:
        return None  # internals moved: cannot tell, so say so
    groups = [g for state in states for g in getattr(state, "_fsdp_param_groups", ())]
    idle = [getattr(getattr(x, "_training_state", None), "name", None) == "IDLE" for x in [*states, *groups]]
    if getattr(context, "iter_forward_root", None) is None and all(idle):
        return lambda: None  # between iterations: nothing to reset
    return None
