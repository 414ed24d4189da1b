"""Activation checkpointing that recomputes through the HAL the forward ran on.

torch.utils.checkpoint runs the checkpointed function again during backward, where autograd runs
the backward: on a CUDA or XPU device's own thread, or wherever `backward()` is called. The
`hal.use(device)` block active at the forward (a context variable) is not active there, so the
recompute's ops went through the default HAL, with its settings and its own measured choices,
and a simulated ASIC's recompute ran on the CPU device. `checkpoint` keeps the block for the
recompute; `keep_use_in_checkpointing` does the same for a Hugging Face model's gradient
checkpointing (`torchhal.kernels.patch` calls it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from torchhal.hal_core.hal import keeping_use


def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    """`torch.utils.checkpoint.checkpoint(function, *args, ...)` whose recompute runs under the
    `hal.use` block active now. `use_reentrant` defaults to False, torch's recommendation (torch
    itself asks for it explicitly); every other keyword goes to torch's checkpoint."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(keeping_use(function), *args, use_reentrant=use_reentrant, **kwargs)


def _keeping_use_of(
    checkpoint_function: Callable[..., Any], function: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    return checkpoint_function(keeping_use(function), *args, **kwargs)


def _keeps_use(checkpoint_function: Callable[..., Any]) -> bool:
    return isinstance(checkpoint_function, functools.partial) and checkpoint_function.func is _keeping_use_of


def keep_use_in_checkpointing(model: nn.Module) -> bool:
    """Make a Hugging Face model's gradient checkpointing recompute under the block of its forward,
    enabled now or later: each module's `_gradient_checkpointing_func` (what transformers calls as
    `func(forward, *args)`) is wrapped, and so is each `_set_gradient_checkpointing` of the
    transformers models in it, which sets them when checkpointing is enabled: the model's own, or
    the one inside a wrapper such as PEFT's, which forwards the call. Wrapping twice changes
    nothing. Returns whether anything was wrapped now."""
    wrapped = False
    # nn.Module.__setattr__ is typed Tensor | Module, but stores any other value as a plain attribute
    for module in model.modules():
        func = module.__dict__.get("_gradient_checkpointing_func")
        if func is not None and not _keeps_use(func):
            module._gradient_checkpointing_func = functools.partial(_keeping_use_of, func)  # type: ignore[assignment]
            wrapped = True
        setter = getattr(module, "_set_gradient_checkpointing", None)
        if inspect.ismethod(setter) and setter.__self__ is module:
            module._set_gradient_checkpointing = _SetterKeepingUse(module, setter.__func__)  # type: ignore[assignment]
            wrapped = True
    return wrapped


class _SetterKeepingUse:
    """transformers' `_set_gradient_checkpointing(enable, gradient_checkpointing_func, ...)` of one
    model, with the function it sets wrapped. A class, not a closure, so a model saved whole
    (`torch.save`) still pickles; it shows the setter's signature, which transformers reads to
    tell its old format from the new."""

    def __init__(self, model: nn.Module, setter: Callable[..., Any]) -> None:
        self._model = model
        self._setter = setter  # the class's function, called with the model

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self._setter.__get__(self._model))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.__signature__.bind(*args, **kwargs)
        bound.apply_defaults()  # the function it sets by default (torch's checkpoint) is wrapped too
        func = bound.arguments.get("gradient_checkpointing_func")
        if func is not None and not _keeps_use(func):
            bound.arguments["gradient_checkpointing_func"] = functools.partial(_keeping_use_of, func)
        return self._setter(self._model, *bound.args, **bound.kwargs)
