"""Sharded evaluation: 2 gloo processes equal one process, and interrupted runs resume from the cache."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.evaluation import dist_tasks
from torchhal.evaluation.distributed import evaluate_sharded
from torchhal.evaluation.store import SampleStore
from torchhal.hal_core import InvalidArgumentError

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("_dist_worker.py")
TOTAL = dist_tasks.N_ITEMS * 2  # evaluations: items × variants
PROCESS_TIMEOUT_S = 120


def _launch(
    world: int, directory: Path, seed: int, stop_after: int, run: str
) -> list[subprocess.CompletedProcess]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT),
        "TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(r),
                str(world),
                str(directory),
                str(seed),
                str(stop_after),
                run,
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=PROCESS_TIMEOUT_S)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def _calls(directory: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in directory.glob("calls-*.log"))


def _single(seed: int, store: SampleStore | None = None, log: Path | None = None):
    return evaluate_sharded(
        dist_tasks.variants(log),
        dist_tasks.items(seed),
        dist_tasks.METRICS,
        name="rms_norm-error",
        store=store,
    )


@pytest.mark.multiprocess
def test_two_ranks_equal_one_process_and_resume_after_an_exception(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    expected = _single(seed)
    assert expected.values.shape == (dist_tasks.N_ITEMS, 2, 2)
    assert (expected.column("bf16", "rel_l2") > expected.column("fp32", "rel_l2")).all()

    failed = _launch(2, tmp_path, seed, stop_after=3, run="first")
    for p in failed:
        assert p.returncode != 0 and "planted interruption" in p.stderr, (p.returncode, p.stderr[-3000:])
    with sqlite3.connect(tmp_path / "samples.sqlite") as db:
        (rows,) = db.execute("SELECT COUNT(*) FROM samples").fetchone()
    assert rows == 6  # 3 finished evaluations on each rank, all on disk
    assert _calls(tmp_path) == 6

    resumed = _launch(2, tmp_path, seed, stop_after=0, run="second")
    for p in resumed:
        assert p.returncode == 0, p.stderr
    results = [json.loads((tmp_path / f"result-{r}.json").read_text()) for r in range(2)]
    for r in results:
        np.testing.assert_array_equal(np.array(r["values"]), expected.values)
    assert sum(r["cached"] for r in results) == 6
    assert sum(r["computed"] for r in results) == TOTAL - 6
    assert _calls(tmp_path) == TOTAL  # nothing finished was evaluated again


@pytest.mark.multiprocess
def test_a_killed_run_resumes_from_the_cache(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    (killed,) = _launch(1, tmp_path, seed, stop_after=-5, run="killed")
    assert killed.returncode == -9  # SIGKILL: no chance to clean up
    log = tmp_path / "calls-in-process.log"
    with SampleStore(tmp_path / "samples.sqlite") as store:
        result = _single(seed, store, log)
    assert (result.cached, result.computed) == (5, TOTAL - 5)
    assert len(log.read_text().splitlines()) == TOTAL - 5
    np.testing.assert_array_equal(result.values, _single(seed).values)


def test_bad_sharded_input_is_refused(tmp_path):
    items = dist_tasks.items(0)
    with pytest.raises(InvalidArgumentError, match=r"got 0 variant\(s\), 1 metric\(s\), 11 item\(s\)"):
        evaluate_sharded({}, items, ["e"], name="x")
    with pytest.raises(InvalidArgumentError, match=r"returned no value for metric\(s\) \['max_abs'\]"):
        evaluate_sharded({"v": lambda item: {"rel_l2": 1.0}}, items, dist_tasks.METRICS, name="x")
    with pytest.raises(InvalidArgumentError, match="returned non-finite values"):
        evaluate_sharded({"v": lambda item: float("nan")}, items, ["e"], name="x")
    result = evaluate_sharded({"v": lambda item: float(item[0].sum())}, items, ["e"], name="x")
    with pytest.raises(InvalidArgumentError, match="unknown variant 'w'"):
        result.column("w")
