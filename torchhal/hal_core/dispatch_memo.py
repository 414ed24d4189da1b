"""The dispatch memo (argument layouts and guards): it remembers kernels.py's selections, never makes one."""

from __future__ import annotations

import importlib
import operator
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

from torchhal.hal_core import telemetry

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.device import Device
    from torchhal.hal_core.kernels import Selection

log = telemetry.get_logger("torchhal.kernels")
SEEN_LIMIT = 4096  # remembered argument layouts per op before the memo starts over


_Hit = tuple["Device", "Selection"]  # a memo hit: the device to run on and the selection


class _ArgumentMemo:
    """One op's validated argument layouts: key -> (device, selection) and the layout's guard, and
    the few layouts found last with their guards. The guards are checked first: an op is mostly
    called with one to three layouts over and over (once per layer of a model, e.g. Qwen3's
    hidden, q and k norms), and torch's C++ check of a guard's tensors costs a fifth to a third
    of keying them. Never cleared: the registry replaces it (`KernelRegistry._forget_layouts`)."""

    __slots__ = ("entries", "recent")

    def __init__(self) -> None:
        self.entries: dict[tuple[Hashable, ...], tuple[_Hit, _Guard | None]] = {}
        # (guard, hit) pairs, most recent first; one tuple, replaced whole, so a reader never
        # pairs one thread's guard with another's hit
        self.recent: tuple[tuple[_Guard, _Hit], ...] = ()

    def remember(self, key: tuple[Hashable, ...], route: Hashable, args: tuple[Any, ...], hit: _Hit) -> None:
        """A newly validated layout: kept under its key, with a guard made once, now."""
        if len(self.entries) >= SEEN_LIMIT:
            self.entries.clear()  # bounded: many distinct shapes re-validate, never grow memory
        guard = _guard(route, args)
        self.entries[key] = hit, guard
        self._promote(guard, hit)

    def found(self, key: tuple[Hashable, ...], route: Hashable, args: tuple[Any, ...]) -> _Hit | None:
        """The hit for a key seen before (None if not), its guard put first among the recent ones.
        The guard is made again only where the caller's thread-local state refuses the stored one
        (e.g. inside `inference_mode`); a layout without one (a tensor passed twice) stays keyed."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        hit, guard = entry
        if guard is not None and not guard.admits(route, args):
            guard = _guard(route, args)
            self.entries[key] = hit, guard
        self._promote(guard, hit)
        return hit

    def _promote(self, guard: _Guard | None, hit: _Hit) -> None:
        if guard is not None:
            self.recent = ((guard, hit), *self.recent[: RECENT_LAYOUTS - 1])


class _Guard:
    """What a call must match to reuse a memo entry without keying its arguments: the same route
    and number of arguments, scalars of the same types and values, and tensors that pass torch's
    C++ `TensorGuards` check (Dynamo's: Python type, dispatch keys, dtype, device, requires_grad,
    sizes and strides). That is everything the key holds and more. Made by `_guard`. This is the
    reference: torchhal_speedups.Guard, the same in C, serves where installed (`_guard_type`)."""

    __slots__ = (
        "arity",
        "check",
        "requires_grad",
        "route",
        "scalar_types",
        "scalars_of",
        "tensors_of",
        "values",
    )

    def __init__(
        self, route: Hashable, args: tuple[Any, ...], tensor_at: list[int], check: Callable[..., bool]
    ) -> None:
        scalar_at = [i for i in range(len(args)) if i not in tensor_at]
        self.route, self.arity, self.check = route, len(args), check
        self.requires_grad = any(args[i].requires_grad for i in tensor_at)  # the check holds it to this
        self.tensors_of, self.scalars_of = _picker(tensor_at), _picker(scalar_at)
        self.values = tuple(args[i] for i in scalar_at)
        self.scalar_types = tuple((i, type(args[i])) for i in scalar_at)

    def admits(self, route: Hashable, args: tuple[Any, ...]) -> bool:
        if route is not self.route or len(args) != self.arity:
            return False
        # types before values: True == 1 == 1.0, and an argument's own == must never run
        for i, kind in self.scalar_types:
            if type(args[i]) is not kind:
                return False
        if self.scalars_of(args) != self.values:
            return False
        tensors = self.tensors_of(args)
        try:  # the C++ check reads strides, and a strided nested tensor aborts the process there
            for t in tensors:
                if t.is_nested:
                    return False
        except AttributeError:  # no tensor where the guard has one
            return False
        return self.check(*tensors)


def _python_first_admitted(
    recent: tuple[tuple[Any, _Hit], ...], route: Hashable, args: tuple[Any, ...], grad_free_only: bool
) -> _Hit | None:
    """The hit of the first (guard, hit) pair whose guard admits the arguments (when
    `grad_free_only`, among guards made from tensors that required no grad), else None. The
    reference for torchhal_speedups' `first_admitted`, and the fallback where it is missing."""
    for guard, hit in recent:
        if not (grad_free_only and guard.requires_grad) and guard.admits(route, args):
            return hit
    return None


def guard_implementation() -> str:
    """What the memo's guards run in: "torchhal_speedups" (C) or "python"."""
    return "python" if (_GUARD or _guard_type()) is _Guard else "torchhal_speedups"


SPEEDUPS_GUARD_API = 1  # torchhal_speedups.GUARD_API this torchhal's memo calls


def _guard_type() -> Any:
    """The guard type, bound on first use with the loop over guards (`_first_admitted`): the C ones
    of the optional torchhal_speedups distribution where it imports, unless
    TORCHHAL_PURE_PYTHON_GUARDS is on (to compare, or to test both); else the reference ones
    above, which is logged once."""
    global _GUARD
    from torchhal.hal_core.settings import env_bool  # settings imports the registry, which imports this

    speedups: Any = None
    if not env_bool(PURE_PYTHON_GUARDS):
        try:
            speedups = importlib.import_module("torchhal_speedups")
        except ImportError as exc:
            log.info(
                "torchhal_speedups is not installed: the dispatch memo's guards run in Python "
                "(0.2 to 0.5 µs more per op call on the GPU hosts measured, 0.6 to 1.6 µs on a 2-core VM)",
                error=repr(exc),
            )
        else:
            found = getattr(speedups, "GUARD_API", None)
            if found != SPEEDUPS_GUARD_API:  # a separate distribution: upgraded apart from torchhal
                log.warning(
                    "torchhal_speedups speaks another guard API: the dispatch memo's guards run in Python",
                    installed=getattr(speedups, "__version__", None),
                    guard_api=found,
                    expected=SPEEDUPS_GUARD_API,
                    hint="install the speedups of this torchhal's source: pip install ./speedups",
                )
                telemetry.count("torchhal.kernel.speedups_mismatch")
                speedups = None
    # the loop before the type: the C loop takes no Python guard, and a guard exists only once
    # the type is bound
    if speedups is None:
        loop, guard = _python_first_admitted, _Guard
    else:
        loop, guard = speedups.first_admitted, speedups.Guard
    for bind in _LOOP_BINDERS:
        bind(loop)
    _GUARD = guard
    return _GUARD


def _argument_key(route: Hashable, args: tuple[Any, ...]) -> tuple[Hashable, ...]:
    """What a signature may depend on: each tensor's type, dtype, shape, strides and device; each
    scalar's type and value (True == 1 == 1.0 hash alike), and a tuple's item types too (a
    window of (True, 0) is refused where (1, 0) is not); and the route. A tuple holding anything
    but plain scalars and tuples of them raises TypeError (its call is validated every time, as
    the guards, which take no tuple, never admit it either): a tensor there hashes by identity,
    so the memo's key would keep the caller's tensors alive, one new entry each call."""
    tensor = _TENSOR or _tensor_type()
    parts: list[Hashable] = [route]
    for a in args:
        kind = type(a)
        if kind is tuple:
            types = tuple(map(type, a))  # the common case inline (a window of two ints): one call less
            parts.append((kind, a, types) if _PLAIN.issuperset(types) else (kind, *_scalars_key(a)))
        elif kind in _PLAIN or not isinstance(a, tensor):
            parts.append((kind, a))
        else:
            parts.append((kind, a.dtype, a.shape, a.stride(), a.device))
    return tuple(parts)


def _scalars_key(items: tuple[Any, ...]) -> tuple[Hashable, Hashable]:
    """A tuple argument's key: its items and their types, a nested tuple keyed alike; TypeError
    where an item is neither a plain scalar nor a tuple (see `_argument_key`)."""
    types = tuple(map(type, items))
    if _PLAIN.issuperset(types):  # the common case (a window of two ints): the items themselves
        return items, types
    if not all(kind in _PLAIN or kind is tuple for kind in types):
        raise TypeError("a tuple argument holding more than plain scalars is not memoised")
    return tuple(_scalars_key(a) if type(a) is tuple else a for a in items), types


def _guard(route: Hashable, args: tuple[Any, ...]) -> _Guard | None:
    """A guard for these arguments, or None where one cannot be had: a scalar that is not a
    bool, int, float, str or None (its == may be anything), a tensor subclass (a FakeTensor's
    symbolic sizes abort the C++ check) or a nested tensor, one tensor object passed twice, or a
    torch without a working `TensorGuards` (logged once; every call is then keyed)."""
    guards = _TENSOR_GUARDS or _tensor_guards_type()
    if guards is None:
        return None
    tensor = _TENSOR or _tensor_type()
    tensor_at = [i for i, a in enumerate(args) if isinstance(a, tensor)]
    tensors = tuple(args[i] for i in tensor_at)
    if any(type(a) not in _PLAIN for a in args if not isinstance(a, tensor)):
        return None
    if any(type(t) not in _GUARDED_TENSORS or t.is_nested for t in tensors):
        return None
    try:
        check = guards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
    except (TypeError, RuntimeError) as exc:  # a tensor torch cannot guard
        log.debug("argument layout not guarded", error=repr(exc))
        return None
    if not check(*tensors):  # it refuses one tensor object passed twice (attention(q, q, q))
        return None
    return (_GUARD or _guard_type())(route, args, tensor_at, check)  # type: ignore[no-any-return]


def _picker(positions: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A C-level function returning the arguments at `positions` as a tuple (itemgetter returns
    a lone item bare, so one position is a one-item slice)."""
    if len(positions) == 1:
        return operator.itemgetter(slice(positions[0], positions[0] + 1))
    return operator.itemgetter(*positions) if positions else operator.itemgetter(slice(0, 0))


# Scalars a guard compares by type and value. The key tests them before `isinstance(a,
# torch.Tensor)`: that test is ~4x slower for a non-tensor (torch.Tensor's metaclass).
_PLAIN = frozenset({bool, int, float, str, type(None)})
_GUARDED_TENSORS: frozenset[type] = frozenset()  # torch.Tensor and nn.Parameter, bound with TensorGuards
RECENT_LAYOUTS = 4  # layouts per op checked by guard before the arguments are keyed
_TENSOR: type[torch.Tensor] | None = None  # torch.Tensor, bound on first dispatch (hal_core imports no torch)
_TENSOR_GUARDS: Any = None  # torch's TensorGuards, bound on first use; False where torch has none
PURE_PYTHON_GUARDS = "TORCHHAL_PURE_PYTHON_GUARDS"  # a bool, on: guards in Python, even with the C ones
_GUARD: Any = None  # the guard type (_Guard, or torchhal_speedups.Guard), bound on first use
# Called by `_guard_type` with the loop over an op's recent guards that goes with the guard type
# (the registry's, in kernels.py, keeps it as a global of its own module: a
# `dispatch_memo._first_admitted` would cost every dispatch an attribute lookup).
_LOOP_BINDERS: list[Callable[[Callable[..., Any]], None]] = []


def _tensor_type() -> type[torch.Tensor]:
    global _TENSOR
    import torch

    _TENSOR = torch.Tensor
    return _TENSOR


def _tensor_guards_type() -> Any:
    """torch's C++ tensor guard (private: Dynamo's own since torch 2.0), or None where this torch
    has none or it fails a first check of its behaviour; logged once."""
    global _TENSOR_GUARDS, _GUARDED_TENSORS
    if _TENSOR_GUARDS is False:
        return None
    try:
        import torch
        from torch._C._dynamo.guards import TensorGuards

        guards: Any = TensorGuards  # its stub leaves out the tensors it takes positionally
        one, two = torch.zeros(1), torch.zeros(2)
        check = guards(one, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        if check(one) is not True or check(two) is not False:
            raise TypeError("TensorGuards.check does not tell a shape change")
    except Exception as exc:  # missing, or changed in any way: key every call instead
        _TENSOR_GUARDS = False
        log.warning(
            "torch's TensorGuards is missing or changed: every memoised op call keys its arguments "
            "in Python (about 1 µs more per call)",
            error=repr(exc),
        )
        return None
    _GUARDED_TENSORS = frozenset({torch.Tensor, torch.nn.Parameter})
    _TENSOR_GUARDS = TensorGuards
    return TensorGuards
