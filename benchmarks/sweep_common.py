"""What the launch-configuration sweeps share: one timing rule and one result record."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch
import triton.testing


def ms(fn: Callable[[], Any], rep: int = 60) -> float:
    """do_bench's median in ms (L2 flushed between calls)."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median"))


def save(out: str | None, rows: list[dict[str, Any]], **extra: Any) -> None:
    """Write the sweep's rows with date, device and torch version to `out` (nothing when None)."""
    if not out:
        return
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        **extra,
        "rows": rows,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
