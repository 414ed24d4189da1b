"""The environment fingerprint carried by every result: what was measured, where, with what code.

A number is only comparable with numbers from the same environment, so every result records
the devices' declared capabilities and fingerprints, the versions of the software stack, the
git commit of the working directory (and whether the tree had uncommitted changes), and the
TORCHHAL_* settings in force. `digest` is a short hash of it all, part of every experiment key.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Iterable
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
