"""The dispatch memo's guard in C (torchhal_speedups) against the Python reference (dispatch_memo._Guard):
the same answers, exceptions and state on the same arguments, no leaked references, and the
registry's choice between them. `bash scripts/test.sh` also runs the registry and autograd tests
with TORCHHAL_PURE_PYTHON_GUARDS=1, so both kinds serve a real registry."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torchhal_speedups
from torch._C._dynamo.guards import TensorGuards

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core import dispatch_memo, kernels, telemetry

KINDS = {"c": torchhal_speedups.Guard, "python": dispatch_memo._Guard}
FIRST_ADMITTED = {"c": torchhal_speedups.first_admitted, "python": dispatch_memo._python_first_admitted}


class Route:
    """Equal to every other Route: a guard compares routes by identity, never by ==."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Route)

    __hash__ = object.__hash__


class RaisingEq:
    def __eq__(self, other: object) -> bool:
        raise ValueError("== raised")

    __hash__ = object.__hash__


@pytest.fixture
def hal(settings):
    return HardwareAbstractionLayer(settings=settings(disable_plugin_autoload="1"))


class NestedRaises:
    """A non-tensor whose is_nested raises something other than AttributeError."""

    @property
    def is_nested(self) -> bool:
        raise KeyError("is_nested")


class NoNestedTruth:
    """is_nested is there, but its truth raises AttributeError (caught, as in the Python guard)."""

    class _Falsy:
        def __bool__(self) -> bool:
            raise AttributeError("no truth")

    is_nested = _Falsy()


def guards(route: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    """A guard of each kind from the same arguments and the same torch check."""
    tensor_at = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    tensors = [args[i] for i in tensor_at]
    check = TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    return {name: kind(route, args, tensor_at, check) for name, kind in KINDS.items()}


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "returned", call()
    except Exception as exc:
        return "raised", type(exc)


ROUTE = Route()
X, W = torch.randn(6, 32), torch.randn(32)
SEEN = (X, W, 1e-6, True, None, "mean", 3)


def calls() -> list[tuple[str, Any, tuple[Any, ...]]]:
    """Fresh arguments against a guard made from (ROUTE, SEEN): (what, route, args)."""
    x, w = torch.randn(6, 32), torch.randn(32)
    rest = SEEN[2:]
    cases = [
        ("the same objects", ROUTE, SEEN),
        ("fresh tensors, same layout", ROUTE, (x, w, *rest)),
        ("equal scalars, fresh objects", ROUTE, (x, w, float("1e-6"), True, None, "".join("mean"), 3)),
        ("another shape", ROUTE, (torch.randn(6, 31), w, *rest)),
        ("another stride", ROUTE, (torch.randn(32, 6).t(), w, *rest)),
        ("a sliced view", ROUTE, (torch.randn(6, 64)[:, ::2], w, *rest)),
        ("another dtype", ROUTE, (x.double(), w, *rest)),
        ("requires grad", ROUTE, (x, w.clone().requires_grad_(), *rest)),
        ("a Parameter", ROUTE, (x, torch.nn.Parameter(w, requires_grad=False), *rest)),
        ("1 for True", ROUTE, (x, w, 1e-6, 1, None, "mean", 3)),
        ("1.0 for True", ROUTE, (x, w, 1e-6, 1.0, None, "mean", 3)),
        ("True for 3", ROUTE, (x, w, 1e-6, True, None, "mean", True)),
        ("3.0 for 3", ROUTE, (x, w, 1e-6, True, None, "mean", 3.0)),
        ("another float", ROUTE, (x, w, 1e-5, True, None, "mean", 3)),
        ("another str", ROUTE, (x, w, 1e-6, True, None, "sum", 3)),
        ("False for True", ROUTE, (x, w, 1e-6, False, None, "mean", 3)),
        ("0 for None", ROUTE, (x, w, 1e-6, True, 0, "mean", 3)),
        ("a tuple for None", ROUTE, (x, w, 1e-6, True, (1, 0), "mean", 3)),
        ("a scalar whose == raises, for None", ROUTE, (x, w, 1e-6, True, RaisingEq(), "mean", 3)),
        ("one argument fewer", ROUTE, (x, w, *rest[:-1])),
        ("one argument more", ROUTE, (x, w, *rest, 0)),
        ("no arguments", ROUTE, ()),
        ("an equal route", Route(), (x, w, *rest)),
        ("no route", None, (x, w, *rest)),
        ("a list for a tensor", ROUTE, ([1.0], w, *rest)),
        ("None for a tensor", ROUTE, (x, None, *rest)),
        ("a float for a tensor", ROUTE, (x, 1e-6, *rest)),
        ("an is_nested that raises KeyError", ROUTE, (x, NestedRaises(), *rest)),
        ("an is_nested whose truth raises AttributeError", ROUTE, (NoNestedTruth(), w, *rest)),
    ]
    with torch.inference_mode():
        cases.append(("inference tensors", ROUTE, (x.clone(), w.clone(), *rest)))
    with warnings.catch_warnings():  # "nested tensors is in prototype stage", once a process
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2, 32), torch.randn(3, 32)], layout=torch.strided)
    cases.append(("a strided nested tensor", ROUTE, (nested, w, *rest)))
    return cases


def test_both_guards_hold_the_same_state():
    made = guards(ROUTE, SEEN)
    for name in ("route", "arity", "check", "requires_grad", "values", "scalar_types"):
        assert getattr(made["c"], name) == getattr(made["python"], name), name
    assert made["c"].scalar_types == ((2, float), (3, bool), (4, type(None)), (5, str), (6, int))
    assert guards(ROUTE, (X, W.clone().requires_grad_(), 1e-6))["c"].requires_grad is True


def test_both_guards_answer_every_call_alike():
    """Neither a strided nested tensor nor anything else in a tensor's place aborts the process."""
    made = guards(ROUTE, SEEN)
    seen = set()
    for what, route, args in calls():
        answers = {
            name: outcome(lambda g=guard, r=route, a=args: g.admits(r, a)) for name, guard in made.items()
        }
        assert answers["c"] == answers["python"], what
        seen.add(answers["c"])
    # the cases reach every kind of answer, so a guard stuck on one of them fails the comparison
    assert seen == {("returned", True), ("returned", False), ("raised", KeyError)}


def test_an_exception_from_a_scalars_eq_comes_out_of_both():
    """Only past an exact type match: a guard made by the registry holds plain scalars only."""
    seen = RaisingEq()
    made = guards(ROUTE, (X, 1.0, seen))
    for kind, guard in made.items():
        assert guard.admits(ROUTE, (X, 1.0, seen)) is True, kind  # the same object: == is not asked
        assert guard.admits(ROUTE, (X, 2.0, RaisingEq())) is False, kind  # values in order
        with pytest.raises(ValueError, match="== raised"):
            guard.admits(ROUTE, (X, 1.0, RaisingEq()))
        with pytest.raises(ValueError, match="== raised"):
            FIRST_ADMITTED[kind](((guard, "hit"),), ROUTE, (X, 1.0, RaisingEq()), False)


def test_a_guard_with_a_tuple_scalar_compares_it_by_value_after_its_type():
    window = (1, 0)
    made = guards(ROUTE, (X, window))
    for args, expected in [
        ((X, (1, 0)), True),
        ((X, (True, 0)), True),  # == by value, as in Python; the key tells the item types apart
        ((X, (1, 1)), False),
        ((X, [1, 0]), False),
        ((X, None), False),
    ]:
        assert made["c"].admits(ROUTE, args) is made["python"].admits(ROUTE, args) is expected, args


@pytest.mark.parametrize("grad_free_only", [False, True])
def test_first_admitted_picks_the_same_hit(grad_free_only):
    x, w, trained = torch.randn(4, 8), torch.randn(8), torch.randn(8, requires_grad=True)
    layouts = [(x, trained, 1e-6), (x, w, 1e-6), (torch.randn(2, 8), w, 1e-6), (x, w, 1e-5)]
    made = [guards(ROUTE, args) for args in layouts]
    recent = {kind: tuple((g[kind], f"hit {i}") for i, g in enumerate(made)) for kind in KINDS}
    probes = [*layouts, (torch.randn(4, 8), torch.randn(8), 1e-6), (x, w, 1e-4), (x, w)]
    hits = []
    for args in probes:
        found = {kind: FIRST_ADMITTED[kind](recent[kind], ROUTE, args, grad_free_only) for kind in KINDS}
        assert found["c"] == found["python"], args
        assert FIRST_ADMITTED["c"](recent["c"], Route(), args, grad_free_only) is None
        hits.append(found["c"])
    assert hits[0] == (None if grad_free_only else "hit 0")
    assert hits[1:5] == ["hit 1", "hit 2", "hit 3", "hit 1"]
    assert hits[5:] == [None, None]
    assert FIRST_ADMITTED["c"]((), ROUTE, layouts[1], grad_free_only) is None


def test_the_c_loop_takes_only_c_guards():
    python_guard = guards(ROUTE, (X, W))["python"]
    with pytest.raises(TypeError, match="Guard, hit"):
        torchhal_speedups.first_admitted(((python_guard, "hit"),), ROUTE, (X, W), False)
    with pytest.raises(TypeError, match="must be a tuple"):
        torchhal_speedups.first_admitted((), ROUTE, [X, W], False)

    class Args(tuple):  # a subclass's own __len__ would go unread: refused, never misread
        def __len__(self) -> int:
            return 99

    c_guard = guards(ROUTE, (X, W))["c"]
    with pytest.raises(TypeError, match="must be a tuple"):
        c_guard.admits(ROUTE, Args((X, W)))


def test_the_c_guard_leaks_no_references():
    """Every path, refused, admitted and raising, many times over: no reference gained or lost."""
    made = guards(ROUTE, SEEN)["c"]
    hit = object()
    recent = ((made, hit),)
    cases = calls()
    # not bools, small ints, None or interned strings: their counts move with the interpreter's
    plain = (bool, int, str, type(None))
    watched = [made, hit, made.check, SEEN[2], *(r for _, r, _ in cases if r is not None)]
    watched += [a for _, _, args in cases for a in args if not isinstance(a, plain)]
    for _ in range(2):  # the first round may intern or cache
        before = [sys.getrefcount(o) for o in watched]
        for _ in range(2000):
            for _, route, args in cases:
                outcome(lambda route=route, args=args: made.admits(route, args))
                outcome(
                    lambda route=route, args=args: torchhal_speedups.first_admitted(recent, route, args, 1)
                )
    assert [sys.getrefcount(o) for o in watched] == before


def test_bad_construction_is_refused():
    check = TensorGuards(X, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    for tensor_at, error in [([2], ValueError), ([0, 0], ValueError), (["0"], TypeError), (None, TypeError)]:
        with pytest.raises(error):
            torchhal_speedups.Guard(ROUTE, (X, 1.0), tensor_at, check)
    with pytest.raises(TypeError):
        torchhal_speedups.Guard(ROUTE, [X, 1.0], [0], check)


@pytest.fixture
def unbound(monkeypatch):
    """The memo's guard kind unbound, so the test sees it chosen; restored afterwards."""
    monkeypatch.setattr(dispatch_memo, "_GUARD", None)
    monkeypatch.setattr(kernels, "_first_admitted", dispatch_memo._python_first_admitted)
    monkeypatch.delenv(dispatch_memo.PURE_PYTHON_GUARDS, raising=False)
    return monkeypatch


def test_the_registry_uses_the_c_guards_where_they_import(unbound, hal):
    assert dispatch_memo.guard_implementation() == "torchhal_speedups"
    assert kernels._first_admitted is torchhal_speedups.first_admitted
    assert hal.report()["kernel_guards"] == "torchhal_speedups"
    for _ in range(2):
        hal.dispatch("rms_norm", X, W, 1e-6)
    assert [type(g) for g, _ in hal.kernels._seen["rms_norm"].recent] == [torchhal_speedups.Guard]


@pytest.mark.parametrize("value", ["1", "yes"])
def test_the_environment_variable_keeps_the_python_guards(unbound, hal, value):
    unbound.setenv(dispatch_memo.PURE_PYTHON_GUARDS, value)
    for _ in range(2):
        hal.dispatch("rms_norm", X, W, 1e-6)
    assert hal.report()["kernel_guards"] == "python"
    assert kernels._first_admitted is dispatch_memo._python_first_admitted
    assert [type(g) for g, _ in hal.kernels._seen["rms_norm"].recent] == [dispatch_memo._Guard]


def test_choosing_the_python_guards_after_the_c_ones_rebinds_the_loop(unbound, hal):
    """The C loop refuses Python guards, so a later choice of them must take the Python loop too."""
    dispatch_memo._guard_type()
    assert kernels._first_admitted is torchhal_speedups.first_admitted
    unbound.setattr(dispatch_memo, "_GUARD", None)
    unbound.setenv(dispatch_memo.PURE_PYTHON_GUARDS, "1")
    for _ in range(3):
        torch.testing.assert_close(hal.dispatch("rms_norm", X, W, 1e-6), torch.rms_norm(X, (32,), W, 1e-6))
    assert kernels._first_admitted is dispatch_memo._python_first_admitted
    assert [type(g) for g, _ in hal.kernels._seen["rms_norm"].recent] == [dispatch_memo._Guard]


def test_without_the_accelerator_the_python_guards_are_logged_once(unbound, hal, capsys):
    unbound.setitem(sys.modules, "torchhal_speedups", None)  # None: the import fails
    telemetry.configure(log_level="info")
    for _ in range(3):
        hal.dispatch("rms_norm", X, W, 1e-6)
    assert dispatch_memo.guard_implementation() == "python"
    lines = [line for line in capsys.readouterr().err.splitlines() if "torchhal_speedups" in line]
    assert len(lines) == 1 and "guards run in Python" in lines[0], lines


def test_speedups_of_another_guard_api_are_not_used(unbound, hal, capsys):
    """torchhal_speedups is its own distribution, upgraded apart from torchhal: one whose Guard or
    first_admitted changed would have raised AttributeError or misread its arguments on every
    dispatch. Another GUARD_API keeps the Python guards, warned and counted."""
    unbound.setattr(torchhal_speedups, "GUARD_API", dispatch_memo.SPEEDUPS_GUARD_API + 1)
    before = telemetry.counts().get("torchhal.kernel.speedups_mismatch", 0)
    for _ in range(2):
        torch.testing.assert_close(hal.dispatch("rms_norm", X, W, 1e-6), torch.rms_norm(X, (32,), W, 1e-6))
    assert hal.report()["kernel_guards"] == "python"
    assert telemetry.counts()["torchhal.kernel.speedups_mismatch"] == before + 1
    assert "torchhal_speedups speaks another guard API" in capsys.readouterr().err
