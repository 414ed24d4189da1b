"""The C memo guard (torchhal_speedups) and the Python reference (dispatch_memo._Guard) against an
independent model of what a guard admits, on fresh random layouts, tensors mutated in place
between calls, and construction from what is not a plain tuple."""

from __future__ import annotations

import random

import pytest
import torch
import torchhal_speedups
from torch._C._dynamo.guards import TensorGuards

from torchhal.hal_core import dispatch_memo

KINDS = {"c": torchhal_speedups.Guard, "python": dispatch_memo._Guard}
FIRST_ADMITTED = {"c": torchhal_speedups.first_admitted, "python": dispatch_memo._python_first_admitted}
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.bool, torch.complex64]
SCALARS = [None, True, False, 0, 1, 3, 1.0, 1e-6, float("nan"), "mean", "sum", 2**70]


def layout(t: torch.Tensor) -> tuple[object, ...]:
    """What torch's check holds a tensor to, read through Python."""
    return (type(t), torch._C._dispatch_keys(t), t.dtype, t.device, t.requires_grad, t.shape, t.stride())


def model(
    route: object,
    call: tuple[object, ...],
    seen_route: object,
    seen: tuple[object, ...],
    layouts: list[object],
) -> bool:
    """What a guard made from (seen_route, seen) must answer for (route, call); `layouts`: those of
    the seen tensors when the guard was made."""
    if route is not seen_route or len(call) != len(seen):
        return False
    scalars = [i for i, a in enumerate(seen) if not isinstance(a, torch.Tensor)]
    if any(type(call[i]) is not type(seen[i]) for i in scalars):
        return False
    if any(not (call[i] is seen[i] or call[i] == seen[i]) for i in scalars):
        return False
    tensors = [call[i] for i, a in enumerate(seen) if isinstance(a, torch.Tensor)]
    if any(not isinstance(t, torch.Tensor) or t.is_nested for t in tensors):
        return False
    if len({id(t) for t in tensors}) != len(tensors):
        return False
    return [layout(t) for t in tensors] == layouts


def random_tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DTYPES)
    shape = tuple(rng.choice([0, 1, 2, 3]) for _ in range(rng.choice([0, 1, 2, 3])))
    t = torch.randn(shape).to(dtype) if rng.random() < 0.8 else torch.empty(shape, dtype=dtype, device="meta")
    pick = rng.random()
    if pick < 0.2 and t.dim() >= 2:
        t = t.transpose(0, 1)
    elif pick < 0.3 and t.dim() >= 1:
        t = t.unsqueeze(0).expand(2, *t.shape)  # a zero stride
    elif pick < 0.4:
        t = torch.randn(16, device=t.device).as_strided((2, 3), (1, 1), 2)  # overlapping, offset
    elif pick < 0.45 and t.is_complex():
        t = t.conj()
    if rng.random() < 0.2 and (t.is_floating_point() or t.is_complex()):
        t = t.detach().requires_grad_()
    if rng.random() < 0.1 and t.is_floating_point():
        t = torch.nn.Parameter(t.detach(), requires_grad=rng.random() < 0.5)
    return t


def random_call(rng: random.Random, seen: tuple[object, ...]) -> tuple[object, ...]:
    """`seen` with up to two arguments replaced, or one added or dropped."""
    call = list(seen)
    for _ in range(rng.choice([0, 1, 2])):
        if call:
            i = rng.randrange(len(call))
            a = call[i]
            pick = rng.random()
            if isinstance(a, torch.Tensor) and pick < 0.4:  # a fresh tensor of the same layout
                fresh = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
                fresh.requires_grad_(a.requires_grad)
                call[i] = (
                    torch.nn.Parameter(fresh, a.requires_grad) if type(a) is torch.nn.Parameter else fresh
                )
            elif pick < 0.5 and isinstance(a, torch.Tensor):
                call[i] = a.detach().as_subclass(torch.nn.Parameter)
            elif pick < 0.6:
                call[i] = rng.choice(call)  # maybe one tensor twice
            elif pick < 0.8:
                call[i] = rng.choice(SCALARS)
            else:
                call[i] = random_tensor(rng)
    if rng.random() < 0.1:
        call.append(rng.choice(SCALARS))
    return tuple(call)


def mutate(rng: random.Random, t: torch.Tensor) -> None:
    """Change a tensor's layout in place, as a caller may between two calls."""
    pick = rng.random()
    if pick < 0.25 and t.dim() == 2:
        t.t_()
    elif pick < 0.5:
        t.resize_(tuple(s + 1 for s in t.shape) or (2,))
    elif pick < 0.75:
        t.set_(torch.zeros(3, dtype=t.dtype))
    else:
        t.set_(torch.zeros(4, dtype=t.dtype)).as_strided_((2,), (2,), 1)


@pytest.mark.parametrize("run", range(3))
def test_both_guards_answer_as_the_model_on_random_layouts(run):
    """Routes, arities, scalar types and values, dtypes, devices, shapes (0-size, 0-dim),
    strides (0, transposed, overlapping), conj views, requires_grad, Parameters, one tensor
    twice, and tensors whose layout changes in place after the guard was made."""
    seed = random.randrange(2**32)  # fresh each run; in every failure message
    rng = random.Random(seed)
    answers = set()
    for _ in range(150):
        route = rng.choice([object(), "r", None])
        seen = tuple(
            random_tensor(rng) if rng.random() < 0.5 else rng.choice(SCALARS) for _ in range(rng.randrange(5))
        )
        at = [i for i, a in enumerate(seen) if isinstance(a, torch.Tensor)]
        if len({id(seen[i]) for i in at}) != len(at):
            continue
        tensors = [seen[i] for i in at]
        check = TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        layouts = [layout(t) for t in tensors]
        made = {kind: guard(route, seen, at, check) for kind, guard in KINDS.items()}
        calls = [(route, seen), (object(), seen)] + [(route, random_call(rng, seen)) for _ in range(4)]
        plain = [
            t for t in tensors if type(t) is torch.Tensor and t.device.type == "cpu" and not t.requires_grad
        ]
        if plain and rng.random() < 0.5:
            mutate(rng, rng.choice(plain))
            calls.append((route, seen))
        for call_route, call in calls:
            expected = model(call_route, call, route, seen, layouts)
            answers.add(expected)
            for kind, guard in made.items():
                assert guard.admits(call_route, call) is expected, (seed, kind, seen, call)
                for grad_free_only in (False, True):
                    hit = FIRST_ADMITTED[kind](((guard, "hit"),), call_route, call, grad_free_only)
                    admitted = expected and not (grad_free_only and guard.requires_grad)
                    assert hit == ("hit" if admitted else None), (seed, kind, grad_free_only, seen, call)
    assert answers == {True, False}


class LongArgs(tuple):
    """A tuple whose __len__ lies: the Python guard reads it, the C one would read the storage."""

    def __len__(self) -> int:
        return 99


def test_the_c_guard_is_made_from_exact_tuples_only():
    """Made from a tuple subclass, it took the storage's two items where the Python guard reads
    99 through __len__ (an IndexError): the two disagreed. It refuses them, as `admits` does."""
    args = LongArgs((torch.randn(2), 1e-6))
    check = TensorGuards(args[0], dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    with pytest.raises(TypeError, match=r"args must be a tuple, not <class '.*LongArgs'>"):
        torchhal_speedups.Guard(object(), args, [0], check)
