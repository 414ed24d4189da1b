"""`prepare()`: put a model and its optimizer on this rank's device under DDP or FSDP2.

Both strategies are torch's own (`DistributedDataParallel`, `fully_shard`); this module adds
the HAL's device, the precision policy from its capabilities, and FSDP2's rules made
automatic: shard each transformer block, then the root, and give the optimizer the sharded
parameters.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import nn

from torchhal.distributed.precision import STRATEGIES, PrecisionPolicy, choose_precision
from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry
from torchhal.hal_core.hal import keeping_use

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from torchhal.distributed.init import DistContext

log = telemetry.get_logger("torchhal.distributed.prepare")

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
BLOCK_CONTAINERS = ("layers", "blocks", "h")
"""Names of the ModuleList that holds a transformer's blocks (Llama `model.layers`, GPT-2 `h`)."""


@dataclass(frozen=True)
class Prepared:
    """What training needs: the wrapped model, its optimizer, the precision policy and scaler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    policy: PrecisionPolicy
    scaler: torch.amp.GradScaler | None
    strategy: str
    sharded_blocks: int = 0
    checkpointed_blocks: int = 0

    def report(self) -> dict[str, Any]:
        """What was prepared; the parameters' dtypes as the model holds them (the policy keeps
        fp32 ones fp32, and a model made in bf16 stays bf16)."""
        return {
            "strategy": self.strategy,
            "sharded_blocks": self.sharded_blocks,
            "checkpointed_blocks": self.checkpointed_blocks,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "parameter_dtypes": sorted(
                {str(p.dtype).removeprefix("torch.") for p in self.model.parameters()}
            ),
            "precision": self.policy.report(),
        }


def prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    *,
    ctx: DistContext,
    strategy: str = "ddp",
    policy: PrecisionPolicy | None = None,
    blocks: Callable[[nn.Module], bool] | None = None,
    mesh: DeviceMesh | None = None,
    ddp_options: Mapping[str, Any] | None = None,
    activation_checkpointing: bool = False,
) -> Prepared:
    """Move `model` to `ctx.device` and wrap it for `strategy` ("ddp", "fsdp", or "local").

    `optimizer` is an optimizer over `model`'s parameters or a factory `params -> optimizer`.
    FSDP2 replaces parameters with sharded ones, so under "fsdp" an optimizer instance (which
    must not have stepped yet) gets the sharded parameters in its groups, in place: the returned
    optimizer is that instance, and an LR scheduler or hook made on it keeps working. `blocks`
    selects the modules FSDP shards one by one (default: the entries of the first ModuleList
    named layers, blocks or h). "local" wraps nothing: for
    heterogeneous runs whose gradients are synchronised explicitly (`hetero.HeteroGroup`).
    `policy` defaults to `choose_precision(ctx.device)`. `ddp_options` go to
    `DistributedDataParallel` (strategy "ddp" only), as Lightning's `DDPStrategy(**kwargs)` takes
    them: `find_unused_parameters=True` for a model whose steps leave parameters without a
    gradient (mixture-of-experts routing), `static_graph=True`, `bucket_cap_mb`, ... (torch's
    static_graph fails an internal assertion under `no_sync`, so `train` refuses it with
    gradient accumulation: pytorch issue 143580). Under "fsdp", BatchNorm in low precision and
    modules whose parameters are of another dtype than the model's (complex, fp64) are sharded
    on their own, uncast; with more than one rank a parameter a rank left unused is reduced as a
    zero gradient, so ranks that route to different experts never mix their gradients.
    `activation_checkpointing=True` keeps only each block's inputs in forward and runs the block
    again in backward (torchtitan's "full" mode: one more forward of each block for its
    activations' memory), on the blocks `blocks` selects, under every strategy; the recompute runs
    through the HAL and device of the forward, on whichever thread autograd runs it.
    """
    if strategy not in STRATEGIES:
        raise UnsupportedError(f"prepare: strategy must be one of {STRATEGIES}, got {strategy!r}")
    options = _checked_ddp_options(ddp_options, strategy)
    if policy is not None:
        policy.check_device(ctx.device, "prepare")
    policy = (policy or choose_precision(ctx.device)).for_strategy(strategy)
    _check_not_wrapped(model)
    plan = _fsdp_plan(model, policy, blocks) if strategy == "fsdp" else None
    checkpointed = _checkpoint_plan(model, blocks) if activation_checkpointing else []
    names = _parameter_names(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_optimizer_covers(optimizer, names)
    if strategy == "fsdp":  # FSDP2's sharding cannot be undone: what would fail after it, refused now
        _check_shardable(model, optimizer, names)
    device = ctx.device.torch_device
    moved = [n for n, p in model.named_parameters() if p.device != device]
    placement = Placement.of(model)
    sharded = 0
    try:
        model.to(device)  # may run out of device memory halfway
        if moved:
            log.info("model moved to its rank's device", device=ctx.device.id, parameters=len(moved))
        for block in checkpointed:  # before DDP or FSDP: their hooks stay outside the recompute
            block.forward = CheckpointedForward(block)
        with telemetry.span("torchhal.distributed.prepare", strategy=strategy, policy=policy.name):
            if strategy == "ddp":
                wrapped: nn.Module = _ddp(model, ctx, options)
            elif plan is not None:  # fsdp
                wrapped, sharded = _fsdp(model, ctx, policy, plan, mesh)
            else:
                wrapped = model
            opt = _optimizer_for(wrapped, optimizer, names, resharded=strategy == "fsdp")
    except BaseException:
        for block in checkpointed:  # a corrected retry finds the blocks as they were
            vars(block).pop("forward", None)
        _put_back(model, placement, strategy)
        raise
    prepared = Prepared(wrapped, opt, policy, policy.grad_scaler(), strategy, sharded, len(checkpointed))
    log.info("model prepared", rank=ctx.rank, device=ctx.device.id, **prepared.report())
    return prepared


class Placement(NamedTuple):
    """A model's tensors as they were before `prepare` moved them: each module's parameters (the
    objects, with their data and gradients) and buffers. Kept, not copied, so putting them back
    costs nothing and is exact."""

    parameters: list[tuple[nn.Module, str, nn.Parameter, torch.Tensor, torch.Tensor | None]]
    buffers: list[tuple[nn.Module, str, torch.Tensor]]

    @classmethod
    def of(cls, model: nn.Module) -> Placement:
        parameters = [
            (module, name, p, p.data, None if p.grad is None else p.grad.data)
            for module in model.modules()
            for name, p in module._parameters.items()
            if p is not None
        ]
        buffers = [
            (module, name, buffer)
            for module in model.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        return cls(parameters, buffers)

    def restore(self) -> int:
        """Put every tensor back; returns how many parameters and buffers had moved. A move sets a
        parameter's data in place, or (where the tensor types differ) puts a new Parameter in
        its module: both are undone."""
        moved: set[int] = set()
        for module, name, param, data, grad in self.parameters:
            current: torch.Tensor | None = module._parameters.get(name)
            if current is not param or param.device != data.device:
                moved.add(id(param))
            if param.device != data.device:
                param.data = data
            if grad is not None and param.grad is not None and param.grad.device != grad.device:
                param.grad.data = grad
            module._parameters[name] = param
        for module, name, buffer in self.buffers:
            current = module._buffers.get(name)
            if current is not buffer:
                moved.add(id(buffer))
            module._buffers[name] = buffer
        return len(moved)


def _put_back(model: nn.Module, placement: Placement, strategy: str) -> None:
    """After a failed prepare: the model's tensors where they were (a move that ran out of device
    memory halfway, a DDP wrap or optimizer factory that raised), unless FSDP2 already sharded a
    module, which cannot be undone: then say so, as the caller's model must be made again."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [name or "<root>" for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if sharded:
        log.error(
            "prepare failed after FSDP2 sharded part of the model, which cannot be undone: make the "
            "model again before retrying",
            strategy=strategy,
            sharded_modules=len(sharded),
            first=sharded[:3],
        )
        telemetry.count("torchhal.distributed.prepare_failed_sharded")
        return
    moved = placement.restore()
    if moved:
        log.warning(
            "prepare failed: the model's tensors were put back where they were",
            strategy=strategy,
            tensors=moved,
        )


def transformer_blocks(
    model: nn.Module, predicate: Callable[[nn.Module], bool] | None = None
) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: those `predicate` accepts, or the block container's entries."""
    if predicate is not None:
        return [m for m in model.modules() if m is not model and predicate(m)]
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_CONTAINERS:
            return list(module)
    return []


CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past", "cache")
"""Keyword arguments through which a block writes a KV cache: the recompute would write it again."""


class CheckpointedForward:
    """A block's forward through activation checkpointing (non-reentrant, torch's recommendation),
    set on the block instance: hooks on the module (DDP's, FSDP2's unshard) stay outside the
    recompute, as transformers checkpoints `forward` and not `__call__`. A class, not a closure,
    so the model still pickles. What it takes care of:

    - the recompute runs under the `hal.use` block of the forward (`keeping_use`): autograd runs
      it on a GPU's own thread, where that block is not active;
    - without grad (evaluation, generation) the forward runs as it is: nothing would be recomputed;
    - keyword arguments reach torch's checkpoint positionally: it restores the random state
      (dropout) of the devices of the tensors in its positional arguments only (nested ones, as a
      Llama layer's `position_embeddings=(cos, sin)`, included);
    - a KV cache passed to the block (`CACHE_ARGUMENTS`, `use_cache`) is dropped, as transformers
      drops it under its own checkpointing: the recompute would append the keys again (logged
      once per block class, counted)."""

    def __init__(self, block: nn.Module) -> None:
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        forward = functools.partial(type(block).forward, block)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        from torch.utils.checkpoint import checkpoint

        _drop_cache(block, kwargs)
        names, positional = list(kwargs), len(args)

        def run(*values: Any) -> Any:
            return forward(*values[:positional], **dict(zip(names, values[positional:], strict=True)))

        return checkpoint(keeping_use(run), *args, *kwargs.values(), use_reentrant=False)


def _drop_cache(block: nn.Module, kwargs: dict[str, Any]) -> None:
    dropped = [name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None]
    for name in dropped:
        kwargs[name] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        dropped.append("use_cache")
    if not dropped:
        return
    kind = type(block).__name__
    telemetry.count("torchhal.distributed.checkpointed_cache_dropped", block=kind)
    if kind not in _CACHE_DROP_SAID:
        _CACHE_DROP_SAID.add(kind)
        log.warning(
            "a checkpointed block was given a KV cache: dropped, as its recompute would write it "
            "again (transformers drops it under its own checkpointing)",
            block=kind,
            arguments=dropped,
        )


_CACHE_DROP_SAID: set[str] = set()
"""Block classes whose dropped KV cache was logged (once per process)."""


def _checkpoint_plan(model: nn.Module, predicate: Callable[[nn.Module], bool] | None) -> list[nn.Module]:
    """The blocks activation checkpointing wraps, refusing before anything moves: none found, one
    whose forward was already replaced on the instance (accelerate's hooks, a checkpointing of
    its own), or one that transformers already checkpoints (recomputing a recompute)."""
    found = transformer_blocks(model, predicate)
    if not found:
        raise InvalidArgumentError(
            f"prepare(activation_checkpointing=True): no blocks to checkpoint: the model has no "
            f"ModuleList named one of {BLOCK_CONTAINERS} and `blocks` selected none; pass blocks="
        )
    names = {id(m): name for name, m in model.named_modules()}
    for block in found:
        if "forward" in vars(block):
            raise InvalidArgumentError(
                f"prepare(activation_checkpointing=True): block {names[id(block)]!r} already has a "
                f"forward of its own on the instance ({type(vars(block)['forward']).__name__}); "
                "checkpointing would replace it"
            )
        if getattr(block, "gradient_checkpointing", False):
            raise InvalidArgumentError(
                f"prepare(activation_checkpointing=True): block {names[id(block)]!r} is already "
                "checkpointed by transformers (gradient_checkpointing_enable); use one of the two"
            )
    stateful = [names[id(m)] for b in found for m in b.modules() if _updates_running_stats(m)]
    if stateful:
        log.warning(
            "activation checkpointing recomputes blocks holding BatchNorm layers, whose running "
            "statistics the recompute updates a second time (as torch.utils.checkpoint does)",
            layers=stateful[:8],
        )
    return found


def _updates_running_stats(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats


def _ddp(model: nn.Module, ctx: DistContext, options: Mapping[str, Any]) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device = ctx.device.torch_device
    device_ids = None if device.type == "cpu" else [device.index]  # DDP takes no device_ids for host modules
    return DistributedDataParallel(
        model, device_ids=device_ids, process_group=ctx.communicator.group, **options
    )


_DDP_SET_BY_PREPARE = ("module", "device_ids", "output_device", "process_group", "device_mesh")


def _checked_ddp_options(options: Mapping[str, Any] | None, strategy: str) -> Mapping[str, Any]:
    """Refuse, before anything is moved or wrapped, options DDP would not take or that prepare sets."""
    if not options:
        return {}
    if strategy != "ddp":
        raise InvalidArgumentError(
            f"prepare: ddp_options apply to strategy 'ddp' only, got strategy {strategy!r} with "
            f"ddp_options {sorted(options)}"
        )
    from torch.nn.parallel import DistributedDataParallel

    accepted = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}
    for key in options:
        if key in _DDP_SET_BY_PREPARE:
            raise InvalidArgumentError(
                f"prepare: ddp_options may not set {key!r}: prepare sets it from ctx (this rank's "
                "device and process group)"
            )
        if key not in accepted:
            raise InvalidArgumentError(
                f"prepare: ddp_options has {key!r}, which DistributedDataParallel does not take "
                f"(it takes {sorted(accepted - set(_DDP_SET_BY_PREPARE))})"
            )
    return options


def _fsdp_plan(
    model: nn.Module, policy: PrecisionPolicy, predicate: Callable[[nn.Module], bool] | None
) -> tuple[list[tuple[nn.Module, bool]], int]:
    """The units FSDP2 shards below the root, inner ones before those that contain them, each
    with whether it is sharded uncast (BatchNorm in low precision, parameters of another dtype;
    a block that is one of those is sharded once, uncast: a BatchNorm in an MLP's `layers`), and
    how many blocks there are; refuses, before anything moves, a unit of mixed dtypes."""
    kept = _batch_norms(model) if policy.name != "fp32" else []
    if kept:
        log.info(
            "FSDP keeps BatchNorm parameters in fp32 (as autocast does), each layer sharded on its own",
            layers=len(kept),
            compute_dtype=str(policy.compute_dtype),
        )
    islands = [m for m in _dtype_islands(model) if m not in kept]
    if islands:
        log.info(
            "FSDP shards modules whose parameters are of another dtype on their own, uncast",
            modules=len(islands),
        )
    uncast = {id(m) for m in kept + islands}
    blocks = transformer_blocks(model, predicate)
    sharded = uncast | {id(b) for b in blocks}
    units = [(m, id(m) in uncast) for m in reversed(list(model.modules())) if id(m) in sharded]
    _check_uniform_units(model, [*(m for m, _ in units), model])
    return units, len(blocks)


def _fsdp(
    model: nn.Module,
    ctx: DistContext,
    policy: PrecisionPolicy,
    plan: tuple[list[tuple[nn.Module, bool]], int],
    mesh: DeviceMesh | None,
) -> tuple[nn.Module, int]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        from torchhal.distributed.mesh import Mesh

        mesh = Mesh.create(ctx).device_mesh
    mp = policy.fsdp_policy()
    units, block_count = plan
    if not block_count:
        log.warning(
            "no transformer blocks found: FSDP shards the root module only, so all parameters are "
            "gathered at once in forward and backward",
            containers=BLOCK_CONTAINERS,
        )
        telemetry.count("torchhal.distributed.fsdp_root_only")
    for module, uncast in units:  # inner modules before the modules that contain them
        fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy() if uncast else mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if mesh.size() > 1:
        _reduce_scatter_unused(model)
    return model, block_count


def _reduce_scatter_unused(model: nn.Module) -> None:
    """FSDP2 reduce-scatters the gradients a rank has: where ranks used different parameters (a
    mixture of experts' routing), same-sized lists were summed position by position, one
    expert's gradient into another's, silently. With this each rank sends zeros for its unused
    parameters, as DDP's find_unused_parameters does; a parameter no rank used gets a zero
    gradient (DDP leaves it None)."""
    setter = getattr(model, "set_reduce_scatter_unused_params", None)
    if setter is None:  # torch 2.11 has none
        log.warning(
            "this torch's FSDP2 cannot reduce unused parameters: ranks must use the same "
            "parameters in every step, or their gradients are mixed"
        )
        telemetry.count("torchhal.distributed.fsdp_unused_params_unsupported")
        return
    setter(True)


def _dtype_islands(model: nn.Module) -> list[nn.Module]:
    """Modules whose own trainable parameters are all of one dtype other than the model's main
    one (by elements): complex filters, a piece kept in fp64. FSDP2 gathers and reduces each
    unit's parameters as one buffer and refuses mixed dtypes at the first forward; with the
    compute dtype's policy it would also cast an fp64 piece down and reduce complex gradients
    in fp32, dropping their imaginary part."""
    sizes: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.requires_grad:
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel()
    if len(sizes) < 2:
        return []
    main = max(sizes, key=lambda dtype: sizes[dtype])
    islands = []
    for module in model.modules():
        dtypes = {p.dtype for p in module.parameters(recurse=False) if p.requires_grad}
        if module is not model and len(dtypes) == 1 and main not in dtypes:
            islands.append(module)
    return islands


def _check_uniform_units(model: nn.Module, units: list[nn.Module]) -> None:
    """Each FSDP2 unit (inner units first) holds the trainable parameters no inner unit holds;
    FSDP2 needs them of one dtype, and said so only as an AssertionError at the first forward."""
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    params = {id(p): name for name, p in model.named_parameters()}
    held: set[int] = set()
    for unit in units:
        mine = [p for p in unit.parameters() if p.requires_grad and id(p) not in held]
        held.update(id(p) for p in mine)
        by_dtype: dict[torch.dtype, list[str]] = {}
        for p in mine:
            by_dtype.setdefault(p.dtype, []).append(params[id(p)])
        if len(by_dtype) > 1:
            listed = "; ".join(
                f"{dtype}: {len(held_by)} ({', '.join(held_by[:3])}{', ...' if len(held_by) > 3 else ''})"
                for dtype, held_by in by_dtype.items()
            )
            raise InvalidArgumentError(
                f"prepare(strategy='fsdp'): FSDP shards module {names[id(unit)]!r} as one unit, whose "
                f"trainable parameters must share one dtype, but they are of {len(by_dtype)}: "
                f"{listed}; put the parameters of each dtype in modules of their own, or freeze "
                "the odd ones"
            )


def _batch_norms(model: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers whose parameters FSDP2 would cast to the compute dtype. torch's
    batch_norm takes low-precision input with fp32 parameters and running statistics, but not
    low-precision parameters with fp32 statistics (FSDP2 casts parameters, not buffers): it
    raises. FSDP1 wrapped these layers apart for the same reason."""
    return [
        m
        for m in model.modules()
        if m is not model
        and isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.track_running_stats
        and any(True for _ in m.parameters(recurse=False))
    ]


def _check_not_wrapped(model: nn.Module) -> None:
    """A model already wrapped for data parallelism, at its root or inside (`torch.compile(DDP(m))`,
    a DDP layer, a module `fully_shard` has sharded), would be wrapped again: DDP in DDP reduces
    every gradient twice and nests its state-dict keys; DDP or FSDP over FSDP's sharded
    parameters fails deep inside torch, at the first forward."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    for name, module in model.named_modules():
        if isinstance(module, DistributedDataParallel):
            where = f"model.{name}" if name else "model"
            raise InvalidArgumentError(
                f"prepare: the model is already wrapped in DistributedDataParallel (at {where}); "
                f"pass the module it wraps ({where}.module), which prepare wraps for the strategy asked"
            )
        if isinstance(module, (FSDPModule, FullyShardedDataParallel)):
            raise InvalidArgumentError(
                f"prepare: the model is already sharded by FSDP (at {f'model.{name}' if name else 'model'}, "
                f"a {type(module).__name__}); pass the model before fully_shard, which prepare applies "
                "for the strategy asked"
            )


def _parameter_names(model: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def _check_optimizer_covers(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> None:
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in names)
    if foreign:
        raise InvalidArgumentError(
            f"prepare: the optimizer holds {foreign} parameter(s) that are not the model's; "
            "make it over model.parameters(), or pass a factory"
        )


def _check_shardable(
    model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory, names: dict[int, str]
) -> None:
    """Under "fsdp", refuse before anything moves what would be refused after FSDP2 sharded the
    model, which cannot be undone (a retry was then refused as "already sharded"): a model without
    parameters (no optimizer can be made over none), and an optimizer instance with state (FSDP2
    replaces the parameters the state is keyed by)."""
    if not names:
        raise InvalidArgumentError(
            f"prepare(strategy='fsdp'): the model ({type(model).__name__}) has no parameters, so "
            "FSDP2 has nothing to shard and no optimizer can be made over it; use strategy 'local' "
            "or give the model its parameters"
        )
    if isinstance(optimizer, torch.optim.Optimizer) and optimizer.state:
        raise InvalidArgumentError(
            "prepare(strategy='fsdp'): the optimizer has state (it has stepped, or made state for "
            "its parameters when it was made, as Adagrad does), and FSDP2 replaces the parameters "
            f"it holds (this {type(optimizer).__name__} holds state for {len(optimizer.state)}); "
            "make the optimizer after prepare, or pass a factory"
        )


def _optimizer_for(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    names: dict[int, str],
    *,
    resharded: bool,
) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters())
    if not resharded:
        return optimizer
    # its state was found empty before sharding (_check_shardable). In place, not a new optimizer:
    # an LR scheduler or a hook made on this one must keep working, and each list too (LBFGS
    # holds its group's list as `_params`)
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"][:] = [current[names[id(p)]] for p in group["params"]]
    log.info("optimizer's parameters swapped for the sharded ones", optimizer=type(optimizer).__name__)
    return optimizer
