"""Data-parallel scaling of a random-initialised ~1B-parameter Llama: 1 GPU against 2 with DDP and FSDP2.

Four phases on every rank, each through torchhal.distributed (init, prepare, train) with the
precision policy the HAL chooses (bf16 on an H200): "local" (each GPU trains its own copy under
autocast over fp32 parameters: DDP's 1-GPU baseline, measured with both GPUs busy), "ddp",
"fsdp_alone" (each GPU runs FSDP2 on a one-rank sub-mesh: bf16 parameter copies as FSDP2 keeps
them, FSDP2's 1-GPU baseline) and "fsdp" (FSDP2 over all ranks, one unit per decoder layer).
Same micro-batch per GPU in every phase (weak scaling), so the scaling efficiency is tokens/s on
2 GPUs ÷ (2 × tokens/s of the strategy's own 1-GPU baseline). Peak memory per GPU is the
allocator's peak within the phase. Step time is wall time after the device synchronised
(median of the timed steps).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/bench_train_scaling.py --out scaling.json
Needs `transformers` (LlamaConfig, LlamaForCausalLM).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

from torchhal import distributed as thd

PHASES = ("local", "ddp", "fsdp_alone", "fsdp")
BASELINE = {"ddp": "local", "fsdp": "fsdp_alone"}  # each strategy against 1 GPU under its own precision


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches a step")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--phases", default=",".join(PHASES))
    p.add_argument("--out", help="JSON results (rank 0 writes)")
    return p.parse_args()


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq_len,
    )
    torch.manual_seed(0)  # the same initial model on every rank
    with device:  # initialise on the device: no host copy of a 4 GB model
        return LlamaForCausalLM(config)


def run_phase(ctx: thd.DistContext, args: argparse.Namespace, strategy: str) -> dict[str, Any]:
    device = ctx.device.torch_device
    torch.accelerator.memory.reset_peak_memory_stats(device.index)
    model = build_model(args, device)
    params = sum(p.numel() for p in model.parameters())
    mesh = None
    if strategy == "fsdp_alone":  # a (world, 1) mesh: this rank's sub-mesh along "alone" is itself
        mesh = thd.Mesh.create(ctx, (ctx.world_size, 1), ("replicas", "alone"))["alone"]
    prepared = thd.prepare(
        model,
        lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        ctx=ctx,
        strategy="fsdp" if strategy == "fsdp_alone" else strategy,
        mesh=mesh,
    )
    gen = torch.Generator(device=device).manual_seed(1000 + ctx.rank)
    total, accumulate = args.warmup + args.steps, args.gradient_accumulation_steps
    batches = (  # made as train() asks for them, as a loader would
        torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), device=device, generator=gen)
        for _ in range(total * accumulate)
    )
    stats = thd.train(
        prepared.model,
        prepared.optimizer,
        batches,
        steps=total,
        ctx=ctx,
        policy=prepared.policy,
        clip_grad_norm=1.0,
        scaler=prepared.scaler,
        loss_fn=lambda m, ids: m(input_ids=ids, labels=ids).loss,
        log_every=total,
        gradient_accumulation_steps=accumulate,
    )
    step_s = statistics.median(s.step_time_s for s in stats[args.warmup :])
    peak = torch.accelerator.memory.max_memory_allocated(device.index)
    mine = {
        "tokens_per_s": args.micro_batch * args.seq_len * accumulate / step_s,
        "step_s": step_s,
        "peak_memory_gib": peak / 2**30,
        "last_loss": stats[-1].loss,
    }
    per_rank = _gather(ctx, mine)
    precision = prepared.policy.report()
    del prepared, model
    gc.collect()
    torch.accelerator.memory.empty_cache()
    return {
        "strategy": strategy,
        "parameters": params,
        "precision": precision,
        "per_rank": per_rank,
        "tokens_per_s_per_gpu": statistics.mean(r["tokens_per_s"] for r in per_rank),
        "tokens_per_s_total": sum(r["tokens_per_s"] for r in per_rank),
        "peak_memory_gib_max": max(r["peak_memory_gib"] for r in per_rank),
    }


def _gather(ctx: thd.DistContext, value: dict[str, float]) -> list[dict[str, float]]:
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, value, group=ctx.communicator.group)
    return out


def main() -> None:
    args = parse_args()
    ctx = thd.init()
    phases = {name: run_phase(ctx, args, name) for name in args.phases.split(",")}
    for name, baseline in BASELINE.items():
        if name in phases and baseline in phases:
            one_gpu = phases[baseline]["tokens_per_s_per_gpu"]
            phases[name]["scaling_baseline"] = baseline
            total = phases[name]["tokens_per_s_total"]
            phases[name]["scaling_efficiency"] = total / (ctx.world_size * one_gpu)
    if ctx.is_main:
        for name, phase in phases.items():
            eff = phase.get("scaling_efficiency")
            print(
                f"{name:>10}: {phase['tokens_per_s_total']:10.0f} tokens/s on {ctx.world_size} GPU(s) "
                f"({phase['tokens_per_s_per_gpu']:.0f} per GPU), "
                f"peak {phase['peak_memory_gib_max']:.1f} GiB/GPU"
                + ("" if eff is None else f", scaling efficiency {eff:.3f} vs {phase['scaling_baseline']}"),
                flush=True,
            )
        if args.out:
            report = {
                "benchmark": "train_scaling",
                "command": f"torchrun --nproc-per-node {ctx.world_size} " + " ".join(sys.argv),
                "date": datetime.now(timezone.utc).isoformat(),
                "host": platform.node(),
                "torch_version": torch.__version__,
                "device": ctx.device.capabilities.name,
                "backend": ctx.backend,
                "world_size": ctx.world_size,
                "config": {k: v for k, v in vars(args).items() if k != "out"},
                "peer": "local / fsdp_alone: each GPU training alone (the 1-GPU baselines), same run",
                "phases": phases,
            }
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    ctx.shutdown()


if __name__ == "__main__":
    main()
