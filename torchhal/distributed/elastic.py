"""Elastic restart under torchrun: each restart rebuilds the process group under a new generation
and resumes from the newest valid checkpoint.

torchrun (`--max-restarts N`) is the restart loop: when a worker dies, its agent stops the others
and starts them all again with TORCHELASTIC_RESTART_COUNT incremented. `ElasticJob.start()` is
what each (re)started worker calls: it joins the rendezvous store, builds the process group and
the health monitor under the prefix `gen<restart count>` (so no key written by the failed
generation, a heartbeat of a dead rank or a process-group handshake, is read by the new one),
and `resume()` loads `latest_valid` of the checkpoint directory.

With `--standalone` (c10d rendezvous), workers share the agent's TCPStore by default, and a
restarted generation can read the previous one's rendezvous keys and fail or hang on connect
(pytorch/pytorch#135712). `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` in torchrun's own environment
turns the sharing off, so every round gets a fresh store; `torchrun_env()` / `torchrun_command()`
set it. A worker cannot set it for its agent, so `start()` logs a warning when it finds itself
restarted on a shared store (the generation prefix still keeps the keys apart), and logs (info)
and counts the shared store on the first generation too.

The prefix does not keep two rounds apart when torchelastic restarts the workers for a membership
change (a node joined): that restart keeps TORCHELASTIC_RESTART_COUNT, so the new round reuses
`gen<n>` on the same shared store and would read the old round's keys (its process group's
addresses too: gloo then fails after its connect timeout). `start()` finds the old round's join
keys before it builds anything and raises a ConfigurationError that says so and names
`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`.

Arguments are checked before the rank joins; a failure after the process group was made stops
the monitor and destroys the groups, so a retry in the same process starts clean.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from torchhal.distributed.checkpoint import Checkpointer
from torchhal.distributed.health import HealthMonitor, check_timing
from torchhal.distributed.init import DistContext, init
from torchhal.hal_core import CollectiveError, ConfigurationError, InvalidArgumentError, telemetry
from torchhal.hal_core.process_groups import env_int

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store
    from torch.distributed.checkpoint.stateful import Stateful

    from torchhal.distributed.loop import StepStats
    from torchhal.hal_core import Device
    from torchhal.hal_core.hal import HardwareAbstractionLayer

log = telemetry.get_logger("torchhal.distributed.elastic")

SHARE_STORE_WORKAROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
"""torchrun's environment for restarts with `--standalone`: a fresh rendezvous store per round."""


def generation() -> int:
    """How many times torchrun restarted this job's workers (0 outside torchrun)."""
    value = env_int("TORCHELASTIC_RESTART_COUNT", default=0)
    if value < 0:
        raise ConfigurationError(f"TORCHELASTIC_RESTART_COUNT must be >= 0, got {value}")
    return value


def torchrun_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`base` (default: this process's environment) with the store-sharing workaround applied."""
    return {**(os.environ if base is None else base), **SHARE_STORE_WORKAROUND}


def torchrun_command(
    script: Path | str,
    args: Sequence[str] = (),
    *,
    nproc_per_node: int,
    max_restarts: int,
    monitor_interval: float = 0.1,
) -> list[str]:
    """`python -m torch.distributed.run --standalone ...` for `script`; run it with `torchrun_env()`."""
    if nproc_per_node < 1 or max_restarts < 0:
        raise InvalidArgumentError(
            f"torchrun_command: need nproc_per_node >= 1 and max_restarts >= 0, got {nproc_per_node}, "
            f"{max_restarts}"
        )
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc_per_node}",
        f"--max-restarts={max_restarts}",
        f"--monitor-interval={monitor_interval:g}",
        str(script),
        *args,
    ]


@dataclass
class ElasticJob:
    """One generation of an elastic job on this rank: its process group, health monitor and checkpoints."""

    ctx: DistContext
    generation: int
    checkpointer: Checkpointer
    monitor: HealthMonitor
    save_every: int
    resumed_step: int | None = field(default=None)

    @classmethod
    def start(
        cls,
        directory: Path | str,
        *,
        hal: HardwareAbstractionLayer | None = None,
        device: Device | str | None = None,
        timeout: timedelta = timedelta(seconds=30),
        keep: int = 3,
        save_every: int = 1,
        heartbeat_interval: float = 0.5,
        heartbeat_deadline: float = 5.0,
        join_timeout: timedelta = timedelta(seconds=300),
        on_failure: Callable[[CollectiveError], None] | None = None,
        store: Store | None = None,
        gen: int | None = None,
    ) -> ElasticJob:
        """Join generation `gen<TORCHELASTIC_RESTART_COUNT>` from torchrun's environment (collective).

        `timeout` bounds every collective, so keep it short: a hung peer then fails in seconds.
        Ranks (re)start at different speeds, so they first meet on the store within `join_timeout`;
        checkpoint collectives get `join_timeout` too, as ranks may take unequal time to write.
        Outside torchrun, pass the rendezvous `store` and the generation `gen` explicitly
        (RANK and WORLD_SIZE still come from the environment).
        """
        # everything the monitor and checkpointer would refuse, refused before this rank joins
        for name, value in (("save_every", save_every), ("keep", keep)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"ElasticJob: {name} must be an integer >= 1, got {value!r}")
        check_timing(
            heartbeat_interval,
            heartbeat_deadline,
            owner="ElasticJob (heartbeat_interval, heartbeat_deadline)",
        )
        gen = generation() if gen is None else gen
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            if gen > 0:
                log.warning(
                    "restarted on torchrun's shared rendezvous store; set "
                    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (see torchhal.distributed.elastic)",
                    generation=gen,
                )
                telemetry.count("torchhal.elastic.shared_store_restart")
            else:  # a membership change restarts this generation under the same prefix
                log.info(
                    "on torchrun's shared rendezvous store: a membership change would restart the "
                    "workers under this same generation and fail; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                    "for torchrun avoids it",
                    generation=gen,
                )
            telemetry.count("torchhal.elastic.shared_store")
        prefix = f"gen{gen}"
        store = store if store is not None else _rendezvous_store(join_timeout)
        _join(store, prefix, join_timeout)
        ctx = init(hal, device=device, store=store, prefix=prefix, timeout=timeout)
        monitor: HealthMonitor | None = None
        try:
            monitor = HealthMonitor(
                dist.PrefixStore(prefix + "/", store),
                rank=ctx.rank,
                world_size=ctx.world_size,
                interval=heartbeat_interval,
                deadline=heartbeat_deadline,
                on_failure=on_failure,
            ).start()
            checkpointer = Checkpointer(directory, ctx, keep=keep, timeout=join_timeout)
        except BaseException as exc:
            _undo_start(ctx, monitor, exc, prefix)
            raise
        log.info("elastic generation started", generation=gen, rank=ctx.rank, world_size=ctx.world_size)
        return cls(ctx, gen, checkpointer, monitor, save_every)

    def resume(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
        *,
        data: Stateful | None = None,
        scheduler: Stateful | None = None,
    ) -> int:
        """Load the newest valid checkpoint (with this rank's loader position and the scheduler's
        state where given, as `Checkpointer.load`); the step to continue from (0 for a fresh start)."""
        info = self.checkpointer.load(model, optimizer, scaler=scaler, data=data, scheduler=scheduler)
        self.resumed_step = None if info is None else info.step
        if info is not None:
            log.info("resumed", generation=self.generation, step=info.step, rank=self.ctx.rank)
            telemetry.count("torchhal.elastic.resumed")
        return 0 if info is None else info.step

    def on_step(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None = None,
        *,
        data: Stateful | None = None,
        scheduler: Stateful | None = None,
        blocking: bool = True,
    ) -> Callable[[StepStats], None]:
        """A `train(on_step=...)` callback: health checks every step, a checkpoint every `save_every`
        (with `data`'s position and `scheduler`'s state where given)."""

        def after(stats: StepStats) -> None:
            self.monitor.observe(stats)
            self.monitor.check()
            done = stats.step + 1
            if done % self.save_every == 0:
                self.checkpointer.save(
                    done, model, optimizer, scaler=scaler, data=data, scheduler=scheduler, blocking=blocking
                )

        return after

    def close(self) -> None:
        """Commit a pending checkpoint, stop the monitor, destroy the process groups. The monitor
        stops and the groups go even when the commit fails (its error is raised after)."""
        try:
            self.checkpointer.close()
        finally:
            try:
                self.monitor.stop()
            finally:
                self.ctx.shutdown()


def _undo_start(ctx: DistContext, monitor: HealthMonitor | None, exc: BaseException, prefix: str) -> None:
    """Stop the monitor and destroy the groups `start` made before `exc`; an error on the way is
    logged (the caller raises `exc`)."""
    telemetry.count("torchhal.elastic.start_undone")
    log.warning(
        "elastic start failed after the process group was made; stopping the monitor and destroying "
        "the groups",
        generation=prefix,
        rank=ctx.rank,
        error=f"{type(exc).__name__}: {exc}",
    )
    steps: list[tuple[str, Callable[[], None]]] = [("destroy the process groups", ctx.shutdown)]
    if monitor is not None:
        steps.insert(0, ("stop the health monitor", monitor.stop))
    for what, undo in steps:
        try:
            undo()
        except Exception as undo_exc:  # the start's own error is the one to raise
            telemetry.count("torchhal.elastic.undo_failed")
            log.error(
                f"elastic start: could not {what} after the start failed",
                generation=prefix,
                rank=ctx.rank,
                error=f"{type(undo_exc).__name__}: {undo_exc}",
            )


def _rendezvous_store(timeout: timedelta) -> Store:
    """The store torchrun's environment points at (the agent's, or one hosted by rank 0)."""
    missing = [n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(n)]
    if missing:
        raise ConfigurationError(
            f"ElasticJob.start needs torchrun's environment; missing {', '.join(missing)}"
        )
    rank, world = env_int("RANK", default=0), env_int("WORLD_SIZE", default=1)  # both set: checked above
    try:
        store: Store
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timeout))
    except (RuntimeError, ValueError) as exc:
        raise ConfigurationError(f"rendezvous through env:// (rank {rank} of {world}) failed: {exc}") from exc
    return store


def _join(store: Store, prefix: str, timeout: timedelta) -> None:
    """Wait (up to `timeout`) until every rank of the generation reached the store.

    The all-joined key is written only when the last rank adds itself, so finding it before this
    rank's add, or a count above the world size after it, means an earlier round of this
    generation wrote them: refused (see the module's note on membership changes)."""
    world = env_int("WORLD_SIZE", default=1)
    joined = dist.PrefixStore(prefix + "/", store)
    if joined.check(["torchhal_all_joined"]):
        _stale_generation(prefix, world, "its all-joined key was already set before this rank joined")
    count = joined.add("torchhal_joined", 1)
    if count > world:
        _stale_generation(prefix, world, f"this rank was number {count} to join a world of {world}")
    if count == world:
        joined.set("torchhal_all_joined", "1")
    try:
        joined.wait(["torchhal_all_joined"], timeout)
    except RuntimeError as exc:
        raise CollectiveError(
            f"generation {prefix}: not every one of {world} ranks joined within "
            f"{timeout.total_seconds():g} s ({count} had when this rank did): {exc}"
        ) from exc


def _stale_generation(prefix: str, world: int, found: str) -> None:
    rank = os.environ.get("RANK", "?")
    telemetry.count("torchhal.elastic.stale_generation")
    message = (
        f"generation {prefix} (rank {rank} of {world}): the rendezvous store already holds this "
        f"generation's keys from an earlier round ({found}), so this round would read that round's "
        "process-group keys and fail to connect. torchelastic restarts workers for a membership change "
        "without raising TORCHELASTIC_RESTART_COUNT, and its agent's shared TCPStore "
        f"(TORCHELASTIC_USE_AGENT_STORE={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}) outlives "
        "the round: launch torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment "
        "(torchhal.distributed.elastic.torchrun_env() sets it) so every round gets a fresh store; "
        "outside torchrun, pass a fresh store or another gen"
    )
    log.error("stale generation on the rendezvous store", generation=prefix, rank=rank, found=found)
    raise ConfigurationError(message)
