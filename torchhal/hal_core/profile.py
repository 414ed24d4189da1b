"""Micro-benchmarks that measure a device, cached on disk by device fingerprint.

Work runs through the HAL (the registry's `matmul` op, the adapter's copy) and is timed with
the device's own timer, so a simulated ASIC reports its simulated time and a GPU its event
time. The same work through plain torch calls is measured beside it in the same run.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import stat
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from functools import cache, partial
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from torchhal.hal_core import telemetry
from torchhal.hal_core.capabilities import SCHEMA_VERSION, DType, MeasuredProfile
from torchhal.hal_core.device import Device
from torchhal.hal_core.errors import TorchHALError
from torchhal.hal_core.torch_flags import float32_matmul_precision

if sys.platform == "win32":
    import msvcrt
else:
    import fcntl

if TYPE_CHECKING:
    import torch

    from torchhal.hal_core.hal import HardwareAbstractionLayer

log = telemetry.get_logger("torchhal.profile")
# Said of a figure lost to out of memory, which passes (other allocations come and go): a profile
# holding such a note is returned, never cached as the device's, so the next run measures again.
PASSING = "out of memory passes: this profile is not cached, the next run measures again"


def fingerprint(device: Device) -> str:
    """Stable id of (device identity, driver, torch version, compute units, schema version): a new
    driver or torch re-measures; so does another thread count on the host (the CPU's compute units
    are torch's threads: a profile measured under OMP_NUM_THREADS=1 was served to a full-core
    run); and each schema version has a file of its own, so an older and a newer torchhal sharing
    a cache stop replacing each other's profile."""
    import torch

    caps = device.capabilities
    ident = {
        "adapter": caps.adapter,
        "name": caps.name,
        "arch": caps.arch,
        "id": caps.uuid or caps.pci_bus_id or device.id,
        "driver": caps.driver_version,
        "memory": caps.memory_bytes,
        "compute_units": caps.compute_units,
        "torch": torch.__version__,
        "schema": SCHEMA_VERSION,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def cache_path(cache_dir: Path, device: Device) -> Path:
    return cache_dir / "profiles" / f"{fingerprint(device)}.json"


def measure_or_load(
    hal: HardwareAbstractionLayer, device: Device, *, refresh: bool = False
) -> MeasuredProfile:
    path = cache_path(hal.settings.cache_dir, device)
    cached = None if refresh else _load_cached(device, path)
    if cached is not None:
        return cached
    # seconds of device work a caller may not expect (HeteroGroup.create asks for a rate): said
    reason = "refresh" if refresh else "no usable profile cached"
    log.info("measuring device profile", device=device.id, reason=reason)
    profile = measure(hal, device)
    lost = passing_losses(profile)
    if lost:
        telemetry.count("torchhal.profile.not_cached")
        log.warning(
            "device profile not cached: out of memory cost it a figure", device=device.id, dtypes=lost
        )
    elif write_cached(path, profile.model_dump_json(indent=2)):
        log.info("device profile cached", device=device.id, path=str(path))
    return profile


def passing_losses(profile: MeasuredProfile) -> list[str]:
    """The dtypes whose figures `profile` lost to out of memory: such a profile is kept by no
    cache, on disk or in a HAL, so the next request measures again."""
    return [note.split()[1] for note in profile.notes if note.endswith(f"({PASSING})")]


# A cache file not there: a miss, said by nobody (its directory may be a file: written, it fails)
ABSENT = (FileNotFoundError, NotADirectoryError)


_TEMP_NAME = re.compile(r"\..+\.[0-9a-f]{16}\.tmp")  # write_cached's temporary files
STALE_TEMP_S = 3600.0  # a write takes milliseconds: a temporary file this old is a killed writer's


def write_cached(path: Path, text: str) -> bool:
    """Write a cache file atomically (a crash never leaves half of one). One that cannot be
    written (TORCHHAL_CACHE_DIR is a file, or read-only) is logged and counted, not raised: the
    measurement it holds is still returned, and is measured again by the next process."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # a temporary file of this writer's own: two processes writing one cache file at once
        # shared `<name>.tmp` and truncated each other's, so a reader could meet half a file.
        # Made with mode 0o666 less the umask, as any file: mkstemp's 0o600 kept the other users
        # of a group-shared cache from reading it. UTF-8 whatever the locale, as it is read.
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        _not_written(path, exc)
        return False
    _remove_stale_temps(path.parent)
    return True


def _remove_stale_temps(directory: Path) -> None:
    """Remove `write_cached`'s temporary files in `directory` older than `STALE_TEMP_S`: a writer
    killed between writing one and renaming it left it there for good. Younger ones may be
    another writer's, still writing, and are left alone. Each removal is logged and counted, and
    so is one that fails (another user's file in a sticky directory); the write stands."""
    cutoff = time.time() - STALE_TEMP_S
    try:
        with os.scandir(directory) as entries:
            names = [entry.path for entry in entries if _TEMP_NAME.fullmatch(entry.name)]
    except OSError as exc:
        _stale_temp_kept(str(directory), exc)
        return
    for name in names:
        try:
            if os.lstat(name).st_mtime >= cutoff:
                continue
            os.unlink(name)
        except FileNotFoundError:
            continue  # another writer removed it first
        except OSError as exc:
            _stale_temp_kept(name, exc)
            continue
        telemetry.count("torchhal.cache.stale_temps_removed")
        log.info("removed a killed writer's temporary cache file", path=name)


def _stale_temp_kept(path: str, exc: OSError) -> None:
    telemetry.count("torchhal.cache.stale_temps_kept")
    log.info("stale temporary cache file not removed", path=path, error=f"{type(exc).__name__}: {exc}")


def update_cached(path: Path, render: Callable[[], str]) -> bool:
    """Read, change and write a cache file that processes share: `render()` reads the file as it
    is now and returns its new text, written with `write_cached`, all under an exclusive lock on
    `<name>.lock` beside it (kept: removing a lock file races its next taker). Unlocked, a
    writer that read before another's write replaced that write, losing what the other added.
    A lock that cannot be taken is a file not written, logged and counted as `write_cached`'s,
    except on a filesystem that has no locks, where the merge goes on unlocked (`_unlocked`)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(path.with_name(f"{path.name}.lock")):
            return write_cached(path, render())
    except OSError as exc:
        _not_written(path, exc)
        return False


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """An advisory lock, held through this open file until it is closed: flock on POSIX (it
    excludes two opens in one process too, where fcntl's record locks are per process), msvcrt's
    one-byte lock on Windows (it retries for 10 s, then raises OSError). Where flock says the
    filesystem has no locks, nothing is held (`_unlocked`).

    A lock file it may not write (another user's, made under umask 022 in a group-shared cache)
    is opened read-only, which flock locks as well (NFS's emulation of flock wants a writable
    file: there that user's write fails as before, logged and counted). Opened for writing only,
    it kept every other user of the cache from writing to it.

    Opened without blocking and without following a symbolic link, and refused unless it is a
    regular file: a FIFO left there by another user hung the read-only open for good, waiting for
    a writer. O_NONBLOCK does not make flock non-blocking."""
    flags = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | flags, 0o666)
    except PermissionError:
        if not os.path.lexists(lock_path):  # not there, and this user may not make it: said as is
            raise
        fd = os.open(lock_path, os.O_RDONLY | flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(
                errno.EINVAL,
                f"lock file {str(lock_path)!r} is not a regular file (mode {stat.filemode(mode)})",
            )
        if sys.platform == "win32":
            msvcrt.locking(fd, msvcrt.LK_LOCK, 1)
            try:
                yield
            finally:
                msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    raise
                _unlocked(str(lock_path.parent), exc)
            yield
    finally:
        os.close(fd)  # releases flock's lock


# What flock answers where the filesystem has no locks (NFS without a lock daemon: ENOLCK; Lustre
# mounted without `flock`: ENOSYS): failing there left every cache on it unwritten for good.
_NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP})


def _unlocked(directory: str, exc: OSError) -> None:
    """A write merged without the lock, as before there was one (two writers at once may lose
    one's additions, measured again later): counted each time, said once per directory."""
    telemetry.count("torchhal.cache.unlocked_writes")
    _say_unlocked(directory, f"{type(exc).__name__}: {exc}")


@cache
def _say_unlocked(directory: str, error: str) -> None:
    log.warning(
        "cache file merged without a lock: this filesystem has none, so processes writing at once "
        "may lose each other's additions (measured again later)",
        directory=directory,
        error=error,
    )


def _not_written(path: Path, exc: OSError) -> None:
    telemetry.count("torchhal.cache.write_failures")
    log.warning(
        "cache not written; check TORCHHAL_CACHE_DIR",
        path=str(path),
        error=f"{type(exc).__name__}: {exc}",
    )


def _load_cached(device: Device, path: Path) -> MeasuredProfile | None:
    """The cached profile, or None: missing, or unusable, which is a cache miss that is logged and
    measured again, never a crash. Unusable: another or no schema version, a torn or hand-edited
    file (numbers as strings, figures no measurement gives: NaN, infinite, zero or negative), or a
    record of another device (a file copied between hosts)."""
    try:
        profile = MeasuredProfile.model_validate_json(path.read_bytes(), strict=True)
    except ABSENT:  # not `path.exists()` first: it raised PermissionError out of the user's job
        return None
    except ValidationError as exc:
        reason = "; ".join(
            ".".join(map(str, e["loc"])) + ": " + e["msg"] if e["loc"] else e["msg"]
            for e in exc.errors(include_url=False)
        )
    except OSError as exc:
        reason = f"{type(exc).__name__}: {exc}"
    else:
        foreign = _foreign(profile, device)
        if foreign is None:
            return profile
        reason = foreign
    telemetry.count("torchhal.cache.unusable")
    log.warning("cached profile unusable; measuring again", device=device.id, path=str(path), reason=reason)
    return None


def _foreign(profile: MeasuredProfile, device: Device) -> str | None:
    """Why a cached profile is not this device's, or None."""
    if "schema_version" not in profile.model_fields_set:
        return "no schema_version"
    mine = {"fingerprint": fingerprint(device), "device_id": device.id, "simulated": device.simulated}
    theirs = {key: getattr(profile, key) for key in mine}
    if theirs != mine:
        return f"a record of another device: {theirs}, this device {mine}"
    return None


def measure(hal: HardwareAbstractionLayer, device: Device) -> MeasuredProfile:
    """Measure matmul TFLOP/s per declared dtype, copy bandwidth and launch latency."""
    import torch

    notes: list[str] = []
    if device.simulated:
        notes.append("times are simulated by the device's cost model; numerics are real")
    budget, what = _budget(device)
    if what != "free":
        notes.append(_memory_unknown(device, budget))
    # host memory, or memory the device does not state: keep sizes for a laptop
    small = device.capabilities.device_type == "cpu" or budget is None
    matmul: dict[DType, float] = {}
    direct: dict[DType, float] = {}
    sizes: dict[DType, int] = {}
    with telemetry.span("torchhal.profile", device=device.id):
        for dtype in DType:  # every declared format gets a figure or a note saying why not
            if dtype not in device.capabilities.dtypes:
                continue
            try:
                most = 512 if device.simulated else 1024 if small else 8192
                max_n, (fitted, to) = _matmul_n(device, dtype, most)
                if max_n < most:
                    notes.append(
                        f"matmul {dtype.value} at n <= {max_n} (not {most}): fitted to {fitted} bytes {to}"
                    )
                sizes[dtype], matmul[dtype], peer, problem = _matmul_rates(hal, device, dtype, max_n)
                if peer is not None:
                    direct[dtype] = peer
                if problem is not None:
                    notes.append(f"matmul {dtype.value} through torch.matmul not measured: {problem}")
            except Exception as exc:  # a declared dtype without a matmul path is reported, not hidden
                passing = f" ({PASSING})" if _out_of_memory(exc) else ""
                notes.append(f"matmul {dtype.value} not measured: {type(exc).__name__}: {exc}{passing}")
                log.warning(
                    "profile: matmul not measured", device=device.id, dtype=dtype.value, error=str(exc)
                )
        copy_bytes = _copy_bytes(device, (64 if small else 1024) * 2**20)
        src = _random(device, (copy_bytes // 4,), torch.float32)
        dst = device.empty(src.shape, torch.float32)
        plain = not device.simulated
        copy_s, direct_copy_s = _seconds(
            device, lambda: device.copy_(dst, src), (lambda: dst.copy_(src)) if plain else None
        )
        one_src, one_dst = _random(device, (1,), torch.float32), device.empty((1,), torch.float32)
        launch_s, direct_launch_s = _seconds(
            device,
            lambda: device.copy_(one_dst, one_src),
            (lambda: one_dst.copy_(one_src)) if plain else None,
            reps=200,
        )
    return MeasuredProfile(
        fingerprint=fingerprint(device),
        device_id=device.id,
        device_name=device.capabilities.name,
        simulated=device.simulated,
        matmul_tflops=matmul,
        matmul_sizes=sizes,
        copy_bandwidth_gbps=2 * copy_bytes / copy_s / 1e9,
        copy_bytes=copy_bytes,
        launch_latency_us=launch_s * 1e6,
        direct_matmul_tflops=None if device.simulated else direct,
        direct_copy_bandwidth_gbps=None if direct_copy_s is None else 2 * copy_bytes / direct_copy_s / 1e9,
        direct_launch_latency_us=None if direct_launch_s is None else direct_launch_s * 1e6,
        measured_at=datetime.now(timezone.utc),
        torch_version=torch.__version__,
        notes=tuple(notes),
    )


def _out_of_memory(exc: Exception) -> bool:
    """A device's (DeviceOutOfMemoryError is a MemoryError) or torch's: torch.OutOfMemoryError
    from torch 2.5 on, the same class as torch.cuda's name for it, which torch 2.4 has."""
    import torch

    return isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError))


def _matmul_rates(
    hal: HardwareAbstractionLayer, device: Device, dtype: DType, max_n: int
) -> tuple[int, float, float | None, str | None]:
    """(n, TFLOP/s through the HAL, through torch.matmul, why torch.matmul was not measured) of
    n×n×n products: a dtype has a size only beside its figure, and the operands are freed before
    the next dtype's. torch.matmul failing (a dtype only a plugin's kernel multiplies) leaves the
    HAL's figure standing, without its peer; a simulated device has no peer."""
    import torch

    with _tf32(dtype is DType.TF32):
        a, b = _sized_operands(hal, device, dtype, max_n)
        n = a.shape[0]
        peer_fn: Callable[[], object] | None = None if device.simulated else partial(torch.matmul, a, b)
        problem = None
        if peer_fn is not None:
            try:
                peer_fn()
            except Exception as exc:
                problem, peer_fn = f"{type(exc).__name__}: {exc}", None
        seconds, peer_seconds = _seconds(device, partial(hal.kernels.call, "matmul", device, a, b), peer_fn)
        rate = 2 * n**3 / seconds / 1e12
        peer = None if peer_seconds is None else 2 * n**3 / peer_seconds / 1e12
    return n, rate, peer, problem


def _copy_bytes(device: Device, most: int) -> int:
    """The copy's size: `most`, halved (to 1 MiB at least) until its source and destination
    take at most half of the device's free memory. A fixed 64 MiB copy made the whole profile
    fail with out-of-memory on a device of 100 MiB."""
    return _halved_to_fit(most, 2**20, lambda size: 2 * size, _budget(device)[0])


def _matmul_n(device: Device, dtype: DType, most: int) -> tuple[int, tuple[int | None, str]]:
    """(The largest n the dtype's products may take, the `_budget` it was fitted to): `most`,
    halved (to 16 at least) until four n×n operands (a, b, the product, and the half-size pair
    still held while the size doubles) take at most half of the free memory. A fixed n failed
    every dtype with out-of-memory on a small device, on every run (such a profile is not cached)."""
    import torch

    itemsize = (dtype.to_torch() or torch.float32).itemsize
    budget = _budget(device)
    return _halved_to_fit(most, 16, lambda n: 4 * n * n * itemsize, budget[0]), budget


def _budget(device: Device) -> tuple[int | None, str]:
    """(Bytes the sizes are fitted to, what they are): free memory; where the runtime does not
    give it, total memory (else the declared capacity; 0 there is not stated); None where no
    figure is known (the sizes are then not fitted)."""
    info = device.memory_info()
    free = info.known("free")
    if free is not None:
        return free, "free"
    total = info.known("total") or device.capabilities.memory_bytes or None
    return total, "in all (free memory unknown)"


def _memory_unknown(device: Device, budget: int | None) -> str:
    """The profile's note, logged and counted, where the device does not say its free memory.
    Fitted to the 0 bytes it then read as free, every matmul ran at n = 16 and the copy at 1 MiB,
    measuring launch overhead rather than the device. The sizes are fitted to total memory
    instead; where that is unknown too, they are the host's (a 64 MiB copy, matmul n <= 1024), and
    an out of memory is noted in the profile, which is then not cached."""
    if budget is None:
        note = "free and total memory unknown: matmul and copy at the host's sizes, not fitted to memory"
    else:
        note = f"free memory unknown: matmul and copy sizes fitted to total memory ({budget} bytes)"
    telemetry.count("torchhal.profile.memory_unknown", device=device.id)
    log.warning("profile: " + note, device=device.id)
    return note


def _halved_to_fit(most: int, least: int, footprint: Callable[[int], int], budget: int | None) -> int:
    """`most`, halved down to `least` until `footprint(size)` is at most half of `budget` (bytes;
    None: not fitted)."""
    size = most
    while budget is not None and size > least and 2 * footprint(size) > budget:
        size //= 2
    return size


def _sized_operands(
    hal: HardwareAbstractionLayer, device: Device, dtype: DType, max_n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Square operands, doubled from 256 (or max_n, if smaller) until one product takes about
    10 ms (or max_n)."""
    import torch

    tdtype = dtype.to_torch() or torch.float32  # tf32 is fp32 storage in a faster matmul mode
    if dtype in (DType.FP8_E4M3, DType.FP8_E5M2, DType.FP8_E4M3_FNUZ, DType.FP8_E5M2_FNUZ):
        raise TorchHALError("fp8 matmul needs scaling factors; no vendor-neutral op measures it yet")
    n = max_n if device.simulated else min(256, max_n)  # simulated time: not the host's speed
    while True:
        a, b = _random(device, (n, n), tdtype), _random(device, (n, n), tdtype)
        hal.kernels.call("matmul", device, a, b)  # warm-up: compilation and handles stay out
        timer = device.timer()
        start = timer.mark()
        hal.kernels.call("matmul", device, a, b)
        if n >= max_n or timer.elapsed_ms(start, timer.mark()) >= 10.0:
            return a, b
        n *= 2


def _random(device: Device, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random (never zero) data on the device: zeros can run faster than real data."""
    t = device.empty(shape, dtype)
    if dtype.is_floating_point:
        t.normal_()
    else:
        t.random_(-8, 8)
    return t


def _tf32(enabled: bool) -> contextlib.AbstractContextManager[None]:
    """TF32 is fp32 matmul at 'high' precision: torch's vendor-neutral switch for it."""
    return float32_matmul_precision("high" if enabled else "highest")


def _seconds(
    device: Device, fn: Callable[[], object], peer: Callable[[], object] | None = None, reps: int = 0
) -> tuple[float, float | None]:
    """Median seconds per call of `fn` and of its plain-torch `peer` (None: not measured) over 5
    timed batches each, after a warm-up call, their batches interleaved: measured one after the
    other, the first had the GPU's boost clock to itself (tf32 matmul through torchhal read 10%
    above torch.matmul in the same run on an H100). Simulated time is a deterministic function
    of the op, so one timed call measures it exactly, and a simulated device has no peer."""
    fns = [fn] if peer is None else [fn, peer]
    for f in fns:
        f()
    timer = device.timer()
    start = timer.mark()
    fn()
    first_ms = timer.elapsed_ms(start, timer.mark())
    if device.simulated:
        if first_ms <= 0:  # not a figure: 2n³ over a clamped zero read as 268,435 TFLOP/s
            raise TorchHALError(
                f"{device.id} charged no simulated time for it (it ran outside the simulation)"
            )
        return first_ms / 1e3, None
    first_ms = max(first_ms, 1e-6)
    reps = reps or max(1, min(50, int(50.0 / first_ms)))  # about 50 ms per batch
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(5):
        for f, taken in zip(fns, samples, strict=True):
            start = timer.mark()
            for _ in range(reps):
                f()
            taken.append(timer.elapsed_ms(start, timer.mark()) / reps / 1e3)
    medians = [statistics.median(taken) for taken in samples]
    return medians[0], (medians[1] if peer is not None else None)
