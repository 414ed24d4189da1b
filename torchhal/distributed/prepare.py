"""`prepare()`: put a model and its optimizer on this rank's device under DDP or FSDP2.

Both strategies are torch's own (`DistributedDataParallel`, `fully_shard`); this module adds
the HAL's device, the precision policy from its capabilities, and FSDP2's rules made
automatic: shard each transformer block, then the root, and build the optimizer over the
sharded parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from torchhal.distributed.precision import STRATEGIES, PrecisionPolicy, choose_precision
from torchhal.hal_core import InvalidArgumentError, UnsupportedError, telemetry

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

    def report(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "sharded_blocks": self.sharded_blocks,
            "parameters": sum(p.numel() for p in self.model.parameters()),
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
) -> Prepared:
    """Move `model` to `ctx.device` and wrap it for `strategy` ("ddp", "fsdp", or "local").

    `optimizer` is an optimizer over `model`'s parameters or a factory `params -> optimizer`.
    FSDP2 replaces parameters with sharded ones, so under "fsdp" an optimizer instance (which
    must not have stepped yet) is rebuilt with the same class, groups and hyperparameters over
    the sharded parameters. `blocks` selects the modules FSDP shards one by one (default: the
    entries of the first ModuleList named layers, blocks or h). "local" wraps nothing: for
    heterogeneous runs whose gradients are synchronised explicitly (`hetero.HeteroGroup`).
    `policy` defaults to `choose_precision(ctx.device)`.
    """
    if strategy not in STRATEGIES:
        raise UnsupportedError(f"prepare: strategy must be one of {STRATEGIES}, got {strategy!r}")
    if policy is not None:
        policy.check_device(ctx.device, "prepare")
    policy = (policy or choose_precision(ctx.device)).for_strategy(strategy)
    _check_not_wrapped(model)
    names = _parameter_names(model)
    if isinstance(optimizer, torch.optim.Optimizer):
        _check_optimizer_covers(optimizer, names)
    device = ctx.device.torch_device
    moved = [n for n, p in model.named_parameters() if p.device != device]
    model.to(device)
    if moved:
        log.info("model moved to its rank's device", device=ctx.device.id, parameters=len(moved))
    sharded = 0
    with telemetry.span("torchhal.distributed.prepare", strategy=strategy, policy=policy.name):
        if strategy == "ddp":
            wrapped: nn.Module = _ddp(model, ctx)
        elif strategy == "fsdp":
            wrapped, sharded = _fsdp(model, ctx, policy, blocks, mesh)
        else:
            wrapped = model
        opt = _optimizer_for(wrapped, optimizer, names, rebuild=strategy == "fsdp")
    prepared = Prepared(wrapped, opt, policy, policy.grad_scaler(), strategy, sharded)
    log.info("model prepared", rank=ctx.rank, device=ctx.device.id, **prepared.report())
    return prepared


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


def _ddp(model: nn.Module, ctx: DistContext) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    device = ctx.device.torch_device
    device_ids = None if device.type == "cpu" else [device.index]  # DDP takes no device_ids for host modules
    return DistributedDataParallel(model, device_ids=device_ids, process_group=ctx.communicator.group)


def _fsdp(
    model: nn.Module,
    ctx: DistContext,
    policy: PrecisionPolicy,
    predicate: Callable[[nn.Module], bool] | None,
    mesh: DeviceMesh | None,
) -> tuple[nn.Module, int]:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        from torchhal.distributed.mesh import Mesh

        mesh = Mesh.create(ctx).device_mesh
    mp = policy.fsdp_policy()
    blocks = transformer_blocks(model, predicate)
    if not blocks:
        log.warning(
            "no transformer blocks found: FSDP shards the root module only, so all parameters are "
            "gathered at once in forward and backward",
            containers=BLOCK_CONTAINERS,
        )
        telemetry.count("torchhal.distributed.fsdp_root_only")
    norms = _batch_norms(model) if mp.param_dtype is not None else []
    if norms:
        log.info(
            "FSDP keeps BatchNorm parameters in fp32 (as autocast does), each layer sharded on its own",
            layers=len(norms),
            compute_dtype=str(mp.param_dtype),
        )
    for norm in norms:  # before the blocks that may contain them
        fully_shard(norm, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    for block in reversed(blocks):  # inner modules before the modules that contain them
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, len(blocks)


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
    """A DDP model wrapped again would reduce every gradient twice and nest its state-dict keys."""
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        raise InvalidArgumentError(
            "prepare: the model is already wrapped in DistributedDataParallel; pass the module it "
            "wraps (model.module), which prepare wraps for the strategy asked"
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


def _optimizer_for(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | OptimizerFactory,
    names: dict[int, str],
    *,
    rebuild: bool,
) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer(model.parameters())
    if not rebuild:
        return optimizer
    if optimizer.state:
        raise InvalidArgumentError(
            "prepare(strategy='fsdp'): the optimizer has already stepped (it has state), and FSDP2 "
            "replaces the parameters it holds; make the optimizer after prepare, or pass a factory"
        )
    current = dict(model.named_parameters())
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [current[names[id(p)]] for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]
    rebuild_with: Any = type(optimizer)
    rebuilt: torch.optim.Optimizer = rebuild_with(groups)  # each group carries every hyperparameter
    log.info("optimizer rebuilt over the sharded parameters", optimizer=type(optimizer).__name__)
    return rebuilt
