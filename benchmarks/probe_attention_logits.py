"""How the Triton attention's error grows with the logits' size, against PyTorch's own.

For q, k ~ a·N(0, 1) (v, dO ~ N(0, 1)), prints per dtype and scale the ratio
error(Triton) / error(PyTorch's math in the same dtype), both against fp64, for the output and
each gradient: FlashAttention's rule wants <= 2 for the output and <= 3 for gradients. The fp32
interpreter measurements in docs/decisions.md ("Attention's reference pair") found dv past 3x
from logits of ~35; this says whether bf16/fp16 on a GPU do the same.

    python3 benchmarks/probe_attention_logits.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from torchhal import HardwareAbstractionLayer
from torchhal.kernels import attention, triton_attention


def torch_math(q, k, v, causal):
    scores = torch.matmul(q * (1.0 / math.sqrt(q.shape[-1])), k.transpose(-1, -2))
    mask = attention.allowed_keys(q.shape[2], k.shape[2], causal, None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def _with_grads(q, k, v, causal, grad_out):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = torch_math(*leaves, causal)
    out.backward(grad_out.to(out.dtype))
    return (out.detach(), *(t.grad for t in leaves))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test under TRITON_INTERPRET=1")
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    caps = HardwareAbstractionLayer().device(args.device).capabilities
    forward, backward = triton_attention.bind_forward(caps), triton_attention.bind_backward(caps)
    rows = []
    for dtype in (getattr(torch, name) for name in args.dtypes):
        for a in (1.0, 2.0, 3.0, 4.0, 6.0):
            for causal in (False, True):
                worst = {"out": 0.0, "dq": 0.0, "dk": 0.0, "dv": 0.0}
                for seed in range(3):
                    torch.manual_seed(seed)
                    shape = (2, 4, args.seq, args.dim)
                    q, k = (
                        (a * torch.randn(shape, device=args.device)).to(dtype),
                        (a * torch.randn(shape, device=args.device)).to(dtype),
                    )
                    v, grad_out = (
                        torch.randn(shape, device=args.device).to(dtype),
                        torch.randn(shape, device=args.device).to(dtype),
                    )
                    logit = (q.double() @ k.double().transpose(-1, -2)).abs().max().item() / math.sqrt(
                        args.dim
                    )
                    truth = _with_grads(q.double(), k.double(), v.double(), causal, grad_out.double())
                    same = _with_grads(q, k, v, causal, grad_out)
                    out, lse = forward(q, k, v, causal, None, None)
                    got = (out, *backward(grad_out, q, k, v, out, lse, causal, None, None))
                    for name, g, s, t in zip(worst, got, same, truth, strict=True):
                        error = (g.double() - t).abs().max().item()
                        base = (s.double() - t).abs().max().item()
                        worst[name] = max(worst[name], error / base if base > 0 else math.inf)
                rows.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "a": a,
                        "causal": causal,
                        "max_logit": round(logit, 1),
                        **{k: round(v, 2) for k, v in worst.items()},
                    }
                )
                print(rows[-1], flush=True)
    with open(args.out, "w") as f:
        json.dump(
            {"device": caps.name, "dim": args.dim, "seq": args.seq, "rows": rows},
            f,
            indent=1,
        )
    print(f"{'dtype':9s} {'a':>4s} {'causal':>6s} {'logit':>6s} {'out':>6s} {'dq':>6s} {'dk':>6s} {'dv':>6s}")
    for r in rows:
        print(
            f"{r['dtype']:9s} {r['a']:4.1f} {r['causal']!s:>6s} {r['max_logit']:6.1f} "
            f"{r['out']:6.2f} {r['dq']:6.2f} {r['dk']:6.2f} {r['dv']:6.2f}"
        )


if __name__ == "__main__":
    main()
