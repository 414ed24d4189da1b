"""A process that remembers its own kernel-selection winners into a shared cache directory.

Each winner goes through a fresh Tuner, as each short-lived process (a torchrun rank, a test
worker) would: it reads the file, merges its winner and writes the file back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

CODE = {"torchhal": "test"}


def remember_many(cache_dir: str, worker: int, count: int, start: Any) -> None:
    from tests.core.adapters import FakeAdapter, fake_caps
    from torchhal.hal_core.device import Device
    from torchhal.hal_core.tuning import Tuner

    device = Device(FakeAdapter(), fake_caps())
    start.wait()  # every worker writes at once, not one after another as their imports finish
    for i in range(count):
        tuner = Tuner(Path(cache_dir), "on", code=lambda: CODE)
        tuner.remember(
            device, "rms_norm", (worker, i), f"test/w{worker}", [f"test/w{worker}", "torchhal/aten"]
        )


def key(worker: int, i: int) -> str:
    """The file's key of worker's i-th winner, as Tuner writes it (`op|repr(signature)`)."""
    return f"rms_norm|{(worker, i)!r}"
