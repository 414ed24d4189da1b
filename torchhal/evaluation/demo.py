"""The A/B section of `torchhal demo`: short experiments on whatever devices are here.

1. The candidates of `rms_norm` on the best real device, against the reference candidate:
   latency and quality. Real timings, so with a short run "inconclusive" is an honest answer.
2. On each simulated device: matmul in bf16 against fp32. Simulated time is deterministic,
   so that comparison is exact; quality shows what bf16 costs in accuracy.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.markup import escape

import torchhal.ops
from torchhal.evaluation.cli import print_result
from torchhal.evaluation.experiment import ExperimentConfig, run_experiment
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.variants import dtype_variants, kernel_variants
from torchhal.hal_core import DeviceRequirements, DType, NoDeviceMatchesError
from torchhal.hal_core.hal import HardwareAbstractionLayer

REPETITIONS = 15  # a demonstration, not a benchmark: enough for the statistics to run
INPUT_SETS = 6


def demo_section(console: Console, hal: HardwareAbstractionLayer) -> None:
    console.rule("5. A/B: kernel candidates and dtypes, with statistics")
    _kernel_candidates(console, hal)
    for dev in hal.devices():
        if dev.simulated and dev.capabilities.supports_dtype(DType.BF16):
            _simulated_dtypes(console, hal, dev.id)


def _kernel_candidates(console: Console, hal: HardwareAbstractionLayer) -> None:
    try:
        dev = hal.best_device(DeviceRequirements(allow_simulated=False))
    except NoDeviceMatchesError as exc:
        console.print(f"  no real device for the kernel A/B: {exc}", markup=False)
        return
    inputs = Inputs.generate(
        lambda i: (dev.to_device(torch.randn(256, 1024)), dev.to_device(torch.randn(1024))), INPUT_SETS
    )
    variants = kernel_variants(hal, "rms_norm", dev, inputs, items_per_call=256)
    if len(variants) < 2:
        console.print(
            f"  rms_norm has one valid candidate on {dev.id} ({variants[0].name}): nothing to compare",
            markup=False,
        )
        return
    config = ExperimentConfig(
        name=f"rms_norm candidates on {dev.id}",
        baseline="torchhal/reference",
        reference="torchhal/reference",
        metrics=("latency", "quality"),
        thresholds={"quality": Threshold(absolute=1e-5)},
        repetitions=REPETITIONS,
        warmup=3,
        n_resamples=2000,
    )
    names = ", ".join(v.name for v in variants)
    console.print(f"  [bold]{escape(config.name)}[/]: {escape(names)} (rows of 1024, fp32)")
    print_result(console, run_experiment(variants, config))


def _simulated_dtypes(console: Console, hal: HardwareAbstractionLayer, device_id: str) -> None:
    dev = hal.device(device_id)
    inputs = Inputs.generate(
        lambda i: (dev.to_device(torch.randn(256, 512)), dev.to_device(torch.randn(512, 256))), INPUT_SETS
    )
    variants = dtype_variants(
        torchhal.ops.matmul, dev, inputs, (torch.float32, torch.bfloat16), hal=hal, items_per_call=256
    )
    config = ExperimentConfig(
        name=f"matmul fp32 vs bf16 on {dev.id} ({dev.capabilities.name}, simulated time)",
        baseline="float32",
        reference="float32",
        metrics=("latency", "quality"),
        thresholds={"quality": Threshold(absolute=1e-2)},
        repetitions=REPETITIONS,
        warmup=1,
    )
    console.print(f"  [bold]{escape(config.name)}[/]")
    print_result(console, run_experiment(variants, config))
