"""Datasheet figures for AMD Instinct SKUs, matched on the name the runtime reports. Declared, never measured.

Matrix-core figures are dense (AMD prints sparsity separately). FP64 and FP32 are the matrix
peaks. INT8 is TOPS. MI300X FP8 is the fnuz format the part computes in.
The MI250X package holds two GCDs and torch sees each GCD as one device (110 CUs, 64 GB), so
its entry is the package datasheet halved, as its source says. A SKU whose figures could not be
sourced has no entry: its devices report no declared peaks.
"""

from __future__ import annotations

from torchhal.hal_core import DeclaredPeaks, DType


def _peaks(source: str, bandwidth: float, **tflops: float) -> DeclaredPeaks:
    return DeclaredPeaks(
        source=source, tflops={DType(k): v for k, v in tflops.items()}, memory_bandwidth_gbps=bandwidth
    )


PEAKS: dict[str, DeclaredPeaks] = {
    "AMD Instinct MI300X": _peaks(
        "AMD Instinct MI300X data sheet",
        5300,
        fp64=163.4,
        fp32=163.4,
        tf32=653.7,
        bf16=1307.4,
        fp16=1307.4,
        fp8_e4m3fnuz=2614.9,
        fp8_e5m2fnuz=2614.9,
        int8=2614.9,
    ),
    "AMD Instinct MI250X": _peaks(
        "AMD Instinct MI250X data sheet (per OAM package of 2 GCDs), halved for the one GCD torch sees",
        1600,
        fp64=47.85,
        fp32=47.85,
        bf16=191.5,
        fp16=191.5,
        int8=191.5,
    ),
    "AMD Instinct MI210": _peaks(
        "AMD Instinct MI210 data sheet",
        1600,
        fp64=45.3,
        fp32=45.3,
        bf16=181,
        fp16=181,
        int8=181,
    ),
}


def peaks_for(name: str) -> DeclaredPeaks | None:
    """The datasheet peaks for a device name, or None when the SKU has none."""
    return PEAKS.get(name.strip())
