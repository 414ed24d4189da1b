"""Whether a CUDA graph capture survives an op's first call of a new signature inside it, with
measured selection on: prints the outcome (the capture's error, or the replay's agreement with the
reference). Run with a build before and after the capture guard (decisions.md, twenty-sixth session).

    python benchmarks/probe_capture_selection.py
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

import torchhal
from torchhal.hal_core.settings import Settings
from torchhal.kernels import attention


def main() -> None:
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with tempfile.TemporaryDirectory() as cache:
        warm = torchhal.HardwareAbstractionLayer(
            settings=Settings(autotune="on", cache_dir=Path(cache) / "w")
        )
        warm.kernels.call("attention", warm.device("cuda:0"), q, k, v, False, None, None)
        hal = torchhal.HardwareAbstractionLayer(settings=Settings(autotune="on", cache_dir=Path(cache) / "f"))
        torchhal.ops.set_default_hal(hal)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.no_grad(), torch.cuda.graph(graph):
                out = torchhal.ops.attention(q, k, v)
        except Exception as exc:  # the outcome is what this probe reports
            print(f"capture failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            return
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        expected = attention.reference(q.float(), k.float(), v.float()).to(torch.bfloat16)
        error = (out.float() - expected.float()).abs().max().item()
        print(f"capture succeeded; replay max error vs reference {error:.3g}")


if __name__ == "__main__":
    main()
