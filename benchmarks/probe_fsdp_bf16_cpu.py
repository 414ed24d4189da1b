"""Does FSDP2 with the bf16 policy train a small model on 2 CPU ranks over gloo? One step of
`thd.prepare(strategy="fsdp", bf16)` + `thd.train`, printing ok or the error per rank. Run as
`python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/probe_fsdp_bf16_cpu.py`
(with PYTHONPATH naming a build) to tell a torch version's behaviour from a torchhal build's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from torchhal import distributed as thd


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(12, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.head(x).squeeze(-1).float(), y)


def main() -> None:
    ctx = thd.init(device="cpu")
    torch.manual_seed(0)
    policy = thd.choose_precision(ctx.device, prefer="bf16")
    prepared = thd.prepare(
        Net(), lambda p: torch.optim.AdamW(p, lr=1e-2), ctx=ctx, strategy="fsdp", policy=policy
    )
    batch = (torch.randn(6, 12), torch.randn(6))
    try:
        (stats,) = thd.train(
            prepared.model, prepared.optimizer, [batch], steps=1, ctx=ctx, policy=prepared.policy
        )
        print(f"rank {ctx.rank}: ok, loss {stats.loss:.4f}, torch {torch.__version__}")
    except Exception as error:  # the probe's answer, printed
        print(f"rank {ctx.rank}: {type(error).__name__}: {error}, torch {torch.__version__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
