"""The kit's tolerance in fp64: fp64's own ulps, so an fp64 candidate that computes in fp32 fails;
fp32's ulps only where the reference itself computes in fp32."""

from __future__ import annotations

import random

import torch

from torchhal.hal_core import KernelRegistry
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.testing import CheckStatus, format_report, run_conformance, tolerance


def _pair(seed: int, k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(64, k, generator=g, dtype=torch.float64)
    return a, torch.randn(k, 48, generator=g, dtype=torch.float64) * k**-0.5


def test_an_fp64_result_computed_in_fp32_fails_and_one_summed_in_another_order_passes() -> None:
    """64 fp32 ulps of max|truth| were allowed in fp64 too: a kernel rounding through fp32
    (relative error ~1e-7, a billion fp64 ulps) passed."""
    a, b = _pair(random.randrange(2**31))
    truth = a @ b
    through_fp32 = tolerance.compare((a.float() @ b.float()).double(), a @ b, truth)
    assert not through_fp32.ok, str(through_fp32)
    assert through_fp32.bound < 1e-12 < through_fp32.error
    other_order = tolerance.compare(torch.einsum("ik,kj->ij", a, b), a @ b, truth)
    assert other_order.ok, str(other_order)


def test_an_fp64_output_the_reference_computes_in_fp32_keeps_fp32_ulps() -> None:
    """A reference returning fp64 values computed in fp32 (each an fp32 number) is as far from an
    fp64 computation as fp32 is: a correct candidate computing in fp64 must still pass."""
    a, b = _pair(random.randrange(2**31))
    in_fp32 = (a.float() @ b.float()).double()  # what such a reference returns, on both sides
    result = tolerance.compare(a @ b, in_fp32, in_fp32)
    assert result.reference_error == 0.0 and result.ok, str(result)
    assert result.bound > 64 * torch.finfo(torch.float32).eps * in_fp32.abs().max().item() * 0.99


def _fp32_inside(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a.float(), b.float()).to(a.dtype)


class Fp64ViaFp32(CPUAdapter):
    """A matmul candidate returning a's dtype, computed in fp32 whatever that dtype is."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register("matmul", "fp32inside", _fp32_inside, provider=self.name)


def test_the_kit_fails_an_fp64_candidate_that_computes_in_fp32() -> None:
    report = run_conformance(Fp64ViaFp32(), seed=random.randrange(2**63))
    result = report.result("kernel.matmul/cpu/fp32inside")
    assert result.status is CheckStatus.FAILED, format_report(report)
    assert result.reason.startswith("cpu fp64 "), result.reason  # fp32, bf16 and fp16 pass first
    assert "output 0: error" in result.reason
