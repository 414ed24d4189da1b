"""Registers and spills of the norm backward kernels as ptxas reports them for sm_90a, compiled on
a machine without a GPU (Triton's front end plus the ptxas that ships with Triton).

A spill is local-memory traffic in the hottest loop, so this is the first thing to look at when a
kernel edit cannot be timed on a GPU. It compiles each given triton_norms.py (default: the
installed one) at the launches the H100 rules pick (hidden 4096 on 8 warps, 8192 and 16384 on 16;
16384), bf16, with pointers and strides marked 16-divisible as the launcher
specialises them.

    python benchmarks/ptxas_norms.py [OLD/triton_norms.py ...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import triton
from sweep_common import load_module
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
LAYER_NORM = {
    **{name: "*bf16" for name in ("DY", "X", "W")},
    **{name: "*fp32" for name in ("Mean", "Rstd")},
    "DX": "*bf16",
    **{name: "*fp32" for name in ("DW", "DB")},
    **{name: "i32" for name in ("dy_stride", "x_stride", "n_rows", "n_cols")},
    **{name: "constexpr" for name in ("BLOCK", "RELOAD_ROW")},
}
RMS_NORM = {
    **{name: "*bf16" for name in ("DY", "X", "W", "DX")},
    "DW": "*fp32",
    **{name: "i32" for name in ("dy_stride", "x_stride", "n_rows", "n_cols")},
    "eps": "fp32",
    **{name: "constexpr" for name in ("BLOCK", "RELOAD_ROW")},
}
LAUNCHES = [(4096, 8, False), (8192, 16, False), (16384, 16, True)]  # (hidden, warps, RELOAD_ROW)


def ptxas_report(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], warps: int) -> str:
    if list(fn.arg_names) != list(signature):  # e.g. an older kernel with another constexpr
        raise SystemExit(f"{fn.__name__} takes {fn.arg_names}; this script compiles {list(signature)}")
    names = list(signature)
    aligned = [n for n, t in signature.items() if t.startswith("*") or "stride" in n or n == "n_cols"]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    ptx = triton.compile(source, target=TARGET, options={"num_warps": warps}).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        out = subprocess.run(
            [get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        os.unlink(f.name)
    text = out.stderr + out.stdout
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None or spills is None:
        raise SystemExit(f"ptxas printed no register or spill figures:\n{text}")
    return f"regs={registers.group(1)} spill_st={spills.group(1)} spill_ld={spills.group(2)}"


def main() -> None:
    from torchhal.kernels import triton_norms

    paths = sys.argv[1:] or [triton_norms.__file__]
    for path in paths:
        module = load_module(path)
        for block, warps, reload in LAUNCHES:
            constexprs = {"BLOCK": block, "RELOAD_ROW": reload}
            layer_norm = ptxas_report(module._layer_norm_bwd, LAYER_NORM, constexprs, warps)
            rms_norm = ptxas_report(module._rms_norm_bwd, RMS_NORM, constexprs, warps)
            print(f"{path} {block} {warps} warps: layer_norm {layer_norm}; rms_norm {rms_norm}")


if __name__ == "__main__":
    main()
