"""The kit's matmul inputs reach every operand layout torch.matmul takes: a candidate right only
for a 2-D b fails, and one whose predicate declines the other layouts is declined, not passed."""

from __future__ import annotations

import random

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import DeviceCapabilities, KernelRegistry, RejectionReason, Unsupported
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.hal_core.settings import Settings
from torchhal.testing import CheckStatus, format_report, kernel_inputs, run_conformance


@pytest.fixture(scope="module")
def core_registry() -> KernelRegistry:
    hal = HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    hal.devices()
    return hal.kernels


def _layouts(op: str, registry: KernelRegistry) -> set[tuple[int, int]]:
    """(a dims, b dims) of the op's cases."""
    made = kernel_inputs.cases(
        op, torch.Generator().manual_seed(random.randrange(2**31)), torch.float32, registry
    )
    assert made is not None
    first = 1 if op == "matmul_backward" else 0  # the backward's grad_out comes first
    return {(c.args[first].dim(), c.args[first + 1].dim()) for c in made}


@pytest.mark.parametrize("op", ["matmul", "matmul_backward"])
def test_cases_cover_vector_matrix_and_batched_operands_on_both_sides(
    core_registry: KernelRegistry, op: str
) -> None:
    """b was always a matrix: a kernel wrong for a batched or vector b passed the kit."""
    layouts = _layouts(op, core_registry)
    assert (2, 2) in layouts, layouts
    assert any(b == 1 for _, b in layouts) and any(a == 1 and b > 2 for a, b in layouts), layouts
    assert any(a > 2 and b > 2 for a, b in layouts) and any(a > 2 and b == 2 for a, b in layouts), layouts


@pytest.mark.parametrize("op", ["matmul", "matmul_backward"])
def test_cases_broadcast_a_batch_of_size_1(core_registry: KernelRegistry, op: str) -> None:
    made = kernel_inputs.cases(op, torch.Generator().manual_seed(1), torch.float32, core_registry)
    assert made is not None
    first = 1 if op == "matmul_backward" else 0
    broadcast = {
        side
        for c in made
        for side, t, other in (
            ("a", c.args[first], c.args[first + 1]),
            ("b", c.args[first + 1], c.args[first]),
        )
        if t.dim() > 2 and other.dim() > 2 and 1 in t.shape[:-2] and t.shape[:-2] != other.shape[:-2]
    }
    assert broadcast == ({"b"} if op == "matmul" else {"a", "b"}), [c.label for c in made]


def _first_batch_of_b(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Right for a matrix b; a batched b is read as its first batch, a vector b as zeros."""
    if b.dim() == 2:
        return torch.matmul(a, b)
    if b.dim() == 1:
        return a.new_zeros(a.shape[:-1])
    return torch.matmul(a, b[(0,) * (b.dim() - 2)].expand_as(b))


class MatrixBOnly(CPUAdapter):
    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register("matmul", "twod", _first_batch_of_b, provider=self.name)


def _declines_non_matrix_b(caps: DeviceCapabilities, sig: object) -> Unsupported | None:
    if getattr(sig, "b_dims", 2) != 2:
        return Unsupported(RejectionReason.SHAPE, "takes a 2-D b only")
    return None


class MatrixBDeclared(CPUAdapter):
    """The same kernel, with a predicate that says what it cannot take."""

    def register_kernels(self, registry: KernelRegistry) -> None:
        registry.register(
            "matmul", "twod", _first_batch_of_b, provider=self.name, supports=_declines_non_matrix_b
        )


def test_a_candidate_wrong_for_a_batched_or_vector_b_fails() -> None:
    report = run_conformance(MatrixBOnly(), seed=random.randrange(2**63))
    result = report.result("kernel.matmul/cpu/twod")
    assert result.status is CheckStatus.FAILED, format_report(report)
    assert "@ 3x17x6: output 0: error" in result.reason, result.reason


def test_a_candidate_declining_those_layouts_is_declined_not_passed_on_them() -> None:
    report = run_conformance(MatrixBDeclared(), seed=random.randrange(2**63))
    result = report.result("kernel.matmul/cpu/twod")
    assert result.status is CheckStatus.PASSED, format_report(report)
    dtypes = 4  # fp32, bf16, fp16, fp64 on the host
    made = kernel_inputs._matmul(torch.Generator().manual_seed(0))
    matrix_b = sum(c.args[1].dim() == 2 for c in made)
    assert result.reason.startswith(f"{matrix_b * dtypes} case(s) within tolerance"), result.reason
    assert f"{(len(made) - matrix_b) * dtypes} case(s) declined by its predicate" in result.reason
