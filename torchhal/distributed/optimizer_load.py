"""The optimizer part of a checkpoint load, worked out from DCP's metadata before anything is read
(`OptimizerTarget`): what state the checkpoint holds for which parameters, what this optimizer's
class would make, the saved parameter groups, and their checks; and the parameter names torch's
state dicts key optimizer state by. The optimizer is loaded through its own `load_state_dict`, so
nothing steps it (torch's get_state_dict and set_state_dict step a fresh one)."""

from __future__ import annotations

import inspect
import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchhal.distributed.checkpoint_errors import CheckpointError, error_line
from torchhal.hal_core import telemetry

if TYPE_CHECKING:
    from torch import nn

log = telemetry.get_logger("torchhal.distributed.checkpoint")


def parameter_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's name as torch's get_state_dict keys its optimizer state: without DDP's
    `module.` and torch.compile's `_orig_mod.` (torch's own `_get_fqns`, where it has one)."""
    try:
        from torch.distributed.checkpoint.state_dict import _get_fqns
    except ImportError:  # pragma: no cover - every torch this supports has it
        _get_fqns = None  # type: ignore[assignment]
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        clean = name
        if _get_fqns is not None:
            fqns = _get_fqns(model, name)
            if len(fqns) == 1:
                clean = next(iter(fqns))
        else:
            clean = ".".join(part for part in name.split(".") if part not in ("module", "_orig_mod"))
        names[id(param)] = clean
    return names


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """Each parameter group's parameters by name; a parameter that is not the model's is refused."""
    names = parameter_names(model)
    out: list[list[str]] = []
    for g, group in enumerate(optimizer.param_groups):
        out.append([])
        for i, param in enumerate(group["params"]):
            if id(param) not in names:
                raise CheckpointError(
                    f"the optimizer's parameter group {g} holds a parameter (position {i}, shape "
                    f"{tuple(param.shape)}) that is not the model's; make the optimizer over "
                    "model.parameters()"
                )
            out[-1].append(names[id(param)])
    return out


_STATE_PREFIX = "optimizer.state."
_NOT_HYPERPARAMETERS = {"params", "param_names", "initial_lr"}  # initial_lr: set by a scheduler
_GROUP_VALUE = re.compile(r"^optimizer\.param_groups\.(\d+)\.(.+)$")


@dataclass
class OptimizerTarget:
    """The optimizer part of a load, worked out from DCP's metadata before anything is read: the
    state the checkpoint holds (for the parameters that had state when it was saved: an unused
    expert's had none), to be loaded into tensors of their own or, where this optimizer's state
    has one of the same shape and dtype, into that; the keys this optimizer's class makes at a
    first step, where the checkpoint lacks them (another optimizer type), so DCP refuses them by
    name before it reads anything; and the saved parameter groups' values. Built without
    stepping the optimizer, as torch's get_state_dict and set_state_dict do for a fresh one."""

    path: Path
    kind: str
    names: list[list[str]]
    state: dict[str, dict[str, Any]]
    missing: dict[str, list[str]]
    saved_groups: list[dict[str, Any]]
    current_groups: list[set[str]]
    state_checked: bool

    @classmethod
    def of(
        cls, path: Path, metadata: Metadata, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> OptimizerTarget:
        names = optimizer_names(model, optimizer)
        params = {
            name: param
            for group, group_names in zip(optimizer.param_groups, names, strict=True)
            for param, name in zip(group["params"], group_names, strict=True)
        }
        saved_state, saved_groups, foreign = _saved_optimizer_layout(metadata, set(params))
        if foreign:
            listed = ", ".join(repr(n) for n in sorted(foreign)[:5]) + (", ..." if len(foreign) > 5 else "")
            raise CheckpointError(
                f"checkpoint {path} does not fit the optimizer: it holds optimizer state for "
                f"{len(foreign)} parameter(s) the optimizer does not hold ({listed}); make the "
                "optimizer over the parameters it was saved with"
            )
        made = _first_step_state_keys(optimizer, names)
        state: dict[str, dict[str, Any]] = {}
        missing: dict[str, list[str]] = {}
        checked = False
        for name, keys in saved_state.items():
            param = params[name]
            current = optimizer.state.get(param, {})
            checked = checked or made is not None or bool(current)
            entry: dict[str, Any] = {}
            for key, meta in keys.items():
                _nest(entry, key, _load_slot(meta, current.get(key[0]) if len(key) == 1 else None, param))
            expected = made.get(name, set()) if made is not None else set(current)
            lacking = sorted(expected - {key[0] for key in keys})
            for slot in lacking:
                entry[slot] = torch.empty(0)  # not in the checkpoint: DCP refuses it by name, reading nothing
            if lacking:
                missing[name] = lacking
            state[name] = entry
        groups: list[dict[str, Any]] = [{} for _ in range(max(saved_groups, default=-1) + 1)]
        for index, values in saved_groups.items():
            current_group = optimizer.param_groups[index] if index < len(optimizer.param_groups) else {}
            for key, meta in values.items():
                like = current_group.get(key[0]) if len(key) == 1 else None
                like = like if isinstance(like, torch.Tensor) else None
                _nest(groups[index], key, _load_slot(meta, None, like))
        current_groups = [set(group) - _NOT_HYPERPARAMETERS for group in optimizer.param_groups]
        return cls(path, type(optimizer).__name__, names, state, missing, groups, current_groups, checked)

    def refused(self, error: CheckpointError) -> CheckpointError:
        """DCP's refusal of the keys the checkpoint lacks, with what they mean."""
        if not self.missing:
            return error
        name, keys = next(iter(sorted(self.missing.items())))
        return CheckpointError(
            f"{error}; the checkpoint lacks optimizer state this {self.kind} keeps for "
            f"{len(self.missing)} parameter(s) ({name!r}: {', '.join(keys)}"
            f"{'; ...' if len(self.missing) > 1 else ''}): it was saved by another optimizer type, "
            "or with other settings (Adam's amsgrad); make the optimizer it was saved with"
        )

    def match_groups(self, saved: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Each of the optimizer's groups' saved hyperparameters: those of the saved group that
        holds exactly its parameters (by name, as torch's set_state_dict matches them), else
        refused naming them."""
        out = []
        for index, names in enumerate(self.names):
            want = set(names)
            candidates = ([saved[index]] if index < len(saved) else []) + saved
            match = next((g for g in candidates if set(g.get("params") or ()) == want), None)
            if match is None:
                there = (
                    f"saved group {index} holds {_listed(sorted(saved[index].get('params') or ()))}"
                    if index < len(saved)
                    else f"the checkpoint has {len(saved)} groups"
                )
                raise CheckpointError(
                    f"checkpoint {self.path} does not fit the optimizer: its parameter group {index} "
                    f"holds {_listed(sorted(want))}, which no saved group holds exactly ({there}); "
                    "make the optimizer with the groups it was saved with"
                )
            if not self.state_checked:
                self._check_same_kind(index, set(match) - _NOT_HYPERPARAMETERS)
            out.append({k: v for k, v in match.items() if k != "params"})
        return out

    def _check_same_kind(self, index: int, saved: set[str]) -> None:
        """Where no saved state could be compared with what this optimizer keeps (a checkpoint
        saved fresh), its hyperparameters' names tell another optimizer type: each side has some
        the other lacks (SGD's momentum, Adam's betas). A torch version adds names on one side
        only (Adam's decoupled_weight_decay), which its optimizers' __setstate__ defaults."""
        here = self.current_groups[index]
        saved_only, here_only = sorted(saved - here), sorted(here - saved)
        if saved_only and here_only:
            raise CheckpointError(
                f"checkpoint {self.path} does not fit the optimizer: its parameter group {index} was "
                f"saved with hyperparameters {saved_only} this {self.kind} does not have, and without "
                f"{here_only}, which it has: it was saved by another optimizer type; make the "
                "optimizer it was saved with"
            )

    def apply(self, optimizer: torch.optim.Optimizer, hyperparameters: list[dict[str, Any]] | None) -> None:
        """Give `optimizer` the loaded state (none for the parameters that had none) and each
        group's saved hyperparameters, through its own load_state_dict: nothing steps it."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        index = 0
        for g, (group, names) in enumerate(zip(optimizer.param_groups, self.names, strict=True)):
            ids = []
            for name in names:
                if name in self.state:
                    state[index] = self.state[name]
                ids.append(index)
                index += 1
            values = (
                hyperparameters[g]
                if hyperparameters is not None
                else {k: v for k, v in group.items() if k != "params"}
            )
            groups.append({**values, "params": ids})
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise CheckpointError(
                f"checkpoint {self.path}: the optimizer ({self.kind}) refused the state loaded for "
                f"{len(self.state)} parameter(s) ({_listed(sorted(self.state))}): {error_line(exc)}"
            ) from exc


def _listed(names: list[str]) -> str:
    return "[" + ", ".join(repr(n) for n in names[:5]) + (", ..." if len(names) > 5 else "") + "]"


def _saved_optimizer_layout(
    metadata: Metadata, names: set[str]
) -> tuple[dict[str, dict[tuple[Any, ...], Any]], dict[int, dict[tuple[Any, ...], Any]], set[str]]:
    """From DCP's metadata: for each parameter with saved optimizer state, its keys (as paths) and
    their storage metadata; for each saved parameter group, its values'; and the names of saved
    parameters not in `names`. DCP's planner keeps each key's path in the saved state dict (the
    key alone is ambiguous: parameter names hold dots); a checkpoint without them is parsed
    against `names`."""
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    state: dict[str, dict[tuple[Any, ...], Any]] = {}
    groups: dict[int, dict[tuple[Any, ...], Any]] = {}
    foreign: set[str] = set()
    for key, meta in metadata.state_dict_metadata.items():
        path = paths.get(key)
        if not isinstance(path, (tuple, list)):
            path = _parsed_path(key, names)
            if path is None:
                continue
        path = tuple(path)
        if path[:2] == ("optimizer", "state") and len(path) >= 4:
            if path[2] in names:
                state.setdefault(path[2], {})[path[3:]] = meta
            else:
                foreign.add(str(path[2]))
        elif path[:2] == ("optimizer", "param_groups") and len(path) >= 4:
            groups.setdefault(int(path[2]), {})[path[3:]] = meta
    return state, groups, foreign


def _parsed_path(key: str, names: set[str]) -> tuple[Any, ...] | None:
    """The path of an optimizer key of a checkpoint whose metadata holds no paths."""
    if key.startswith(_STATE_PREFIX):
        rest = key[len(_STATE_PREFIX) :]
        owner = max((n for n in names if rest.startswith(n + ".")), key=len, default=None)
        if owner is None:
            owner, _, leaf = rest.rpartition(".")
            return ("optimizer", "state", owner, leaf)
        return ("optimizer", "state", owner, *rest[len(owner) + 1 :].split("."))
    match = _GROUP_VALUE.match(key)
    if match:
        return ("optimizer", "param_groups", int(match.group(1)), match.group(2))
    return None


def _nest(into: Any, path: tuple[Any, ...], value: Any) -> None:
    """Set `value` at `path` below `into`, making the dicts and (for integer parts: LBFGS's lists
    of tensors) lists on the way, as DCP's unflattening does."""
    for part, following in itertools.pairwise(path):
        made: list[Any] | dict[Any, Any] = [] if isinstance(following, int) else {}
        if isinstance(into, list):
            into.extend([None] * (part + 1 - len(into)))
            into[part] = made if into[part] is None else into[part]
            into = into[part]
        else:
            into = into.setdefault(part, made)
    if isinstance(into, list):
        into.extend([None] * (path[-1] + 1 - len(into)))
    into[path[-1]] = value


def _load_slot(meta: Any, current: Any, like: torch.Tensor | None) -> Any:
    """Where DCP loads a saved value: the optimizer's current tensor of the same shape and dtype
    (loaded in place), else a new tensor like `like` (a parameter: an FSDP2 DTensor stays one) or
    on the host; a saved object (a number, a tuple) needs none."""
    if not isinstance(meta, TensorStorageMetadata):
        return None
    size, dtype = tuple(meta.size), meta.properties.dtype
    if isinstance(current, torch.Tensor) and tuple(current.shape) == size and current.dtype == dtype:
        return current
    if like is not None and tuple(like.shape) == size:
        return torch.empty_like(like, dtype=dtype, requires_grad=False)
    return torch.empty(size, dtype=dtype)


def _first_step_state_keys(
    optimizer: torch.optim.Optimizer, names: list[list[str]]
) -> dict[str, set[str]] | None:
    """The state keys `optimizer` makes for each parameter at a first step, learned by stepping a
    new optimizer of its class, with its groups' hyperparameters at learning rate 0, over
    stand-ins of one element a dimension with zero gradients (as torch's `_init_optim_state`,
    frozen parameters get none), its step hooks and the global ones left out: the optimizer
    itself never steps. None (logged, counted) where that cannot be told: a class outside
    torch.optim (its step may run collectives) or one whose step needs more (LBFGS's closure)."""
    kind = type(optimizer)
    if kind.__module__ != "torch.optim" and not kind.__module__.startswith("torch.optim."):
        _keys_unchecked(kind, "its class is not one of torch.optim's")
        return None
    stand_ins: list[list[torch.Tensor]] = []
    groups = []
    for group in optimizer.param_groups:
        made = []
        for param in group["params"]:
            local = param.to_local() if hasattr(param, "to_local") else param
            stand_in = torch.zeros(
                (1,) * param.dim(), dtype=param.dtype, device=local.device, requires_grad=param.requires_grad
            )
            if param.requires_grad:
                stand_in.grad = torch.zeros_like(stand_in)
            made.append(stand_in)
        stand_ins.append(made)
        values = {k: v for k, v in group.items() if k in optimizer.defaults}
        if "lr" in values:
            values["lr"] = torch.tensor(0.0) if isinstance(values["lr"], torch.Tensor) else 0.0
        groups.append({**values, "params": made})
    try:  # the defaults its constructor takes (AdamW's sets decoupled_weight_decay itself)
        accepted = inspect.signature(kind.__init__).parameters
        probe = kind(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})
        step = kind.step
        if getattr(step, "hooked", False):  # Optimizer's wrapper, which runs the step hooks
            step = step.__wrapped__  # type: ignore[attr-defined]  # functools.wraps set it
        step(probe)
    except Exception as exc:
        _keys_unchecked(kind, f"a step of it over stand-ins raised {error_line(exc)}")
        return None
    return {
        name: set(probe.state[stand_in]) if stand_in in probe.state else set()
        for made, group_names in zip(stand_ins, names, strict=True)
        for stand_in, name in zip(made, group_names, strict=True)
    }


def _keys_unchecked(kind: type, why: str) -> None:
    log.info(
        "the optimizer state keys a checkpoint must hold are not known for this optimizer: the "
        "state it holds is loaded as it is",
        optimizer=kind.__qualname__,
        reason=why,
    )
    telemetry.count("torchhal.checkpoint.optimizer_keys_unchecked")
