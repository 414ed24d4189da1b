"""`train()`: a small training loop with a span per step and a structlog line every few steps.

Each step: for each of its micro-batches (`gradient_accumulation_steps`, default 1), fetched
as it is run so that one is held at a time, forward under the policy's autocast and backward
(through the gradient scaler for fp16); then an optional explicit gradient sync (heterogeneous
runs), unscale and clip, optimizer step. Ops inside run with `ctx.hal.use(ctx.device)` active,
so `torchhal.ops` dispatch to this rank's device (a simulated ASIC included). Step time is host
wall time after the device synchronised, less the time spent waiting on the loader; tokens
counts this rank's tokens (see `_tokens`: a mapping's `input_ids`, else its `labels`, else the
batch's first tensor; a floating tensor counts its elements over all but its last dimension), and
is None where a batch holds no tensor to count (said once per `train` call).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchhal.distributed.fsdp_state import fsdp_no_sync
from torchhal.distributed.precision import dtype_name
from torchhal.distributed.rollback import Buffers, forget_unscaling, stop_step
from torchhal.hal_core import CollectiveError, DeviceTimer, HostTimer, InvalidArgumentError, telemetry

if TYPE_CHECKING:
    from torchhal.distributed.init import DistContext
    from torchhal.distributed.precision import PrecisionPolicy

log = telemetry.get_logger("torchhal.distributed.train")

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


@dataclass(frozen=True)
class StepStats:
    step: int
    loss: float
    step_time_s: float
    tokens: int | None  # None: a batch held no tensor to count tokens in
    tokens_per_s: float | None
    grad_norm: float | None  # before clipping; None when not clipping
    scale: float | None = None  # the gradient scaler's scale after the step (fp16)
    scaler_skipped: bool = False  # the scaler found inf/nan gradients and skipped the optimizer step
    # forward and backward on the device's own timer, before the gradient sync (set when train has
    # a grad_sync): this rank's own speed, which a blocking sync hides from step_time_s; with
    # gradient accumulation, summed over the micro-batches (not the loader or the ranks' agreement
    # between them)
    compute_s: float | None = None
    # the forward's real elapsed time (set by train), summed over the step's micro-batches. No
    # collective runs in it under local and heterogeneous training. Under DDP the gradient
    # all-reduce runs in backward, but with broadcast_buffers=True (DDP's default) and a model
    # that has buffers, DDP's forward first broadcasts rank 0's buffers: a collective that waits
    # until every rank has reached its forward (their loaders and optimizer steps differ a
    # little), before any of the forward's compute, so a rank slow in its own forward still shows
    # here, where the synchronised step_time_s hides it. Under FSDP the forward waits on
    # parameter all-gathers, so a straggler shows only in part.
    forward_s: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Iterable[Batch],
    *,
    steps: int,
    ctx: DistContext,
    policy: PrecisionPolicy,
    clip_grad_norm: float | None = None,
    scaler: torch.amp.GradScaler | None = None,
    loss_fn: LossFn | None = None,
    grad_sync: Callable[[nn.Module], None] | None = None,
    on_step: Callable[[StepStats], None] | None = None,
    log_every: int = 10,
    first_step: int = 0,
    gradient_accumulation_steps: int = 1,
) -> list[StepStats]:
    """Run `steps` optimizer steps over `batches`; return each step's statistics.

    A batch is a tensor, a tuple of tensors or a mapping of names to tensors (Hugging Face's
    `{"input_ids", "labels", "attention_mask"}`) on `ctx.device`; `loss_fn(model, batch)` returns
    the scalar loss (default: `model(*batch)`, `model(**batch)` for a mapping, `model(batch)` for a
    tensor; an output that is not a tensor gives its `.loss`, as a Hugging Face model's).
    `grad_sync(model)` runs after backward, for gradients synchronised outside DDP/FSDP.
    `first_step` numbers the steps of a resumed run.
    Each step consumes `gradient_accumulation_steps` batches (micro-batches): each one's loss is
    divided by that count before backward, so the gradient is the mean over the micro-batches
    (one batch of them all under a mean loss, when they are of equal size), and gradients are
    reduced across ranks once per step (DDP's `no_sync`, FSDP2's `set_requires_gradient_sync`).
    StepStats.loss is the mean of the micro-batches' losses, tokens their sum. Micro-batches are
    fetched one at a time, each as it is run, so one is held at a time (as DeepSpeed, Lightning
    and Hugging Face's Trainer hold them).
    Every rank must get `steps * gradient_accumulation_steps` batches, and make the same
    `train` calls with the same `steps` and `gradient_accumulation_steps`. Where steps synchronise
    ranks (DDP, FSDP, a grad_sync), the ranks agree before each micro-batch that each has it (an
    all-gather of one number on the group's host side), so a rank whose batches ran out stops
    every rank with an error naming it, instead of leaving its peers waiting in a collective
    until the process-group timeout. A step stopped before the optimizer's update (batches ran
    out, or an error in a micro-batch, grad_sync or clipping) leaves the model, the optimizer and
    the scaler as they were before it: the gradients it had accumulated are dropped (logged and
    counted), the model's persistent buffers (BatchNorm's running statistics) restored, the
    scaler's record of unscaling dropped. An error in the optimizer's own step does the same,
    but the parameters and optimizer state it had updated stay updated (logged and counted). An
    error in the scaler's update() after it leaves the step taken, its gradients dropped. The
    optimizer's step is called without a closure: one that needs one (LBFGS) is refused.
    A model in training mode keeps its submodules' modes (a BatchNorm frozen with `.eval()` for
    fine-tuning stays frozen, as Lightning keeps them); one in evaluation mode is put in training
    mode whole, and that is logged. Where `on_step` leaves the model (or the module a DDP or
    compiled wrapper wraps) in evaluation mode (a validation pass), every module's mode recorded
    when training began is put back before the next step (logged once a call, counted).
    Gradients that parameters hold when `train` begins (a backward run before it) are dropped
    before the first step (logged as a warning naming how many, counted), not added into it.
    The strategy (DDP, FSDP2, local) is the model's: a policy that never went through `prepare`
    (`choose_precision`'s) takes it from the DDP or FSDP2 module inside the model, so the batch
    agreement and autocast are the same whichever of the two policies is passed; a policy
    prepared for another strategy than the model's is refused. Where steps synchronise gradients
    across ranks, the ranks agree once at the start (one host-side all-gather of a small code)
    that their gradients are scaled alike (a gradient scaler on every rank or on none), their
    strategy is the same and, under FSDP2, their parameter dtype; a mismatch is refused on every
    rank naming each rank's policy and scaler (scaled and unscaled gradients were averaged).
    Ranks may compute in different formats otherwise (fp32 on one, bf16 on another: gradients
    are fp32 on both), which is logged. Under FSDP2 with a parameter dtype below fp32, FSDP2
    casts every floating-point tensor passed to the model's forward to that dtype (targets
    included), where DDP's autocast leaves them as given: the first forward of a `train` call
    that has such a cast logs it as a warning (counted); give the loss's targets to `loss_fn`
    outside the model to keep them in fp32.
    """
    if steps < 0:
        raise InvalidArgumentError(f"train: steps must be >= 0, got {steps}")
    if clip_grad_norm is not None and not clip_grad_norm > 0:
        raise InvalidArgumentError(f"train: clip_grad_norm must be > 0 or None, got {clip_grad_norm}")
    if log_every < 1:
        raise InvalidArgumentError(f"train: log_every must be >= 1, got {log_every}")
    accumulate = gradient_accumulation_steps
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise InvalidArgumentError(
            f"train: gradient_accumulation_steps must be an integer >= 1, got {accumulate!r}"
        )
    _check_closure_free(optimizer)
    policy.check_device(ctx.device, "train")
    if policy.uses_grad_scaler and scaler is None:
        raise InvalidArgumentError(
            f"train: precision policy {policy.name!r} needs a gradient scaler (pass prepared.scaler)"
        )
    policy = _policy_for_model(model, policy)
    compute_loss = loss_fn or _call_model
    source = iter(batches)
    agree = steps_synchronise(ctx.world_size, policy, grad_sync)
    no_sync = _gradient_sync_off(model) if accumulate > 1 else None
    if agree and steps > 0:
        _agree_on_gradients(ctx, policy, scaler, accumulate)
    if steps > 0:
        _drop_stale_gradients(model, optimizer)
    _to_training_mode(model)
    modes = _Modes(model)
    buffers = Buffers(model)
    stats: list[StepStats] = []
    uncounted = False  # said once a call: a batch held no tensor to count tokens in
    with ctx.hal.use(ctx.device), _CastWatch(model, policy):
        for step in range(first_step, first_step + steps):
            feed = _MicroBatches(source, ctx, accumulate, agree, step - first_step, steps)
            try:
                buffers.save()  # before the fetch: an error here loses no batch
            except BaseException:
                feed.fail(0)  # the peers are in micro-batch 0's agreement: they stop too
                raise
            feed.fetch_first()  # before the step begins, as when all were fetched here
            with telemetry.span("torchhal.train.step", step=step, rank=ctx.rank) as span:
                result = _step(
                    model,
                    optimizer,
                    feed,
                    no_sync,
                    buffers,
                    step,
                    ctx,
                    policy,
                    clip_grad_norm,
                    scaler,
                    compute_loss,
                    grad_sync,
                )
                span.set_attribute("loss", result.loss)
                span.set_attribute("step_time_s", result.step_time_s)
                if result.tokens_per_s is not None:
                    span.set_attribute("tokens_per_s", result.tokens_per_s)
                if result.grad_norm is not None:
                    span.set_attribute("grad_norm", result.grad_norm)
                if result.scale is not None:
                    span.set_attribute("scaler_skipped", result.scaler_skipped)
                if (step - first_step) % log_every == 0 or step == first_step + steps - 1:
                    log.info("train step", rank=ctx.rank, device=ctx.device.id, **result.as_dict())
            if result.tokens is None and not uncounted:
                uncounted = True
                log.warning(
                    "train: a batch holds no tensor to count tokens in (a mapping's input_ids or labels, "
                    "else the batch's first tensor): tokens and tokens_per_s are None, not a count",
                    step=step,
                )
                telemetry.count("torchhal.train.tokens_uncounted")
            stats.append(result)
            if on_step is not None:
                on_step(result)
                modes.put_back_after_on_step(step)
    return stats


def steps_synchronise(world_size: int, policy: PrecisionPolicy, grad_sync: object | None) -> bool:
    """Whether a step's collectives make the ranks wait on each other (DDP's and FSDP's gradient
    reductions, a grad_sync), so that they must agree each has a batch. Ranks training models of
    their own (a policy that never went through prepare, or `local`) may run different counts."""
    return world_size > 1 and (grad_sync is not None or policy.strategy in ("ddp", "fsdp"))


_EXHAUSTED = object()
"""What `next` gives once a rank's batches ran out."""


class _MicroBatches:
    """One step's micro-batches, fetched one at a time as the step runs them, so that the step
    holds one (the loader's own prefetch aside), where fetching all k before the step held k.
    With `agree`, the ranks agree before each micro-batch that each has it, and every rank raises
    naming those that ran out, or those whose loader (or buffer copy) raised: such a rank takes
    part in the agreement before it raises its own error, so its peers stop at once instead of
    waiting there until the process-group timeout. Before each, not only where DDP or FSDP2 run
    collectives (FSDP2's forward all-gathers, DDP's first forward broadcasts buffers, the last
    backward reduces): a model or loss_fn may run its own (SyncBatchNorm, a contrastive loss's
    all_gather), and an agreement on the host side costs no device time."""

    def __init__(
        self,
        source: Iterator[Batch],
        ctx: DistContext,
        accumulate: int,
        agree: bool,
        done: int,
        steps: int,
    ) -> None:
        self._source, self._ctx, self.count = source, ctx, accumulate
        self._agree, self._done, self._steps = agree, done, steps
        self._first: Batch = _EXHAUSTED
        self.loading_s = 0.0  # in the loader, for the micro-batches after the first

    def fetch_first(self) -> None:
        """Micro-batch 0, with its agreement, before the step's clock starts."""
        self._first = self._fetch(0)
        self.loading_s = 0.0

    def take(self, index: int) -> Batch:
        """Micro-batch `index`; the step holds no reference to the one before it by now."""
        if index == 0:
            batch, self._first = self._first, _EXHAUSTED
            return batch
        return self._fetch(index)

    def _fetch(self, index: int) -> Batch:
        # only the loader's time is not step time: an agreement waits for the other ranks, as
        # the gradient all-reduce does (on the host side of the group, not on the device queue)
        began = time.perf_counter()
        try:
            batch = next(self._source, _EXHAUSTED)
        except BaseException:
            self.fail(index)
            raise
        self.loading_s += time.perf_counter() - began
        have = batch is not _EXHAUSTED
        if have and not self._agree:
            return batch
        said = self._agreement(index, _HAVE if have else _RAN_OUT) if self._agree else []
        failed = [rank for rank, code in enumerate(said) if code == _FAILED]
        if failed:
            raise CollectiveError(
                f"train: rank(s) {failed} raised before micro-batch {index} of step {self._done} "
                "(in the loader or the buffer copy; their error is in their own log), so every "
                "rank stops here rather than wait in a collective"
            )
        short = [rank for rank, code in enumerate(said) if code == _RAN_OUT]
        if have and not short:
            return batch
        raise InvalidArgumentError(_ran_out(short, self._done, self._steps, index, have, self.count))

    def fail(self, index: int) -> None:
        """This rank raised before micro-batch `index`: where ranks agree, say so in the agreement
        its peers wait in, then let the rank's own error be raised (never one from here)."""
        if not self._agree:
            return
        try:
            self._agreement(index, _FAILED)
        except Exception as error:  # a peer gone, or out of step: the rank's own error is raised
            log.warning(
                "train: could not tell the other ranks that this rank stopped",
                error=f"{type(error).__name__}: {error}",
            )

    def _agreement(self, index: int, code: int) -> list[int]:
        """Every rank's code for micro-batch `index` of this step. Each value carries its rank's
        place (step and micro-batch of this call, modulo 2**20, so that a group gathering on its
        device in fp32 holds it exactly) beside the code, so ranks at different places (an
        earlier error stopped them at different points: one raised in a forward while another's
        loader raised at the next micro-batch; or they split their steps into `train` calls
        differently) are told so, rather than pairing one's agreement with another's."""
        place = self._done * self.count + index
        values = self._ctx.communicator.host_all_gather(float(code + 4 * (place % _PLACES)))
        places = [_place_of(v, place) for v in values]
        apart = [rank for rank, there in enumerate(places) if there != place]
        if apart:
            raise _out_of_step(apart, places, place, self.count)
        return [int(v) % 4 for v in values]


def _place_of(value: float, near: int) -> int | None:
    """The place a rank's agreement value carries, taken as the one nearest `near` of those
    alike modulo 2**20; None for a rank at the start of a train call (`_agree_on_gradients`
    sends a negative value)."""
    if value < 0:
        return None
    there = near + (int(value) // 4 - near) % _PLACES
    return there - _PLACES if there - near > _PLACES // 2 else there


def _out_of_step(
    apart: list[int], places: list[int | None], place: int | None, count: int
) -> CollectiveError:
    """Ranks `apart` agree at other places than this rank (None: a train call's start)."""

    def where(there: int | None) -> str:
        if there is None:
            return "step 0 micro-batch 0 (the start, where ranks agree on their gradients' scaling)"
        return f"step {there // count} micro-batch {there % count}"

    return CollectiveError(
        f"train: ranks out of step: rank(s) {apart} at "
        f"{', '.join(where(places[r]) for r in apart)} of their train call, this rank at "
        f"{where(place)}: an earlier error stopped ranks at different points (recreate the "
        "process group before training again), or ranks split their steps into train "
        "calls differently (every rank must make the same calls)"
    )


_PLACES = 2**20
"""Places told apart in an agreement (4 codes each: below 2**22, exact in fp32)."""

_HAVE, _RAN_OUT, _FAILED = 1, 0, 2
"""What each rank says in the agreement before a micro-batch, beside its place (on the host side
of the group: no device queue drained)."""


def _ran_out(short: list[int], done: int, steps: int, got: int, have: bool, accumulate: int) -> str:
    """`got`: this rank's micro-batches of the step before the one it lacked, or (`have`) before
    the one it holds, where it learned that another rank lacks one."""
    where = f"after {done} of {steps} steps"
    if accumulate > 1:
        had = f"at least {got + 1}" if have else str(got)
        where += f" (gradient_accumulation_steps {accumulate}: this rank had {had} of them for the next)"
    if not short:  # one rank alone, or steps that synchronise nothing
        return f"train: batches ran out {where}"
    return (
        f"train: batches ran out {where} on rank(s) {short}; every rank must get the same number "
        "of batches, so every rank stops here rather than wait in a collective"
    )


def _gradient_sync_off(model: nn.Module) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """A context in which backward accumulates gradients without reducing them across ranks:
    DDP's `no_sync`, or FSDP2's (`fsdp_state.fsdp_no_sync`); nothing for a model that reduces
    nothing. The DDP module may be inside `model` too: torch.compile(DDP(m)) is not one, and each micro-batch
    reduced there (k all-reduces a step)."""
    from torch.nn.parallel import DistributedDataParallel

    modules = list(model.modules())
    replicated = next((m for m in modules if isinstance(m, DistributedDataParallel)), None)
    if replicated is not None:
        if replicated.static_graph:
            raise InvalidArgumentError(
                "train: gradient_accumulation_steps > 1 needs DDP's no_sync, which a DDP model made "
                "with static_graph=True does not support (torch fails an internal assertion, "
                "pytorch issue 143580); prepare without static_graph, or accumulate 1 step"
            )
        return replicated.no_sync
    return fsdp_no_sync(model)


def _step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    feed: _MicroBatches,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None,
    buffers: Buffers,
    step: int,
    ctx: DistContext,
    policy: PrecisionPolicy,
    clip: float | None,
    scaler: torch.amp.GradScaler | None,
    compute_loss: LossFn,
    grad_sync: Callable[[nn.Module], None] | None,
) -> StepStats:
    start = time.perf_counter()
    clock = _real_time(ctx)
    timer = ctx.device.timer() if grad_sync is not None else None  # compute_s, for a grad_sync
    micro: list[_Micro] = []
    try:
        for index in range(feed.count):
            last = index == feed.count - 1
            micro.append(
                _forward_backward(
                    model,
                    feed.take(index),  # no name holds it here: it goes when its backward is done
                    feed.count,
                    None if last else no_sync,
                    clock,
                    timer,
                    ctx,
                    policy,
                    scaler,
                    compute_loss,
                )
            )
        compute_s = None if timer is None else sum(timer.elapsed_ms(*m.compute) for m in micro) / 1e3
        if grad_sync is not None:
            grad_sync(model)
        norm = None
        if clip is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            norm = _as_float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    except BaseException:
        stop_step(model, optimizer, scaler, buffers, step, len(micro))
        raise
    scale_before = None if scaler is None else scaler.get_scale()
    # whether the optimizer's own step began (GradScaler may refuse before it: fp16 gradients)
    began: list[object] = []
    hook = optimizer.register_step_pre_hook(lambda *_: began.append(True))
    try:
        _optimizer_step(optimizer, scaler)
    except BaseException:
        if began:
            log.warning(
                "train: the optimizer's step raised; the parameters and the optimizer's state may be "
                "partly updated (an optimizer's update cannot be undone)",
                step=step,
            )
            telemetry.count("torchhal.train.partial_optimizer_steps")
        stop_step(model, optimizer, scaler, buffers, step, len(micro))
        raise
    finally:
        hook.remove()
    skipped, scale = False, None
    if scaler is not None:
        # GradScaler skips the optimizer step on inf/nan gradients and then lowers its scale
        # (it never lowers it otherwise): a smaller scale after update() means a skipped step.
        _update_scaler(scaler, optimizer, step)
        scale = float(scaler.get_scale())
        skipped = scale_before is not None and scale < scale_before
    optimizer.zero_grad(set_to_none=True)
    losses = [m.loss for m in micro]
    value = float(losses[0]) if len(losses) == 1 else float(torch.stack([x.float() for x in losses]).mean())
    ctx.device.synchronize()
    elapsed = time.perf_counter() - start - feed.loading_s
    forward_s = sum(clock.elapsed_ms(*m.forward) for m in micro) / 1e3
    counts = [m.tokens for m in micro]
    tokens = None if None in counts else sum(c for c in counts if c is not None)
    return StepStats(
        step=step,
        loss=value,
        step_time_s=elapsed,
        tokens=tokens,
        tokens_per_s=None if tokens is None else tokens / elapsed if elapsed > 0 else math.inf,
        grad_norm=norm,
        scale=scale,
        scaler_skipped=skipped,
        compute_s=compute_s,
        forward_s=forward_s,
    )


def _optimizer_step(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
    """The optimizer's step, through the scaler where there is one. For an optimizer that
    unscales inside its own step (fused Adam), GradScaler sets `grad_scale` and `found_inf` on it
    and deletes them after a step that returns; an optimizer that raised keeps them, and the next
    step would unscale by the scale squared, so they are deleted here as GradScaler would."""
    if scaler is None:
        optimizer.step()
        return
    try:
        scaler.step(optimizer)
    except BaseException:
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            for name in _SCALER_SETS:
                vars(optimizer).pop(name, None)
        raise


def _update_scaler(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, step: int) -> None:
    """`scaler.update()`, after the optimizer's step was taken. Where it raises, the step is not
    undone (its update is in the parameters), so it is finished as far as it can be: gradients
    dropped and the scaler's record of the step cleared, its scale as update() left it (logged
    and counted). Before, the next `train` call raised once on that record ("unscale_() is being
    called after step()", or "step() has already been called since the last update()" without
    clipping), holding the gradients the step had already applied."""
    try:
        scaler.update()
    except BaseException:
        log.warning(
            "train: the gradient scaler's update raised after the optimizer's step was taken; the "
            "step stands, its gradients were dropped and the scaler's record of it cleared",
            step=step,
        )
        telemetry.count("torchhal.train.scaler_update_failures")
        optimizer.zero_grad(set_to_none=True)
        forget_unscaling(scaler, optimizer)
        raise


_SCALER_SETS = ("grad_scale", "found_inf")
"""What GradScaler.step sets on an optimizer that unscales in its own step."""


@dataclass(frozen=True)
class _Micro:
    """What a step keeps of a micro-batch once its backward is done: never the batch itself."""

    loss: torch.Tensor  # undivided, detached
    forward: tuple[object, object]  # marks on the real-time clock
    compute: tuple[object, object]  # forward to end of backward on the device timer (a grad_sync)
    tokens: int | None  # None: no tensor to count them in


def _forward_backward(
    model: nn.Module,
    batch: Batch,
    count: int,
    sync_off: Callable[[], contextlib.AbstractContextManager[None]] | None,
    clock: DeviceTimer,
    timer: DeviceTimer | None,
    ctx: DistContext,
    policy: PrecisionPolicy,
    scaler: torch.amp.GradScaler | None,
    compute_loss: LossFn,
) -> _Micro:
    """Forward and backward of one of `count` micro-batches, its loss divided by `count` so the
    gradients are their mean; under `sync_off` (all but the last) ranks do not reduce them."""
    _check_batch(batch, ctx)
    with sync_off() if sync_off is not None else contextlib.nullcontext():
        began = timer.mark() if timer is not None else None
        forward_began = clock.mark()
        with policy.autocast():
            loss = compute_loss(model, batch)
        forward = (forward_began, clock.mark())
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidArgumentError(f"train: the loss must be a scalar tensor, got {_describe(loss)}")
        part = loss / count if count > 1 else loss
        (scaler.scale(part) if scaler is not None else part).backward()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
        compute = (began, timer.mark()) if timer is not None else (None, None)
    return _Micro(loss.detach(), forward, compute, _tokens(batch))


def _to_training_mode(model: nn.Module) -> None:
    """Training mode for a model left in evaluation mode (after a validation pass); a model already
    training keeps the modes its author set on submodules."""
    if model.training:
        frozen = sum(1 for m in model.modules() if not m.training)
        if frozen:
            log.info("training keeps the evaluation mode set on submodules", submodules=frozen)
        return
    log.info("model was in evaluation mode: all of it put in training mode")
    model.train()


class _Modes:
    """Each module's training mode when `train` began, put back after an `on_step` that left the
    model in evaluation mode (a validation pass: `model.eval()`, or `.eval()` of the module a DDP
    or compiled wrapper wraps, which is the caller's own model). Every later step ran in evaluation
    mode before: dropout off, BatchNorm normalising with its running statistics and not updating
    them. A change `on_step` makes to a submodule alone (freezing a BatchNorm) is its author's and
    is kept."""

    def __init__(self, model: nn.Module) -> None:
        self._modes = [(module, module.training) for module in model.modules()]
        self._roots = [root for root in _trained_roots(model) if root.training]
        self._said = False

    def put_back_after_on_step(self, step: int) -> None:
        if all(root.training for root in self._roots):
            return
        for module, mode in self._modes:  # each module's own, not .train(mode) of a subtree
            module.training = mode
        telemetry.count("torchhal.train.modes_put_back")
        if not self._said:
            self._said = True
            frozen = sum(1 for _, mode in self._modes if not mode)
            log.info(
                "train: on_step left the model in evaluation mode; the modes its modules had when "
                "train began were put back for the next step (this is said once a train call)",
                step=step,
                modules=len(self._modes),
                kept_in_evaluation_mode=frozen,
            )


def _trained_roots(model: nn.Module) -> list[nn.Module]:
    """The model, and the module each DDP or compiled (torch.compile) wrapper inside it wraps."""
    from torch.nn.parallel import DistributedDataParallel

    roots = [model]
    for module in model.modules():
        inner = module.module if isinstance(module, DistributedDataParallel) else None
        compiled = getattr(module, "_orig_mod", None)
        for found in (inner, compiled):
            if isinstance(found, nn.Module) and all(found is not r for r in roots):
                roots.append(found)
    return roots


def _drop_stale_gradients(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Gradients held when `train` begins (a gradient check, a learning-rate probe, a backward
    the caller ran) were added into the first step's: dropped here, as every step drops its own
    after the optimizer's step, and said (a warning naming how many parameters held one)."""
    params = {id(p): p for p in model.parameters()}
    for group in optimizer.param_groups:
        params.update((id(p), p) for p in group["params"])
    held = [p for p in params.values() if p.grad is not None]
    if not held:
        return
    log.warning(
        "train: parameters held gradients when train began (from a backward run before it); they "
        "were dropped before the first step instead of being added into it",
        parameters_with_gradients=len(held),
        parameters=len(params),
    )
    telemetry.count("torchhal.train.stale_gradients_dropped", value=len(held))
    for p in held:
        p.grad = None


def _model_strategy(model: nn.Module) -> str | None:
    """The strategy a model was wrapped for: "ddp" where it holds a DistributedDataParallel module
    (a compiled DDP model included), "fsdp" where it holds an FSDP2 module, else None."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    modules = list(model.modules())
    if any(isinstance(m, DistributedDataParallel) for m in modules):
        return "ddp"
    if any(isinstance(m, FSDPModule) for m in modules):
        return "fsdp"
    return None


_WRAPPERS = {"ddp": "a DistributedDataParallel module", "fsdp": "an FSDP2 (fully_shard) module"}


def _policy_for_model(model: nn.Module, policy: PrecisionPolicy) -> PrecisionPolicy:
    """The policy with the model's strategy. A policy that never went through `prepare`
    (`choose_precision`'s, the one given to prepare) has none: it skipped the ranks' batch
    agreement under DDP (a rank whose batches ran out left its peer in DDP's all-reduce until
    the group's timeout), and under FSDP2 it added autocast to FSDP2's own casting. It takes the
    strategy of the DDP or FSDP2 module inside the model (logged, counted). A policy prepared
    for another strategy than the model's is refused: it is another model's."""
    found = _model_strategy(model)
    mine = policy.strategy
    if found == mine or (found is None and mine in (None, "local")):
        return policy
    if mine is None:
        assert found is not None
        log.info(
            "train: the precision policy did not come from prepare (it has no strategy); the "
            "model's strategy is used",
            policy=policy.name,
            strategy=found,
        )
        telemetry.count("torchhal.train.strategy_from_model", strategy=found)
        return policy.for_strategy(found)
    holds = (
        f"holds {_WRAPPERS[found]} (strategy {found!r})"
        if found is not None
        else "holds no DistributedDataParallel or FSDP2 module, so its gradients are not "
        "synchronised (was the module inside prepared.model passed?)"
    )
    raise InvalidArgumentError(
        f"train: precision policy {policy.name!r} was prepared for strategy {mine!r}, but the model "
        f"{holds}; pass prepared.model with prepared.policy of the same prepare call"
    )


_POLICY_CODES = ("fp32", "bf16", "fp16")
_STRATEGY_CODES = (None, "ddp", "fsdp")  # "local" (with a grad_sync) as None


def _agree_on_gradients(
    ctx: DistContext, policy: PrecisionPolicy, scaler: torch.amp.GradScaler | None, accumulate: int
) -> None:
    """Before the first step of a `train` call whose steps synchronise gradients: the ranks
    agree, in one host-side all-gather of a small negative code (told apart from the batch
    agreement's codes, which are >= 0), that their gradients can be combined: a gradient scaler
    on every rank or on none (a heterogeneous run with fp32 on one rank and fp16 with a scaler on
    another averaged scaled with unscaled gradients, and the replicas diverged silently), the
    same strategy, and under FSDP2 the same parameter dtype (its all-gathers and reductions run
    in it). A mismatch is refused on every rank, naming each rank's policy and scaler. Different
    compute formats otherwise (fp32 beside bf16 under DDP or a grad_sync: fp32 gradients on
    both) are allowed, and logged."""
    scaled = scaler is not None and scaler.is_enabled()
    strategy = policy.strategy if policy.strategy in _STRATEGY_CODES else None
    code = _POLICY_CODES.index(policy.name) + 3 * int(scaled) + 6 * _STRATEGY_CODES.index(strategy)
    values = ctx.communicator.host_all_gather(float(-1 - code))
    places = [_place_of(v, 0) for v in values]  # a rank in a step's agreement sent a value >= 0
    apart = [rank for rank, there in enumerate(places) if there is not None]
    if apart:
        raise _out_of_step(apart, places, None, accumulate)
    codes = [-1 - int(v) for v in values]
    ranks = [(_POLICY_CODES[c % 3], bool(c // 3 % 2), _STRATEGY_CODES[c // 6]) for c in codes]

    def param_dtype(name: str, strat: str | None) -> str:
        return name if strat == "fsdp" else "fp32"

    problems, advice = [], []
    if len({s for _, _, s in ranks}) > 1:
        problems.append("the same strategy")
        advice.append("prepare the model with the same strategy on every rank")
    elif len({param_dtype(n, s) for n, _, s in ranks}) > 1:
        problems.append("the same parameter dtype under FSDP2 (its all-gathers and reductions run in it)")
        advice.append("under FSDP2 give every rank the same precision policy")
    if len({sc for _, sc, _ in ranks}) > 1:
        problems.append(
            "a gradient scaler on every rank or on none (scaled and unscaled gradients would be averaged)"
        )
        advice.append("train fp16 with prepared.scaler on every rank, or bf16/fp32 on every rank")
    described = "; ".join(
        f"rank {r}: policy {n!r}, {'a' if sc else 'no'} gradient scaler, strategy {s or 'local'!r}"
        for r, (n, sc, s) in enumerate(ranks)
    )
    if problems:
        raise InvalidArgumentError(
            f"train: the ranks synchronise gradients, so they need {' and '.join(problems)}; "
            f"{described}. To fix: {'; '.join(advice)} (choose_precision(device, prefer=...))"
        )
    if len({n for n, _, _ in ranks}) > 1:
        log.info(
            "train: ranks compute in different formats; their gradients are fp32 on every rank",
            ranks=described,
        )


class _CastWatch:
    """Under FSDP2 with a parameter dtype below fp32, FSDP2 casts every floating-point tensor
    passed to a sharded module's forward to that dtype (`MixedPrecisionPolicy`'s
    `cast_forward_inputs`, on by default): targets passed to `model(*batch)` reach the loss in
    bf16, where DDP's autocast leaves them fp32. It cannot be turned off without breaking models
    whose root computes with its own (cast) parameters on its inputs, and which input is a target
    cannot be told. So, while `train` runs, hooks around the outermost FSDP2 modules' own
    pre-forward hook (one before it, one after) see the tensors FSDP2 cast, and the first
    forward of a call that had any says so: a warning naming how many and their shapes, counted.
    Integer inputs (token ids, class labels) are never cast, and not reported."""

    def __init__(self, model: nn.Module, policy: PrecisionPolicy) -> None:
        self._handles: list[Any] = []
        self._before: list[torch.Tensor] | None = None
        self._said = policy.strategy != "fsdp" or policy.name == "fp32"
        if self._said:
            return
        from torch.distributed.fsdp import FSDPModule

        inside: set[int] = set()
        for module in model.modules():
            if id(module) in inside or not isinstance(module, FSDPModule):
                continue
            inside.update(id(m) for m in module.modules())
            self._handles.append(module.register_forward_pre_hook(self._see, prepend=True, with_kwargs=True))
            self._handles.append(module.register_forward_pre_hook(self._compare, with_kwargs=True))

    def __enter__(self) -> _CastWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _see(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._before = None if self._said else _tensor_leaves((args, kwargs))

    def _compare(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        before, self._before = self._before, None
        if before is None or self._said:
            return
        after = _tensor_leaves((args, kwargs))
        if len(after) != len(before):  # another hook changed the inputs' structure: nothing to pair
            return
        cast = [
            (b, a) for b, a in zip(before, after, strict=True) if b.is_floating_point() and b.dtype != a.dtype
        ]
        if not cast:
            return
        self._said = True
        log.warning(
            "train: FSDP2 cast floating-point inputs of the model's forward to its parameter dtype "
            "(MixedPrecisionPolicy's cast_forward_inputs), where DDP's autocast leaves them as given: "
            "targets or masks passed to the model lose precision; compute the loss from them in "
            "loss_fn, outside the model, to keep them as they are (said once a train call)",
            cast=len(cast),
            tensors=[f"{tuple(b.shape)} {dtype_name(b.dtype)}->{dtype_name(a.dtype)}" for b, a in cast[:4]],
        )
        telemetry.count("torchhal.train.fsdp_cast_inputs")


def _tensor_leaves(value: object) -> list[torch.Tensor]:
    """The tensors in nested tuples, lists and mappings, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for item in value for t in _tensor_leaves(item)]
    return []


def _check_closure_free(optimizer: torch.optim.Optimizer) -> None:
    """`train` calls `optimizer.step()` with no closure, so an optimizer whose step needs one
    (LBFGS re-evaluates the loss several times a step) is refused before any batch is taken;
    it failed after the first forward and backward, and was logged as a partial update."""
    try:
        parameters = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):  # a step whose signature cannot be read: it is called as is
        return
    closure = parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise InvalidArgumentError(
            f"train: {type(optimizer).__name__}.step needs a closure (it evaluates the loss itself, "
            "maybe several times a step), and train calls optimizer.step() without one; drive it "
            "with a loop of your own"
        )


def _real_time(ctx: DistContext) -> DeviceTimer:
    """A timer of real elapsed time on this rank: its device's own (events on a GPU), or for a
    simulated device, whose timer reports simulated time, the host clock."""
    return HostTimer(ctx.device.synchronize) if ctx.device.simulated else ctx.device.timer()


def _call_model(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The default loss: `model(*batch)` for a tuple or list, `model(**batch)` for a mapping (a
    Hugging Face model given its labels), `model(batch)` for a tensor; an output that is not a
    tensor gives its `loss` (a Hugging Face ModelOutput's)."""
    if isinstance(batch, Mapping):
        out = model(**batch)
    else:
        out = model(*batch) if isinstance(batch, (tuple, list)) else model(batch)
    if not isinstance(out, torch.Tensor) and isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss  # type: ignore[no-any-return]
    return out  # type: ignore[no-any-return]


def _tensors(batch: Batch) -> Sequence[torch.Tensor]:
    """The batch's tensors: a tensor itself, a tuple's or list's items, a mapping's values."""
    if isinstance(batch, Mapping):
        items: Iterable[object] = batch.values()
    elif isinstance(batch, (tuple, list)):
        items = batch
    else:
        items = (batch,)
    return [t for t in items if isinstance(t, torch.Tensor)]


_TOKEN_KEYS = ("input_ids", "labels")
"""A mapping's tensors that hold its tokens, in the order they are looked for (Hugging Face's names)."""


def _tokens(batch: Batch) -> int | None:
    """This batch's tokens: a mapping's `input_ids`, else its `labels`, else the batch's first
    tensor (a mapping's first tensor value). Integer ids count each element; a floating tensor
    (features: (B, D), or embeddings: (B, T, D)) counts its elements over all but its last
    dimension, a 1-D one each element. None where the batch holds no tensor."""
    chosen: torch.Tensor | None = None
    if isinstance(batch, Mapping):
        chosen = next((batch[k] for k in _TOKEN_KEYS if isinstance(batch.get(k), torch.Tensor)), None)
    if chosen is None:
        tensors = _tensors(batch)
        if not tensors:
            return None
        chosen = tensors[0]
    if (chosen.is_floating_point() or chosen.is_complex()) and chosen.dim() >= 2:
        return math.prod(chosen.shape[:-1])
    return chosen.numel()


def _check_batch(batch: Batch, ctx: DistContext) -> None:
    """Batches must already be on the rank's device: nothing is moved behind the caller's back."""
    want = ctx.device.torch_device
    for t in _tensors(batch):
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise InvalidArgumentError(
                f"train: a batch tensor is on {t.device}, but rank {ctx.rank} trains on "
                f"{ctx.device.id} ({want}); move batches there explicitly"
            )


def _as_float(norm: torch.Tensor) -> float:
    """A gradient norm as a number; FSDP2 returns a replicated DTensor."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__
