"""Start fault-tolerance worlds (plain processes or torchrun) and read what their ranks wrote.

Unlike `launch.run_world`, a failing rank is expected here: once one process exits non-zero the
others get `grace_s` to finish (to report the error they saw), then are killed, as torchrun's
agent does. A world still running after `wall_limit_s` fails the test with every log tail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from torchhal.distributed.elastic import torchrun_command, torchrun_env

WORKER = Path(__file__).with_name("ft_train.py")
ROOT = Path(__file__).resolve().parents[2]
# the checkout first, then any path the caller has (torchhal installed under a PYTHONPATH)
BASE_ENV = {
    "OMP_NUM_THREADS": "1",
    "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1",
    "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
}
WALL_LIMIT_S = 60


def run_ranks(
    world: int, out: Path, args: Sequence[str], *, grace_s: float = 20, wall_limit_s: float = WALL_LIMIT_S
) -> list[int]:
    """Run ft_train.py on `world` ranks over a FileStore in `out`; their exit codes."""
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(world):
        env = {**os.environ, **BASE_ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)}
        log = (out / f"rank{rank}.log").open("a")
        cmd = [sys.executable, str(WORKER), str(out), *args]
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    start, failed_at = time.monotonic(), None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now - start > wall_limit_s or (failed_at is not None and now - failed_at > grace_s):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            if now - start > wall_limit_s:
                pytest.fail(f"world in {out} ran past {wall_limit_s} s:\n{logs(out, world)}")
            break
        time.sleep(0.1)
    return [p.returncode for p in procs]


def run_torchrun(
    out: Path, args: Sequence[str], *, nproc: int = 2, max_restarts: int = 1, wall_limit_s: float = 90
) -> int:
    """Run ft_train.py under `torchrun --standalone --max-restarts`; its exit code."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(WORKER, [str(out), *args], nproc_per_node=nproc, max_restarts=max_restarts)
    log = out / "torchrun.log"
    with log.open("w") as f:
        try:
            proc = subprocess.run(
                cmd,
                env=torchrun_env({**os.environ, **BASE_ENV}),
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=wall_limit_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun ran past {wall_limit_s} s:\n{log.read_text()[-6000:]}")
    return proc.returncode


def reports(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def logs(out: Path, world: int) -> str:
    parts = []
    for r in range(world):
        file = out / f"rank{r}.log"
        parts.append(f"--- rank {r}\n{file.read_text()[-4000:] if file.exists() else '(no log)'}")
    return "\n".join(parts)


STEPS, SAVE_EVERY, FAULT_AT = 8, 2, 5
"""Every fault-tolerance world trains STEPS steps, checkpoints every SAVE_EVERY, faults after FAULT_AT."""

_reference: dict[str, object] = {}


def reference_final(tmp_root: Path) -> dict:
    """The final parameters of an uninterrupted 2-rank run (async checkpoints), made once per session."""
    if "params" not in _reference:
        out = tmp_root / "reference"
        codes = run_ranks(2, out, [str(out / "ckpt"), "--generation", "0", "--async-save", *schedule()])
        assert codes == [0, 0], f"reference run exit codes {codes}:\n{logs(out, 2)}"
        finals = [torch_load(Path(r["final"])) for r in reports(out, 2)]
        assert_identical(finals[0], finals[1])
        _reference.update(params=finals[0], out=out)
    return _reference["params"]  # type: ignore[return-value]


def schedule() -> list[str]:
    return ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]


def torch_load(path: Path) -> dict:
    import torch

    return torch.load(path, weights_only=True)


def assert_identical(actual: dict, expected: dict) -> None:
    """Bit-identical parameters, named."""
    import torch

    assert actual.keys() == expected.keys()
    differing = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not differing, f"parameters not bit-identical: {differing}"
