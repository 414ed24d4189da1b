"""Train a tiny GPT with torchhal.distributed on whatever devices the HAL finds, CPUs or GPUs.

    torchrun --nproc-per-node 2 examples/train_tiny_gpt.py --steps 20
    torchrun --nproc-per-node 2 examples/train_tiny_gpt.py --strategy fsdp --gradient-accumulation-steps 2
    TORCHHAL_PLUGINS=simasic torchrun --nproc-per-node 2 examples/train_tiny_gpt.py \
        --strategy hetero --devices cpu,simasic:0       # a CPU and a simulated ASIC in one job

The task is synthetic and quick to learn: each sequence continues x[t+1] = (5 x[t] + 3) mod vocab
from a random first token, so the loss falls from ln(vocab) within a few steps. The global batch of
each step is drawn from a generator seeded by (seed, step); every rank trains on its own rows
of it (an equal share under ddp/fsdp, a share proportional to its measured matmul throughput
under hetero). RMSNorm and attention run through torchhal.ops, so they dispatch to the rank's
HAL device. With --json-out DIR each rank writes DIR/rank<r>.json (reports and step stats).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import torchhal
from torchhal import distributed as thd


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The op wants one dtype; under autocast x may be bf16 while the weight stays fp32.
        return torchhal.ops.rms_norm(x, self.weight.to(x.dtype))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = (t.transpose(1, 2).contiguous() for t in qkv.unbind(2))  # (batch, heads, seq, head_dim)
        attn = torchhal.ops.attention(q, k, v, causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, seq, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tokens(idx) + self.positions(pos)
        for block in self.layers:
            x = block(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def global_batch(step: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole step's batch, the same on every rank: (inputs, next-token targets)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    seq = torch.empty(args.global_batch, args.seq_len + 1, dtype=torch.int64)
    seq[:, 0] = torch.randint(0, args.vocab, (args.global_batch,), generator=gen)
    for t in range(1, args.seq_len + 1):
        seq[:, t] = (5 * seq[:, t - 1] + 3) % args.vocab
    return seq[:, :-1], seq[:, 1:]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--strategy", choices=("ddp", "fsdp", "hetero"), default="ddp")
    p.add_argument("--devices", help="HAL device per local rank, comma-separated (default: the HAL's choice)")
    p.add_argument("--precision", choices=("auto", "bf16", "fp16", "fp32"), default="auto")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument(
        "--gradient-accumulation-steps",
        type=_at_least_one,
        default=1,
        help="micro-batches per step (split of each rank's rows)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block in backward instead of keeping its activations",
    )
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-method", help="rendezvous URL (default: torchrun's environment)")
    p.add_argument("--json-out", type=Path, help="directory for rank<r>.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hal = torchhal.ops.default_hal()
    ctx = thd.init(hal, device=_device_for_rank(args.devices), init_method=args.init_method)
    policy = thd.choose_precision(ctx.device, prefer=None if args.precision == "auto" else args.precision)
    torch.manual_seed(args.seed)  # every rank builds the same initial model
    model = TinyGPT(args.vocab, args.dim, args.layers, args.heads, args.seq_len)
    strategy = "local" if args.strategy == "hetero" else args.strategy
    prepared = thd.prepare(
        model,
        lambda params: torch.optim.AdamW(params, lr=args.lr),
        ctx=ctx,
        strategy=strategy,
        activation_checkpointing=args.activation_checkpointing,
        policy=policy,
    )
    group, rows, local_batch = None, None, None
    if args.strategy == "hetero":
        gemm = (args.global_batch * args.seq_len // ctx.world_size, args.dim, 4 * args.dim)
        rate = thd.measured_throughput(hal, ctx.device, policy.compute_dtype, gemm)
        group = thd.HeteroGroup.create(ctx, global_batch=args.global_batch, throughput=rate)
        local_batch = group.local_batch
    elif args.global_batch % ctx.world_size:
        raise SystemExit(f"--global-batch {args.global_batch} must divide by the world size {ctx.world_size}")
    else:
        local_batch = args.global_batch // ctx.world_size
        rows = slice(ctx.rank * local_batch, (ctx.rank + 1) * local_batch)

    micro = args.gradient_accumulation_steps
    sizes = group.batch_sizes if group is not None else (local_batch,)  # every rank decides alike
    if any(size % micro for size in sizes):
        raise SystemExit(f"every rank's batch {list(sizes)} must divide into {micro} micro-batches")

    def batches():
        for step in range(args.steps):
            inputs, targets = global_batch(step, args)
            if group is not None:
                inputs, targets = group.local_slice(inputs), group.local_slice(targets)
            else:
                inputs, targets = inputs[rows], targets[rows]
            for part in zip(inputs.chunk(micro), targets.chunk(micro), strict=True):
                yield tuple(t.to(ctx.device.torch_device) for t in part)

    stats = thd.train(
        prepared.model,
        prepared.optimizer,
        batches(),
        steps=args.steps,
        ctx=ctx,
        policy=prepared.policy,
        clip_grad_norm=args.clip,
        scaler=prepared.scaler,
        grad_sync=None if group is None else group.sync_gradients,
        gradient_accumulation_steps=micro,
    )
    first, last = stats[0], stats[-1]
    print(
        f"rank {ctx.rank} {ctx.device.id} {prepared.policy.name}: loss {first.loss:.3f} -> {last.loss:.3f}, "
        f"last step {last.step_time_s * 1e3:.1f} ms, {last.tokens_per_s:.0f} tokens/s",
        flush=True,
    )
    if args.json_out is not None:
        args.json_out.mkdir(parents=True, exist_ok=True)
        report = {
            "context": ctx.report(),
            "prepared": prepared.report(),
            "hetero": None if group is None else group.report(),
            "batch": {"local": local_batch, "global": args.global_batch, "seq_len": args.seq_len},
            "steps": [s.as_dict() for s in stats],
        }
        (args.json_out / f"rank{ctx.rank}.json").write_text(json.dumps(report, indent=2))
    ctx.shutdown()


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def _device_for_rank(devices: str | None) -> str | None:
    if devices is None:
        return None
    names = [d.strip() for d in devices.split(",") if d.strip()]
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= len(names):
        raise SystemExit(f"--devices names {len(names)} device(s), but this is local rank {local}")
    return names[local]


if __name__ == "__main__":
    main()
