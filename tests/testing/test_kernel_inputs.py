"""The kit's kernel inputs fit the ops torchhal defines, and its tolerance separates right from wrong."""

from __future__ import annotations

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import KernelRegistry
from torchhal.hal_core.settings import Settings
from torchhal.testing import kernel_inputs, tolerance


@pytest.fixture(scope="module")
def core_registry() -> KernelRegistry:
    hal = HardwareAbstractionLayer(settings=Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}))
    hal.devices()
    return hal.kernels


def _tensors(value: object) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else [t for v in value for t in _tensors(v)]  # type: ignore[attr-defined]


def test_every_core_op_has_conformance_inputs(core_registry: KernelRegistry) -> None:
    missing = sorted(set(core_registry.ops()) - set(kernel_inputs.CASES))
    assert not missing, (
        f"add cases for {missing} to torchhal/testing/kernel_inputs.py, or their candidates go untested"
    )


@pytest.mark.parametrize("op", sorted(kernel_inputs.CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inputs_fit_the_op_signature_and_reference(
    core_registry: KernelRegistry, op: str, dtype: torch.dtype
) -> None:
    if op not in core_registry.ops():
        pytest.skip(f"torchhal does not define op {op!r} yet, so its inputs cannot be checked against it")
    cases = kernel_inputs.cases(op, torch.Generator().manual_seed(7), dtype, core_registry)
    assert cases and len({c.label for c in cases}) == len(cases)
    # linear_cross_entropy_backward's grad_loss comes in the loss's dtype (fp32 for half inputs)
    first = 1 if op == "linear_cross_entropy_backward" else 0
    for typed in cases:
        leading = typed.args[first : first + 2]
        assert all(t.dtype == dtype for t in leading if isinstance(t, torch.Tensor)), typed.label
        core_registry.signature(op, *typed.args, **typed.kwargs)
        outputs = _tensors(core_registry.op(op).reference(*typed.args, **typed.kwargs))
        # -inf is a valid log-sum-exp for a query that sees no key; NaN and +inf never are
        assert all(bool((t.isfinite() | t.isneginf()).all()) for t in outputs), typed.label
        assert any(bool((t != 0).any()) for t in outputs), typed.label


# What a fast kernel of each op insists on, read from the last dimension of its first input (the
# head dim, or the row length). A matmul or linear_cross_entropy predicate cannot decline by size
# (their signatures carry no sizes), so their candidates meet the odd shapes too; an aligned case
# is there for the fast path such a candidate takes on aligned sizes, which no odd shape reaches.
HEAD_DIM_OPS = ("attention", "attention_varlen", "rope")
ROW_OPS = ("rms_norm", "layer_norm", "swiglu", "geglu")
NO_SIZE_RULE = ("matmul", "linear_cross_entropy")


def _family(op: str) -> str:
    return op.removesuffix("_forward").removesuffix("_backward")


@pytest.mark.parametrize("op", sorted(kernel_inputs.CASES))
def test_inputs_reach_the_sizes_fast_kernels_insist_on(core_registry: KernelRegistry, op: str) -> None:
    """A candidate whose predicate takes only head_dim 64/128 or rows of a multiple of 256 must
    meet such a case, or it is never run and reports not applicable."""
    if op not in core_registry.ops():
        pytest.skip(f"torchhal does not define op {op!r} yet")
    family = _family(op)
    assert family in HEAD_DIM_OPS + ROW_OPS + NO_SIZE_RULE, f"{op}: say which sizes its fast kernels need"
    cases = kernel_inputs.cases(op, torch.Generator().manual_seed(7), torch.float32, core_registry)
    assert cases
    if family in NO_SIZE_RULE:  # every dim of some case's floating tensors a multiple of 64
        dims = [
            [n for t in c.args if isinstance(t, torch.Tensor) and t.is_floating_point() for n in t.shape]
            for c in cases
        ]
        assert any(all(n % 64 == 0 for n in d) for d in dims), dims
        return
    last = {c.args[0].shape[-1] for c in cases}
    if family in HEAD_DIM_OPS:
        assert {64, 128} <= last, sorted(last)
    else:
        assert any(n % 256 == 0 for n in last), sorted(last)


def test_inputs_are_random_per_generator_and_cast_only_floats(core_registry: KernelRegistry) -> None:
    def draw(seed: int) -> list[kernel_inputs.Case]:
        made = kernel_inputs.cases(
            "linear_cross_entropy", torch.Generator().manual_seed(seed), torch.float16, core_registry
        )
        assert made is not None
        return made

    first, second = draw(1), draw(2)
    assert not torch.equal(first[0].args[0], second[0].args[0])
    assert first[0].args[0].dtype == torch.float16 and first[0].args[2].dtype == torch.int64


def test_backward_inputs_carry_the_forward_results(core_registry: KernelRegistry) -> None:
    if "attention_forward" not in core_registry.ops():
        pytest.skip("torchhal does not define attention_forward yet")
    made = kernel_inputs.cases(
        "attention_backward", torch.Generator().manual_seed(3), torch.bfloat16, core_registry
    )
    assert made is not None
    grad_out, q, k, v, out, lse = made[0].args
    expected_out, expected_lse = core_registry.op("attention_forward").reference(q, k, v, **made[0].kwargs)
    assert grad_out.dtype == q.dtype == out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)


def test_layer_norm_backward_inputs_carry_the_forward_statistics(core_registry: KernelRegistry) -> None:
    made = kernel_inputs.cases(
        "layer_norm_backward", torch.Generator().manual_seed(3), torch.bfloat16, core_registry
    )
    assert made is not None
    for case in made:
        dy, x, weight, mean, rstd = case.args
        eps = 1e-6 if "eps 1e-6" in case.label else 1e-5
        _, want_mean, want_rstd = core_registry.op("layer_norm_forward").reference(x, weight, weight, eps)
        assert dy.dtype == x.dtype == torch.bfloat16 and mean.dtype == rstd.dtype == torch.float32
        assert torch.equal(mean, want_mean) and torch.equal(rstd, want_rstd), case.label


def test_unknown_op_has_no_inputs(core_registry: KernelRegistry) -> None:
    assert kernel_inputs.cases("frobnicate", torch.Generator(), torch.float32, core_registry) is None


def _matmul_pair(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(19, 77, generator=g).to(dtype), torch.randn(77, 23, generator=g).to(dtype)
    return a, b, a.double() @ b.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_correct_kernel_is_within_tolerance(dtype: torch.dtype) -> None:
    a, b, truth = _matmul_pair(dtype)
    reference = a @ b
    other_order = torch.einsum("ik,kj->ij", a.float(), b.float()).to(dtype)  # accumulates differently
    result = tolerance.compare(other_order, reference, truth)
    assert result.ok, str(result)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_kernel_off_by_a_percent_fails(dtype: torch.dtype) -> None:
    a, b, truth = _matmul_pair(dtype)
    reference = a @ b
    result = tolerance.compare(reference * 1.01, reference, truth)
    assert not result.ok and result.error > result.bound


def test_fp32_floor_keeps_the_bound_positive_when_the_reference_is_exact() -> None:
    truth = torch.randn(64, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    exact = truth.float()
    result = tolerance.compare(exact, exact, exact.double())
    assert result.reference_error == 0.0 and result.bound > 0
    assert tolerance.compare(exact * (1 + 1e-5), exact, exact.double()).ok is False


def test_nan_output_fails() -> None:
    truth = torch.randn(8, dtype=torch.float64)
    bad = truth.float().clone()
    bad[3] = float("nan")
    assert not tolerance.compare(bad, truth.float(), truth).ok


def test_equal_infinities_are_no_error_and_a_wrong_infinity_fails() -> None:
    """attention's lse is -inf for a query that sees no key: -inf against -inf is right, not NaN."""
    truth = torch.randn(8, dtype=torch.float64)
    truth[2] = float("-inf")
    lse = truth.float()
    assert tolerance.compare(lse, lse, truth).ok
    wrong = lse.clone()
    wrong[5] = float("-inf")
    assert not tolerance.compare(wrong, lse, truth).ok
    finite_where_inf = lse.clone()
    finite_where_inf[2] = 0.0
    assert not tolerance.compare(finite_where_inf, lse, truth).ok


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _varlen_shapes(q, k, v, cu_q, cu_k, max_q, max_k, **_):  # type: ignore[no-untyped-def]
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0] == v.shape[0]
    assert int(lengths_q.max()) == max_q and int(lengths_k.max()) == max_k
    assert q.shape[1] % k.shape[1] == 0
    return q


DESIGN_FORMULAS = {  # DESIGN.md's definitions, for ops torchhal does not define yet
    "layer_norm": lambda x, w, b, eps=1e-5: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps),
    "swiglu": lambda gate, up: torch.nn.functional.silu(gate) * up,
    "geglu": lambda gate, up: torch.nn.functional.gelu(gate, approximate="tanh") * up,
    "rope": lambda q, k, cos, sin: (q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin),
    "attention_varlen": _varlen_shapes,
    "linear_cross_entropy": lambda h, w, t, bias=None, **kw: torch.nn.functional.cross_entropy(
        torch.nn.functional.linear(h, w, bias), t, **kw
    ),
}


@pytest.mark.parametrize("op", sorted(DESIGN_FORMULAS))
def test_inputs_of_ops_still_to_come_fit_design_md(op: str, core_registry: KernelRegistry) -> None:
    cases = kernel_inputs.cases(op, torch.Generator().manual_seed(11), torch.float32, core_registry)
    assert cases
    for case in cases:
        outputs = _tensors(DESIGN_FORMULAS[op](*case.args, **case.kwargs))
        assert all(bool(t.isfinite().all()) for t in outputs), case.label


def test_an_exact_answer_is_no_part_of_the_allowed_error_even_where_none_was_allowed() -> None:
    """error 0 against bound 0 (an exactly right all-zero output) was ratio inf: reported as the
    worst case of a passing check, hiding the real one."""
    exact = tolerance.Comparison(error=0.0, reference_error=0.0, bound=0.0)
    assert exact.ok and exact.ratio == 0.0
    assert tolerance.Comparison(error=1e-9, reference_error=0.0, bound=0.0).ratio == float("inf")
    assert tolerance.Comparison(error=1.0, reference_error=1.0, bound=4.0).ratio == 0.25
