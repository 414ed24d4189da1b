"""The evaluation the distributed tests shard: the error of rms_norm in fp32 and bf16 against fp64.

Shared by the test (single process) and the worker processes, so all compute the same thing.
Items are random, drawn from a seed the test picks fresh and passes to every process.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from tests.evaluation.helpers import rms_norm_reference

N_ITEMS = 11  # odd, so ranks of a world of 2 hold different numbers of items


def items(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 64, generator=gen), torch.rand(64, generator=gen) + 0.5) for _ in range(N_ITEMS)]


def _error(dtype: torch.dtype) -> Callable[[tuple[torch.Tensor, torch.Tensor]], dict[str, float]]:
    def error(item: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
        x, w = item
        exact = rms_norm_reference(x.double(), w.double())
        out = rms_norm_reference(x.to(dtype), w.to(dtype)).double()
        return {
            "rel_l2": float(torch.linalg.vector_norm(out - exact) / torch.linalg.vector_norm(exact)),
            "max_abs": float((out - exact).abs().max()),
        }

    return error


def variants(log: Path | None = None) -> dict[str, Callable[..., dict[str, float]]]:
    """The variants; with `log`, every evaluation appends one line to it (to count calls)."""

    def logged(name: str, fn: Callable[..., dict[str, float]]) -> Callable[..., dict[str, float]]:
        def run(item: tuple[torch.Tensor, torch.Tensor]) -> dict[str, float]:
            if log is not None:
                with log.open("a") as f:
                    f.write(name + "\n")
            return fn(item)

        return run

    return {
        name: logged(name, _error(dtype))
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
    }


METRICS = ("rel_l2", "max_abs")
