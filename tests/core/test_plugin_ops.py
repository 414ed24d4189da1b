"""Ops a plugin defines, reached as the core's are and certified by the kit (issue 2, items 6 and 7).

`torchhal.ops.dispatch(op, *args)` runs any registry op through the innermost `hal.use()` HAL or
the default one; `define_op(..., examples=fn)` gives the conformance kit the inputs on which it
checks the op's candidates against the op's reference.
"""

from __future__ import annotations

import gc
import random
import re
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import pytest
import torch

import torchhal
from tests.docs.snippets import assert_matches_reference
from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import InvalidArgumentError, KernelRegistry, UnknownOpError
from torchhal.hal_core.adapters.cpu import CPUAdapter
from torchhal.hal_core.settings import Settings
from torchhal.testing import CheckResult, CheckStatus, ConformanceSuite
from torchhal.testing.checks_kernels import CANDIDATE_DTYPES

OP = "softcap"  # tanh(x / cap) * cap: an op no core defines


class SoftcapSignature(NamedTuple):
    dtype: torch.dtype
    ndim: int
    cap: float


def softcap_signature(x: Any, cap: Any) -> SoftcapSignature:
    if not isinstance(x, torch.Tensor) or not isinstance(cap, float) or cap <= 0:
        raise InvalidArgumentError(f"{OP}: x must be a tensor and cap a positive float, got {x!r}, {cap!r}")
    return SoftcapSignature(x.dtype, x.dim(), cap)


def softcap_reference(x: torch.Tensor, cap: float) -> torch.Tensor:
    """In fp64: the ground truth."""
    return (torch.tanh(x.double() / cap) * cap).to(x.dtype)


def softcap_fp32(x: torch.Tensor, cap: float) -> torch.Tensor:
    """A correct candidate: computes in fp32, fp64 in fp64 (the kit fails fp64 computed in fp32)."""
    wide = torch.promote_types(x.dtype, torch.float32)
    return (torch.tanh(x.to(wide) / cap) * cap).to(x.dtype)


def softcap_off_in_the_last_column(x: torch.Tensor, cap: float) -> torch.Tensor:
    """A wrong candidate: the remainder column is off by 1% (the bug odd shapes are there to find)."""
    out = softcap_fp32(x, cap)
    out[..., -1] *= 1.01
    return out


def softcap_examples(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
    def randn(*shape: int) -> torch.Tensor:
        return (3 * torch.randn(*shape, generator=generator)).to(device, dtype)

    return [(randn(7, 13), 2.5), (randn(3, 5, 33), 30.0)]


def make_hal(tmp_path: Any) -> HardwareAbstractionLayer:
    settings = Settings.from_env(
        {"TORCHHAL_CACHE_DIR": str(tmp_path / "cache"), "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}
    )
    return HardwareAbstractionLayer(settings=settings)


def define_softcap(hal: HardwareAbstractionLayer, fn: Callable[..., Any], provider: str) -> list[str]:
    """`softcap` defined on `hal` as a plugin's hook defines it, with one candidate recording its calls."""
    hal.devices()
    calls: list[str] = []

    def candidate(x: torch.Tensor, cap: float) -> torch.Tensor:
        calls.append(provider)
        return fn(x, cap)

    hal.kernels.define_op(OP, softcap_reference, signature=softcap_signature, examples=softcap_examples)
    hal.kernels.register(OP, "fast", candidate, provider=provider, priority=50)
    return calls


@pytest.fixture
def default_hal(tmp_path: Any) -> Iterator[HardwareAbstractionLayer]:
    hal = make_hal(tmp_path / "default")
    torchhal.ops.set_default_hal(hal)
    try:
        yield hal
    finally:
        torchhal.ops.set_default_hal(None)


def random_input() -> tuple[torch.Tensor, float]:
    return 3 * torch.randn(random.randint(2, 9), random.randint(17, 70)), random.uniform(1.0, 10.0)


def test_ops_dispatch_runs_a_plugin_op_through_the_default_hal_and_the_innermost_use(default_hal, tmp_path):
    ours = define_softcap(default_hal, softcap_fp32, "acme")
    other = make_hal(tmp_path / "other")
    theirs = define_softcap(other, softcap_fp32, "other")
    x, cap = random_input()

    out = torchhal.ops.dispatch(OP, x, cap)
    assert ours == ["acme"] and theirs == []
    assert_matches_reference(default_hal, OP, out, x, cap)

    with other.use("cpu"):  # the use() block's HAL, not the default one
        inner = torchhal.ops.dispatch(OP, x, cap)
        with default_hal.use("cpu"):  # the innermost block wins
            innermost = torchhal.ops.dispatch(OP, x, cap)
    assert ours == ["acme", "acme"] and theirs == ["other"]
    assert_matches_reference(other, OP, inner, x, cap)
    assert_matches_reference(default_hal, OP, innermost, x, cap)


def test_ops_dispatch_of_an_unknown_op_names_it_and_the_defined_ones(default_hal, tmp_path):
    define_softcap(default_hal, softcap_fp32, "acme")
    x, _ = random_input()
    with pytest.raises(UnknownOpError) as raised:
        torchhal.ops.dispatch("softcapp", x, 1.0)
    message = str(raised.value)
    assert message.startswith("unknown op 'softcapp'; defined ops: ")
    assert "softcap, " in message and "rms_norm" in message and "attention" in message
    other = make_hal(tmp_path / "other")
    with (
        other.use("cpu"),
        pytest.raises(UnknownOpError, match=r"^unknown op 'softcap'; defined ops: .*rms_norm"),
    ):
        torchhal.ops.dispatch(OP, x, 1.0)  # defined on the default HAL only


def test_ops_dispatch_keeps_nothing_of_an_unknown_op(default_hal):
    """A tensor passed where the op's name goes (`dispatch(x, w)`) was kept, as a key of the
    default HAL's bound dispatchers, for the life of the process."""
    x = torch.randn(random.randint(100, 200), 64)
    kept = weakref.ref(x)
    with pytest.raises(
        UnknownOpError, match=r"^unknown op of type Tensor \(op names are strings\)"
    ) as raised:
        torchhal.ops.dispatch(x, x)
    assert "tensor(" not in str(raised.value)  # named by its type, not printed whole
    del raised
    del x
    gc.collect()
    assert kept() is None


class SoftcapOnTheHost(CPUAdapter):
    """The host adapter with a plugin's hook, as the guide's §8 hands a plugin to the kit."""

    name = "softcap-host"

    def __init__(self, hook: Callable[[KernelRegistry], None]) -> None:
        super().__init__()
        self.hook = hook

    def register_kernels(self, registry: KernelRegistry) -> None:
        self.hook(registry)


def kernel_results(hook: Callable[[KernelRegistry], None]) -> dict[str, CheckResult]:
    suite = ConformanceSuite(SoftcapOnTheHost(hook), seed=random.randrange(2**63))
    return {c.id: suite.run_check(c) for c in suite.checks() if c.id.startswith(f"kernel.{OP}/")}


def hook_with(
    examples: Any = softcap_examples, **candidates: Callable[..., Any]
) -> Callable[[KernelRegistry], None]:
    def hook(registry: KernelRegistry) -> None:
        registry.define_op(OP, softcap_reference, signature=softcap_signature, examples=examples)
        for name, fn in candidates.items():
            registry.register(OP, name, fn, provider="acme")

    return hook


def test_the_kit_passes_a_correct_candidate_of_a_plugin_op_on_its_examples_in_every_dtype():
    drawn: list[tuple[torch.device, torch.dtype]] = []

    def examples(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
        drawn.append((device, dtype))
        return softcap_examples(device, dtype, generator)

    (result,) = kernel_results(hook_with(examples, fp32=softcap_fp32)).values()
    declared = CPUAdapter().discover()[0].dtypes
    dtypes = [d.to_torch() for d in CANDIDATE_DTYPES if d in declared]
    assert len(dtypes) >= 2  # fp32 and fp64 at least: more than one dtype checked
    assert result.status is CheckStatus.PASSED, result.reason
    assert result.reason.startswith(f"{2 * len(dtypes)} case(s) within tolerance")
    assert drawn == [(torch.device("cpu"), d) for d in dtypes]


def test_the_kit_fails_a_wrong_candidate_of_a_plugin_op_naming_it_and_the_case():
    results = kernel_results(hook_with(fp32=softcap_fp32, wrong=softcap_off_in_the_last_column))
    assert results[f"kernel.{OP}/acme/fp32"].status is CheckStatus.PASSED
    wrong = results[f"kernel.{OP}/acme/wrong"]
    assert wrong.status is CheckStatus.FAILED
    assert wrong.reason.startswith("cpu fp32 example 0 (7x13, 2.5): output 0: error "), wrong.reason


def test_a_raising_or_malformed_examples_fails_the_ops_checks_naming_the_op():
    def raising(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
        raise ValueError("no inputs today")

    def one_list(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[Any]:
        first, second = softcap_examples(device, dtype, generator)
        return [first, list(second)]

    said = {
        " raised ValueError: no inputs today": raising,
        " must return a list of argument tuples, got tuple": lambda *a: tuple(softcap_examples(*a)),
        ": item 1 must be a tuple of the op's arguments, got list": one_list,
    }
    for what, examples in said.items():
        (result,) = kernel_results(hook_with(examples, fp32=softcap_fp32)).values()
        assert result.status is CheckStatus.FAILED
        assert result.reason.startswith(f"op {OP!r}: examples(cpu, torch.float32, generator){what}"), (
            result.reason
        )


def test_examples_that_ignore_the_dtype_asked_fail_instead_of_certifying_it():
    """Examples always in fp32 ran the bf16 and fp16 cases in fp32: a candidate wrong only in
    bf16 passed, certified for bf16. An fp32 side tensor beside one in the dtype asked is fine."""

    def always_fp32(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
        return softcap_examples(device, torch.float32, generator)

    def wrong_in_bf16(x: torch.Tensor, cap: float) -> torch.Tensor:
        out = softcap_fp32(x, cap)
        return out * 2 + 1 if x.dtype == torch.bfloat16 else out

    (result,) = kernel_results(hook_with(always_fp32, wrong=wrong_in_bf16)).values()
    assert result.status is CheckStatus.FAILED
    assert (
        f"op {OP!r}: examples(cpu, torch.bfloat16, generator): item 0 has no floating tensor in "
        "torch.bfloat16 (its floating tensors are torch.float32)"
    ) in result.reason, result.reason


def test_examples_give_no_inputs_in_a_dtype_the_op_does_not_take():
    """An empty list: that dtype is skipped, and said; none in any dtype is not applicable."""

    def fp32_only(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
        return softcap_examples(device, dtype, generator) if dtype == torch.float32 else []

    (result,) = kernel_results(hook_with(fp32_only, fp32=softcap_fp32)).values()
    assert result.status is CheckStatus.PASSED, result.reason
    assert re.match(
        r"2 case\(s\) within tolerance, .*; its op's examples give no inputs in cpu ", result.reason
    )
    assert "cpu bf16" in result.reason and "cpu fp32" not in result.reason
    (result,) = kernel_results(hook_with(lambda *a: [], fp32=softcap_fp32)).values()
    assert result.status is CheckStatus.NOT_APPLICABLE
    assert result.reason.startswith("no inputs: its op's examples give none in cpu "), result.reason


def test_examples_may_keep_fixed_dtype_inputs_beside_the_dtype_asked_as_an_argument():
    """A dequantize: int8 values and fp32 scales whatever the output dtype, which it takes as an
    argument; its candidates are checked in every dtype."""
    op = "dequantize"

    def reference(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (q.double() * scale.double()[:, None]).to(dtype)

    def signature(q: Any, scale: Any, dtype: Any) -> tuple[Any, ...]:
        return (q.dtype, scale.dtype, dtype, q.dim())

    def examples(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
        q = torch.randint(-128, 128, (7, 33), generator=generator, dtype=torch.int8)
        return [(q.to(device), torch.rand(7, generator=generator).to(device), dtype)]

    def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (q.to(torch.promote_types(dtype, torch.float32)) * scale[:, None]).to(dtype)

    def hook(registry: KernelRegistry) -> None:
        registry.define_op(op, reference, signature=signature, examples=examples)
        registry.register(op, "fp32", dequantize, provider="acme")

    suite = ConformanceSuite(SoftcapOnTheHost(hook), seed=random.randrange(2**63))
    (result,) = [suite.run_check(c) for c in suite.checks() if c.id == f"kernel.{op}/acme/fp32"]
    assert result.status is CheckStatus.PASSED, result.reason
    assert result.reason.startswith(f"{len(CANDIDATE_DTYPES)} case(s) within tolerance"), result.reason


def test_examples_the_ops_signature_refuses_fail_naming_the_disagreement():
    def wrong_cap(device: torch.device, dtype: torch.dtype, generator: torch.Generator) -> list[tuple]:
        return [(x, 2) for x, _ in softcap_examples(device, dtype, generator)]  # an int cap

    (result,) = kernel_results(hook_with(wrong_cap, fp32=softcap_fp32)).values()
    assert result.status is CheckStatus.FAILED
    assert "the op's signature rejected its own examples (InvalidArgumentError: softcap:" in result.reason


def test_without_examples_its_candidates_are_not_applicable_saying_how_to_give_them():
    (result,) = kernel_results(hook_with(None, fp32=softcap_fp32)).values()
    assert result.status is CheckStatus.NOT_APPLICABLE
    assert result.reason == (
        f"the kit has no inputs for op {OP!r}: give them where the op is defined, as "
        f"define_op({OP!r}, ..., examples=fn), fn(device, dtype, generator) returning a list of "
        "argument tuples (fresh random inputs at odd shapes)"
    )


@pytest.mark.parametrize(
    ("part", "value"), [("reference", None), ("signature", "dtype"), ("examples", [(torch.ones(1), 1.0)])]
)
def test_define_op_refuses_what_cannot_be_called_naming_the_op(part, value):
    registry = KernelRegistry()
    given = {"reference": softcap_reference, "signature": softcap_signature, part: value}
    reference = given.pop("reference")
    expected = "callable or None" if part == "examples" else "callable"
    with pytest.raises(
        InvalidArgumentError, match=rf"^define_op: op 'softcap': {part} must be {expected}, got "
    ):
        registry.define_op(OP, reference, **given)
    assert OP not in registry.ops()  # nothing half-defined


def test_define_op_names_a_long_refused_value_by_its_type_and_a_shortened_repr():
    """A list of example tuples passed where the callable goes printed whole (14,000 characters)."""
    value = [(torch.randn(1000), 1.0)] * 8
    with pytest.raises(InvalidArgumentError) as raised:
        KernelRegistry().define_op(OP, softcap_reference, signature=softcap_signature, examples=value)
    message = str(raised.value)
    assert message.startswith(
        "define_op: op 'softcap': examples must be callable or None, got list [(tensor("
    )
    assert len(message) < 400, len(message)  # whole, it was over 100,000
