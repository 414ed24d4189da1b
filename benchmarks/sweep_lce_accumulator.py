"""The fused cross-entropy's weight-gradient step, one fp32 accumulator against two vocabulary slabs.

Per chunk, linear_cross_entropy adds grad_logits.T @ hidden_chunk (bf16 inputs, fp32 output) into
the (vocab, hidden) weight-gradient accumulator. Held as two slabs (vocabulary halves), its
rounding to bf16 can reuse the first slab's memory (triton_cross_entropy._SplitAccumulator), at
the price of two matmuls of half the rows. This times both at chunk sizes around the H100's
`min_chunk_rows` (do_bench medians), vocabulary 128256, hidden 2048, bf16, on cuda:0.

    python3 benchmarks/sweep_lce_accumulator.py [--out sweep.json]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from sweep_common import ms, save

VOCAB, HIDDEN = 128256, 2048
ROWS = (1280, 1664, 1920, 2048, 2560)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    whole = torch.zeros(VOCAB, HIDDEN, device="cuda")
    half = (VOCAB + 1) // 2
    slabs = (torch.zeros(half, HIDDEN, device="cuda"), torch.zeros(VOCAB - half, HIDDEN, device="cuda"))
    rows_out: list[dict[str, Any]] = []
    for rows in ROWS:
        grad_logits = torch.randn(rows, VOCAB, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        a = grad_logits.t()

        def one(a: torch.Tensor = a, h: torch.Tensor = h) -> None:
            torch.addmm(whole, a, h, torch.float32, out=whole)

        def two(a: torch.Tensor = a, h: torch.Tensor = h) -> None:
            for slab, part in zip(slabs, a.split(half), strict=True):
                torch.addmm(slab, part, h, torch.float32, out=slab)

        flop = 2 * rows * VOCAB * HIDDEN
        row: dict[str, Any] = {"rows": rows}
        for name, fn in (("one", one), ("two", two)):
            time_ms = ms(fn, rep=100)
            row[f"{name}_ms"], row[f"{name}_tflops"] = time_ms, flop / time_ms / 1e9
        rows_out.append(row)
    save(args.out, rows_out, vocab=VOCAB, hidden=HIDDEN)
    print(f"weight-gradient accumulation, vocab {VOCAB} x hidden {HIDDEN}, bf16 in, fp32 out")
    print(f"{'rows':>6s} {'one ms':>8s} {'TF/s':>6s} {'two ms':>8s} {'TF/s':>6s} {'two/one':>8s}")
    for r in rows_out:
        print(
            f"{r['rows']:6d} {r['one_ms']:8.3f} {r['one_tflops']:6.0f} {r['two_ms']:8.3f} "
            f"{r['two_tflops']:6.0f} {r['two_ms'] / r['one_ms']:8.3f}"
        )


if __name__ == "__main__":
    main()
