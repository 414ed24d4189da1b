"""Measured selection: time the valid candidates once per (device, signature), keep the winner.

Used where timing is real and cheap to get right (devices with timing events that are not
simulated, unless told otherwise). Winners persist on disk per device fingerprint, beside the
measured profiles, so a new process does not measure again. A winner is only as good as the code
that won: each file records the versions of the distributions whose kernels competed (torchhal,
the vendor plugins, Triton), and winners measured with other versions are measured again.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import threading
from collections.abc import Callable, Hashable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from torchhal.hal_core import telemetry
from torchhal.hal_core.capabilities import Feature
from torchhal.hal_core.errors import CallDeclined

if TYPE_CHECKING:
    from torchhal.hal_core.device import Device

log = telemetry.get_logger("torchhal.tuning")
TuneMode = Literal["off", "on", "auto"]
Timing = Literal["eager", "graph"]
Winner = dict[str, Any]  # {"winner": qualified name, "contenders": the sorted names measured}
BATCHES, CALLS_PER_BATCH = 3, 5
# Triton's distribution goes by several names (PyTorch's CUDA, ROCm and XPU wheels pin their own)
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu")


class Tuner:
    def __init__(
        self,
        cache_dir: Path | None,
        mode: TuneMode = "auto",
        code: Callable[[], dict[str, str]] = dict,
        timing: Timing = "eager",
    ) -> None:
        """`code()`: the versions of the code behind the candidates (`code_versions`), asked once,
        when winners are first read or written. `timing`: what a candidate's time is (Settings'
        `selection_timing`): calls back to back, or replays of them captured as a device graph."""
        self.mode = mode
        self.timing = timing
        self._eager_instead: set[str] = set()  # devices told once that they capture no graphs
        self._dir = None if cache_dir is None else cache_dir / "selections"
        self._code = code
        self._versions: dict[str, str] | None = None
        self._winners: dict[str, dict[str, Winner]] = {}  # fingerprint -> op|signature -> winner
        self._measured: set[tuple[Path, str]] = set()  # (file, key) of the winners measured here
        self._lock = threading.Lock()

    def wants(self, device: Device) -> bool:
        if self.mode == "auto":
            caps = device.capabilities
            return Feature.DEVICE_EVENTS in caps.features and not caps.simulated
        return self.mode == "on"

    def recall(self, device: Device, op: str, sig: Hashable, contenders: Iterable[str]) -> str | None:
        """The winner measured among exactly these contenders: a candidate added, enabled again
        or failing no longer since then may be faster, so another set is measured again."""
        entry = self._table(device).get(self._key(device, op, sig))
        if entry is None or entry["contenders"] != sorted(contenders):
            return None
        winner: str = entry["winner"]
        return winner

    def remember(
        self, device: Device, op: str, sig: Hashable, winner: str, contenders: Iterable[str]
    ) -> None:
        """Keep `winner` of `contenders` (those that measured), and save the table merged with the
        file's winners, so HALs and processes sharing a cache keep each other's: the file is read,
        merged and written under a lock (`update_cached`). The file's winners take the place of
        those this Tuner only read (another process may have measured them again since: a stale
        table written back undid it), never of those it measured. A file that cannot be locked or
        written keeps the winner in this Tuner only (logged, counted): the next process measures
        again."""
        from torchhal.hal_core.profile import update_cached

        with self._lock:
            table = self._table(device)
            key = self._key(device, op, sig)
            table[key] = {"winner": winner, "contenders": sorted(contenders)}
            path = self._path(device)
            if path is None:
                return
            self._measured.add((path, key))
            code = self._code_versions()

            def merged() -> str:
                on_disk = _parse(_read_json(path), code)  # a reason (str) where absent or unusable
                if isinstance(on_disk, dict):
                    table.update({k: v for k, v in on_disk.items() if (path, k) not in self._measured})
                return json.dumps({"code": code, "winners": table}, indent=1, sort_keys=True)

            update_cached(path, merged)

    def measure(
        self,
        device: Device,
        candidates: Sequence[tuple[str, Callable[..., Any]]],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> list[tuple[str, float]]:
        """Milliseconds per call for each candidate, fastest first; one that raises gets inf. Under
        graph timing on a device that captures graphs, replays of each candidate's calls are
        timed, and one that cannot be captured gets inf too (a caller's graph would fail with it).
        One that declines the call (CallDeclined: a refusal of this call, not a failure) is left
        out, unmeasured; the registry, which knows the op, says so and places it."""
        per_call = _ms_per_replay if self._graphs(device) else _ms_per_call
        timings = []
        for name, fn in candidates:
            try:
                timings.append((name, per_call(device, fn, args, kwargs)))
            except CallDeclined as exc:
                log.debug("candidate declined the call it was measured on", candidate=name, error=repr(exc))
            except Exception as exc:
                log.warning("candidate raised while being measured", candidate=name, error=repr(exc))
                timings.append((name, math.inf))
        return sorted(timings, key=lambda t: t[1])

    def forget(self) -> None:
        """Drop the winners held in memory (measured here or read from the files), not the files:
        the next selection reads its file again, and measures where the file has no winner
        (`KernelRegistry.clear_cache`)."""
        with self._lock:
            self._winners = {}
            self._measured = set()

    def _graph_timed(self, device: Device) -> bool:
        """Whether candidates are timed as graph replays on `device`: graph timing asked and the
        device declares graphs."""
        return self.timing == "graph" and Feature.GRAPHS in device.capabilities.features

    def _graphs(self, device: Device) -> bool:
        """`_graph_timed`, saying so where graph timing was asked of a device without graphs,
        which is timed eagerly instead (logged once per device, counted each measurement)."""
        if self._graph_timed(device):
            return True
        if self.timing == "graph":
            telemetry.count("torchhal.tuning.graph_timing_unavailable")
            if device.id not in self._eager_instead:
                self._eager_instead.add(device.id)
                log.warning(
                    "graph timing asked; the device captures no graphs: eager timing", device=device.id
                )
        return False

    def _key(self, device: Device, op: str, sig: Hashable) -> str:
        """A winner's key in the table: graph-timed winners apart from eager ones (the two orders
        differ where host launch cost decides)."""
        key = f"{op}|{sig!r}"
        return f"{key}|graph" if self._graph_timed(device) else key

    def _table(self, device: Device) -> dict[str, Winner]:
        from torchhal.hal_core.profile import fingerprint

        fp = fingerprint(device)
        if fp not in self._winners:
            path = self._path(device)
            read = {} if path is None else _read_winners(path, self._code_versions)
            # two threads may both read: the first table stays, with what was remembered into it
            return self._winners.setdefault(fp, read)
        return self._winners[fp]

    def _path(self, device: Device) -> Path | None:
        """The file of `device`'s winners (None: no cache directory)."""
        from torchhal.hal_core.profile import fingerprint

        return None if self._dir is None else self._dir / f"{fingerprint(device)}.json"

    def _code_versions(self) -> dict[str, str]:
        if self._versions is None:
            self._versions = self._code()
        return self._versions


def code_versions(distributions: Iterable[str]) -> dict[str, str]:
    """Versions of the distributions whose kernels compete, and of Triton where installed, read
    from package metadata (nothing is imported). A distribution without metadata is "unknown"."""
    versions = {}
    for name in sorted(set(distributions)):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "unknown"
    for name in TRITON_DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        break
    return versions


def _read_winners(path: Path, versions: Callable[[], dict[str, str]]) -> dict[str, Winner]:
    """The persisted winners, or none where there is no file, it is unusable (torn, hand-edited,
    an older format, unreadable) or was measured with other code: then every selection is
    measured again and the file rewritten, which is logged, never a crash. Read, not checked with
    `path.exists()` first: that raised PermissionError out of the user's op. `versions()` (the
    code's, from package metadata) is asked only where there is a file."""
    from torchhal.hal_core.profile import ABSENT

    saved = _read_json(path)
    if isinstance(saved, ABSENT):
        return {}
    code = versions()
    parsed = _parse(saved, code)
    if isinstance(parsed, dict):
        return parsed
    if parsed is None:
        log.info(
            "cached kernel selections were measured with other code; measuring again",
            path=str(path), measured_with=saved.get("code"), now=code,
        )  # fmt: skip
    else:
        telemetry.count("torchhal.cache.unusable")
        log.warning("cached kernel selections unusable; measuring again", path=str(path), reason=parsed)
    return {}


def _read_json(path: Path) -> Any:
    """The file's JSON, or the exception that kept it from being read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return exc


def _parse(saved: Any, code: dict[str, str]) -> dict[str, Winner] | str | None:
    """The winners of a saved file measured with `code`; None where other code measured them; else
    why the file is unusable."""
    if isinstance(saved, Exception):
        return f"{type(saved).__name__}: {saved}"
    table = saved.get("winners") if isinstance(saved, dict) else None
    if not isinstance(table, dict) or not all(map(_is_winner, table.values())):
        return 'not an object with "code" and "winners" (op|signature -> winner and contenders)'
    return table if saved.get("code") == code else None


def _is_winner(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("winner"), str)
        and isinstance(entry.get("contenders"), list)
        and all(isinstance(name, str) for name in entry["contenders"])
    )


def _ms_per_call(
    device: Device, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> float:
    fn(*args, **kwargs)  # warm-up: compilation and autotuning stay out of the figure
    timer = device.timer()
    best = math.inf
    for _ in range(BATCHES):
        start = timer.mark()
        for _ in range(CALLS_PER_BATCH):
            fn(*args, **kwargs)
        best = min(best, timer.elapsed_ms(start, timer.mark()) / CALLS_PER_BATCH)
    return best


def _ms_per_replay(
    device: Device, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> float:
    """Milliseconds per call of `fn` replayed from a device graph of CALLS_PER_BATCH calls. Each
    timed replay follows an untimed one, so the device is busy when the start mark is recorded and
    the host's launch of the replay stays out of the figure. Each call's outputs are dropped before
    the next, so the graph's memory holds one call's, as eager timing does."""

    def calls() -> None:
        for _ in range(CALLS_PER_BATCH):
            fn(*args, **kwargs)

    replay = device.graph_replay(calls)
    timer = device.timer()
    best = math.inf
    for _ in range(BATCHES):
        replay()
        start = timer.mark()
        replay()
        best = min(best, timer.elapsed_ms(start, timer.mark()) / CALLS_PER_BATCH)
    return best
