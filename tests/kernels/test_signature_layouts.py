"""The registry's argument memo keys a tensor torch calls contiguous without its strides
(`KernelRegistry.dispatch`), so no memoised op's signature may tell apart two such tensors of one
shape: they differ only in the strides of size-1 dims, which no index ever steps. Checked on the
conformance kit's inputs of every op, and on inputs made of size-1 dims, each size-1 dim of each
tensor given another stride; and the memo itself: such a pair shares one entry, a truly strided
tensor of the same shape gets its own."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from torchhal.testing import kernel_inputs


def _restride_size_one_dims(value: Any, stride: int) -> Any:
    """A view of the same elements whose size-1 dims have stride `stride` (torch: still contiguous)."""
    if not isinstance(value, torch.Tensor) or 1 not in value.shape:
        return value
    strides = [stride if n == 1 else s for n, s in zip(value.shape, value.stride(), strict=True)]
    view = value.as_strided(value.shape, strides, value.storage_offset())
    assert view.is_contiguous() == value.is_contiguous() and view.stride() != value.stride()
    return view


def _signature_or_error(registry: Any, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return registry.signature(op, *args, **kwargs)
    except Exception as exc:  # the same refusal, by type and message, counts as the same answer
        return type(exc), str(exc)


def _memoised_ops(registry: Any) -> list[str]:
    return [op for op in registry.ops() if registry.op(op).memoize]


def _size_one_inputs() -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Inputs built of size-1 dims where an op allows them: a hidden size of 1 (norm weights and
    biases of one element), one row, one head, one position."""
    x, w, b = torch.randn(3, 1), torch.randn(1), torch.randn(1)
    q = torch.randn(1, 1, 5, 8)
    return {
        "rms_norm": ((x, w, 1e-6), {}),
        "rms_norm_backward": ((torch.randn(3, 1), x, w, 1e-6), {}),
        "layer_norm": ((x, w, b, 1e-5), {}),
        "layer_norm_forward": ((x, w, b, 1e-5), {}),
        "swiglu": ((torch.randn(1, 7), torch.randn(1, 7)), {}),
        "attention": ((q, q.clone(), q.clone()), {"causal": True}),
        "attention_forward": ((q, q.clone(), q.clone(), True, None, None), {}),
    }


def test_signatures_ignore_the_strides_of_size_one_dims(plain_hal):
    registry = plain_hal.kernels
    g = torch.Generator().manual_seed(0)
    checked = 0
    for op in _memoised_ops(registry):
        cases = kernel_inputs.cases(op, g, torch.float32, registry) or []
        inputs = [(c.args, c.kwargs) for c in cases]
        if op in _size_one_inputs():
            inputs.append(_size_one_inputs()[op])
        for args, kwargs in inputs:
            if not any(isinstance(a, torch.Tensor) and 1 in a.shape for a in (*args, *kwargs.values())):
                continue
            checked += 1
            for stride in (0, 1_000_003):  # neither is any size-1 dim's stride in these inputs
                restrided = tuple(_restride_size_one_dims(a, stride) for a in args)
                assert _signature_or_error(registry, op, restrided, kwargs) == _signature_or_error(
                    registry, op, args, kwargs
                ), f"{op}: size-1 dims with stride {stride} change the signature"
    assert checked >= 8, f"only {checked} input sets had a size-1 dim"


def test_the_memo_shares_contiguous_layouts_and_keeps_strided_ones_apart(plain_hal):
    registry, cpu = plain_hal.kernels, plain_hal.device("cpu")
    validated = []
    opdef = registry.op("rms_norm")

    def counting(*args: Any) -> Any:
        validated.append(args[0].stride())
        return opdef.signature(*args)

    registry._ops["rms_norm"] = type(opdef)(opdef.name, opdef.reference, counting, opdef.doc)
    try:
        w = torch.randn(16)
        x = torch.randn(1, 6, 16)
        registry.call("rms_norm", cpu, x, w, 1e-6)
        registry.call("rms_norm", cpu, _restride_size_one_dims(x, 0), w, 1e-6)
        assert len(validated) == 1  # contiguous alike: one memo entry
        strided = torch.randn(1, 16, 6).transpose(1, 2)  # same shape, not contiguous
        out = registry.call("rms_norm", cpu, strided, w, 1e-6)
        assert len(validated) == 2 and validated[-1] == strided.stride()
        expected = opdef.reference(strided.contiguous(), w, 1e-6)
        torch.testing.assert_close(out, expected)
    finally:
        registry._ops["rms_norm"] = opdef


@pytest.mark.parametrize("hidden", [0, 1])
def test_unit_stride_ignores_dims_that_are_never_stepped(hidden):
    from torchhal.kernels.triton_rows import unit_stride

    t = torch.randn(4, hidden)
    assert unit_stride(t) and unit_stride(t.as_strided(t.shape, (hidden, 5)))
    assert not unit_stride(torch.randn(4, 2).t().contiguous().t())
