"""Start worker processes for the multi-process tests and collect their JSON results.

Each worker runs named checks and writes `rank<r>.json` ({check: "ok" | traceback}). A world
that hangs is killed after WALL_LIMIT_S, and the test fails with every rank's log tail.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

WALL_LIMIT_S = 60
BASE_ENV = {"OMP_NUM_THREADS": "1", "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}


def run_world(
    worker: Path,
    scenario: str,
    world: int,
    out: Path,
    *,
    rank_env: Sequence[Mapping[str, str]] | None = None,
    wall_limit_s: float = WALL_LIMIT_S,
) -> tuple[list[dict[str, str]], int]:
    """Run `worker SCENARIO RANK WORLD OUT SEED` on `world` ranks; return each rank's results and the seed."""
    seed = random.randrange(2**31)
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, **BASE_ENV, **(rank_env[rank] if rank_env else {})}
        log = (out / f"rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), scenario, str(rank), str(world), str(out), str(seed)],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        codes = [p.wait(timeout=wall_limit_s) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{scenario} world {world} (seed {seed}) hung past {wall_limit_s} s:\n{logs(out, world)}")
    if any(codes):
        pytest.fail(f"{scenario} world {world} (seed {seed}) exit codes {codes}:\n{logs(out, world)}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)], seed


def logs(out: Path, world: int) -> str:
    return "\n".join(f"--- rank {r}\n{(out / f'rank{r}.log').read_text()[-4000:]}" for r in range(world))


def check_outcome(results: list[dict[str, str]], seed: int, name: str) -> None:
    """Fail with each failing rank's traceback when check `name` did not pass on every rank."""
    failures = {r: res.get(name, "not run") for r, res in enumerate(results) if res.get(name) != "ok"}
    if failures:
        detail = "\n".join(f"--- rank {r}\n{text}" for r, text in failures.items())
        pytest.fail(f"check {name!r} failed (seed {seed}):\n{detail}")
