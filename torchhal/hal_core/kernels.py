"""KernelRegistry: ops, their candidate implementations, selection and fallback.

An op has one reference implementation in plain PyTorch (the ground truth) and any number of
candidates. Each op also has a *signature* function: it validates the arguments (bad input is
refused here, before any kernel runs) and returns a small hashable summary (dtype, shape
class, flags). Candidates judge only that summary, so a selection cached per (device,
signature) is exactly as valid as a fresh one, and cached dispatch is two dict lookups.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import math
import reprlib
import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from torchhal.hal_core import telemetry
from torchhal.hal_core.dispatch_memo import (
    _LOOP_BINDERS,
    _argument_key,
    _ArgumentMemo,
    _python_first_admitted,
)
from torchhal.hal_core.errors import (
    CallDeclined,
    ConfigurationError,
    InvalidArgumentError,
    KernelFailedError,
    TorchHALError,
    UnknownOpError,
    UnsupportedError,
)
from torchhal.hal_core.tuning import Tuner

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.capabilities import DeviceCapabilities
    from torchhal.hal_core.device import Device

log = telemetry.get_logger("torchhal.kernels")

REFERENCE = "reference"
NOT_SEEN: Any = object()  # `KernelRegistry.dispatch_seen`'s answer for arguments it will not run
# The loop over an op's recent guards; the C one replaces it when dispatch_memo binds the C guards
# (until then no guard exists, and the Python loop would take either kind). A global of this
# module: one lookup per dispatch.
_first_admitted = _python_first_admitted


def _bind_first_admitted(loop: Callable[..., Any]) -> None:
    global _first_admitted
    _first_admitted = loop


_LOOP_BINDERS.append(_bind_first_admitted)


class RejectionReason(str, enum.Enum):
    DEVICE = "device"  # wrong device type, vendor or architecture
    DTYPE = "dtype"
    SHAPE = "shape"  # a size or head dim the kernel does not handle
    LAYOUT = "layout"  # strides, contiguity, packing
    FEATURE = "feature"  # a device feature the kernel needs is missing
    DISABLED = "disabled"  # turned off by TORCHHAL_DISABLE_KERNELS
    FAILED = "failed"  # raised when called; demoted for this signature
    OUTRANKED = "outranked"  # valid, but a higher-priority candidate was chosen


@dataclass(frozen=True, slots=True)
class Rejection:
    candidate: str
    reason: RejectionReason
    detail: str

    def __str__(self) -> str:
        return f"{self.candidate}: {self.reason.value} ({self.detail})"


@dataclass(frozen=True, slots=True)
class Unsupported:
    """What a capability predicate returns to turn a candidate down. `reason` may be given as its
    value ("shape"); anything else is refused here, where the predicate's author sees it."""

    reason: RejectionReason
    detail: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "reason", RejectionReason(self.reason))


Predicate = Callable[["DeviceCapabilities", Any], "Unsupported | None"]
# (device, dtype, generator) -> argument tuples: an op's inputs for the conformance kit
Examples = Callable[["torch.device", "torch.dtype", "torch.Generator"], "list[tuple[Any, ...]]"]
Locate = Callable[[str, Any], "Device"]  # (op, first argument) -> the device to run on


@dataclass(frozen=True, slots=True)
class Candidate:
    """An implementation of an op. `bind`, when given, specialises `fn` for one device's
    capabilities (launch configuration from SIMD width, shared memory, compute units; the
    device a simulated kernel charges) once per selection, not per call."""

    op: str
    name: str
    provider: str
    fn: Callable[..., Any]
    supports: Predicate | None = None
    priority: float = 0.0
    bind: Callable[[DeviceCapabilities], Callable[..., Any]] | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.provider}/{self.name}"


@dataclass(frozen=True, slots=True)
class OpDef:
    name: str
    reference: Callable[..., Any]
    signature: Callable[..., Hashable]
    doc: str = ""
    # The signature depends only on the arguments' dtypes, shapes, strides, devices and scalar
    # values, never on tensor contents: calls can then skip validation for arguments seen before.
    memoize: bool = True
    # fresh random argument tuples for the conformance kit, for an op outside the kit's own inputs
    examples: Examples | None = None
    # torch device types (a tensor's `.device.type`) on which the signature does read tensor
    # contents, where reading them costs no synchronisation (attention_varlen's offsets on the
    # CPU): calls whose first argument is there are validated every time, others are memoised
    reads_values_on: frozenset[str] = frozenset()

    def memoizes(self, args: tuple[Any, ...]) -> bool:
        """Whether a call with `args`, once validated, may skip validation next time."""
        if not self.memoize:
            return False
        if not self.reads_values_on:
            return True
        device = getattr(args[0], "device", None) if args else None
        return device is not None and getattr(device, "type", None) not in self.reads_values_on


@dataclass(frozen=True, slots=True)
class Selection:
    """The chosen candidate for one (op, device, signature) and why the others were not."""

    op: str
    device: str
    signature: Hashable
    candidate: Candidate
    fallbacks: tuple[Candidate, ...]  # valid candidates tried next, in order, on failure
    rejected: tuple[Rejection, ...]
    fn: Callable[..., Any]  # the candidate's callable, bound to the device when it has `bind`
    timings_ms: tuple[tuple[str, float], ...] = ()  # when chosen by measurement, fastest first
    # chosen by priority, not settled by measurement, and never memoised; a later plain call
    # measures. Made while the device's stream captured a graph (timing would break the capture:
    # not cached); for arguments without storage (fake tensors, torch.func's wrappers), which a
    # kernel may not read (cached under a key of its own, `UNMEASURED`, that plain calls never
    # read); or where every contender raised while measured (the arguments may be the cause: not
    # cached). A failure of a provisional selection demotes nothing, but in that last case once a
    # later candidate has run on the same arguments (as `_fall_back` judges any call).
    provisional: bool = False

    def explain(self) -> str:
        lines = [f"{self.op} on {self.device} for {self.signature}: {self.candidate.qualified_name}"]
        lines += [f"  measured {name}: {ms:.4g} ms" for name, ms in self.timings_ms]
        if self.provisional:
            why = (
                "every contender raised while measured"
                if _raised_while_measured(self)
                else "not measured: a graph capture, arguments without storage, or every contender "
                "declined the call"
            )
            lines.append(f"  provisional: priority order ({why})")
        lines += [f"  rejected {r}" for r in self.rejected]
        return "\n".join(lines)


class KernelRegistry:
    """Ops and candidates for one HAL. Selections are cached; fallbacks are counted."""

    def __init__(self, disabled: Iterable[str] = frozenset(), tuner: Tuner | None = None) -> None:
        """`disabled`: candidate names (or provider/name) never selected, as `disabled` takes them;
        `tuner` measures valid candidates once per (device, signature)."""
        self._disabled = _checked_disabled(disabled)
        self.tuner = tuner
        self._ops: dict[str, OpDef] = {}
        self._candidates: dict[str, list[Candidate]] = {}
        # (device id, signature), or for arguments without storage (device id, signature, UNMEASURED)
        self._cache: dict[str, dict[tuple[Hashable, ...], Selection]] = {}
        # per memoised op: the argument layouts already validated, and the selection each leads to
        self._seen: dict[str, _ArgumentMemo] = {}
        self._lock = threading.Lock()
        # "op:provider/name" -> how often that candidate failed for that op (the same candidate
        # name, e.g. torchhal/triton, serves several ops)
        self.fallback_counts: dict[str, int] = {}
        self._call_routes: dict[Device, Hashable] = {}  # see `_route_of`
        self._declines_said: set[tuple[str, str]] = set()  # (op, candidate) logged once

    @property
    def disabled(self) -> frozenset[str]:
        """Candidate names (or provider/name) never selected (TORCHHAL_DISABLE_KERNELS)."""
        return self._disabled

    @disabled.setter
    def disabled(self, names: Iterable[str]) -> None:
        """Refused as Settings refuses it where it names the reference; otherwise every selection and
        memoised layout is dropped (they were judged under the old names), and a selection being
        made meanwhile is not cached (each op's candidate list is replaced, as `register` does)."""
        checked = _checked_disabled(names)
        with self._lock:
            self._disabled = checked
            for op, candidates in self._candidates.items():
                self._candidates[op] = list(candidates)
                self._cache[op].clear()
                self._forget_layouts(op)
        log.info("disabled kernels changed: selections dropped", disabled=sorted(checked))

    def define_op(
        self,
        name: str,
        reference: Callable[..., Any],
        *,
        signature: Callable[..., Hashable],
        doc: str = "",
        memoize: bool = True,
        examples: Examples | None = None,
        reads_values_on: Collection[str] = (),
    ) -> None:
        """Define an op with its reference implementation, which is also its last candidate.
        `memoize=False` for an op whose signature reads tensor contents (e.g. offsets);
        `reads_values_on=("cpu",)` where it reads them only for tensors on those device types.
        `examples(device, dtype, generator)` returns a list of argument tuples (fresh random
        inputs at odd shapes) on which the conformance kit checks the op's candidates against
        its reference; without it the kit cannot check them (the core's ops have the kit's own)."""
        opdef = OpDef(
            name, reference, signature, doc, memoize, examples, _device_types(name, reads_values_on)
        )
        _check_op(opdef)
        with self._lock:
            if name in self._ops:
                raise TorchHALError(f"op {name!r} is already defined (by {self._ops[name].reference!r})")
            # its tables first, the op last: a concurrent call of an op that was visible before
            # its tables existed raised a bare KeyError
            self._candidates[name] = [Candidate(name, REFERENCE, "torchhal", reference, None, -math.inf)]
            self._cache[name] = {}
            if memoize:
                self._seen[name] = _ArgumentMemo()
            self._ops[name] = opdef

    def register(
        self,
        op: str,
        name: str,
        fn: Callable[..., Any],
        *,
        provider: str,
        supports: Predicate | None = None,
        priority: float = 0.0,
        bind: Callable[[DeviceCapabilities], Callable[..., Any]] | None = None,
    ) -> Candidate:
        """Add a candidate implementation of `op`. Higher priority is preferred. Names are unique
        per provider: two vendors may each have a `triton` candidate."""
        _check_name("register", "op", op)
        self._opdef(op)
        candidate = Candidate(op, name, provider, fn, supports, priority, bind)
        _check_candidate(candidate)
        with self._lock:
            if name == REFERENCE or any(
                c.qualified_name == candidate.qualified_name for c in self._candidates[op]
            ):
                raise TorchHALError(f"op {op!r} already has a candidate named {candidate.qualified_name!r}")
            # a new list, never this one sorted in place: a selection may be iterating it, and
            # compares its list with the op's current one before caching what it chose
            self._candidates[op] = sorted([*self._candidates[op], candidate], key=_rank)
            self._cache[op].clear()
            self._forget_layouts(op)
        return candidate

    @contextlib.contextmanager
    def all_or_nothing(self) -> Iterator[KernelRegistry]:
        """Keep the ops and candidates registered in the block only if it exits normally: a
        plugin's kernel hook that raises half-way leaves nothing behind (the loader then refuses
        the plugin whole). For registration at discovery, before any op is dispatched."""
        ops, candidates = dict(self._ops), {op: list(cands) for op, cands in self._candidates.items()}
        try:
            yield self
        except BaseException:
            with self._lock:
                for op in self._ops.keys() - ops.keys():
                    del self._ops[op], self._candidates[op], self._cache[op]
                    self._seen.pop(op, None)
                for op, cands in candidates.items():
                    if self._candidates[op] != cands:
                        self._candidates[op] = cands
                        self._cache[op].clear()
                        self._forget_layouts(op)
            raise

    def ops(self) -> tuple[str, ...]:
        return tuple(sorted(self._ops))

    def op(self, name: str) -> OpDef:
        return self._opdef(name)

    def candidates(self, op: str) -> tuple[Candidate, ...]:
        self._opdef(op)
        return tuple(self._candidates[op])

    def bound(self, candidate: Candidate, device: Device) -> Callable[..., Any]:
        """A candidate's callable for `device`, bound as selection binds it (to compare candidates)."""
        return _bound(candidate, device.capabilities)

    def signature(self, op: str, *args: Any, **kwargs: Any) -> Hashable:
        return _signature(self._opdef(op), args, kwargs)

    def select(self, op: str, device: Device, *args: Any, **kwargs: Any) -> Selection:
        """Validate the arguments and return the selection for them on `device`."""
        sig = _signature(self._opdef(op), args, kwargs)
        return self._cache[op].get((device.id, sig)) or self._select(op, device, sig, args, kwargs)

    def call(self, op: str, device: Device, *args: Any, **kwargs: Any) -> Any:
        """Run `op` on `device` with the selected candidate, falling back if it raises.
        Keyword calls (not the ops' path) are validated every time."""
        if not kwargs:
            return self.dispatch(op, self._route_of(device), lambda _op, _first: device, *args)
        if _any_fake(args) or _any_fake(kwargs.values()):
            opdef = self._opdef(op)
            _signature(opdef, args, kwargs)
            return opdef.reference(*args, **kwargs)  # shapes only: see `dispatch`
        selection = self.select(op, device, *args, **kwargs)
        try:
            return selection.fn(*args, **kwargs)
        except Exception as exc:
            return self._fall_back(selection, device, exc, args, kwargs)

    def dispatch(self, op: str, route: Hashable, locate: Locate, *args: Any) -> Any:
        """`call` for a caller that finds the device from the arguments (what `torchhal.ops` does).

        Arguments whose dtypes, shapes, strides, devices and scalars were validated before under the
        same `route` (what else decides the device, e.g. a `use()` override) go straight to their
        selection: no validation and no device lookup. Anything else is validated, and its device
        found by `locate(op, first_argument)`. Positional only: a `**kwargs` costs every call."""
        try:
            seen = self._seen.get(op)  # None for an unknown op and for an op that is never memoised
        except TypeError:  # an unhashable op name, which `_opdef` names below (free on the hit path)
            seen = None
        key: tuple[Hashable, ...] | None = None
        hit = None
        if seen is not None:
            hit = _first_admitted(seen.recent, route, args, False)  # the layouts found last, by guard
            if hit is None:
                try:
                    key = _argument_key(route, args)
                except RuntimeError:  # a tensor without sizes or strides (nested): validate every time
                    key = None
                except TypeError:  # a tuple holding a tensor (or any non-scalar): as above
                    key = None
                else:
                    try:
                        hit = seen.found(key, route, args)
                    except TypeError:  # an unhashable argument: validate every time
                        key = None
        if hit is None:
            opdef = self._opdef(op)
            if _any_fake(args):
                # FakeTensorMode outside torch.compile (shape inference, make_fx): the reference
                # propagates shapes through torch ops; a kernel would raise on the fake memory and
                # be demoted, or be measured, its fake timings persisted, for real calls
                _signature(opdef, args, {})
                return opdef.reference(*args)
            device = locate(op, args[0] if args else None)
            sig = _signature(opdef, args, {})
            selection = self._cache[op].get((device.id, sig)) or self._select(op, device, sig, args)
            if key is not None and seen is not None and opdef.memoizes(args) and not selection.provisional:
                seen.remember(key, route, args, (device, selection))
        else:
            device, selection = hit
        try:
            return selection.fn(*args)
        except Exception as exc:  # a failing kernel is demoted, never fatal while others remain
            return self._fall_back(selection, device, exc, args, {})

    def dispatch_seen(self, op: str, route: Hashable, args: tuple[Any, ...]) -> Any:
        """`dispatch` for arguments that pass the guard of one of the op's recent layouts
        (`RECENT_LAYOUTS`), made from tensors that required no gradient; `NOT_SEEN` for any
        other (nothing is run or validated; `dispatch` then finds older layouts by their key).

        For the autograd glue: the guard checks each tensor's `requires_grad`, so one that admits
        the arguments has said that none requires grad, and the glue need not read them all
        first (three tensor attributes cost as much as the guard's whole Python part). The
        arguments come as one tuple: every caller has them as one, and `*args` at each of the
        three frames between the op and here would unpack and pack them again."""
        try:
            seen = self._seen.get(op)
        except TypeError:  # an unhashable op name: `dispatch` names it
            return NOT_SEEN
        hit = None if seen is None else _first_admitted(seen.recent, route, args, True)
        if hit is None:
            return NOT_SEEN
        device, selection = hit
        try:
            return selection.fn(*args)
        except Exception as exc:  # as in `dispatch`
            return self._fall_back(selection, device, exc, args, {})

    def _route_of(self, device: Device) -> Hashable:
        """The memo route of `call(op, device, ...)`: an object of its own per device, so that its
        layouts are never taken for those of `hal.use(device)`, which routes by the same Device
        but sends a tensor of another device type to that tensor's device."""
        route = self._call_routes.get(device)
        if route is None:
            route = self._call_routes.setdefault(device, _CallRoute(device.id))
        return route

    def clear_cache(self) -> None:
        """Drop the in-process choices: the selections, the memoised layouts and the tuner's winners
        held in memory (the next selection reads the selections file again, and measures what it
        does not hold; delete the file to measure everything again)."""
        with self._lock:
            for selections in self._cache.values():
                selections.clear()
            for op in self._seen:
                self._forget_layouts(op)
        if self.tuner is not None:
            self.tuner.forget()

    def _forget_layouts(self, op: str) -> None:
        """Start `op`'s argument memo over (under the lock). A new memo, not the old one cleared:
        a dispatch that read the old one before may still write to it, and must not write a
        selection from before the change into the memo that later calls read."""
        if op in self._seen:
            self._seen[op] = _ArgumentMemo()

    def _opdef(self, op: str) -> OpDef:
        try:
            return self._ops[op]
        except (KeyError, TypeError):  # TypeError: an unhashable name (a list), unknown as any other
            raise UnknownOpError(op, self._ops) from None

    def _select(
        self,
        op: str,
        device: Device,
        sig: Hashable,
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> Selection:
        """The selection for `sig` on `device`, cached unless provisional (`Selection.provisional`;
        one for arguments without storage is cached under a key of its own, `UNMEASURED`);
        `args` (and `kwargs`) to measure the valid candidates on, where the tuner measures."""
        caps = device.capabilities
        dtype = getattr(sig, "dtype", None)
        if dtype is not None and not caps.supports_dtype(dtype):
            declared = ", ".join(sorted(d.value for d in caps.dtypes))
            raise UnsupportedError(
                f"op {op!r} on {device.id}: dtype {dtype} is not supported by this device "
                f"(declared dtypes: {declared})"
            )
        unmeasured: tuple[Hashable, ...] | None = None
        if (
            args is not None
            and self.tuner is not None
            and self.tuner.wants(device)
            and not all(map(_has_storage, (*args, *(kwargs or {}).values())))
        ):  # its unmeasured selection, kept apart from the one plain calls measure (`_by_measurement`)
            unmeasured = (device.id, sig, UNMEASURED)
            cached = self._cache[op].get(unmeasured)
            if cached is not None:
                return cached
        candidates = self._candidates[op]  # register replaces the list; this one stays as it is
        with telemetry.span("torchhal.kernel.select", op=op, device=device.id, signature=str(sig)) as span:
            valid, rejected = self._judge_all(op, device, candidates, sig)
            timings: tuple[tuple[str, float], ...] = ()
            remembered: str | None = None
            provisional = False
            if len(valid) > 1 and args is not None and self.tuner is not None and self.tuner.wants(device):
                valid, timings, remembered, provisional = self._by_measurement(
                    op, device, sig, valid, args, kwargs or {}
                )
            selection = self._choose(op, device, sig, valid, rejected, timings, remembered, provisional)
            span.set_attribute("torchhal.kernel.candidate", selection.candidate.qualified_name)
            span.set_attribute("torchhal.kernel.rejected", [str(r) for r in selection.rejected])
        log.debug(
            "kernel selected",
            op=op,
            device=device.id,
            signature=str(sig),
            candidate=selection.candidate.qualified_name,
        )
        if not provisional:
            self._store(selection, candidates)
        elif unmeasured is not None and not device.capturing():  # every vmap'd call selected again
            self._store(selection, candidates, unmeasured)
        return selection

    def _choose(
        self,
        op: str,
        device: Device,
        sig: Hashable,
        valid: list[Candidate],
        rejected: list[Rejection],
        timings: tuple[tuple[str, float], ...],
        remembered: str | None,
        provisional: bool,
    ) -> Selection:
        """The selection of the first of `valid` (best first) that binds; the rest its fallbacks."""
        while True:
            chosen, rest = valid[0], tuple(valid[1:])
            try:
                fn = _bound(chosen, device.capabilities)
                break
            except Exception as exc:  # a broken bind is a failing kernel, not the caller's error
                rejected.append(self._broken(op, device, chosen, "its bind", exc))
                if not rest:
                    raise _none_supports(op, device, sig, rejected) from exc
                valid = list(rest)
        rejected += [
            Rejection(c.qualified_name, RejectionReason.OUTRANKED, _outranked(c, chosen, timings, remembered))
            for c in rest
        ]
        return Selection(op, device.id, sig, chosen, rest, tuple(rejected), fn, timings, provisional)

    def _next(self, selection: Selection, device: Device, failed: list[Rejection]) -> Selection:
        """After the `failed` candidates raised: the next of `selection`'s own order, which is the
        measured one where it was measured (re-selecting by priority locked in the slowest),
        its timings kept. UnsupportedError when none is left."""
        gone = {r.candidate for r in failed}
        order = [c for c in (selection.candidate, *selection.fallbacks) if c.qualified_name not in gone]
        judged = [
            r
            for r in selection.rejected
            if r.reason not in (RejectionReason.FAILED, RejectionReason.OUTRANKED)
        ]
        rejected = [*failed, *judged]
        if not order:
            raise _none_supports(selection.op, device, selection.signature, rejected)
        return self._choose(
            selection.op,
            device,
            selection.signature,
            order,
            rejected,
            selection.timings_ms,
            None,
            selection.provisional,
        )

    def _judge_all(
        self, op: str, device: Device, candidates: list[Candidate], sig: Hashable
    ) -> tuple[list[Candidate], list[Rejection]]:
        """The candidates valid for `sig` (best first) and why each other one is not."""
        valid: list[Candidate] = []
        rejected: list[Rejection] = []
        for cand in candidates:
            try:
                verdict = self._judge(cand, device.capabilities, sig)
            except Exception as exc:  # a broken predicate turns its own candidate down, said so
                rejected.append(self._broken(op, device, cand, "its predicate", exc))
                continue
            if verdict is None:
                valid.append(cand)
            else:
                rejected.append(Rejection(cand.qualified_name, verdict.reason, verdict.detail))
        if not valid:
            raise _none_supports(op, device, sig, rejected)
        return valid, rejected

    def _broken(self, op: str, device: Device, cand: Candidate, part: str, exc: Exception) -> Rejection:
        """A candidate whose predicate or bind raised: logged, counted, and turned down."""
        name = cand.qualified_name
        self._count_fallback(op, name)
        log.warning(
            "kernel candidate broken", op=op, device=device.id, candidate=name, part=part, error=repr(exc)
        )
        return Rejection(name, RejectionReason.FAILED, f"{part} raised {type(exc).__name__}: {exc}")

    def _count_fallback(self, op: str, candidate: str) -> None:
        key = f"{op}:{candidate}"
        with self._lock:  # a read-modify-write: threads falling back at once lost counts
            self.fallback_counts[key] = self.fallback_counts.get(key, 0) + 1
        telemetry.count("torchhal.kernel.fallbacks", op=op, candidate=candidate)

    def _store(
        self, selection: Selection, candidates: list[Candidate], key: tuple[Hashable, ...] | None = None
    ) -> None:
        """Cache `selection`, made from `candidates`, unless a candidate was registered since (the
        cache would then hide the new one until the next clear); `key`: another than its own."""
        op, key = selection.op, key or (selection.device, selection.signature)
        with self._lock:
            if self._candidates[op] is not candidates:
                return
            replaced = key in self._cache[op]
            self._cache[op][key] = selection
            if replaced:  # a demotion: the memo may point to the selection it replaces
                self._forget_layouts(op)

    def _by_measurement(
        self,
        op: str,
        device: Device,
        sig: Hashable,
        valid: list[Candidate],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[list[Candidate], tuple[tuple[str, float], ...], str | None, bool]:
        """Valid candidates reordered fastest first (priority order breaks ties and failures), the
        timings, the winner remembered from an earlier measurement of these same contenders (its
        timings are not kept), and whether the order is provisional: the device's stream captures
        a graph, where timing would synchronise and invalidate the capture, and nothing was
        remembered (`_say_unmeasured_in_capture`); or every contender that did not decline raised
        while measured, where the arguments are the likely cause (as `_fall_back` judges a call):
        none is counted, and a later call measures. The reference is the ground truth, not a
        contender: it stays last, unmeasured (it may materialise what the fast kernels avoid, e.g. a
        seq² score matrix). A contender that declines the call it is measured on (CallDeclined)
        keeps its place in priority order, unmeasured, the measured ones filling the other places:
        a decline is of that call, and demotes nothing."""
        assert self.tuner is not None
        contenders = [c for c in valid if c.name != REFERENCE]
        if len(contenders) < 2:
            return valid, (), None, False
        if not all(map(_has_storage, (*args, *kwargs.values()))):
            # fake tensors, torch.func's wrappers: a kernel that reads memory raises on them, and
            # was ranked last for the plain calls of this signature too. Priority order, provisional:
            # not memoised, and cached only under a key of its own (`UNMEASURED`, in `_select`) that
            # plain calls never read, so a call with real tensors measures.
            return valid, (), None, True
        by_name = {c.qualified_name: c for c in contenders}
        remembered = self.tuner.recall(device, op, sig, by_name)
        if remembered in by_name:
            order = [by_name[remembered]] + [c for c in valid if c.qualified_name != remembered]
            return order, (), remembered, False
        if device.capturing():
            _say_unmeasured_in_capture(op, device)
            return valid, (), None, True
        caps = device.capabilities
        timings = self.tuner.measure(
            device, [(c.qualified_name, _bound_or_raiser(c, caps)) for c in contenders], args, kwargs
        )
        timed = {name for name, _ in timings}
        declined = [c for c in contenders if c.qualified_name not in timed]  # the tuner left them out
        measured = [name for name, ms in timings if math.isfinite(ms)]
        raised = [name for name, ms in timings if not math.isfinite(ms)]  # the tuner logged each
        span = trace.get_current_span()
        for name in (c.qualified_name for c in declined):
            telemetry.count("torchhal.kernel.declined_while_measured", op=op, candidate=name)
            span.add_event("candidate declined while measured", {"candidate": name})
            if (op, name) not in self._declines_said:  # a decline is said once, as in `_fall_back`
                self._declines_said.add((op, name))
                log.warning(
                    "kernel declined the call it was measured on: unmeasured, kept in its place by "
                    "priority (said once; counted each time)",
                    op=op,
                    device=device.id,
                    candidate=name,
                )
        if declined and not measured and not raised:  # nothing to rank by: measured again next call
            return valid, (), None, True
        if raised and not measured:  # a bad call's arguments, most likely: nothing counted or kept
            telemetry.count("torchhal.kernel.all_raised_while_measured", op=op)
            log.warning(
                "every contender raised while measured: priority order, provisional (not cached); "
                "a later call measures",
                op=op,
                device=device.id,
                signature=str(sig),
                raised=raised,
            )
            span.add_event("every contender raised while measured", {"candidates": raised})
            return valid, tuple(timings), None, True
        for name in raised:
            self._count_fallback(op, name)
            span.add_event("candidate raised while measured", {"candidate": name})
        if measured:  # one that raised or declined is not beaten for good: the next process measures
            self.tuner.remember(device, op, sig, measured[0], measured)
        ranked = iter([by_name[name] for name in (*measured, *raised)])
        order = [c if c in declined else next(ranked) for c in contenders]
        return order + [c for c in valid if c not in contenders], tuple(timings), None, False

    def _judge(self, cand: Candidate, caps: DeviceCapabilities, sig: Hashable) -> Unsupported | None:
        if cand.name in self._disabled or cand.qualified_name in self._disabled:
            return Unsupported(RejectionReason.DISABLED, "listed in TORCHHAL_DISABLE_KERNELS")
        if cand.supports is None:
            return None
        verdict = cand.supports(caps, sig)
        if verdict is not None and not isinstance(verdict, Unsupported):
            raise TypeError(f"returned {verdict!r}, not an Unsupported or None")
        return verdict

    def _fall_back(
        self,
        selection: Selection,
        device: Device,
        exc: Exception,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """After `selection`'s kernel raised `exc`: run the next valid candidate, and once one runs,
        demote the ones that raised for this signature (cached, counted). When every candidate
        raises, the arguments are the likely cause: none that raised is demoted or counted, and
        KernelFailedError says what each raised. Bad arguments and exhausted memory are raised as
        they are (see `_not_a_kernel_fault`). Where an argument is a tensor without storage (under
        torch.func's vmap or grad, a kernel that reads memory cannot run), the fallback is logged
        and counted but demotes nothing: the signature does not tell those tensors from plain ones,
        and a demotion would send every later plain call to the fallback too. A CallDeclined is a
        refusal of this call only: counted, said once, never demoted (where another candidate's
        failure demotes it, the decliner keeps its place). A fallback from a selection made while
        every contender raised while measured demotes as any other does: only once a candidate has
        run on these arguments, which then are not the cause."""
        failures = [exc]
        try:
            if _not_a_kernel_fault(exc):
                raise exc
            op, raised = selection.op, []
            failed = [r for r in selection.rejected if r.reason is RejectionReason.FAILED]
            candidates = self._candidates[op]
            current = selection
            demote = False  # only declines (CallDeclined) so far: this call's, not the signature's
            declines: set[str] = set()  # the candidates that declined this call
            while True:
                name = current.candidate.qualified_name
                raised.append(name)
                failed.append(Rejection(name, RejectionReason.FAILED, f"{type(exc).__name__}: {exc}"))
                declined = isinstance(exc, CallDeclined)
                demote = demote or not declined
                if declined:
                    declines.add(name)
                with telemetry.span(
                    "torchhal.kernel.fallback", op=op, device=device.id, candidate=name, error=repr(exc)
                ):
                    if not declined or (op, name) not in self._declines_said:  # a decline: said once
                        if declined:
                            self._declines_said.add((op, name))
                        event = "kernel declined the call, falling back (said once; counted each time)"
                        log.warning(
                            event if declined else "kernel failed, falling back",
                            op=op,
                            device=device.id,
                            candidate=name,
                            error=repr(exc),
                        )
                    try:
                        current = self._next(selection, device, failed)
                    except UnsupportedError:
                        raise KernelFailedError(
                            f"op {op!r} on {device.id}: every candidate failed (so no kernel was demoted: "
                            "the arguments are the likely cause): " + "; ".join(str(r) for r in failed)
                        ) from failures[0]
                    # with those whose bind raised in `_next` (counted there): not bound and counted
                    # again at the next step of this chain
                    failed = [r for r in current.rejected if r.reason is RejectionReason.FAILED]
                try:
                    result = current.fn(*args, **kwargs)
                except Exception as next_exc:
                    if _not_a_kernel_fault(next_exc):
                        raise
                    exc = next_exc
                    failures.append(exc)
                    continue
                for name in raised:
                    self._count_fallback(op, name)
                # demoted for later calls, unless the failure may be the arguments' or the moment's:
                # only declines, tensors without storage (positional or keyword), or a selection made
                # (or a failure met) during a graph capture, whose "not permitted while capturing"
                # errors pass with it; nor where a candidate was registered after `selection` was
                # made (its order is stale). Provisional selections demote nothing, but one made
                # because every contender raised while measured: a candidate has run on these
                # arguments now, so the contenders' failures were theirs.
                if (
                    demote
                    and all(map(_has_storage, (*args, *kwargs.values())))
                    and (not selection.provisional or _raised_while_measured(selection))
                    and not device.capturing()
                    and _knows_all(selection, candidates)
                ):
                    if declines:  # demote only those that failed: decliners keep their places
                        current = self._next(
                            selection, device, [r for r in failed if r.candidate not in declines]
                        )
                    self._store(replace(current, provisional=False), candidates)
                return result
        finally:
            # an error raised from here holds this frame in its traceback, and this frame held the
            # errors: a cycle that kept the failed calls' frames, tensors and all, alive until a
            # garbage collection (an out-of-memory "retry smaller" then ran out again)
            del exc, failures


# The third part of the cache key of a selection made for arguments without storage, unmeasured
UNMEASURED = "unmeasured"


def _checked_disabled(names: object) -> frozenset[str]:
    """`KernelRegistry.disabled` checked as Settings checks TORCHHAL_DISABLE_KERNELS: candidate names
    or provider/name, none naming the reference (every op's ground truth and last fallback). A lone
    string is refused: it would read as the names of its letters."""
    items = tuple(names) if isinstance(names, Iterable) and not isinstance(names, str) else None
    if items is None or not all(isinstance(name, str) and name for name in items):
        raise ConfigurationError(
            "KernelRegistry.disabled must be a collection of candidate names (name or provider/name), "
            f"got {_seen(names)}"
        )
    refused = reference_refusal(items)
    if refused:
        raise ConfigurationError(f"KernelRegistry.disabled {refused}")
    return frozenset(items)


def reference_refusal(names: Iterable[str]) -> str | None:
    """Why a list of candidate names to disable is refused where it names the reference (every
    op's ground truth and last fallback: disabled, an op no other candidate computes on a device
    failed on every call; `x/reference` names it or nothing); None where it does not."""
    refused = [name for name in names if name.rpartition("/")[2] == REFERENCE]
    if not refused:
        return None
    return (
        f"names {', '.join(map(repr, refused))}: the reference implementation cannot be disabled "
        "(it is every op's ground truth and last fallback); name the other candidates to disable instead"
    )


def _raised_while_measured(selection: Selection) -> bool:
    """Whether `selection` is provisional because every contender raised while measured (the only
    provisional selections that carry timings)."""
    return selection.provisional and bool(selection.timings_ms)


def _knows_all(selection: Selection, candidates: list[Candidate]) -> bool:
    """Whether `selection` was made from all of `candidates` (chosen, fallback or rejected)."""
    known = {selection.candidate.qualified_name, *(c.qualified_name for c in selection.fallbacks)}
    known.update(r.candidate for r in selection.rejected)
    return all(c.qualified_name in known for c in candidates)


def _none_supports(op: str, device: Device, sig: Hashable, rejected: list[Rejection]) -> UnsupportedError:
    reasons = "; ".join(str(r) for r in rejected)
    return UnsupportedError(f"op {op!r} on {device.id}: no candidate supports {sig}: {reasons}")


def _rank(candidate: Candidate) -> tuple[float, str, str]:
    """Candidates' order: priority, highest first, then name and provider."""
    return (-candidate.priority, candidate.name, candidate.provider)


def is_finite_number(value: object) -> bool:
    """An int or float that is finite as a float; not a bool (True is no eps, scale or priority)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond the float range
        return False


def _check_candidate(candidate: Candidate) -> None:
    """What `register` refuses, naming the op and the candidate: a NaN priority made the order
    inconsistent (a priority 1000 lost to 100), a string left the op's list unsorted."""
    where = f"register: candidate {candidate.qualified_name!r} of op {candidate.op!r}"
    _check_name(where, "name", candidate.name)
    _check_name(where, "provider", candidate.provider)
    if not is_finite_number(candidate.priority):
        raise InvalidArgumentError(
            f"{where}: priority must be a finite number, got {_seen(candidate.priority)}"
        )
    if not callable(candidate.fn):
        raise InvalidArgumentError(f"{where}: fn must be callable, got {_seen(candidate.fn)}")
    for part in ("supports", "bind"):
        value = getattr(candidate, part)
        if value is not None and not callable(value):
            raise InvalidArgumentError(f"{where}: {part} must be callable or None, got {_seen(value)}")


def _check_op(opdef: OpDef) -> None:
    """What `define_op` refuses, naming the op: a reference or signature that is not callable
    was accepted, and every call of the op then failed far from its definition."""
    _check_name("define_op", "the op's name", opdef.name)
    where = f"define_op: op {opdef.name!r}"
    for part in ("reference", "signature"):
        if not callable(getattr(opdef, part)):
            raise InvalidArgumentError(f"{where}: {part} must be callable, got {_seen(getattr(opdef, part))}")
    if opdef.examples is not None and not callable(opdef.examples):
        raise InvalidArgumentError(f"{where}: examples must be callable or None, got {_seen(opdef.examples)}")


def _device_types(op: str, value: object) -> frozenset[str]:
    """`define_op`'s reads_values_on as a set of device type names: a lone string would read as the
    device types of its letters, and a generator checked before being kept would be kept empty."""
    items = tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else None
    if items is None or not all(isinstance(t, str) and t for t in items):
        raise InvalidArgumentError(
            f"define_op: op {op!r}: reads_values_on must be a collection of device type names, "
            f"got {_seen(value)}"
        )
    return frozenset(items)


def _check_name(where: str, what: str, value: object) -> None:
    """Op, candidate and provider names are non-empty strings: a list was a bare "unhashable
    type" TypeError from a dict lookup, and a list or empty candidate name was kept."""
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{where}: {what} must be a non-empty string, got {_seen(value)}")


def _seen(value: object) -> str:
    """A refused value as an error names it: its repr, or where that is long, its type and a
    shortened repr (a list of tensors passed by mistake printed whole, 14,000 characters)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{type(value).__name__} {reprlib.repr(value)}"


_warned_in_capture: set[tuple[str, str]] = set()


def _say_unmeasured_in_capture(op: str, device: Device) -> None:
    """Selection met a device whose stream is capturing a graph (the first call of a signature
    inside a caller's capture): timing there would synchronise and invalidate the capture, so the
    candidates go in priority order, for this call only (counted; logged once per op and device)."""
    telemetry.count("torchhal.kernel.unmeasured_in_capture", op=op)
    if (op, device.id) not in _warned_in_capture:
        _warned_in_capture.add((op, device.id))
        log.warning(
            "kernel selection during a graph capture: candidates not measured, priority order "
            "until a call outside the capture measures them",
            op=op,
            device=device.id,
        )


def _outranked(
    cand: Candidate, chosen: Candidate, timings: tuple[tuple[str, float], ...], remembered: str | None
) -> str:
    """Why a valid candidate was not chosen: measured slower, now or in the earlier run whose
    winner `remembered` is chosen (the priorities said nothing true there: "priority 50, as
    torchhal/aten's" of a priority-10 winner), or ranked lower. Every valid candidate but the
    reference was measured then (`Tuner.recall` matches the contenders exactly); when the winner
    cannot run now (its bind raised), the rest are ranked by priority, as nothing says how they
    compared with each other. A contender that declined the call it was to be measured on has no
    timing: it keeps its place by priority among the measured ones."""
    measured = dict(timings)
    ms, best = measured.get(cand.qualified_name), measured.get(chosen.qualified_name)
    if ms is not None and best is not None:
        return (
            "raised while measured" if math.isinf(ms) else f"measured {ms:.4g} ms a call against {best:.4g}"
        )
    if measured and cand.name != REFERENCE and ms is None:
        return "declined the call it was to be measured on: unmeasured, in its place by priority"
    if best is None and ms is not None:
        own = "raised while measured" if math.isinf(ms) else f"measured {ms:.4g} ms a call"
        return (
            f"{own}; {chosen.qualified_name} declined the call it was to be measured on: unmeasured, "
            "in its place by priority"
        )
    if chosen.qualified_name == remembered and cand.name != REFERENCE:
        return f"measured slower than {chosen.qualified_name} in an earlier run (remembered)"
    if cand.priority < chosen.priority:
        return f"priority {cand.priority} < {chosen.priority}"
    return f"priority {cand.priority}, as {chosen.qualified_name}'s: ranked after it by name and provider"


def _bound(candidate: Candidate, caps: DeviceCapabilities) -> Callable[..., Any]:
    return candidate.bind(caps) if candidate.bind is not None else candidate.fn


def _bound_or_raiser(candidate: Candidate, caps: DeviceCapabilities) -> Callable[..., Any]:
    """`_bound`, or where bind raises, a callable that raises the same: measured as a failure."""
    try:
        return _bound(candidate, caps)
    except Exception as exc:
        error = exc

        def raiser(*args: Any, **kwargs: Any) -> Any:
            raise error

        return raiser


def _has_storage(value: object) -> bool:
    """False for a tensor whose memory cannot be read (torch.func's batched and grad wrappers,
    fake tensors)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return True
    if _is_fake(value):
        return False
    try:
        value.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


@functools.cache
def _fake_test() -> tuple[tuple[type, ...], Callable[[Any], bool], Callable[[Any], bool]]:
    """(the plain tensor types, torch's is_fake, functorch's wrapped-tensor test), bound once."""
    import torch
    from torch._subclasses.fake_tensor import is_fake

    return (torch.Tensor, torch.nn.Parameter), is_fake, torch._C._functorch.is_functorch_wrapped_tensor


def _is_fake(value: object) -> bool:
    """A FakeTensor, or a functional or functorch tensor wrapping one. A plain tensor is answered
    at once: torch's is_fake unwraps and costs ~5 µs a tensor (varlen on the CPU, never memoised,
    asks on every call)."""
    plain, is_fake, wrapped = _fake_test()
    if type(value) in plain and not wrapped(value):
        return False
    return bool(is_fake(value))


def _any_fake(values: Iterable[object]) -> bool:
    import torch

    return any(isinstance(v, torch.Tensor) and _is_fake(v) for v in values)


def _signature(opdef: OpDef, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """`opdef.signature(*args, **kwargs)`, arguments that do not fit its parameters refused naming
    the op (the signature's own TypeError, "missing 1 required positional argument: 'weight'",
    did not say which op)."""
    try:
        return opdef.signature(*args, **kwargs)
    except TypeError as exc:
        try:
            inspect.signature(opdef.signature).bind(*args, **kwargs)
        except TypeError as unbound:
            params = inspect.signature(opdef.signature)
            raise InvalidArgumentError(f"op {opdef.name!r} takes {params}: {unbound}") from None
        raise exc


@dataclass(frozen=True)
class _CallRoute:
    """The memo route of `KernelRegistry.call` on one device (`KernelRegistry._route_of`)."""

    device: str


def _not_a_kernel_fault(exc: Exception) -> bool:
    """Bad arguments and exhausted memory are the caller's to see: another kernel would not help,
    and on a device that accounts memory a host fallback would hide the out-of-memory."""
    import torch

    return isinstance(exc, (InvalidArgumentError, MemoryError, torch.OutOfMemoryError))
