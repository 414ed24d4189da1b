"""The conformance engine: the plan of checks for one adapter, running them, and the report.

Both faces use it: `run_conformance` (library and CLI) runs the whole plan; the pytest
plugin turns each planned check into a test item and runs them one by one.
"""

from __future__ import annotations

import atexit
import contextvars
import functools
import inspect
import os
import secrets
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from torchhal.hal_core import (
    HAL_API_VERSION,
    ConfigurationError,
    DType,
    InvalidArgumentError,
    VendorAdapter,
    telemetry,
)
from torchhal.hal_core.kernels import is_finite_number
from torchhal.testing import checks_adapter, checks_collectives, checks_device, checks_dtypes, checks_kernels
from torchhal.testing.context import (
    ADAPTER_ERRORS,
    AdapterUnderTest,
    CheckFailed,
    NotApplicable,
    StepUnfinished,
    describe,
    stuck_in,
    where,
    where_in,
)
from torchhal.testing.report import CheckResult, CheckStatus, ConformanceReport

if TYPE_CHECKING:
    from torchhal.hal_core.hal import HardwareAbstractionLayer
    from torchhal.hal_core.kernels import Candidate

log = telemetry.get_logger("torchhal.testing")

CHECK_TIME_LIMIT_S = 60.0  # generous: the slowest real check (kernel candidates on a GPU) takes seconds


@dataclass(frozen=True, slots=True)
class Check:
    id: str
    title: str
    mandatory: bool
    run: Callable[[AdapterUnderTest], str]  # returns what was verified; raises NotApplicable or CheckFailed


_FIXED = (
    Check(
        "adapter.attributes",
        "name, vendor, priority and api_versions well-typed",
        True,
        checks_adapter.check_attributes,
    ),
    Check(
        "adapter.probe",
        "probe() is fast, returns a ProbeResult, answers the same twice",
        True,
        checks_adapter.check_probe,
    ),
    Check(
        "adapter.discover",
        "discover() returns well-formed, uniquely indexed devices",
        True,
        checks_adapter.check_discover,
    ),
    Check(
        "adapter.numerics_settings",
        "numerics_settings() names JSON-scalar switches and reads the same twice",
        True,
        checks_adapter.check_numerics_settings,
    ),
    Check("device.synchronize", "synchronize() works on every device", True, checks_device.check_synchronize),
    Check(
        "device.memory_info",
        "memory_info() is consistent (free, used <= total), comparing the figures it does not call unknown",
        True,
        checks_device.check_memory_info,
    ),
    Check(
        "device.memory_accounting",
        "used_bytes grows when memory is allocated through Device.empty (n/a where used is unknown)",
        True,
        checks_device.check_memory_accounting,
    ),
    Check(
        "device.health",
        "health() returns a HealthReport that does not report the device failed",
        True,
        checks_device.check_health,
    ),
    Check(
        "adapter.topology",
        "topology() is symmetric and names only the adapter's devices",
        True,
        checks_device.check_topology,
    ),
    Check(
        "device.timer",
        "timer() marks measure a real interval of device work",
        True,
        checks_device.check_timer,
    ),
    Check(
        "device.timer_events",
        "devices with device_events time with events",
        False,
        checks_device.check_timer_events,
    ),
    Check(
        "device.graphs",
        "devices with the graphs feature capture work and replay it on new values",
        False,
        checks_device.check_graphs,
    ),
    Check(
        "collectives.backend",
        "collective_backend() is a backend torch.distributed has",
        True,
        checks_collectives.check_collective_backend,
    ),
    Check(
        "collectives.all_reduce",
        "declared backends all_reduce correctly (world size 1)",
        False,
        checks_collectives.check_all_reduce,
    ),
    *(
        Check(
            f"dtype.{d.value}",
            f"declared dtype {d.value} computes on the device",
            False,
            checks_dtypes.dtype_check(d),
        )
        for d in DType
    ),
    Check(
        "kernels.register",
        "register_kernels() adds well-formed candidates",
        True,
        checks_kernels.check_register_kernels,
    ),
)


def _no_candidates(ctx: AdapterUnderTest) -> str:
    try:
        ctx.kernel_candidates()
    except NotApplicable:
        raise
    except ADAPTER_ERRORS as exc:
        raise NotApplicable(
            f"blocked: register_kernels raised {describe(exc)} (see kernels.register)"
        ) from exc
    raise NotApplicable("the adapter registers no kernel candidates")


def _unlisted(stuck: str) -> Callable[[AdapterUnderTest], str]:
    """The plan's kernels.candidates when listing the candidates ran out of time: no candidate
    was checked, which must not read as an adapter without kernels."""

    def check(ctx: AdapterUnderTest) -> str:
        raise CheckFailed(f"listing the kernel candidates (probe, discover, register_kernels) {stuck}")

    return check


class ConformanceSuite:
    """The checks for one adapter, planned once, run together or one at a time."""

    def __init__(
        self, adapter: VendorAdapter, *, seed: int | None = None, time_limit_s: float = CHECK_TIME_LIMIT_S
    ) -> None:
        self.seed = secrets.randbits(63) if seed is None else seed
        self.time_limit_s = checked_time_limit(time_limit_s)
        self.context = AdapterUnderTest(adapter, self.seed)
        self._plan: tuple[Check, ...] | None = None
        self._left: list[threading.Thread] = []  # threads of calls that ran past the time limit

    @property
    def adapter_name(self) -> str:
        return str(getattr(self.context.adapter, "name", type(self.context.adapter).__name__))

    def checks(self) -> tuple[Check, ...]:
        """Every check, in order: the fixed ones, then one per kernel candidate the adapter registers."""
        if self._plan is None:
            candidates, stuck = self._planned_candidates()
            per_candidate = tuple(
                Check(
                    checks_kernels.candidate_id(c),
                    f"candidate {c.qualified_name} of {c.op} matches the reference",
                    False,
                    checks_kernels.candidate_check(c.op, c.qualified_name),
                )
                for c in candidates
            )
            none = Check(
                "kernels.candidates",
                "every kernel candidate matches its reference",
                False,
                _no_candidates if stuck is None else _unlisted(stuck),
            )
            self._plan = _FIXED + (per_candidate or (none,))
        return self._plan

    def _planned_candidates(self) -> tuple[list[Candidate], str | None]:
        """The adapter's kernel candidates, listed under the time limit like a check: listing runs
        probe, discover and register_kernels, and one that never returned hung the plan (and so
        the kit) for good. Past the limit: no candidates, and where the listing is stuck."""
        listed: list[list[Candidate] | BaseException] = []

        def list_them() -> None:
            try:
                listed.append(self.context.kernel_candidates())
            except ADAPTER_ERRORS:  # blocked or raising: kernels.register and kernels.candidates report it
                listed.append([])
            except BaseException as exc:  # KeyboardInterrupt: the caller's
                listed.append(exc)

        stuck = self._within_limit(list_them, "planning")
        if stuck is not None:
            return [], stuck
        if isinstance(listed[0], BaseException):
            raise listed[0]
        return listed[0], None

    def _within_limit(self, work: Callable[[], None], name: str) -> str | None:
        """`work` under the time limit (`run_within_limit`): None once it finished, else where it
        is stuck. The steps a stuck call holds answer StepUnfinished to later checks."""
        thread, frame = run_within_limit(work, name, self.time_limit_s)
        if frame is None:
            return None
        self._left.append(thread)
        return (
            f"did not finish within the {self.time_limit_s:g} s time limit: stuck "
            f"{stuck_in(traceback.extract_stack(frame))} (the kit left that call running and went on)"
        )

    def still_running(self) -> tuple[threading.Thread, ...]:
        """The threads of calls left running past the time limit that have not returned yet."""
        return tuple(thread for thread in self._left if thread.is_alive())

    def run_check(self, check: Check) -> CheckResult:
        """Run one check under the time limit (`_within_limit`). A check past the limit fails
        naming where it is stuck, and the run goes on."""
        start = time.perf_counter()
        outcome: list[tuple[CheckStatus, str]] = []
        stuck = self._within_limit(functools.partial(self._outcome, check, outcome), check.id)
        if stuck is not None:
            status, reason = CheckStatus.FAILED, stuck
        else:
            status, reason = outcome[0]
            if isinstance(reason, BaseException):  # KeyboardInterrupt: the caller's
                raise reason
        duration = time.perf_counter() - start
        log.info(
            "conformance check", adapter=self.adapter_name, check=check.id, status=status.value, reason=reason
        )
        return CheckResult(check.id, check.title, check.mandatory, status, reason, duration)

    def _outcome(self, check: Check, into: list[tuple[CheckStatus, str]]) -> None:
        try:
            into.append((CheckStatus.PASSED, check.run(self.context)))
        except NotApplicable as exc:
            into.append((CheckStatus.NOT_APPLICABLE, str(exc)))
        except (CheckFailed, StepUnfinished) as exc:  # StepUnfinished here: the check's own step
            into.append((CheckStatus.FAILED, str(exc)))
        except ADAPTER_ERRORS as exc:
            into.append((CheckStatus.FAILED, f"raised {describe(exc)} ({where(exc)})"))
        except (
            BaseException
        ) as exc:  # KeyboardInterrupt: not the check's, raised again in the caller's thread
            into.append((CheckStatus.FAILED, exc))  # type: ignore[arg-type]

    def report(self, results: tuple[CheckResult, ...]) -> ConformanceReport:
        import torch

        from torchhal import __version__

        return ConformanceReport(
            adapter=self.adapter_name,
            vendor=str(getattr(self.context.adapter, "vendor", "?")),
            devices=tuple(self.context.device_summaries()),
            torch_version=torch.__version__,
            torchhal_version=__version__,
            hal_api_version=HAL_API_VERSION,
            seed=self.seed,
            checks=results,
        )

    def run(self) -> ConformanceReport:
        with telemetry.span("torchhal.conformance", adapter=self.adapter_name, seed=self.seed):
            results = tuple(self.run_check(check) for check in self.checks())
        report = self.report(results)
        telemetry.count("torchhal.conformance.runs", adapter=self.adapter_name, ok=str(report.ok).lower())
        return report


def checked_time_limit(time_limit_s: float, name: str = "time_limit_s") -> float:
    """`time_limit_s` when it is a finite number > 0; InvalidArgumentError otherwise, naming it
    as the caller's user wrote it (`name`: the CLI's option, not this parameter)."""
    if not is_finite_number(time_limit_s) or time_limit_s <= 0:
        raise InvalidArgumentError(f"conformance: {name} must be a finite number > 0, got {time_limit_s!r}")
    return time_limit_s


def run_within_limit(
    work: Callable[[], None], name: str, time_limit_s: float
) -> tuple[threading.Thread, FrameType | None]:
    """Run `work` in a daemon thread, waiting at most `time_limit_s`: the thread, and the frame
    it is stuck in (None once it finished). Python cannot kill a thread, so a stuck one is left
    running; a process holding one ends with `exit_leaving_threads`."""
    thread = threading.Thread(
        target=contextvars.copy_context().run,  # keeps the run's span for the check's logs
        args=(work,),
        name=f"torchhal-conformance {name}",
        daemon=True,
    )
    thread.start()
    thread.join(time_limit_s)
    frame = sys._current_frames().get(thread.ident) if thread.is_alive() else None  # type: ignore[arg-type]
    if frame is None:
        thread.join()  # it finished as the limit passed: its outcome is there
    return thread, frame


class DiscoveryStuck(Exception):
    """The HAL's discovery ran past the time limit; `thread` is still running it."""

    def __init__(self, message: str, thread: threading.Thread) -> None:
        super().__init__(message)
        self.thread = thread


def discover_within_limit(hal: HardwareAbstractionLayer, time_limit_s: float = CHECK_TIME_LIMIT_S) -> None:
    """Run `hal`'s discovery (plugin imports, each adapter's probe, discover and register_kernels)
    under the kit's time limit: a plugin whose discovery never returns hung `torchhal conformance`
    before its first check. Raises DiscoveryStuck naming the adapter or plugin module it is stuck
    in, and what discovery raised (a strict-mode PluginError) in the caller's thread."""
    time_limit_s = checked_time_limit(time_limit_s)
    raised: list[BaseException] = []

    def discover() -> None:
        try:
            hal.devices()
        except BaseException as exc:  # the caller's to handle, in its own thread
            raised.append(exc)

    thread, frame = run_within_limit(discover, "discovery", time_limit_s)
    if frame is not None:
        raise DiscoveryStuck(
            f"conformance: discovery did not finish within the {time_limit_s:g} s time limit: stuck "
            f"{_discovering(frame)} (TORCHHAL_PLUGINS=NAME loads only the plugins named)",
            thread,
        )
    if raised:
        raise raised[0]


def _discovering(frame: FrameType) -> str:
    """Whose code a stuck discovery is in: the outermost adapter method on the stack (its probe,
    discover, ...) or else the outermost module being imported (a plugin's), and where."""
    frames = traceback.extract_stack(frame)
    chain = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back  # type: ignore[assignment]
    for outer in reversed(chain):
        owner = outer.f_locals.get("self")
        if isinstance(owner, VendorAdapter):
            name = inspect.getattr_static(owner, "name", None)  # a property could hang this thread too
            label = repr(name) if isinstance(name, str) else type(owner).__name__
            return f"in adapter {label}'s {outer.f_code.co_name}() {where_in(frames)}"
    for outer in reversed(chain):
        if outer.f_code.co_name == "<module>":
            return f"importing module {outer.f_globals.get('__name__')!r} {where_in(frames)}"
    return stuck_in(frames)


def exit_leaving_threads(code: int) -> NoReturn:
    """Exit now, without finalizing the interpreter: a call the kit left running past its time
    limit that is still in torch code then is stopped inside C++ and aborts the process
    (SIGABRT, exit code 134, "terminate called without an active exception") instead of
    exiting with `code`. Exit handlers (telemetry flushes) still run."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def resolve_adapter(
    adapter: VendorAdapter | str, hal: HardwareAbstractionLayer | None = None
) -> VendorAdapter:
    """An adapter instance as given, or the one named so among `hal`'s loaded adapters."""
    if isinstance(adapter, VendorAdapter):
        return adapter
    if not isinstance(adapter, str):
        raise ConfigurationError(f"conformance: adapter must be a VendorAdapter or a name, got {adapter!r}")
    if hal is None:
        from torchhal.hal_core.hal import HardwareAbstractionLayer

        hal = HardwareAbstractionLayer()
    for loaded in hal.adapters:
        if loaded.name == adapter:
            return loaded
    known = ", ".join(a.name for a in hal.adapters) or "none"
    notes = "".join(
        f"; plugin {d.name!r} {d.status.value} at {d.stage}: {d.reason}"
        for d in hal.diagnostics
        if d.name == adapter
    )
    raise ConfigurationError(
        f"conformance: no adapter named {adapter!r} (adapters, their hardware present or not: {known}){notes}"
    )


def run_conformance(
    adapter: VendorAdapter | str,
    *,
    hal: HardwareAbstractionLayer | None = None,
    seed: int | None = None,
    time_limit_s: float = CHECK_TIME_LIMIT_S,
) -> ConformanceReport:
    """Run every conformance check on `adapter` (an instance, or a name resolved through `hal`).

    `seed` replays the random inputs of an earlier report (its `seed` field); by default each
    run draws fresh ones. A check running past `time_limit_s` fails (see `run_check`).
    """
    return ConformanceSuite(resolve_adapter(adapter, hal), seed=seed, time_limit_s=time_limit_s).run()
