"""Multi-process tests of the Communicator over real gloo process groups.

Each world starts its process group once and runs every check of `_worker.CHECKS` in it; each
check is then reported here as its own test. World 2 rendezvous through torchrun's environment
variables, world 4 through a file:// URL, the timeout test through a FileStore object. On a
machine with two GPUs the same checks run on one GPU per rank over nccl.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.ports import free_port

WORKER = Path(__file__).with_name("_worker.py")
WALL_LIMIT_S = 90  # a hung worker fails the test within this many seconds


def _load_worker():
    spec = importlib.util.spec_from_file_location("torchhal_collectives_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK_NAMES = [*_load_worker().CHECKS, "destroy"]


def run_world(scenario: str, world: int, out: Path, init: str) -> tuple[list[dict], int]:
    """Start `world` worker processes and return each rank's JSON result and the seed used."""
    seed = random.randrange(2**31)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"}
    if init == "env":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    procs = []
    for rank in range(world):
        log = (out / f"rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(rank), str(world), str(out), str(seed), init],
                env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    try:
        codes = [p.wait(timeout=WALL_LIMIT_S) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(
            f"{scenario} world {world} (seed {seed}) hung past {WALL_LIMIT_S} s:\n{_logs(out, world)}"
        )
    if any(codes):
        pytest.fail(f"{scenario} world {world} (seed {seed}) exit codes {codes}:\n{_logs(out, world)}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)], seed


def _logs(out: Path, world: int) -> str:
    return "\n".join(f"--- rank {r}\n{(out / f'rank{r}.log').read_text()[-4000:]}" for r in range(world))


SUITES = {  # name: (scenario, world size, rendezvous)
    "gloo-2": ("suite", 2, "env"),
    "gloo-4": ("suite", 4, "file"),
    "nccl": ("gpu_suite", 2, "file"),  # one rank a GPU
}


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict], int]]:
    """Each suite's per-rank results, run once for the module on first use."""

    class Lazy(dict):
        def __missing__(self, name: str) -> tuple[list[dict], int]:
            scenario, world, init = SUITES[name]
            self[name] = run_world(scenario, world, tmp_path_factory.mktemp(name), init)
            return self[name]

    return Lazy()


def _assert_check_passed(suites: dict, name: str, check: str) -> None:
    per_rank, seed = suites[name]
    failures = {
        rank: res[check] for rank, res in enumerate(per_rank) if res.get(check, "missing") is not None
    }
    tracebacks = "\n".join(f"--- rank {rank}\n{tb}" for rank, tb in failures.items())
    assert not failures, (
        f"{check} failed ({name}, seed {seed}; it can desynchronise later checks):\n{tracebacks}"
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("check", CHECK_NAMES)
@pytest.mark.parametrize("suite", ["gloo-2", "gloo-4"])
def test_collective_check(suites: dict, suite: str, check: str) -> None:
    _assert_check_passed(suites, suite, check)


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs two NVIDIA GPUs (and torch built with CUDA): nccl takes one rank a GPU, and the "
    "checks need a second rank (send/recv, shapes that do not divide by the world size)",
)
@pytest.mark.parametrize("check", CHECK_NAMES)
def test_collective_check_on_gpus(suites: dict, check: str) -> None:
    _assert_check_passed(suites, "nccl", check)


@pytest.mark.multiprocess
def test_timeout_surfaces_as_collective_error(tmp_path: Path) -> None:
    """A collective, islands() and new_group() on a peer that never comes (each waits on its own)."""
    (rank0, _), _ = run_world("timeout", 2, tmp_path, "store")
    for name in ("all_reduce", "islands", "new_group"):
        outcome = rank0[name]
        assert outcome["error"] == "CollectiveError", (name, outcome)
        assert f"{name} timed out" in outcome["message"], outcome["message"]
        assert "process-group timeout 2 s" in outcome["message"], outcome["message"]
        assert 1.5 <= outcome["elapsed_s"] < 15, f"{name} took {outcome['elapsed_s']:.1f} s for a 2 s timeout"
