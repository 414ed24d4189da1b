"""The environment fingerprint carried by every result: what was measured, where, with what code.

A number is only comparable with numbers from the same environment, so every result records
the devices' declared capabilities and fingerprints, the versions of the software stack, the
git commit of the working directory (and whether the tree had uncommitted changes), the
TORCHHAL_* settings in force, and torch's global math and performance settings (thread counts,
float32 matmul precision, deterministic algorithms, and each adapter's own: TF32, cuDNN's). `digest` is
a short hash of it all, part of every experiment key.

A variant's own code is in its key too (`code_digest`), with its default arguments and the
arguments a partial binds, so editing its body or a default starts a new experiment instead of
resuming the old timings. What it calls is not: an edit there is seen only through the git
state, and samples resumed while the tree is dirty or not in git are warned about and counted
(`warn_resumed`). Nor are the values it closes over, nor the value of a bound object whose repr
is its memory address (a config, a tokenizer wrapper: the address differs in every process, so
only the object's type is hashed; the first of each type is warned about, every one counted as
`torchhal.evaluation.unkeyed_bound_values`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import subprocess
import types
from collections.abc import Callable, Iterable
from typing import Any

from torchhal.hal_core import Device, telemetry, torch_flags
from torchhal.hal_core.profile import fingerprint as device_fingerprint

log = telemetry.get_logger("torchhal.evaluation.fingerprint")

_GIT_TIMEOUT_S = 10.0

# the default repr of an object (`<pkg.Cfg object at 0x7f3a...>`), a function's, a lock's, ...
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]+")
_UNKEYED_COUNTER = "torchhal.evaluation.unkeyed_bound_values"
_unkeyed_types_warned: set[str] = set()


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
        "torch_settings": torch_settings(unique.values()),
    }
    data["digest"] = digest(data)
    return data


def torch_settings(devices: Iterable[Device]) -> dict[str, Any]:
    """torch's process-wide settings that change timings or results: those of every device
    (thread counts, deterministic algorithms, fp32 matmul precision) and, per adapter, its
    runtime's own (TF32, reduced-precision reductions, autotuning: `Device.numerics_settings`).
    Read from flags only: nothing here initialises a device runtime."""
    by_adapter = {device.capabilities.adapter: device for device in devices}
    return {
        **torch_flags.general_settings(),
        "adapters": {name: by_adapter[name].numerics_settings() for name in sorted(by_adapter)},
    }


def capabilities_json(device: Device) -> dict[str, Any]:
    """The declared capabilities as JSON (the model dumps its sets sorted, so this is stable)."""
    return device.capabilities.model_dump(mode="json")


def digest(data: Any) -> str:
    """A short stable hash of JSON-able data."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def code_digest(fn: Callable[..., Any]) -> str | None:
    """A hash of the bytecode behind `fn`: its instructions, the names it reads, its constants and
    its default arguments, nested functions' included; for a functools.partial its function's and
    the arguments it binds, for a bound method its function's, for a torch Module (an object whose
    class has `forward`) its class's forward (every Module's `__call__` is torch's), for another
    callable object its class's `__call__`, and a decorator's `__wrapped__` too. None where no
    Python code is found (a builtin). Line numbers and file names are left out, so moving code keeps
    the hash; what `fn` calls is not followed, nor the values it closes over; a bound value whose
    repr is its memory address counts by its type only (warned about, see the module's doc)."""
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
        function: Any = target
        code = getattr(target, "__code__", None)
        if code is None:  # a callable object: its class's forward (a torch Module) or __call__
            function = getattr(type(target), "forward", None) or type(target).__call__
            code = getattr(function, "__code__", None)
        if code is not None:
            parts = _code_parts(code)
            # default arguments live on the function, not in its code (`block=64` -> `block=4096`);
            # appended only where there are some, so the keys of functions without them stay
            defaults = getattr(function, "__defaults__", None)
            kwdefaults = getattr(function, "__kwdefaults__", None)
            if defaults or kwdefaults:
                parts.append(
                    [_constant(defaults or ()), sorted(_constant(kv) for kv in (kwdefaults or {}).items())]
                )
            codes.append(parts)
        current = getattr(target, "__wrapped__", None)
    return digest(codes) if codes else None


def _code_parts(code: types.CodeType) -> list[Any]:
    return [code.co_code.hex(), list(code.co_names), [_constant(c) for c in code.co_consts]]


def _constant(value: Any) -> Any:
    if isinstance(value, types.CodeType):
        return _code_parts(value)
    if isinstance(value, (tuple, list)):
        return [_constant(v) for v in value]
    if isinstance(value, (dict, set, frozenset)):  # their order may follow string hashing (per process)
        entries = [_constant(v) for v in (value.items() if isinstance(value, dict) else value)]
        return sorted(e if isinstance(e, str) else repr(e) for e in entries)
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # a tensor or array bound by a partial
        return f"{type(value).__name__}{tuple(value.shape)}:{value.dtype}"
    text = repr(value)
    if not _ADDRESS.search(text):
        return text
    # the repr holds a memory address, new in every process: hashing it would give the experiment
    # a new key each run, so resuming never matched. A function is named by where it is defined
    # (its code is not followed, as for anything the variant calls); any other object counts by
    # its type only, and its value is not in the key.
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return f"{value.__module__ or ''}:{getattr(value, '__qualname__', value.__name__)}"
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    _unkeyed(kind)
    return f"<{kind}>"


def _unkeyed(kind: str) -> None:
    """Warn (once per type) and count (every time) a bound value left out of an experiment key."""
    telemetry.count(_UNKEYED_COUNTER)
    if kind in _unkeyed_types_warned:
        return
    _unkeyed_types_warned.add(kind)
    log.warning(
        "a bound object's value is not part of the experiment key: only its type is",
        type=kind,
        reason="its repr holds a memory address, which differs in every process",
        fix="bind plain values (numbers, strings, tuples), give the type a __repr__ of its "
        "content, or name what differs in the variant's description",
    )


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
    except subprocess.CalledProcessError as exc:  # git ran and refused: the report said it raw
        said = (exc.stderr or "").strip().splitlines()
        if said and "not a git repository" in said[0]:
            reason = f"{'working directory' if cwd is None else cwd} is not in a git repository"
        else:  # a repository without commits, say; git's message may be in the user's language
            reason = f"{' '.join(exc.cmd)} exited with {exc.returncode}: {said[0] if said else 'no message'}"
    except (OSError, subprocess.SubprocessError) as exc:  # no git, or one that did not answer
        reason = f"{type(exc).__name__}: {str(exc).strip() or 'git failed'}"
    else:
        return {"commit": commit, "dirty": dirty}
    log.info("no git state for the fingerprint", reason=reason)
    return {"commit": None, "dirty": None, "reason": reason}


def _git(args: list[str], cwd: str | None) -> str:
    done = subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, timeout=_GIT_TIMEOUT_S, check=True
    )
    return done.stdout.strip()
