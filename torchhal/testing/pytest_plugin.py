"""pytest face of the conformance kit: one test item per check.

    pytest -p torchhal.testing.pytest_plugin --torchhal-adapter NAME

or `pytest_plugins = ["torchhal.testing.pytest_plugin"]` in a conftest.py. Items are named
`torchhal-conformance[NAME]::<check id>`; a failed check fails its item with the reason, a
check that does not apply is skipped with the reason. The adapter is resolved through a
fresh `HardwareAbstractionLayer()`, or through the HAL a conftest returns from the hook
`pytest_torchhal_conformance_hal(config)` (e.g. one built with `adapters=[MyAdapter()]`
to certify an adapter before it is packaged), after its discovery, which must finish within
`--torchhal-discovery-time-limit` seconds.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import _pytest.config
import pytest

from torchhal.hal_core import TorchHALError, telemetry
from torchhal.testing.report import CheckStatus
from torchhal.testing.suite import (
    CHECK_TIME_LIMIT_S,
    Check,
    ConformanceSuite,
    DiscoveryStuck,
    checked_time_limit,
    discover_within_limit,
    exit_leaving_threads,
    resolve_adapter,
)

if TYPE_CHECKING:
    from torchhal.hal_core.hal import HardwareAbstractionLayer

log = telemetry.get_logger("torchhal.testing")

_SUITES = pytest.StashKey[dict[str, ConformanceSuite]]()
_SESSION = pytest.StashKey[pytest.Session]()
# pytest's run (`pytest.main`, and the function behind it) and its console entry points (the
# `pytest` command and `python -m pytest`), by code object; names differ across pytest versions
_RUN = frozenset(f.__code__ for f in (pytest.main, getattr(_pytest.config, "_main", None)) if f is not None)
_CONSOLE = frozenset(
    f.__code__
    for f in (getattr(_pytest.config, "_console_main", None), getattr(_pytest.config, "console_main", None))
    if f is not None
)


class ConformanceHookspecs:
    @pytest.hookspec(firstresult=True)
    def pytest_torchhal_conformance_hal(self, config: pytest.Config) -> HardwareAbstractionLayer | None:
        """Return the HAL through which --torchhal-adapter names are resolved (default: a fresh one)."""


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(ConformanceHookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("torchhal", "torchhal adapter conformance")
    group.addoption(
        "--torchhal-adapter",
        action="append",
        default=[],
        metavar="NAME",
        help="run the torchhal conformance kit on the adapter NAME (repeatable)",
    )
    group.addoption(
        "--torchhal-seed",
        type=int,
        default=None,
        metavar="SEED",
        help="replay the random inputs of an earlier conformance run (printed in the report header)",
    )
    group.addoption(
        "--torchhal-time-limit",
        type=float,
        default=CHECK_TIME_LIMIT_S,
        metavar="SECONDS",
        help=f"fail a conformance check still running after SECONDS (default {CHECK_TIME_LIMIT_S:g})",
    )
    group.addoption(
        "--torchhal-discovery-time-limit",
        type=float,
        default=CHECK_TIME_LIMIT_S,
        metavar="SECONDS",
        help="stop with a usage error when the plugins' discovery has not finished after SECONDS "
        f"(default {CHECK_TIME_LIMIT_S:g})",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SUITES] = {}
    config.addinivalue_line(
        "markers", "torchhal_conformance: a check of the torchhal adapter conformance kit"
    )


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """After every other plugin's unconfigure: while a check left running past its time limit
    has not returned, end the `pytest` command with the session's exit status now, as
    `torchhal conformance` does (`exit_leaving_threads`); finalizing the interpreter while that
    call ran torch code aborted pytest (SIGABRT, exit code 134). A `pytest.main()` call (an
    in-process run) is not the process's to end: its caller is warned instead."""
    session = config.stash.get(_SESSION, None)
    left = [
        thread.name for suite in config.stash.get(_SUITES, {}).values() for thread in suite.still_running()
    ]
    if not left or session is None:
        return
    status = int(session.exitstatus)
    if not _runs_the_process():
        log.warning(
            "conformance calls left running past their time limit; the process may abort if they "
            "are still running when it exits",
            threads=left,
        )
        return
    log.warning(
        "conformance calls left running past their time limit: pytest exits without finalizing the "
        "interpreter",
        threads=left,
        exit_status=status,
    )
    exit_leaving_threads(status)


def _runs_the_process() -> bool:
    """Whether this run is the `pytest` command itself, whose console entry point hands the run's
    status to sys.exit, rather than a `pytest.main()` call whose caller goes on afterwards."""
    frame = sys._getframe()
    while frame is not None and frame.f_code not in _RUN:
        frame = frame.f_back  # type: ignore[assignment]
    while frame is not None and frame.f_code in _RUN:
        frame = frame.f_back  # type: ignore[assignment]
    return frame is not None and frame.f_code in _CONSOLE


def _suites(config: pytest.Config) -> dict[str, ConformanceSuite]:
    suites = config.stash[_SUITES]
    names = config.getoption("torchhal_adapter")
    if names and not suites:
        hal = config.hook.pytest_torchhal_conformance_hal(config=config)
        if hal is None:
            from torchhal.hal_core.hal import HardwareAbstractionLayer

            hal = HardwareAbstractionLayer()
        try:
            limit = checked_time_limit(config.getoption("torchhal_discovery_time_limit"))
        except TorchHALError as exc:
            raise pytest.UsageError(f"--torchhal-discovery-time-limit: {exc}") from exc
        try:
            # a plugin whose discovery never returns hung pytest before any item existed
            discover_within_limit(hal, limit)
        except (DiscoveryStuck, TorchHALError) as exc:  # stuck, or a strict-mode plugin failure
            raise pytest.UsageError(str(exc)) from None
        for name in names:
            try:
                adapter = resolve_adapter(name, hal)
            except TorchHALError as exc:
                raise pytest.UsageError(f"--torchhal-adapter: {exc}") from exc
            try:
                suites[name] = ConformanceSuite(
                    adapter,
                    seed=config.getoption("torchhal_seed"),
                    time_limit_s=config.getoption("torchhal_time_limit"),
                )
            except TorchHALError as exc:
                raise pytest.UsageError(f"--torchhal-time-limit: {exc}") from exc
    return suites


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"torchhal conformance: adapter {name!r}, seed {s.seed}" for name, s in _suites(config).items()]


class ConformanceFailure(Exception):
    """A check found the adapter non-conforming; the message is the check's reason."""


class ConformanceItem(pytest.Item):
    """One conformance check as a test: fails with the check's reason, skips when not applicable."""

    def __init__(self, *, suite: ConformanceSuite, check: Check, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.suite = suite
        self.check = check
        self.add_marker(pytest.mark.torchhal_conformance)

    def runtest(self) -> None:
        result = self.suite.run_check(self.check)
        if result.status is CheckStatus.NOT_APPLICABLE:
            pytest.skip(f"{self.check.id} not applicable: {result.reason}")
        if result.status is CheckStatus.FAILED:
            raise ConformanceFailure(result.reason)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, ConformanceFailure):
            return f"{self.check.id} ({self.check.title}) failed: {excinfo.value}"
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[str, int | None, str]:
        return (
            f"torchhal-conformance[{self.suite.adapter_name}]",
            None,
            f"{self.check.id}: {self.check.title}",
        )


class ConformanceCollector(pytest.Collector):
    """The checks planned for one adapter (fixed checks, then one per kernel candidate)."""

    def __init__(self, *, suite: ConformanceSuite, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.suite = suite

    def collect(self) -> list[pytest.Item]:
        return [
            ConformanceItem.from_parent(self, name=c.id, suite=self.suite, check=c)
            for c in self.suite.checks()
        ]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    """Append the conformance items before other plugins (-k, -m) filter the collection.

    The collect report tells the terminal and other reporters about the items, as if they had
    been collected from a file.
    """
    for name, suite in _suites(config).items():
        node = f"torchhal-conformance[{name}]"
        collector = ConformanceCollector.from_parent(session, name=node, nodeid=node, suite=suite)
        collected = collector.collect()
        config.hook.pytest_collectreport(report=pytest.CollectReport(node, "passed", None, list(collected)))
        items.extend(collected)
