"""Per-step cost of `train`'s buffer copies (`torchhal.distributed.rollback.Buffers.save`), on one
CPU thread, best of 7 repeats of 2,000 saves: a model without buffers, 12 BatchNorm layers (36
persistent statistics, copied every step), and non-persistent rotary tables that no forward
changes (watched each step, never copied).

    python benchmarks/bench_step_buffers.py
"""

from __future__ import annotations

import timeit

import torch
from torch import nn

from torchhal.distributed.rollback import Buffers


class Rotary(nn.Module):
    """A rotary module's non-persistent tables (Hugging Face Llama has one per model)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.randn(64), persistent=False)
        self.register_buffer("cos", torch.randn(4096, 128), persistent=False)
        self.register_buffer("sin", torch.randn(4096, 128), persistent=False)


def per_save_us(model: nn.Module) -> float:
    buffers = Buffers(model)
    buffers.save()
    return min(timeit.repeat(buffers.save, number=2000, repeat=7)) / 2000 * 1e6


def main() -> None:
    torch.set_num_threads(1)
    models = {
        "no buffers (32 Linear)": nn.Sequential(*[nn.Linear(8, 8) for _ in range(32)]),
        "12 BatchNorm1d (36 statistics copied)": nn.Sequential(*[nn.BatchNorm1d(8) for _ in range(12)]),
        "1 rotary module (3 watched)": Rotary(),
        "32 rotary modules (96 watched)": nn.Sequential(*[Rotary() for _ in range(32)]),
    }
    print(f"{'model':<40} {'µs a step':>10}")
    for name, model in models.items():
        print(f"{name:<40} {per_save_us(model):>10.2f}")


if __name__ == "__main__":
    main()
