"""Datasheet figures for NVIDIA SKUs, matched on the name the driver reports. Declared, never measured.

Tensor-core figures are dense: NVIDIA's datasheets print them with 2:4 sparsity and state in a
footnote that dense figures are one half (the A100 and L40S sheets print both). FP64 and FP32
are the non-sparse peaks (FP64 through tensor cores where the part has them). INT8 is TOPS.
`nvlink_gbps` is the datasheet's total NVLink bandwidth (both directions, all links).
A SKU whose figures could not be sourced has no entry: its devices report no declared peaks.
"""

from __future__ import annotations

from typing import NamedTuple

from torchhal.hal_core import DeclaredPeaks, DType


class Sku(NamedTuple):
    names: tuple[str, ...]  # device names as torch.cuda.get_device_properties reports them
    peaks: DeclaredPeaks
    nvlink_gbps: float | None = None
    nvlink_links: int | None = None

    def nvlink_per_link_gbps(self) -> float | None:
        """Declared bandwidth of one link in one direction."""
        if self.nvlink_gbps is None or not self.nvlink_links:
            return None
        return self.nvlink_gbps / 2 / self.nvlink_links


def _peaks(source: str, bandwidth: float, **tflops: float) -> DeclaredPeaks:
    return DeclaredPeaks(
        source=source, tflops={DType(k): v for k, v in tflops.items()}, memory_bandwidth_gbps=bandwidth
    )


_HOPPER = dict(fp64=67, fp32=67, tf32=494.5, bf16=989.5, fp16=989.5, fp8_e4m3=1979, fp8_e5m2=1979, int8=1979)
_A100 = dict(fp64=19.5, fp32=19.5, tf32=156, bf16=312, fp16=312, int8=624)
_A100_SHEET = "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4)"

SKUS: tuple[Sku, ...] = (
    Sku(
        ("NVIDIA H100 80GB HBM3",),
        _peaks("NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column", 3350, **_HOPPER),
        nvlink_gbps=900,
        nvlink_links=18,
    ),
    Sku(
        ("NVIDIA H100 PCIe",),
        _peaks(
            "NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column",
            2000,
            fp64=51,
            fp32=51,
            tf32=378,
            bf16=756.5,
            fp16=756.5,
            fp8_e4m3=1513,
            fp8_e5m2=1513,
            int8=1513,
        ),
    ),
    Sku(
        ("NVIDIA H200",),
        _peaks("NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column", 4800, **_HOPPER),
        nvlink_gbps=900,
        nvlink_links=18,
    ),
    Sku(("NVIDIA A100-SXM4-80GB",), _peaks(f"{_A100_SHEET}, A100 80GB SXM", 2039, **_A100), 600, 12),
    Sku(("NVIDIA A100-SXM4-40GB",), _peaks(f"{_A100_SHEET}, A100 40GB SXM", 1555, **_A100), 600, 12),
    Sku(("NVIDIA A100 80GB PCIe",), _peaks(f"{_A100_SHEET}, A100 80GB PCIe", 1935, **_A100)),
    Sku(("NVIDIA A100-PCIE-40GB",), _peaks(f"{_A100_SHEET}, A100 40GB PCIe", 1555, **_A100)),
    Sku(
        ("NVIDIA L4",),
        _peaks(
            "NVIDIA L4 Tensor Core GPU datasheet",
            300,
            fp32=30.3,
            tf32=60,
            bf16=121,
            fp16=121,
            fp8_e4m3=242.5,
            fp8_e5m2=242.5,
            int8=242.5,
        ),
    ),
    Sku(
        ("NVIDIA L40S",),
        _peaks(
            "NVIDIA L40S GPU datasheet",
            864,
            fp32=91.6,
            tf32=183,
            bf16=362.05,
            fp16=362.05,
            fp8_e4m3=733,
            fp8_e5m2=733,
        ),
    ),
    Sku(
        ("NVIDIA B200",),
        _peaks(
            "NVIDIA HGX B200 datasheet, individual GPU",
            7700,
            fp64=37,
            fp32=75,
            tf32=1100,
            bf16=2250,
            fp16=2250,
            fp8_e4m3=4500,
            fp8_e5m2=4500,
            int8=4500,
        ),
        nvlink_gbps=1800,
        nvlink_links=18,
    ),
)

_BY_NAME = {name: sku for sku in SKUS for name in sku.names}


def sku_for(name: str) -> Sku | None:
    """The datasheet entry for a device name, or None when the SKU has none."""
    return _BY_NAME.get(name.strip())
