"""Datasheet figures for AMD Instinct SKUs, matched on the name the runtime reports. Declared, never measured.

Matrix-core figures are dense (AMD prints sparsity separately). FP64 and FP32 are the matrix
peaks. INT8 is TOPS. MI300X FP8 is the fnuz format the part computes in.
The MI250X package holds two GCDs and torch sees each GCD as one device (110 CUs, 64 GB), so
its entry is the package datasheet halved, as its source says. A SKU whose figures could not be
sourced has no entry: its devices report no declared peaks.

Each entry holds the compute units its figures are for: a device that reports fewer (an MI300X
partitioned into CPX mode shows 38 CUs of one XCD under the same name) gets no declared peaks.
Each count agrees with its entry's figures at the sheet's peak engine clock: bf16 / (CUs x clock)
is CDNA3's 2048 and CDNA2's 1024 flop per CU per cycle, fp64 256 (MI300X 304 at 2100 MHz,
MI250X 110 per GCD and MI210 104 at 1700 MHz).
"""

from __future__ import annotations

from typing import NamedTuple

from torchhal.hal_core import DeclaredPeaks, DType


class Sku(NamedTuple):
    compute_units: int  # the whole device's, as its data sheet counts them (per GCD for MI250X)
    peaks: DeclaredPeaks


def _peaks(source: str, bandwidth: float, **tflops: float) -> DeclaredPeaks:
    return DeclaredPeaks(
        source=source, tflops={DType(k): v for k, v in tflops.items()}, memory_bandwidth_gbps=bandwidth
    )


SKUS: dict[str, Sku] = {
    "AMD Instinct MI300X": Sku(
        304,
        _peaks(
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
    ),
    "AMD Instinct MI250X": Sku(
        110,
        _peaks(
            "AMD Instinct MI250X data sheet (per OAM package of 2 GCDs), halved for the one GCD torch sees",
            1600,
            fp64=47.85,
            fp32=47.85,
            bf16=191.5,
            fp16=191.5,
            int8=191.5,
        ),
    ),
    "AMD Instinct MI210": Sku(
        104,
        _peaks("AMD Instinct MI210 data sheet", 1600, fp64=45.3, fp32=45.3, bf16=181, fp16=181, int8=181),
    ),
}


# Names the runtime reports for an entry's devices besides the entry's own. ROCm 6.x names the GCDs
# of MI250X and MI250 alike; the compute units tell them apart (110 MI250X, 104 MI250), and the
# adapter declares an entry's peaks only where they match, so an MI250 GCD declares none.
ALIASES = {"AMD Instinct MI250X/MI250": "AMD Instinct MI250X"}
# An SR-IOV virtual function, as cloud MI300X guests see their GPU: the same part under this suffix
# (one that holds fewer compute units than the entry declares no peaks, as a partition does).
VIRTUAL_FUNCTION = " VF"


def sku_for(name: str) -> Sku | None:
    """The data sheet entry for a device name, or None when the SKU has none."""
    name = name.strip().removesuffix(VIRTUAL_FUNCTION)
    return SKUS.get(ALIASES.get(name, name))
