"""Checkpoints through torch.distributed.checkpoint (DCP), committed atomically and verified on load.

DCP writes the model and optimizer shards (`get_state_dict` gives DDP's plain tensors or FSDP2's
DTensors, so a checkpoint saved at one world size loads at another, resharded). torchhal adds
what makes a checkpoint safe to resume from after a crash:
- a step is written under `<dir>/.step_<n>.tmp/` and renamed to `<dir>/step_<n>/` only after
  every rank finished, with `manifest.json` (step, world size, sha256 of every file) written last,
  so a directory named `step_<n>` is complete;
- `latest_valid(dir)` walks back from the newest step to the newest one whose manifest verifies,
  logging and counting every one it skips (truncated, edited, incomplete);
- each rank's RNG states (torch's CPU generator and its device's: `ctx.device`, or without a ctx
  the device the model's parameters are on; and Python's and NumPy's) sit beside the shards in
  `rng_rank<r>.pt`, so a resumed run draws the same random numbers as an uninterrupted one;
- each rank's data loader state (`data=`: an object with `state_dict`/`load_state_dict`, as
  torchdata's StatefulDataLoader) in `data_rank<r>.pt`, so a resumed run continues its epoch
  where it stopped, every rank from its own position;
- the learning-rate scheduler's state (`scheduler=`, the same on every rank) in `scheduler.pt`, so
  a resumed run continues its warm-up and decay instead of starting them again;
- only the newest `keep` checkpoints are kept, and checkpoints of later steps than one just
  committed (a run resumed from an earlier step) are set aside, so a crash never resumes the
  abandoned timeline.
`step` is the number of optimizer steps completed: resume with `train(first_step=step)`. An
optimizer without state (one that has not stepped, or SGD without momentum, which keeps none) is
saved as fresh with its parameter groups' hyperparameters (torch's `get_state_dict` would make its
state by stepping it at learning rate 0: Adam's step count, Rprop's step sizes and any step hook
would move) and loads as fresh with them (a scheduler's lowered learning rate included). A load
never steps the optimizer either: what it loads is what the checkpoint holds (state for the
parameters that had it, none for those that had none), refused before anything changes where it
does not fit (`optimizer_load.OptimizerTarget`). The directory must be storage every rank sees
(DCP's file writer and the commit both assume it); what rank 0 alone does there (choose the
checkpoint to load, commit, prune) it tells every rank, so a failure there is a CheckpointError on
every rank at once.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import random
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from torchhal.distributed.checkpoint_errors import CheckpointError, CheckpointIOError, error_line
from torchhal.distributed.optimizer_load import OptimizerTarget, optimizer_names
from torchhal.distributed.precision import dtype_name
from torchhal.hal_core import ConfigurationError, InvalidArgumentError, telemetry

if TYPE_CHECKING:
    from torch import nn

    from torchhal.distributed.init import DistContext
    from torchhal.hal_core import Device

log = telemetry.get_logger("torchhal.distributed.checkpoint")

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.step_(\d+)\.tmp$")
_SUPERSEDED = re.compile(r"^superseded_step_(\d+)_by_(\d+)$")
_REPLACED_DIR = re.compile(r"^\.step_(\d+)\.replaced$")
_T = TypeVar("_T")


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete, verified checkpoint."""

    step: int
    path: Path
    world_size: int
    optimizer_groups: list[int] | None = None  # each parameter group's size; None before manifests had it


def step_dir(directory: Path | str, step: int) -> Path:
    return Path(directory) / f"step_{step}"


def verify(path: Path | str) -> CheckpointInfo:
    """The checkpoint at `path` if its manifest verifies every file; else CheckpointError saying why."""
    path = Path(path)
    manifest = path / MANIFEST
    try:
        meta = json.loads(manifest.read_text())
        step, world, files = int(meta["step"]), int(meta["world_size"]), dict(meta["files"])
        groups = meta.get("optimizer_groups")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path}: no {MANIFEST} (incomplete)") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: unreadable {MANIFEST}: {exc}") from None
    if ".metadata" not in files:
        raise CheckpointError(f"checkpoint {path}: the manifest lists no DCP .metadata file")
    for name, want in sorted(files.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path}: file {name} listed in the manifest is missing")
        got = _sha256(file)
        if got != want:
            raise CheckpointError(
                f"checkpoint {path}: file {name} has sha256 {got[:12]}..., the manifest says {want[:12]}..."
            )
    return CheckpointInfo(step, path, world, groups)


def latest_valid(directory: Path | str) -> CheckpointInfo | None:
    """The newest checkpoint under `directory` that verifies; each newer one skipped is logged and
    counted. Read-only: a checkpoint a commit left aside and did not put back (it stopped between
    its two renames) is found where it lies, `.step_<n>.replaced`; a Checkpointer's load and prune
    put it back (renaming here could break a commit running in another process)."""
    directory = Path(directory)
    for step, path in sorted(_steps(directory, aside=True), reverse=True):
        try:
            return verify(path)
        except CheckpointError as exc:
            log.warning("checkpoint skipped", path=str(path), step=step, reason=str(exc))
            telemetry.count("torchhal.checkpoint.skipped")
    return None


class Checkpointer:
    """Saves and restores one training job's checkpoints under `directory`.

    Collective: every rank makes one (it creates a gloo group of all ranks, so DCP's planning and
    torchhal's commit never interleave with training collectives, even while an async save runs
    in the background) and calls `save`/`wait`/`load`/`close` at the same points. Without a
    default process group it works in this process alone. The device whose RNG state is saved is
    `ctx.device`; without a ctx, the device the model's parameters and buffers are on (the first
    of several, said once and counted each save: `torchhal.checkpoint.rng_devices_not_saved`).
    """

    def __init__(
        self,
        directory: Path | str,
        ctx: DistContext | None = None,
        *,
        keep: int = 3,
        timeout: timedelta | None = None,
    ) -> None:
        if keep < 1:
            raise InvalidArgumentError(f"Checkpointer: keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.device = ctx.device if ctx is not None else None
        self._group: dist.ProcessGroup | None = None
        if dist.is_initialized():
            limit = timeout or (ctx.communicator.timeout if ctx is not None else None)
            self._group = dist.new_group(backend="gloo", timeout=limit)
        self.rank = dist.get_rank() if self._group is not None else 0
        self.world_size = dist.get_world_size() if self._group is not None else 1
        self._alone = self._group is None  # no process group: DCP reads and writes in this process only
        self._pending: tuple[int, Path, Future[Any], list[int]] | None = None
        self._said_devices = False
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)

    # -- save ----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None = None,
        data: Stateful | None = None,
        scheduler: Stateful | None = None,
        blocking: bool = True,
    ) -> CheckpointInfo | None:
        """Checkpoint the state after `step` optimizer steps. `blocking=False` uses `dcp.async_save`:
        the state is staged now and written in the background; the next `save`, `wait` or `load`
        commits it. Returns the committed checkpoint (None while an async save is in flight).
        `data` is this rank's data loader, whose `state_dict()` is saved for this rank (every
        rank passes its own, or none does); `scheduler` the learning-rate scheduler (rank 0's
        state is saved: every rank steps the same one)."""
        if step < 0:
            raise InvalidArgumentError(f"Checkpointer.save: step must be >= 0, got {step}")
        data_state = (
            None if data is None else _serialised_state(data, "data", "torchdata's StatefulDataLoader")
        )
        scheduler_state = (
            None if scheduler is None else _serialised_state(scheduler, "scheduler", "torch's LRScheduler")
        )
        self.wait()
        self._check_every_rank_passes_data(data is not None)
        tmp = self.directory / f".step_{step}.tmp"
        self._on_rank0(f"removal of the stale temporary checkpoint {tmp}", lambda: _remove_stale(tmp))
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save(rng_state(self._rng_device(model)), tmp / f"rng_rank{self.rank}.pt")
        if data_state is not None:
            (tmp / _data_file(self.rank)).write_bytes(data_state)
        if scheduler_state is not None and self.rank == 0:
            (tmp / SCHEDULER_FILE).write_bytes(scheduler_state)
        state = _training_state(model, optimizer, scaler, step, fresh=not optimizer.state)
        groups = [len(group["params"]) for group in optimizer.param_groups]
        with telemetry.span("torchhal.checkpoint.save", step=step, blocking=blocking, rank=self.rank):
            if blocking:
                with _dcp_errors("save of step", step, tmp):
                    dcp.save(state, checkpoint_id=tmp, process_group=self._group, no_dist=self._alone)
                return self._commit(step, tmp, groups)
            with _dcp_errors("save of step", step, tmp):
                future = dcp.async_save(
                    state, checkpoint_id=tmp, process_group=self._group, no_dist=self._alone
                )
            self._pending = (step, tmp, _as_future(future), groups)
        log.info("async checkpoint staged", step=step, rank=self.rank)
        return None

    def wait(self) -> CheckpointInfo | None:
        """Finish and commit the async save in flight, if any."""
        if self._pending is None:
            return None
        step, tmp, future, groups = self._pending
        self._pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is no Exception
            raise CheckpointError(
                f"async checkpoint of step {step} into {tmp} failed: {error_line(exc)}"
            ) from exc
        return self._commit(step, tmp, groups)

    def _check_every_rank_passes_data(self, mine: bool) -> None:
        """`data=` on some ranks only would commit a checkpoint no `load(data=...)` can resume:
        refused on every rank, before anything is written."""
        if self._group is None:
            return
        passed: list[Any] = [None] * self.world_size
        dist.all_gather_object(passed, mine, group=self._group)
        if any(passed) and not all(passed):
            with_data = [rank for rank, given in enumerate(passed) if given]
            raise InvalidArgumentError(
                f"Checkpointer.save: data= was given on rank(s) {with_data} of {self.world_size}; "
                "every rank passes its own data loader, or none does"
            )

    def _commit(self, step: int, tmp: Path, groups: list[int]) -> CheckpointInfo:
        """After every rank wrote its files: manifest last, rename into place, prune old steps.
        Rank 0 does both and tells every rank how they went: a failure (a full disk at the
        rename) is a CheckpointError on every rank at once, where the others waited for it until
        the group's timeout."""
        self._barrier()
        final = step_dir(self.directory, step)

        def commit() -> None:
            files = {p.name: _sha256(p) for p in sorted(tmp.iterdir()) if p.is_file()}
            meta = {
                "format": FORMAT_VERSION,
                "step": step,
                "world_size": self.world_size,
                "files": files,
                "optimizer_groups": groups,
            }
            (tmp / MANIFEST).write_text(json.dumps(meta, indent=1, sort_keys=True))
            _rename_replacing(tmp, final)

        self._on_rank0(f"commit of the checkpoint of step {step} into {final}", commit)
        self._on_rank0(
            f"pruning beside the checkpoint of step {step} (committed at {final})",
            lambda: self._prune(step),
        )
        log.info("checkpoint committed", step=step, path=str(final), rank=self.rank)
        telemetry.count("torchhal.checkpoint.saved")
        return CheckpointInfo(step, final, self.world_size, groups)

    def _prune(self, newest: int) -> None:
        """Keep the checkpoint just committed and the `keep - 1` before it. Checkpoints of later
        steps belong to a timeline this run abandoned when it resumed from an earlier one (a
        rollback past a loss spike): they are set aside as `superseded_step_<n>_by_<newest>`,
        kept for inspection but never resumed from, since `latest_valid` would have preferred
        them after the next crash and silently undone the rollback. A checkpoint an interrupted
        commit left aside as `.step_<n>.replaced` without a `step_<n>` is put back first."""
        _recover_replaced(self.directory)
        steps = sorted(_steps(self.directory), reverse=True)
        for step, path in steps:
            if step > newest:
                aside = path.with_name(f"superseded_step_{step}_by_{newest}")
                if aside.exists():  # a second rollback to the same step: the newer copy stays
                    log.warning("superseded checkpoint replaced", path=str(aside))
                    shutil.rmtree(aside)
                path.rename(aside)
                log.warning(
                    "checkpoint of a later step set aside: this run resumed from an earlier one",
                    committed=newest,
                    step=step,
                    moved_to=str(aside),
                )
                telemetry.count("torchhal.checkpoint.superseded")
        for step, path in [(s, p) for s, p in steps if s <= newest][self.keep :]:
            shutil.rmtree(path)
            log.info("old checkpoint removed", step=step, path=str(path), keep=self.keep)
        # set-aside timelines are kept for inspection, `keep` of them, newest rollback first:
        # each is a whole checkpoint, and rollbacks would otherwise fill the disk without a word
        set_aside = sorted(
            (
                (int(m.group(2)), int(m.group(1)), p)
                for p in self.directory.iterdir()
                if (m := _SUPERSEDED.match(p.name))
            ),
            reverse=True,
        )
        for _, _, path in set_aside[self.keep :]:
            shutil.rmtree(path)
            log.info("old superseded checkpoint removed", path=str(path), keep=self.keep)
        for child in self.directory.iterdir():
            match = _TMP_DIR.match(child.name)
            if match and int(match.group(1)) < newest:
                shutil.rmtree(child)
                log.info("abandoned temporary checkpoint removed", path=str(child))
            elif _REPLACED_DIR.match(child.name):  # its step_<n> is in place: the older copy
                shutil.rmtree(child)
                log.info("replaced checkpoint left by an interrupted commit removed", path=str(child))

    # -- load ----------------------------------------------------------------------------------

    def load(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scaler: torch.amp.GradScaler | None = None,
        data: Stateful | None = None,
        scheduler: Stateful | None = None,
        path: Path | str | None = None,
    ) -> CheckpointInfo | None:
        """Restore the newest valid checkpoint (or `path`) into `model`, `optimizer`, `scaler`, the
        RNGs, this rank's data loader `data` and the learning-rate `scheduler`; None when there is
        none. Rank 0 chooses, so every rank loads the same step (a checkpoint it finds incomplete
        is a CheckpointError on every rank). Refused before anything is loaded: a checkpoint of
        another model (keys, shapes, dtypes), of another optimizer layout (parameter groups, or
        state for parameters the optimizer does not hold), without this rank's loader state when
        `data` is given (saved without it, or by another world size), without a scaler or
        scheduler state when `scaler` or `scheduler` is. The optimizer gets the state the
        checkpoint holds, for the parameters that had it, and the saved hyperparameters of each
        group; it is never stepped (torch's `set_state_dict` steps a fresh one at learning rate 0
        to make its state, running its step hooks). A saved loader, scaler or scheduler state
        that load is not given is left unused (logged and counted), as are RNG states of another
        world size or device type. A loader or scheduler that refuses its state, or a DCP load
        that fails, leaves them and a fresh optimizer as they were."""
        if data is not None:
            _check_stateful(data, "Checkpointer.load", "data", "torchdata's StatefulDataLoader")
        if scheduler is not None:
            _check_stateful(scheduler, "Checkpointer.load", "scheduler", "torch's LRScheduler")
        self.wait()
        where = path if path is not None else self.directory
        info: CheckpointInfo | None = self._on_rank0(
            f"choice of the checkpoint to load from {where}",
            lambda: verify(path) if path is not None else self._latest(),
        )
        if info is None:
            log.info("no valid checkpoint to resume from", directory=str(self.directory))
            return None
        data_state = self._data_state(info, data)
        wants_scaler = scaler is not None and bool(scaler.state_dict())  # a disabled scaler has none
        metadata = dcp.FileSystemReader(info.path).read_metadata()
        model_state = get_model_state_dict(model)
        _check_fits(info.path, metadata.state_dict_metadata, model_state, scaler=wants_scaler)
        _check_optimizer_groups(info, metadata.state_dict_metadata, optimizer)
        scheduler_state = _scheduler_state(info, scheduler)
        device = self._rng_device(model)
        rng = self._rng_to_restore(info, device)
        target = OptimizerTarget.of(info.path, metadata, model, optimizer)
        hyperparameters = self._saved_hyperparameters(info, target)
        # the loader and scheduler first: one that refuses its state finds everything as it was
        restored: list[tuple[Stateful, Any]] = []
        try:
            for stateful, saved in ((data, data_state), (scheduler, scheduler_state)):
                if stateful is not None:
                    before = stateful.state_dict()
                    stateful.load_state_dict(saved)
                    restored.append((stateful, before))
            state = self._load_training_state(info, model, model_state, optimizer, target, scaler)
            target.apply(optimizer, hyperparameters)
        except BaseException:
            for stateful, before in reversed(restored):
                stateful.load_state_dict(before)
            raise
        if scaler is not None:
            scaler.load_state_dict(state["scaler"])
        elif any(key.startswith("scaler.") for key in metadata.state_dict_metadata):
            _left_unused("scaler", "a fresh scaler starts at its initial scale", info.path, rank=self.rank)
        if rng is not None:
            set_rng_state(rng, device)
        log.info("checkpoint loaded", step=info.step, path=str(info.path), saved_world_size=info.world_size)
        return info

    def _saved_hyperparameters(
        self, info: CheckpointInfo, target: OptimizerTarget
    ) -> list[dict[str, Any]] | None:
        """The saved step and parameter groups, read (DCP's small values only) and checked against
        the manifest and the optimizer before anything is loaded; each of the optimizer's groups'
        saved hyperparameters, or None for a checkpoint of an earlier version saved fresh, which
        holds none (logged, counted)."""
        small: dict[str, Any] = {"step": None}
        if target.saved_groups:
            small["optimizer"] = {"param_groups": target.saved_groups}
        with _dcp_errors("load of", info.step, info.path):
            dcp.load(small, checkpoint_id=info.path, process_group=self._group, no_dist=self._alone)
        if int(small["step"]) != info.step:
            raise CheckpointError(f"checkpoint {info.path}: holds step {small['step']}, manifest {info.step}")
        if not target.saved_groups:
            log.warning(
                "the checkpoint holds no optimizer hyperparameters (saved fresh by an earlier "
                "version): the optimizer keeps its own learning rate and the rest",
                path=str(info.path),
                rank=self.rank,
            )
            telemetry.count("torchhal.checkpoint.hyperparameters_not_restored")
            return None
        return target.match_groups(small["optimizer"]["param_groups"])

    def _load_training_state(
        self,
        info: CheckpointInfo,
        model: nn.Module,
        model_state: dict[str, Any],
        optimizer: torch.optim.Optimizer,
        target: OptimizerTarget,
        scaler: torch.amp.GradScaler | None,
    ) -> dict[str, Any]:
        """DCP's load of the model and of the optimizer state the checkpoint holds; the optimizer
        gets it afterwards (`OptimizerTarget.apply`)."""
        state: dict[str, Any] = {"model": model_state}
        if target.state:
            state["optimizer"] = {"state": target.state}
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        with telemetry.span("torchhal.checkpoint.load", step=info.step, rank=self.rank):
            try:
                with _dcp_errors("load of", info.step, info.path):
                    dcp.load(state, checkpoint_id=info.path, process_group=self._group, no_dist=self._alone)
            except CheckpointError as exc:
                raise target.refused(exc) from exc.__cause__
            set_model_state_dict(model, state["model"])
        return state

    def _data_state(self, info: CheckpointInfo, data: Stateful | None) -> Any:
        """This rank's saved loader state for `data`, read before anything is loaded. The decision
        rests on files every rank sees, so every rank refuses (or not) alike."""
        saved = [r for r in range(info.world_size) if (info.path / _data_file(r)).is_file()]
        if data is None:
            if saved:
                _left_unused("data", "the data starts where the loader is", info.path, rank=self.rank)
            return None
        if len(saved) != info.world_size:
            held = f"only for rank(s) {saved} of {info.world_size}" if saved else "none"
            raise CheckpointError(
                f"checkpoint {info.path} holds no data loader state ({held}): it was saved without "
                "data=, so the data position cannot be restored; load without data= to resume the "
                "model alone"
            )
        if info.world_size != self.world_size:
            raise CheckpointError(
                f"checkpoint {info.path}: its data loader states belong to the {info.world_size} ranks "
                f"that saved them, and this job has {self.world_size}; a loader's position does not "
                "reshard, so load without data= and position the data yourself"
            )
        return torch.load(info.path / _data_file(self.rank), weights_only=True)

    def _rng_device(self, model: nn.Module) -> Device | torch.device | None:
        """The device whose generator is checkpointed: ctx's, or without a ctx the one the model's
        tensors are on (None: the host's alone). The first of several is taken, said once."""
        if self.device is not None:
            return self.device
        found: list[torch.device] = []
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            if tensor.device.type not in ("cpu", "meta") and tensor.device not in found:
                found.append(tensor.device)
        if len(found) > 1:
            telemetry.count("torchhal.checkpoint.rng_devices_not_saved")
            if not self._said_devices:
                self._said_devices = True
                log.warning(
                    "the model's tensors are on several devices and the Checkpointer has no ctx: the "
                    "RNG state of the first alone is checkpointed",
                    devices=[str(d) for d in found],
                    saved=str(found[0]),
                )
        return found[0] if found else None

    def _rng_to_restore(
        self, info: CheckpointInfo, device: Device | torch.device | None
    ) -> dict[str, Any] | None:
        """This rank's saved RNG states, read before anything is loaded; None (logged, counted)
        where they cannot apply: another world size, or another device type (a checkpoint of a
        GPU run resumed on the host: its host generators alone would leave the run's random
        stream half restored)."""
        file = info.path / f"rng_rank{self.rank}.pt"
        saved: dict[str, Any] | None = torch.load(file, weights_only=True) if file.is_file() else None
        off_host = _off_host(device)
        here = off_host[0] if off_host is not None else "cpu"
        saved_type = saved.get("device_type", "cpu") if saved is not None else None
        if info.world_size == self.world_size and saved is not None and saved_type == here:
            return saved
        why = (
            "another world size"
            if info.world_size != self.world_size or saved is None
            else "another device type"
        )
        log.warning(
            f"RNG states not restored: the checkpoint was saved at {why}",
            path=str(info.path),
            saved_world_size=info.world_size,
            world_size=self.world_size,
            saved_device_type=saved_type,
            device_type=here,
            rank=self.rank,
        )
        telemetry.count("torchhal.checkpoint.rng_not_restored")
        return None

    def _latest(self) -> CheckpointInfo | None:
        """`latest_valid`, after putting back what an interrupted commit left aside (rank 0 of the
        job that writes here: no commit of its own runs meanwhile)."""
        _recover_replaced(self.directory)
        return latest_valid(self.directory)

    def _on_rank0(self, what: str, work: Callable[[], _T]) -> _T:
        """`work` done by rank 0 alone (the shared directory's commit and pruning, the choice of
        the checkpoint to load), its result given to every rank. Where it raised, every rank
        raises a CheckpointError naming `what` and rank 0's error (a CheckpointIOError where that
        was an OSError), at once: the others waited for rank 0 until the group's timeout and got
        gloo's "Timed out ... recv", naming nothing."""
        outcome: list[Any] = [None]
        cause: Exception | None = None
        if self.rank == 0:
            try:
                outcome[0] = (True, work())
            except Exception as exc:
                cause = exc
                outcome[0] = (False, error_line(exc), isinstance(exc, OSError))
        if self._group is not None:
            dist.broadcast_object_list(outcome, src=0, group=self._group)
        if outcome[0][0]:
            return cast(_T, outcome[0][1])  # work()'s result, broadcast from rank 0
        _, reason, os_error = outcome[0]
        error = CheckpointIOError if os_error else CheckpointError
        raise error(f"{what} failed on rank 0: {reason}") from cause

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Commit a pending async save and destroy the checkpoint group."""
        self.wait()
        if self._group is not None and dist.is_initialized():
            dist.destroy_process_group(self._group)
        self._group = None

    def _barrier(self) -> None:
        if self._group is not None:
            dist.barrier(group=self._group)


def _off_host(device: Device | torch.device | None) -> tuple[str, int | None] | None:
    """(device type, index) of a device off the host, a HAL Device or a torch.device; else None."""
    if device is None:
        return None
    if isinstance(device, torch.device):
        return None if device.type == "cpu" else (device.type, device.index)
    kind = device.torch_device.type
    return None if kind == "cpu" else (kind, device.index)


def rng_state(device: Device | torch.device | None) -> dict[str, Any]:
    """torch's CPU generator state, `device`'s generator when its tensors live off the host, and
    Python's and NumPy's global generators, which data pipelines draw from (shuffles, crops)."""
    numpy_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {  # weights_only loading takes tensors and plain values, not ndarrays
            "bit_generator": numpy_state["bit_generator"],
            "key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
            "pos": numpy_state["state"]["pos"],
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        },
    }
    off_host = _off_host(device)
    if off_host is not None:
        kind, index = off_host
        module = torch.get_device_module(kind)
        state["device_type"] = kind
        state["device"] = module.get_rng_state() if index is None else module.get_rng_state(index)
    return state


def set_rng_state(state: dict[str, Any], device: Device | torch.device | None) -> None:
    torch.set_rng_state(state["cpu"])
    if "python" in state:  # checkpoints of earlier versions hold torch's generators only
        random.setstate(state["python"])
        saved = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": saved["bit_generator"],
                "state": {"key": saved["key"].numpy().astype(np.uint32), "pos": saved["pos"]},
                "has_gauss": saved["has_gauss"],
                "gauss": saved["gauss"],
            }
        )
    saved = state.get("device_type")
    off_host = _off_host(device)
    here = off_host[0] if off_host is not None else None
    if saved != here:
        raise ConfigurationError(
            f"RNG state: saved for device type {saved or 'host only'}, restoring on {here or 'host only'}"
        )
    if off_host is not None:
        kind, index = off_host
        module = torch.get_device_module(kind)
        if index is None:
            module.set_rng_state(state["device"])
        else:
            module.set_rng_state(state["device"], index)


def _data_file(rank: int) -> str:
    return f"data_rank{rank}.pt"


SCHEDULER_FILE = "scheduler.pt"


def _scheduler_state(info: CheckpointInfo, scheduler: Stateful | None) -> Any:
    """The saved scheduler state for `scheduler`, read before anything is loaded."""
    file = info.path / SCHEDULER_FILE
    if scheduler is None:
        if file.is_file():
            _left_unused("scheduler", "a fresh scheduler starts its schedule again", info.path)
        return None
    if not file.is_file():
        raise CheckpointError(
            f"checkpoint {info.path} holds no learning-rate scheduler state (saved without scheduler=); "
            "load without scheduler= and position the schedule yourself"
        )
    return torch.load(file, weights_only=True)


def _left_unused(argument: str, consequence: str, path: Path, **where: Any) -> None:
    """Log and count a saved state that `load` was not given the object for (`argument`=)."""
    log.warning(
        f"{argument} state not restored: load got no {argument}=, so {consequence}, not where the "
        "checkpoint left it",
        path=str(path),
        **where,
    )
    telemetry.count(f"torchhal.checkpoint.{argument}_not_restored")


def _check_stateful(value: object, where: str, name: str, example: str) -> None:
    missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(value, m, None))]
    if missing:
        raise InvalidArgumentError(
            f"{where}: {name} must have state_dict() and load_state_dict() (as {example}), "
            f"got {type(value).__name__} without {', '.join(missing)}"
        )


def _serialised_state(value: Stateful, name: str, example: str) -> bytes:
    """`value.state_dict()` as bytes, read back now as `load` will read it (`weights_only`), so a
    state that could not be restored fails this save, not the resume after a crash."""
    _check_stateful(value, "Checkpointer.save", name, example)
    state, buffer = value.state_dict(), io.BytesIO()
    try:
        torch.save(state, buffer)
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if "Unpickler error" in line), str(exc))
        raise InvalidArgumentError(
            f"Checkpointer.save: the state_dict() of {name} ({type(value).__name__}) cannot be saved and "
            f"read back with torch.load(weights_only=True): {reason}; keep it to tensors, numbers, "
            "strings and containers, or allowlist its types (torch.serialization.add_safe_globals)"
        ) from exc
    return buffer.getvalue()


FRESH_OPTIMIZER = "optimizer_fresh"
"""The key a checkpoint of an optimizer without state holds (beside its parameter groups)."""


def _training_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler | None,
    step: int,
    *,
    fresh: bool,
) -> dict[str, Any]:
    """What DCP saves. A `fresh` optimizer (one without state: before its first step, or SGD
    without momentum after any number) has its parameter groups in the checkpoint, laid out as
    torch's get_state_dict lays them (each group's hyperparameters and its parameters' names), and
    no state: get_state_dict would make its state by stepping it (at learning rate 0, with zero
    gradients), which moves Adam's step count and Rprop's step sizes and runs every step hook."""
    state: dict[str, Any] = {"step": step}
    if fresh:
        state["model"], state[FRESH_OPTIMIZER] = get_model_state_dict(model), True
        names = optimizer_names(model, optimizer)
        state["optimizer"] = {
            "param_groups": [
                {**{k: v for k, v in group.items() if k != "params"}, "params": list(group_names)}
                for group, group_names in zip(optimizer.param_groups, names, strict=True)
            ]
        }
    else:
        state["model"], state["optimizer"] = get_state_dict(model, optimizer)
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    return state


def _check_optimizer_groups(
    info: CheckpointInfo, metadata: Mapping[str, Any], optimizer: torch.optim.Optimizer
) -> None:
    """Refuse a checkpoint of another parameter-group layout, as Optimizer.load_state_dict does:
    DCP would give every group the saved first group's hyperparameters, silently (the biases of a
    decay/no-decay split then decayed, at the weights' learning rate)."""
    here = [len(group["params"]) for group in optimizer.param_groups]
    saved: list[Any] | None = info.optimizer_groups
    if saved is None:  # checkpoints before the manifest listed them: the group count from DCP's keys
        indices = {int(m.group(1)) for key in metadata if (m := _GROUP_KEY.match(key))}
        if not indices or len(indices) == len(here):
            return
        saved = [f"{len(indices)} groups"]
    if saved != here:
        raise CheckpointError(
            f"checkpoint {info.path} does not fit the optimizer: its parameter groups hold {saved} "
            f"parameters, the optimizer's {here}; make the optimizer with the groups it was saved with"
        )


_GROUP_KEY = re.compile(r"^optimizer\.param_groups\.(\d+)\.")


def _remove_stale(tmp: Path) -> None:
    if tmp.exists():
        log.warning("stale temporary checkpoint removed", path=str(tmp))
        shutil.rmtree(tmp)


def _recover_replaced(directory: Path) -> None:
    """Put back each checkpoint a commit moved aside (`.step_<n>.replaced`, a step saved again) and
    did not replace, as it stopped between its two renames: the next prune deleted it. Run by a
    Checkpointer's load and prune, not by `latest_valid`, which only finds it. Logged and
    counted; one that cannot be put back (read-only storage) is logged and left."""
    if not directory.is_dir():
        return
    for child in sorted(directory.iterdir()):
        match = _REPLACED_DIR.match(child.name)
        if not match or not child.is_dir():
            continue
        final = step_dir(directory, int(match.group(1)))
        if final.exists():
            continue
        try:
            child.rename(final)
        except FileNotFoundError:  # another process put it back first
            continue
        except OSError as exc:
            log.error(
                "a checkpoint an interrupted commit left aside could not be put back",
                path=str(child),
                reason=error_line(exc),
            )
            continue
        log.warning(
            "checkpoint left aside by an interrupted commit put back",
            path=str(final),
            step=int(match.group(1)),
        )
        telemetry.count("torchhal.checkpoint.replaced_recovered")


def _rename_replacing(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (the same step saved again) is moved aside
    first and deleted only once the new one is in place, so a failed rename keeps it."""
    if not final.exists():
        tmp.rename(final)
        return
    old = final.with_name(f".{final.name}.replaced")
    if old.exists():
        shutil.rmtree(old)
    final.rename(old)
    try:
        tmp.rename(final)
    except BaseException:
        old.rename(final)
        raise
    shutil.rmtree(old)
    log.warning("existing checkpoint of the same step replaced", path=str(final))


@contextlib.contextmanager
def _dcp_errors(what: str, step: int, path: Path) -> Iterator[None]:
    """DCP's CheckpointException (a BaseException, which `except Exception` misses) as a
    CheckpointError naming the step, the path and each failing rank's error."""
    try:
        yield
    except CheckpointException as exc:
        raise CheckpointError(f"checkpoint {what} {step} at {path} failed: {error_line(exc)}") from exc


def _check_fits(
    path: Path, metadata: Mapping[str, Any], model_state: dict[str, Any], *, scaler: bool
) -> None:
    """Refuse a checkpoint of another model before anything is loaded, naming the keys, shapes and
    dtypes that differ. DCP loads only the keys the model asks for, so a checkpoint holding more (a bigger
    model) would load in part, silently; a shape mismatch was DCP's traceback inside another, as
    was a gradient scaler asked for but not saved. Every rank reads the same metadata, so every
    rank refuses alike."""
    if scaler and not any(key.startswith("scaler.") for key in metadata):
        raise CheckpointError(
            f"checkpoint {path} holds no gradient scaler state (saved without scaler=); load without "
            "scaler= and start a fresh one"
        )
    saved = {
        key.removeprefix("model."): (tuple(meta.size), meta.properties.dtype)
        for key, meta in metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    here = {
        key: (tuple(value.shape), value.dtype)
        for key, value in model_state.items()
        if isinstance(value, torch.Tensor)
    }
    both = sorted(here.keys() & saved.keys())
    shapes = [f"{k!r}: saved {saved[k][0]}, model {here[k][0]}" for k in both if saved[k][0] != here[k][0]]
    dtypes = [
        f"{k!r}: saved {dtype_name(saved[k][1])}, model {dtype_name(here[k][1])}"
        for k in both
        if saved[k][0] == here[k][0] and saved[k][1] != here[k][1]
    ]
    only_model, only_saved = (
        [repr(k) for k in sorted(a.keys() - b.keys())] for a, b in ((here, saved), (saved, here))
    )
    if not (shapes or dtypes or only_model or only_saved):
        return
    problems = [
        f"{len(items)} {what} ({'; '.join(items[:5])}{'; ...' if len(items) > 5 else ''})"
        for what, items in (
            ("shape(s) differ", shapes),
            ("dtype(s) differ", dtypes),
            ("key(s) only in the model", only_model),
            ("key(s) only in the checkpoint", only_saved),
        )
        if items
    ]
    hint = (
        "; DCP would cast the saved values to the model's dtypes, silently (fp32 weights rounded to "
        "bf16): cast the model to the checkpoint's dtypes before load (model.to(dtype)) and cast it "
        "after, if it is to train in another"
        if dtypes
        else ""
    )
    raise CheckpointError(f"checkpoint {path} does not fit the model: {', '.join(problems)}{hint}")


def _steps(directory: Path, *, aside: bool = False) -> list[tuple[int, Path]]:
    """The committed steps' directories; with `aside`, also each `.step_<n>.replaced` whose
    `step_<n>` is missing (an interrupted commit's, see `_recover_replaced`)."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _STEP_DIR.match(child.name) or (_REPLACED_DIR.match(child.name) if aside else None)
        if match and child.is_dir():
            step = int(match.group(1))
            if match.re is _STEP_DIR or not step_dir(directory, step).exists():
                found.append((step, child))
    return found


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _as_future(result: Any) -> Future[Any]:
    """`dcp.async_save` returns a Future, or (newer torch, some stagers) a response holding one."""
    if isinstance(result, Future):
        return result
    upload = getattr(result, "upload_completion", None)
    if isinstance(upload, Future):
        return upload
    raise CheckpointError(f"dcp.async_save returned {type(result).__name__}, which holds no Future")
