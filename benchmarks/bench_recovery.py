"""Time from a failed rank to training resumed: detection + restart + checkpoint load, phase by phase.

The launcher runs this script under `torchrun --standalone --nproc-per-node 2 --max-restarts 1`
(with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, see torchhal.distributed.elastic). Each worker trains
the example's tiny GPT (sized by the flags) with DDP through torchhal.distributed, checkpointing
every step with DCP; in generation 0, rank 1 fails after step `--fault-at`: `kill` (SIGKILL: the
agent sees the exit) or `hang` (sleeps: the survivor's collective times out, the health monitor
names the hung rank, the survivor exits, the agent restarts everyone). NCCL's watchdog is
configured so a hang cannot outlive the short process-group timeout:
TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (abort communicators and tear the process down on a timeout),
TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC (the watchdog's own heartbeat, default 480 s), and
`--pg-timeout` seconds for every collective. Phases printed (seconds, wall clock of one host):
detect+restart (fault -> restarted process starts), import (interpreter + torch + torchhal),
process group (rendezvous + communicator init), model build (+ DDP), checkpoint load, first step,
and the total.

    python benchmarks/bench_recovery.py --fault kill --out recovery_kill.json     # 2 GPUs, NCCL
    python benchmarks/bench_recovery.py --fault hang --out recovery_hang.json
    python benchmarks/bench_recovery.py --fault kill --dim 64 --layers 2 --vocab 64  # CPU smoke, gloo
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: the restarted process's first instant

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from datetime import datetime, timedelta, timezone  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from torchhal import distributed as thd  # noqa: E402
from torchhal.distributed.elastic import ElasticJob, torchrun_command, torchrun_env  # noqa: E402
from torchhal.hal_core import CollectiveError  # noqa: E402

IMPORTED = time.time()
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_tiny_gpt.py"
WATCHDOG_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_ENABLE_MONITORING": "1"}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fault", choices=("kill", "hang"), default="kill")
    p.add_argument("--fault-at", type=int, default=5, help="rank 1 fails after this many steps")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--pg-timeout", type=float, default=10.0, help="process-group (collective) timeout, s")
    p.add_argument("--heartbeat-deadline", type=float, default=5.0)
    p.add_argument("--watchdog-heartbeat", type=int, default=20, help="TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    p.add_argument("--async-save", action="store_true", help="checkpoint with dcp.async_save")
    p.add_argument("--workdir", type=Path, help="checkpoints and per-rank timings (default: a temp dir)")
    p.add_argument("--out", type=Path, help="JSON results")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def launch(args: argparse.Namespace) -> None:
    work = args.workdir or Path(tempfile.mkdtemp(prefix="torchhal_recovery_"))
    work.mkdir(parents=True, exist_ok=True)
    forwarded = [a for a in sys.argv[1:] if a != "--worker"]
    cmd = torchrun_command(
        Path(__file__), [*forwarded, "--worker", "--workdir", str(work)], nproc_per_node=2, max_restarts=1
    )
    env = torchrun_env(
        {**os.environ, **WATCHDOG_ENV, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(args.watchdog_heartbeat)}
    )
    started = time.time()
    code = subprocess.run(cmd, env=env, check=False).returncode
    if code != 0:
        raise SystemExit(f"torchrun exited {code}; worker timings in {work}")
    fault = json.loads((work / "fault.json").read_text())
    ranks = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    resumed = ranks[0]
    if resumed["generation"] != 1:
        raise SystemExit(f"expected the job to finish in generation 1, got {resumed['generation']}")
    t = resumed["times"]
    phases = {
        "detect_and_restart_s": t["started"] - fault["time"],
        "import_s": t["imported"] - t["started"],
        "process_group_s": t["joined"] - t["imported"],
        "model_build_s": t["built"] - t["joined"],
        "checkpoint_load_s": t["loaded"] - t["built"],
        "first_step_s": t["first_step"] - t["loaded"],
        "total_s": t["first_step"] - fault["time"],
    }
    print(f"fault {args.fault} of rank 1 after step {args.fault_at}; resumed from {resumed['resumed_step']}")
    mb = resumed["checkpoint_bytes"] / 1e6
    print(f"device {resumed['device']}, backend {resumed['backend']}, checkpoint {mb:.1f} MB")
    for name, seconds in phases.items():
        print(f"  {name:24s} {seconds:8.2f}")
    if args.out is not None:
        report = {
            "benchmark": "recovery",
            "date": datetime.now(timezone.utc).isoformat(),
            "host": platform.node(),
            "torch": torch.__version__,
            "args": {k: str(v) for k, v in vars(args).items()},
            "fault": fault,
            "phases_s": phases,
            "ranks": ranks,
            "wall_s": time.time() - started,
        }
        args.out.write_text(json.dumps(report, indent=2))


def worker(args: argparse.Namespace) -> None:
    spec = importlib.util.spec_from_file_location("train_tiny_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpt)
    data = gpt.parse_args(
        [
            "--vocab",
            str(args.vocab),
            "--dim",
            str(args.dim),
            "--layers",
            str(args.layers),
            "--heads",
            str(args.heads),
            "--seq-len",
            str(args.seq_len),
            "--global-batch",
            str(args.global_batch),
        ]
    )
    job = ElasticJob.start(
        args.workdir / "ckpt",
        timeout=timedelta(seconds=args.pg_timeout),
        keep=2,
        heartbeat_deadline=args.heartbeat_deadline,
        heartbeat_interval=min(0.5, args.heartbeat_deadline / 4),
    )
    joined = time.time()
    ctx = job.ctx
    torch.manual_seed(data.seed)
    model = gpt.TinyGPT(data.vocab, data.dim, data.layers, data.heads, data.seq_len)
    prepared = thd.prepare(model, lambda p: torch.optim.AdamW(p, lr=1e-4), ctx=ctx, strategy="ddp")
    built = time.time()
    first = job.resume(prepared.model, prepared.optimizer, prepared.scaler)
    loaded = time.time()
    share = data.global_batch // ctx.world_size
    rows = slice(ctx.rank * share, (ctx.rank + 1) * share)
    device = ctx.device.torch_device
    batches = (
        tuple(t[rows].to(device) for t in gpt.global_batch(step, data)) for step in range(first, args.steps)
    )
    save = job.on_step(prepared.model, prepared.optimizer, prepared.scaler, blocking=not args.async_save)
    times = {"started": STARTED, "imported": IMPORTED, "joined": joined, "built": built, "loaded": loaded}

    def on_step(stats: thd.StepStats) -> None:
        if "first_step" not in times:
            times["first_step"] = time.time()
        save(stats)
        if job.generation == 0 and ctx.rank == 1 and stats.step + 1 == args.fault_at:
            (args.workdir / "fault.json").write_text(json.dumps({"fault": args.fault, "time": time.time()}))
            if args.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(60)

    try:
        with job.monitor.guard():
            thd.train(
                prepared.model,
                prepared.optimizer,
                batches,
                steps=args.steps - first,
                ctx=ctx,
                policy=prepared.policy,
                scaler=prepared.scaler,
                clip_grad_norm=1.0,
                first_step=first,
                on_step=on_step,
            )
    except CollectiveError as exc:
        print(f"rank {ctx.rank} generation {job.generation}: {exc}", file=sys.stderr, flush=True)
        os._exit(3)  # the process group is broken: let the agent restart the job
    newest = thd.latest_valid(args.workdir / "ckpt")
    size = sum(f.stat().st_size for f in newest.path.iterdir()) if newest is not None else 0
    report = {
        "generation": job.generation,
        "resumed_step": job.resumed_step,
        "device": ctx.device.id,
        "backend": ctx.backend,
        "checkpoint_bytes": size,
        "times": times,
    }
    (args.workdir / f"rank{ctx.rank}.json").write_text(json.dumps(report, indent=2))
    job.close()


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
