"""torch.func's transforms through the ops give what they give through the op's reference, with
the Triton kernels selected (interpreter, fp32): `grad` and `jacrev` for every differentiable op,
and `vmap` of `grad` (per-sample gradients). Before, `grad` and `jacrev` raised torch's message
about `setup_context` (the ops' Function took `ctx` in its forward), and vmap over a grad raised
for want of a vmap rule."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_double_backward import CASES


def _split(op: str) -> tuple[list[torch.Tensor], tuple[int, ...], object, object]:
    """The case's inputs (detached), the positions that take gradients, its op and reference call."""
    make, call, (name, *options) = CASES[op]
    made = make()
    wrt = tuple(i for i, t in enumerate(made) if t.requires_grad)
    return [t.detach() for t in made], wrt, call, (name, options)


def _loss(run, inputs: list[torch.Tensor], wrt: tuple[int, ...]):
    """A scalar of the op's outputs, as a function of the inputs at `wrt` (not linear in them)."""

    def loss(*chosen: torch.Tensor) -> torch.Tensor:
        args = list(inputs)
        for position, value in zip(wrt, chosen, strict=True):
            args[position] = value
        outputs = run(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return sum((o.sin() + 0.5 * o.square()).sum() for o in outputs)

    return loss


def _reference(hal, op: str, name_options):
    name, options = name_options
    reference = hal.kernels.op(name).reference
    return lambda *a: reference(*a[: len(a) - (op == "attention_varlen")], *options)


@pytest.mark.parametrize("op", list(CASES))
def test_torch_func_grad_through_an_op_matches_its_reference(triton_hal, op):
    inputs, wrt, call, name_options = _split(op)
    argnums = tuple(range(len(wrt)))
    with triton_hal.use("cpu"):
        got = torch.func.grad(_loss(call, inputs, wrt), argnums=argnums)(*(inputs[i] for i in wrt))
    truth = torch.func.grad(_loss(_reference(triton_hal, op, name_options), inputs, wrt), argnums=argnums)(
        *(inputs[i] for i in wrt)
    )
    for g, t in zip(got, truth, strict=True):
        torch.testing.assert_close(g, t, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "matmul", "rope"])
def test_torch_func_jacrev_through_an_op_matches_its_reference(triton_hal, op):
    inputs, _, call, name_options = _split(op)

    def first_output(run):
        def f(x: torch.Tensor) -> torch.Tensor:
            out = run(x, *inputs[1:])
            return out[0] if isinstance(out, tuple) else out

        return f

    with triton_hal.use("cpu"):
        got = torch.func.jacrev(first_output(call))(inputs[0])
    truth = torch.func.jacrev(first_output(_reference(triton_hal, op, name_options)))(inputs[0])
    torch.testing.assert_close(got, truth, rtol=2e-4, atol=2e-5)


def test_per_sample_gradients_by_vmap_of_grad(monkeypatch):
    """Opacus-style per-sample gradients of a norm's and a matmul's weights: one per row. Under
    vmap the tensors have no storage, so the Triton kernels fall back to their references (logged,
    counted, demoting nothing: see test_layer_norm's vmap test)."""
    import torchhal

    from .conftest import make_hal

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_hal = make_hal(interpret=True)  # its own: the session HALs' guard fails any fallback

    x, norm_weight, proj = torch.randn(6, 24), torch.randn(24), torch.randn(24, 8)

    def sample_loss(norm, mm):
        def loss(w: torch.Tensor, p: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
            return mm(norm(row[None], w), p).sin().sum()

        return loss

    ours = sample_loss(torchhal.ops.rms_norm, torchhal.ops.matmul)
    rms = triton_hal.kernels.op("rms_norm").reference
    reference = sample_loss(lambda r, w: rms(r, w, 1e-6), torch.matmul)
    per_sample = torch.func.vmap(torch.func.grad(ours, argnums=(0, 1)), in_dims=(None, None, 0))
    with triton_hal.use("cpu"):
        got = per_sample(norm_weight, proj, x)
    truth = torch.func.vmap(torch.func.grad(reference, argnums=(0, 1)), in_dims=(None, None, 0))(
        norm_weight, proj, x
    )
    assert got[0].shape == (6, 24) and got[1].shape == (6, 24, 8)
    assert triton_hal.kernels.fallback_counts and all(
        key.endswith(":torchhal/triton") for key in triton_hal.kernels.fallback_counts
    ), triton_hal.kernels.fallback_counts
    for g, t in zip(got, truth, strict=True):
        torch.testing.assert_close(g, t, rtol=2e-4, atol=2e-5)
