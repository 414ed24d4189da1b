"""Running a call that must fail as an asynchronous device assert: in a child process, since a
device-side assert poisons the process's CUDA context. The child script ends with the checked call
made under `torch.cuda.set_sync_debug_mode("error")`; `SYNC_TAIL` then says whether it was queued
without a sync and whether the next synchronisation raised."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SYNC_TAIL = """
torch.cuda.set_sync_debug_mode("default")
print("queued without a sync", flush=True)
try:
    torch.cuda.synchronize()
except RuntimeError as exc:
    print("raised at the sync:", exc, flush=True)
    sys.exit(3)
print("no error", flush=True)
"""


def run_expecting_device_assert(
    script: str, mode: str, tmp_path: Path, **env: str
) -> subprocess.CompletedProcess[str]:
    """Run `script` + SYNC_TAIL with argument `mode` and `env` added; assert it queued the check
    without a sync and raised a device-side assert at the sync. Returns the finished child."""
    child = subprocess.run(
        [sys.executable, "-c", script + SYNC_TAIL, mode],
        capture_output=True,
        text=True,
        env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), **env},
        timeout=600,
    )
    assert child.returncode == 3, f"stdout:\n{child.stdout}\nstderr:\n{child.stderr[-4000:]}"
    assert "queued without a sync" in child.stdout
    assert "device-side assert" in child.stdout
    return child
