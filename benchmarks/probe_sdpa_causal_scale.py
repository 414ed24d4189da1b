"""What torch's SDPA kernels give for causal attention with a scale <= 0 (the SDPA candidates turn
it down: torch's CPU kernels give NaN). Prints, per backend and scale, whether the output has NaN
and its largest difference from the math backend given an explicit boolean mask.
Usage: python benchmarks/probe_sdpa_causal_scale.py"""

from __future__ import annotations

import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(2, 8, 256, 128, device=device, dtype=dtype) for _ in range(3))
    mask = torch.ones(256, 256, dtype=torch.bool, device=device).tril()
    backends: list[SDPBackend | None] = [None, SDPBackend.MATH]  # None: the kernel torch picks
    if device == "cuda":
        backends += [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    print(f"device {torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}")
    for scale in (0.0, -0.5, 0.5):
        with sdpa_kernel(SDPBackend.MATH):
            want = sdpa(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
        for backend in backends:
            name = "default" if backend is None else backend.name
            try:
                with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                    got = sdpa(q, k, v, is_causal=True, scale=scale).float()
            except RuntimeError as exc:
                print(f"scale {scale:5}: {name:20s} refused: {str(exc).splitlines()[0][:80]}")
                continue
            nan = bool(got.isnan().any())
            diff = (got - want).abs().nan_to_num(float("inf")).max().item()
            print(f"scale {scale:5}: {name:20s} NaN {nan!s:5}  max |diff| vs masked math {diff:.3g}")


if __name__ == "__main__":
    main()
