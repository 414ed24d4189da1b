"""What a stopped step puts back, so that it can be run again: the model's buffers that its
forwards changed (`Buffers`), its gradients (FSDP2's unsharded ones too), the wrapper's
mid-iteration state (DDP's reducer, FSDP2's iteration) and the gradient scaler's record of it.
`train` copies the buffers before each step and calls `stop_step` when a step stops."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from torchhal.distributed.fsdp_state import drop_unsharded_gradients, fsdp_reset
from torchhal.hal_core import telemetry

log = telemetry.get_logger("torchhal.distributed.train")


def stop_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    buffers: Buffers,
    step: int,
    done: int,
) -> None:
    """A step stopped (an error, or a rank's batches ran out): put the buffers back, drop the
    gradients and the scaler's record of this step, so that a retry or a later `train` call
    starts as the step did. Raises nothing: the step's own error is the one to raise."""
    restored = buffers.restore()  # logs each buffer it cannot put back
    _reset_wrapper(model)
    _drop_gradients(model, optimizer, step, done, restored)
    if scaler is not None:
        forget_unscaling(scaler, optimizer)


def _reset_wrapper(model: nn.Module) -> None:
    """A backward that raised part-way leaves DDP's reducer waiting for the rest of its buckets
    (the next step raises "Expected to have finished reduction in the prior iteration", which
    points at unused parameters) and FSDP2's iteration open (parameters unsharded, its trackers
    set: the steps after compute other updates, silently). The outermost wrapper is reset: DDP's
    reducer where it is not finalised, FSDP2's root with `reset_iter_state` (torch 2.13); where
    torch has neither, or the reset raises, that is said (logged and counted), never raised."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    wrapper = next((m for m in model.modules() if isinstance(m, (DistributedDataParallel, FSDPModule))), None)
    if wrapper is None:
        return
    try:
        if isinstance(wrapper, DistributedDataParallel):
            reset = _reducer_reset(wrapper)
        else:
            reset = fsdp_reset(wrapper)
        if reset is not None:
            reset()
            return
    except Exception as error:
        why = f"the reset raised {type(error).__name__}: {error}"
    else:
        why = f"torch {torch.__version__} has no call that resets it"
    log.warning(
        "train: the stopped step left the model's wrapper mid-iteration and it was not reset; "
        "rebuild the model (prepare it again, from a checkpoint) before training it again",
        wrapper=type(wrapper).__name__,
        why=why,
    )
    telemetry.count("torchhal.train.wrapper_not_reset")


def _reducer_reset(ddp: nn.Module) -> Callable[[], None] | None:
    """What resets DDP's reducer; a no-op where its last backward finished."""
    reducer = getattr(ddp, "reducer", None)
    check = getattr(reducer, "_check_reducer_finalized", None)
    reset: Callable[[], None] | None = getattr(reducer, "_reset_state", None)
    if check is None or reset is None:
        return None
    try:
        check()
    except RuntimeError:  # "Expected to have finished reduction ...": a backward stopped part-way
        return reset
    return lambda: None


def forget_unscaling(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> None:
    """GradScaler records that it unscaled an optimizer's gradients (and what its inf check found)
    until its next update(): after a step stopped past unscale_, the next step's unscale_ would
    raise. update() clears the record but also moves the scale as if the step were taken, so the
    record alone is dropped, through GradScaler's internals; where those moved, says so."""
    if not scaler.is_enabled():
        return
    states = getattr(scaler, "_per_optimizer_states", None)
    if isinstance(states, dict):
        states.pop(id(optimizer), None)
        return
    log.warning(
        "train: cannot clear the gradient scaler's record of the stopped step in this torch "
        "version; call scaler.update() before training again",
        torch=torch.__version__,
    )
    telemetry.count("torchhal.train.scaler_not_reset")


def _drop_gradients(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    step: int,
    done: int,
    restored: int,
) -> None:
    """A step stopped (an error, or a rank's batches ran out): drop what its `done` micro-batches
    accumulated, so that a retry or a later `train` call starts clean (`restored`: the buffers
    put back as they were before the step)."""
    optimizer.zero_grad(set_to_none=True)
    drop_unsharded_gradients(model)
    if done:
        log.warning(
            "train: step stopped; its accumulated gradients were dropped and its buffers restored",
            step=step,
            micro_batches=done,
            restored_buffers=restored,
        )
        telemetry.count("torchhal.train.dropped_micro_batches", done)


class Buffers:
    """The model's buffers that a training forward changes, copied before each step and put back
    when the step stops. Persistent statistics (those `state_dict` saves, floating point, or
    integer counters of one element: BatchNorm's running statistics, spectral norm's vectors, a
    quantization observer's ranges, a user's moving average) are copied from the first step:
    torch does not say which a forward updates, and BatchNorm's own update does not even bump
    the buffer's version counter. The other buffers (non-persistent ones, by torch's definition
    recomputable caches such as rotary tables; integer payloads such as GPTQ/AWQ's packed weights)
    are copied only once seen changing (another tensor in the slot, or a bumped version counter:
    an MoE's `tokens_per_expert` accumulated with `add_`), since copying every one would double
    their memory; a stopped step that is the first of the `train` call to change one leaves it
    changed, logged and counted. A lazy module's buffers are looked at once its first forward
    made them. Found once per `train` call: a model without buffers pays two empty-list checks
    a step."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._promoted: set[str] = set()  # buffers of the other kind seen changing: copied too
        self._find()
        self._held: list[tuple[str, nn.Module, str, torch.Tensor]] = []  # what the last save copied
        self._saved: list[torch.Tensor] = []  # its copies, reused step after step
        self._ids: list[int] = []  # of the held buffers
        self._kinds: list[tuple[torch.Size, torch.dtype, torch.device]] = []  # theirs when copied
        self._fused: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # copies, plain buffers
        self._each: list[tuple[torch.Tensor, torch.Tensor]] = []  # copy, subclass buffer (DTensor)

    def _find(self) -> None:
        """The buffers to copy, those to watch, and the lazy ones, looked for again once a forward
        made them or one watched is seen changing."""
        slots = [
            (f"{prefix}.{name}" if prefix else name, module, name, buffer)
            # every slot, a buffer two modules share included: a forward may reassign either; and
            # one holding None, which a first forward may fill (`if self.ema is None: self.ema = ...`)
            for prefix, module in self._model.named_modules(remove_duplicate=False)
            for name, buffer in module._buffers.items()
        ]
        self._lazy = [(qualified, b) for qualified, _, _, b in slots if nn.parameter.is_lazy(b)]
        self._where: list[tuple[str, nn.Module, str]] = []
        self._watched: list[tuple[str, nn.Module, str]] = []
        for qualified, module, name, buffer in slots:
            if nn.parameter.is_lazy(buffer):
                continue
            persistent = name not in module._non_persistent_buffers_set
            statistic = buffer is not None and persistent and _statistic(buffer)
            copied = statistic or qualified in self._promoted
            (self._where if copied else self._watched).append((qualified, module, name))
        # `_buffers`, not getattr (Module.__getattr__ costs microseconds a buffer); a ScriptModule's
        # is a wrapper without `dict.get`
        self._dicts = [module._buffers for _, module, _ in self._where]
        self._names = [name for _, _, name in self._where]
        self._watched_dicts = [module._buffers for _, module, _ in self._watched]
        self._watched_names = [name for _, _, name in self._watched]
        every = self._dicts + self._watched_dicts
        self._get = dict.get if all(type(d) is dict for d in every) else _slot
        self._marks = self._watch()

    def _watch(self) -> list[tuple[int, int | None] | None]:
        """What tells a watched buffer changed: the tensor in its slot and its version counter (an
        inference tensor has none, and a training forward cannot write it in place)."""
        return [
            None if b is None else (id(b), None if b.is_inference() else b._version)
            for b in map(self._get, self._watched_dicts, self._watched_names)
        ]

    def _changed(self) -> list[tuple[str, nn.Module, str, bool]]:
        """The watched buffers changed since the marks were taken, each with whether it was None."""
        return [
            (*w, then is None)
            for w, then, now in zip(self._watched, self._marks, self._watch(), strict=True)
            if then != now
        ]

    def save(self) -> None:
        """Copy the buffers before a step's first forward: plain tensors with one fused copy, into
        copies kept from step to step while each buffer stays the same tensor of the same shape,
        dtype and device (an observer's forward `resize_`s its ranges in place); tensor
        subclasses (a replicated DTensor) one by one, as `_foreach_copy_` has no DTensor rule."""
        # both before looking again: looking retakes the watch's marks
        changed = [qualified for qualified, *_ in self._changed()] if self._watched else []
        made = bool(self._lazy) and not all(nn.parameter.is_lazy(b) for _, b in self._lazy)  # in place
        if changed:
            log.info(
                "train: buffers the last step changed are copied before each step from now on",
                buffers=changed,
            )
            self._promoted.update(changed)
        if changed or made:
            self._find()
        if not self._where:
            return
        # a forward may have assigned a module a new buffer, None, or deleted it since the last step
        present = [b for b in map(self._get, self._dicts, self._names) if b is not None]
        ids, kinds = list(map(id, present)), list(map(_KIND, present))
        if ids != self._ids or kinds != self._kinds:
            self._remake(ids, kinds)
        with torch.no_grad():
            if self._fused[0]:  # _foreach_copy_ refuses empty lists
                torch._foreach_copy_(*self._fused)
            for copy, buffer in self._each:
                copy.copy_(buffer)

    def _remake(self, ids: list[int], kinds: list[tuple[torch.Size, torch.dtype, torch.device]]) -> None:
        """New copies for the buffers that changed, the others kept."""
        held = [
            (*w, b)
            for w, d in zip(self._where, self._dicts, strict=True)
            if (b := _slot(d, w[2])) is not None
        ]
        kept = dict(zip(zip(self._ids, self._kinds, strict=True), self._saved, strict=True))
        found = [kept.pop(key, None) for key in zip(ids, kinds, strict=True)]
        saved = [torch.empty_like(b) if c is None else c for c, (*_, b) in zip(found, held, strict=True)]
        pairs = [(copy, b) for copy, (*_, b) in zip(saved, held, strict=True)]
        plain = [(copy, b) for copy, b in pairs if type(b) is torch.Tensor]
        self._fused = ([copy for copy, _ in plain], [b for _, b in plain])
        self._each = [(copy, b) for copy, b in pairs if type(b) is not torch.Tensor]
        self._held, self._saved, self._ids, self._kinds = held, saved, ids, kinds

    def restore(self) -> int:
        """Put each buffer back in place (DDP and FSDP2 hold these very tensors), and back on its
        module where a forward assigned it a new tensor (`self.avg = self.avg * d + ...`) or
        deleted it. One that cannot be put back is logged and counted, and the others still are:
        this runs while the step's own error propagates, which it must not replace. Returns how
        many were put back."""
        for qualified, lazy in self._lazy:
            if not nn.parameter.is_lazy(lazy):  # made by this step's forward: no copy to put back
                log.warning(
                    "train: a buffer was not restored after the step stopped; it keeps that step's "
                    "value (a lazy module made it during the step, so it had no copy)",
                    buffer=qualified,
                )
                telemetry.count("torchhal.train.buffers_not_restored")
        restored = 0
        for qualified, module, name, was_none in self._changed() if self._watched else ():
            if was_none:  # filled by the step: emptied again
                module._buffers[name] = None
                restored += 1
                continue
            log.warning(
                "train: a buffer was not restored after the step stopped; it keeps that step's value "
                "(no step of this train call had changed it before, so it had no copy)",
                buffer=qualified,
            )
            telemetry.count("torchhal.train.buffers_not_restored")
        for (qualified, module, name, buffer), copy in zip(self._held, self._saved, strict=True):
            try:
                # an inference tensor (made under inference_mode) is written in inference mode only
                with torch.inference_mode() if buffer.is_inference() else torch.no_grad():
                    if buffer.shape != copy.shape:  # resized in place by the forward
                        buffer.resize_(copy.shape)
                    buffer.copy_(copy)
                if _slot(module._buffers, name) is not buffer:
                    module._buffers[name] = buffer
            except Exception as error:
                log.warning(
                    "train: a buffer was not restored after the step stopped; it keeps that step's value",
                    buffer=qualified,
                    error=f"{type(error).__name__}: {error}",
                )
                telemetry.count("torchhal.train.buffers_not_restored")
            else:
                restored += 1
        return restored


def _slot(buffers: Any, name: str) -> torch.Tensor | None:
    """A module's buffer `name`, or None where it was deleted or set to None (`buffers` is the
    module's `_buffers`: a dict, or a ScriptModule's wrapper of one, which has no `get`)."""
    return buffers[name] if name in buffers else None


_KIND = operator.attrgetter("shape", "dtype", "device")
"""What a buffer's copy must match: `_foreach_copy_` broadcasts and converts without a word."""


def _statistic(buffer: torch.Tensor) -> bool:
    """A buffer a training forward may update: floating point, or a one-element counter."""
    return buffer.is_floating_point() or buffer.is_complex() or buffer.numel() == 1
