"""One training step of a random-initialised ~1B-parameter Hugging Face Llama, patched against unpatched.

The peer is the same model as transformers runs it (SDPA attention, its own RMSNorm, MLP and RoPE);
the patched copy (`torchhal.kernels.patch`) starts from the same weights and runs RMSNorm, SwiGLU,
RoPE and causal GQA attention through torchhal.ops, and, since the step passes labels, its loss
through the fused torchhal.ops.linear_cross_entropy on the final hidden states and lm_head's weight
(no logits are made; the unpatched model computes transformers' cross-entropy on its materialised
logits, upcast to fp32). The table's `loss` column and the JSON's `loss` say which loss each variant
ran, from the patch report. A step is forward, loss, backward, AdamW step, gradients freed. Both
models and their optimizers stay resident; measurement alternates blocks of steps (unpatched,
patched, unpatched, ...) after a warm-up of each, so clock and thermal drift fall on both alike.
tokens/s is batch x seq over the median per-step time of a variant's blocks (wall time between
device synchronisations).

Peak memory is the allocator's peak during a variant's blocks (torch.cuda.max_memory_allocated,
reset before each block), reported two ways: `peak_gib` as measured (both models resident) and
`peak_gib_alone`, the peak minus the other model's parameters and optimizer state, which is what
the variant alone would reach (allocated bytes add up; the other model holds no gradients or
activations between its blocks). The first step's losses on the same batch are printed as a check
that the two models compute the same thing.

    python benchmarks/bench_llama_patch.py --out llama_patch.json          # ~1B, bf16, on cuda:0
    python benchmarks/bench_llama_patch.py --tiny                          # smoke run, CPU is fine

Needs transformers and, on a GPU, a torchhal plugin that gives cuda:0 a HAL device
(torchhal-nvidia). Defaults fit in about 3 minutes on an H100.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Any

import torch

VARIANTS = ("unpatched", "patched")
TINY = dict(
    hidden=64, intermediate=96, layers=2, heads=4, kv_heads=2, vocab=128, batch=2, seq=32, warmup=1, steps=2
)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=3, help="steps of each variant before measuring")
    p.add_argument("--steps", type=int, default=10, help="steps per measured block")
    p.add_argument("--rounds", type=int, default=3, help="blocks of each variant, alternating")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model: a smoke run, CPU is fine")
    p.add_argument("--out", help="JSON results")
    args = p.parse_args()
    if args.tiny:
        vars(args).update(TINY, rounds=2)
    return args


def build_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A random-initialised Llama (GQA: kv_heads < heads), made on the device in `dtype`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with device:  # initialise on the device: no host copy of a 2 GB model
        return LlamaForCausalLM(config).to(dtype).train()


def resident_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters and optimizer state: what a model holds between its steps."""
    tensors = [*model.parameters()]
    tensors += [
        t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor) -> torch.Tensor:
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss  # no KV cache in training
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_hal(device: torch.device) -> dict[str, Any]:
    """The default HAL's device for these tensors (torchhal.ops dispatches through it)."""
    from torchhal import ops
    from torchhal.hal_core import DeviceNotFoundError

    try:
        dev = ops.default_hal().device_for_tensor(torch.empty(0, device=device))
    except DeviceNotFoundError as exc:
        sys.exit(f"bench_llama_patch: torchhal has no device for {device} ({exc}); install torchhal-nvidia")
    caps = dev.capabilities
    return {"hal_device": dev.id, "name": caps.name, "features": sorted(f.value for f in caps.features)}


def device_and_dtype(args: argparse.Namespace, benchmark: str) -> tuple[torch.device, torch.dtype]:
    """cuda:0 in bf16, or with --tiny and no GPU the CPU in fp32; refuses a full run on the CPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        sys.exit(f"{benchmark}: needs a CUDA device (or --tiny for a CPU smoke run)")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def main() -> None:
    args = parse_args()
    import torchhal.kernels
    from torchhal import ops
    from torchhal.hal_core import telemetry
    from torchhal.kernels import nn as thnn

    device, dtype = device_and_dtype(args, "bench_llama_patch")
    hal = check_hal(device)

    unpatched = build_model(args, device, dtype)
    patched = copy.deepcopy(unpatched)
    report = torchhal.kernels.patch(patched)
    models = {"unpatched": unpatched, "patched": patched}
    optimizers = {k: torch.optim.AdamW(m.parameters(), lr=1e-5) for k, m in models.items()}
    params = sum(p.numel() for p in unpatched.parameters())
    print(f"device: {hal['name']} ({hal['hal_device']}); {params / 1e9:.2f}B parameters, {dtype}", flush=True)
    print(report, flush=True)
    loss_path = {
        "unpatched": "transformers ForCausalLMLoss (logits materialised)",
        "patched": "torchhal.ops.linear_cross_entropy (fused, no logits)"
        if report.count("loss")
        else "transformers ForCausalLMLoss (logits materialised)",
    }
    print(f"loss: {loss_path}", flush=True)

    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device, generator=gen)
    first_loss = {k: float(train_step(m, optimizers[k], ids)) for k, m in models.items()}
    print(f"first-step loss on one batch: {first_loss}", flush=True)
    fallbacks_before = telemetry.counts()
    for name, model in models.items():  # warm-up: Triton compilation, kernel selection, allocator
        for _ in range(args.warmup):
            train_step(model, optimizers[name], ids)
    synchronize(device)
    resident = {k: resident_bytes(m, optimizers[k]) for k, m in models.items()}

    step_s: dict[str, list[float]] = {k: [] for k in VARIANTS}
    peak: dict[str, int | None] = dict.fromkeys(VARIANTS)
    t_start = time.perf_counter()
    for _ in range(args.rounds):
        for name in VARIANTS:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            synchronize(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                loss = train_step(models[name], optimizers[name], ids)
            synchronize(device)
            step_s[name].append((time.perf_counter() - t0) / args.steps)
            if device.type == "cuda":
                peak[name] = max(peak[name] or 0, torch.cuda.max_memory_allocated(device))
        last_loss = float(loss)
    measured_s = time.perf_counter() - t_start

    tokens = args.batch * args.seq
    results: dict[str, dict[str, Any]] = {}
    for name in VARIANTS:
        other = next(k for k in VARIANTS if k != name)
        median = statistics.median(step_s[name])
        results[name] = {
            "tokens_per_s": tokens / median,
            "step_s_median": median,
            "step_s_blocks": step_s[name],
            "peak_gib": None if peak[name] is None else peak[name] / 2**30,
            "peak_gib_alone": None if peak[name] is None else (peak[name] - resident[other]) / 2**30,
            "resident_gib": resident[name] / 2**30,
            "first_step_loss": first_loss[name],
        }
    u, p = results["unpatched"], results["patched"]
    ratios = {"tokens_per_s": p["tokens_per_s"] / u["tokens_per_s"]}
    if u["peak_gib_alone"]:
        ratios["peak_gib_alone"] = p["peak_gib_alone"] / u["peak_gib_alone"]
    new_counts = {
        k: v - fallbacks_before.get(k, 0)
        for k, v in telemetry.counts().items()
        if k.startswith(thnn.FALLBACK_COUNTER) and v != fallbacks_before.get(k, 0)
    }
    record = {
        "benchmark": "bench_llama_patch",
        "command": "python " + " ".join(sys.argv),
        "date": datetime.now(timezone.utc).isoformat(),
        "host": platform.node(),
        "device": hal["name"],
        "hal": hal,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "dtype": str(dtype),
        "parameters": params,
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "peer": "unpatched: the model as transformers runs it (SDPA attention), measured in the same run",
        "patch": report.to_dict(),
        "loss": loss_path,
        "results": results,
        "ratio_patched_over_unpatched": ratios,
        "fallbacks_during_measurement": new_counts,  # attention and loss (torchhal.nn.fallback)
        "kernel_fallbacks": dict(ops.default_hal().kernels.fallback_counts),
        "last_loss": last_loss,
        "measured_s": measured_s,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)

    print(
        f"\n{'variant':>10} {'tokens/s':>12} {'step ms':>9} {'peak GiB alone':>15} {'first loss':>11}  loss"
    )
    for name in VARIANTS:
        r = results[name]
        mem = "n/a" if r["peak_gib_alone"] is None else f"{r['peak_gib_alone']:.2f}"
        print(
            f"{name:>10} {r['tokens_per_s']:12.0f} {1e3 * r['step_s_median']:9.1f} {mem:>15} "
            f"{r['first_step_loss']:11.4f}  {loss_path[name]}"
        )
    ratio_mem = ratios.get("peak_gib_alone")
    print(
        f"{'ratio':>10} {ratios['tokens_per_s']:12.3f}x {'':>9} "
        f"{'n/a' if ratio_mem is None else f'{ratio_mem:.3f}x':>15}"
        + (f"   fallbacks: {new_counts}" if new_counts else "")
    )


if __name__ == "__main__":
    main()
