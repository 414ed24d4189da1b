"""The environment fingerprint carried by every result: what was measured, where, with what code.

A number is only comparable with numbers from the same environment, so every result records
the devices' declared capabilities and fingerprints, the versions of the software stack, the
git commit of the working directory (and whether the tree had uncommitted changes), and the
TORCHHAL_* settings in force. `digest` is a short hash of it all, part of every experiment key.

A variant's own code is in its key too (`code_digest`), so editing its body starts a new
experiment instead of resuming the old timings. What it calls is not: an edit there is seen only
through the git state, and samples resumed while the tree is dirty or not in git are warned
about and counted (`warn_resumed`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import subprocess
import types
from collections.abc import Callable, Iterable
from typing import Any

from torchhal.hal_core import Device, telemetry
from torchhal.hal_core.profile import fingerprint as device_fingerprint

log = telemetry.get_logger("torchhal.evaluation.fingerprint")

_GIT_TIMEOUT_S = 10.0


def environment_fingerprint(devices: Iterable[Device]) -> dict[str, Any]:
    """Devices, software versions, git state and settings, as JSON-able data with its `digest`."""
    import numpy
    import torch

    from torchhal import __version__

    unique = {(d.id, device_fingerprint(d)): d for d in devices}  # one id may name devices of two HALs
    data: dict[str, Any] = {
        "devices": [
            {"id": dev_id, "fingerprint": fp, "capabilities": capabilities_json(dev)}
            for (dev_id, fp), dev in sorted(unique.items())
        ],
        "versions": {
            "torchhal": __version__,
            "torch": torch.__version__,
            "numpy": numpy.__version__,
            "python": platform.python_version(),
        },
        "platform": {
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
        },
        "git": git_state(),
        "settings": {k: v for k, v in sorted(os.environ.items()) if k.startswith("TORCHHAL_")},
    }
    data["digest"] = digest(data)
    return data


def capabilities_json(device: Device) -> dict[str, Any]:
    """The declared capabilities as JSON (the model dumps its sets sorted, so this is stable)."""
    return device.capabilities.model_dump(mode="json")


def digest(data: Any) -> str:
    """A short stable hash of JSON-able data."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_digest(fn: Callable[..., Any]) -> str | None:
    """A hash of the bytecode behind `fn`: its instructions, the names it reads and its constants,
    nested functions' included; for a functools.partial its function's and the arguments it binds,
    for a bound method its function's, for a torch Module (an object whose class has `forward`) its
    class's forward (every Module's `__call__` is torch's), for another callable object its class's
    `__call__`, and a decorator's `__wrapped__` too. None where no Python code is found (a builtin).
    Line numbers and file names are left out, so moving code keeps the hash; what `fn` calls is
    not followed."""
    codes: list[Any] = []
    seen = set()
    current: Any = fn
    while current is not None and id(current) not in seen:  # a __wrapped__ chain may loop
        seen.add(id(current))
        while isinstance(current, functools.partial):
            codes.append(
                [_constant(a) for a in current.args]
                + sorted(_constant(kv) for kv in current.keywords.items())
            )
            current = current.func
        target = getattr(current, "__func__", current)  # a bound method's function
        code = getattr(target, "__code__", None)
        if code is None:  # a callable object: its class's forward (a torch Module) or __call__
            call = getattr(type(target), "forward", None) or type(target).__call__
            code = getattr(call, "__code__", None)
        if code is not None:
            codes.append(_code_parts(code))
        current = getattr(target, "__wrapped__", None)
    return digest(codes) if codes else None


def _code_parts(code: types.CodeType) -> list[Any]:
    return [code.co_code.hex(), list(code.co_names), [_constant(c) for c in code.co_consts]]


def _constant(value: Any) -> Any:
    if isinstance(value, types.CodeType):
        return _code_parts(value)
    if isinstance(value, tuple):
        return [_constant(v) for v in value]
    if isinstance(value, frozenset):  # its order follows string hashing, which varies by process
        return sorted(repr(v) for v in value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor or array bound by a partial
        return f"{type(value).__name__}{tuple(value.shape)}:{value.dtype}"
    return repr(value)


def warn_resumed(fingerprint: dict[str, Any], experiment: str, resumed: int) -> None:
    """Warn about and count `resumed` samples taken from a store while the git tree is dirty or
    unknown: code the variant calls may have changed since they were measured (`code_digest`
    covers only the variant's own code), and its experiment key would not show it."""
    dirty = fingerprint["git"]["dirty"]
    if dirty is False or not resumed:
        return
    log.warning(
        "resumed samples may be stale: code changed since they were measured is not detected",
        experiment=experiment,
        resumed=resumed,
        git="uncommitted changes" if dirty else "no git state",
        fix="delete the store's rows of this experiment (or use a new store) after editing code",
    )
    telemetry.count("torchhal.evaluation.resumed_with_unversioned_code", value=resumed)


def git_state(cwd: str | None = None) -> dict[str, Any]:
    """The commit of the git tree around `cwd` (default: the working directory) and whether it is dirty."""
    try:
        commit = _git(["rev-parse", "HEAD"], cwd)
        dirty = bool(_git(["status", "--porcelain", "--untracked-files=no"], cwd))
    except (OSError, subprocess.SubprocessError) as exc:
        reason = f"{type(exc).__name__}: {str(exc).strip() or 'git failed'}"
        log.info("no git state for the fingerprint", reason=reason)
        return {"commit": None, "dirty": None, "reason": reason}
    return {"commit": commit, "dirty": dirty}


def _git(args: list[str], cwd: str | None) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=True
    )
    return done.stdout.strip()
