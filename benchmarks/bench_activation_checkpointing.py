"""Activation checkpointing on a patched ~1B Hugging Face Llama: a training step without it, with
transformers' gradient checkpointing (which `torchhal.kernels.patch` makes recompute under the
forward's `hal.use` block), and with what `torchhal.distributed.prepare(activation_checkpointing=
True)` sets on each block (`CheckpointedForward`: the block's forward through torch's
non-reentrant checkpoint, its recompute under the forward's block).

One model and optimizer, the variant switched between blocks of steps (none, transformers,
torchhal, none, ...) after a warm-up of each; tokens/s over the median step time of a variant's
blocks, peak memory as the allocator's peak during its blocks (torch.cuda.max_memory_allocated,
reset before each). Before measuring, each variant's loss and gradient norm on one batch from the
same weights are printed: checkpointing changes what is kept, not what is computed. The forward
runs inside `hal.use(device)`, as `torchhal.distributed.train` runs it.

    python benchmarks/bench_activation_checkpointing.py --out ac.json   # ~1B, bf16, cuda:0
    python benchmarks/bench_activation_checkpointing.py --tiny          # smoke run, CPU is fine
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch
from bench_llama_patch import build_model, check_hal, device_and_dtype, parse_args, synchronize, train_step

VARIANTS = ("none", "transformers", "torchhal")


def set_variant(model: torch.nn.Module, variant: str) -> None:
    from torchhal.distributed.prepare import CheckpointedForward

    layers = model.model.layers
    for layer in layers:
        vars(layer).pop("forward", None)
    # transformers 5.2x names them activation_checkpointing_*; the old names are deprecated there
    enable = getattr(model, "activation_checkpointing_enable", None)
    disable = getattr(model, "activation_checkpointing_disable", model.gradient_checkpointing_disable)
    if variant == "transformers":
        if enable is None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    disable()
    if variant == "torchhal":
        for layer in layers:
            layer.forward = CheckpointedForward(layer)


def loss_and_grad_norm(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, float]:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    model.zero_grad(set_to_none=True)
    return float(loss.detach()), float(norm)


def main() -> None:
    args = parse_args()
    import torchhal.kernels
    from torchhal import ops

    device, dtype = device_and_dtype(args, "bench_activation_checkpointing")
    hal_info = check_hal(device)
    hal = ops.default_hal()
    model = build_model(args, device, dtype)
    report = torchhal.kernels.patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    params = sum(p.numel() for p in model.parameters())
    print(f"device: {hal_info['name']}; {params / 1e9:.2f}B parameters, {dtype}", flush=True)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=gen)

    step_s: dict[str, list[float]] = {k: [] for k in VARIANTS}
    peak: dict[str, int | None] = dict.fromkeys(VARIANTS)
    first: dict[str, tuple[float, float]] = {}
    with hal.use(hal_info["hal_device"]):
        for variant in VARIANTS:
            set_variant(model, variant)
            first[variant] = loss_and_grad_norm(model, ids)
        for variant in VARIANTS:
            set_variant(model, variant)
            for _ in range(args.warmup):
                train_step(model, optimizer, ids)
        print(f"loss and gradient norm from the same weights: {first}", flush=True)
        synchronize(device)
        for _ in range(args.rounds):
            for variant in VARIANTS:
                set_variant(model, variant)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                synchronize(device)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    train_step(model, optimizer, ids)
                synchronize(device)
                step_s[variant].append((time.perf_counter() - t0) / args.steps)
                if device.type == "cuda":
                    peak[variant] = max(peak[variant] or 0, torch.cuda.max_memory_allocated(device))

    tokens = args.batch * args.seq
    results: dict[str, dict[str, Any]] = {}
    for variant in VARIANTS:
        median = statistics.median(step_s[variant])
        results[variant] = {
            "tokens_per_s": tokens / median,
            "step_s_median": median,
            "step_s_blocks": step_s[variant],
            "peak_gib": None if peak[variant] is None else peak[variant] / 2**30,
            "first_loss": first[variant][0],
            "first_grad_norm": first[variant][1],
        }
    record = {
        "benchmark": "bench_activation_checkpointing",
        "command": "python " + " ".join(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(),
        "host": platform.node(),
        "device": hal_info["name"],
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": str(dtype),
        "parameters": params,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "patch": report.to_dict(),
        "results": results,
        "kernel_fallbacks": dict(hal.kernels.fallback_counts),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    base = results["none"]
    print(
        f"\n{'variant':>13} {'tokens/s':>10} {'vs none':>8} {'peak GiB':>9} {'vs none':>8} {'first loss':>11}"
    )
    for variant in VARIANTS:
        r = results[variant]
        mem = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        mem_ratio = "n/a" if r["peak_gib"] is None else f"{r['peak_gib'] / base['peak_gib']:.3f}"
        print(
            f"{variant:>13} {r['tokens_per_s']:10.0f} {r['tokens_per_s'] / base['tokens_per_s']:8.3f} "
            f"{mem:>9} {mem_ratio:>8} {r['first_loss']:11.4f}"
        )


if __name__ == "__main__":
    main()
