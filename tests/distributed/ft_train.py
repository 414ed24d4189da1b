"""One rank of a fault-tolerance test: trains the example's tiny GPT with checkpoints, injects a fault.

Run by `ft_launch` (RANK/WORLD_SIZE set, a FileStore under OUT) or by torchrun (env://):
    python ft_train.py OUT CKPT_DIR [--steps N] [--save-every S] [--fault kill|hang --fault-at K]
        [--collective-timeout SECONDS]
`--strategy fsdp` shards with FSDP2 instead of DDP. The fault fires only in generation 0, after
step K's checkpoint decision, on rank R: `kill` is a SIGKILL of the process, `hang` sleeps forever.
Every rank writes OUT/rank<r>.json: the generation, the step it resumed from, and either its
final parameters' file or the error it stopped with.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from torchhal import distributed as thd
from torchhal.distributed.elastic import ElasticJob
from torchhal.hal_core import CollectiveError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_gpt.py"
COLLECTIVE_TIMEOUT = timedelta(seconds=30)
"""Bounds every collective. A killed rank's peers hear of it at once (its sockets close), so the
kill worlds need no short bound, and a short one failed generation 0 under load on 2 cores before
it reached the fault; only a hung rank's peers wait for it, so the hang test passes HANG_TIMEOUT."""
HANG_TIMEOUT = timedelta(seconds=3)
HEARTBEAT_INTERVAL, HEARTBEAT_DEADLINE = 0.25, 2.0


def example():
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, by its name in the unwrapped model (DDP's `module.`, FSDP2's DTensors)."""
    inner = getattr(model, "module", model)
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in inner.state_dict().items()
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("ckpt", type=Path)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--fault", choices=("kill", "hang"))
    p.add_argument("--fault-at", type=int, default=5)
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--generation", type=int, help="outside torchrun: this launch's generation")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--strategy", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--collective-timeout", type=float, default=COLLECTIVE_TIMEOUT.total_seconds())
    return p.parse_args(argv)


def main() -> None:
    args = parse(sys.argv[1:])
    gpt = example()
    data = gpt.parse_args(
        ["--vocab", "32", "--dim", "32", "--heads", "2", "--seq-len", "12", "--global-batch", "8"]
    )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = None if args.generation is None else dist.FileStore(str(args.out / "store"), world)
    job = ElasticJob.start(
        args.ckpt,
        device="cpu",
        store=store,
        gen=args.generation,
        timeout=timedelta(seconds=args.collective_timeout),
        keep=2,
        save_every=args.save_every,
        heartbeat_interval=HEARTBEAT_INTERVAL,
        heartbeat_deadline=HEARTBEAT_DEADLINE,
    )
    ctx = job.ctx
    torch.manual_seed(data.seed)
    model = gpt.TinyGPT(data.vocab, data.dim, data.layers, data.heads, data.seq_len)
    prepared = thd.prepare(model, lambda p: torch.optim.AdamW(p, lr=data.lr), ctx=ctx, strategy=args.strategy)
    first = job.resume(prepared.model, prepared.optimizer)
    share = data.global_batch // world
    rows = slice(rank * share, (rank + 1) * share)
    batches = (tuple(t[rows] for t in gpt.global_batch(step, data)) for step in range(first, args.steps))
    checkpoint = job.on_step(prepared.model, prepared.optimizer, blocking=not args.async_save)

    def on_step(stats: thd.StepStats) -> None:
        checkpoint(stats)
        if args.fault and job.generation == 0 and rank == args.fault_rank and stats.step + 1 == args.fault_at:
            (args.out / "fault.json").write_text(json.dumps({"fault": args.fault, "time": time.time()}))
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(60)

    report = {"generation": job.generation, "resumed_step": job.resumed_step, "first_step": first}
    try:
        with job.monitor.guard():
            thd.train(
                prepared.model,
                prepared.optimizer,
                batches,
                steps=args.steps - first,
                ctx=ctx,
                policy=prepared.policy,
                clip_grad_norm=data.clip,
                first_step=first,
                on_step=on_step,
            )
    except CollectiveError as exc:
        report.update(error=str(exc), error_time=time.time())
        (args.out / f"rank{rank}.json").write_text(json.dumps(report))
        os._exit(3)  # the process group is broken: no orderly shutdown
    final = args.out / f"final_rank{rank}.pt"
    torch.save(full_state(prepared.model), final)
    report["final"] = str(final)
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    job.close()


if __name__ == "__main__":
    main()
