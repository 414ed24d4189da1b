"""One rank of the sweep-18 multi-process checks (run by `launch.run_world`, never collected):
    python sweep18_worker.py SCENARIO RANK WORLD OUT_DIR SEED
"uneven" (world 2, CPU, gloo, DDP): rank 1 gets fewer batches than `steps`. Each rank then
stays alive until both have written their outcome, as a rank that catches the error and goes on
would: a peer left waiting in the step's all-reduce then hangs until the collective timeout.
"""

from __future__ import annotations

import json
import random
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from torchhal import distributed as thd
from torchhal.hal_core import InvalidArgumentError

TIMEOUT = timedelta(seconds=20)
FAIL_WITHIN_S = 10.0


def uneven(rank: int, world: int, out: Path, seed: int) -> str:
    rng = random.Random(seed)
    steps, short_by, dim = rng.randint(2, 4), rng.randint(1, 2), rng.randint(3, 7)
    store = dist.FileStore(str(out / "store"), world)
    ctx = thd.init(device="cpu", rank=rank, world_size=world, store=store, timeout=TIMEOUT)
    try:
        torch.manual_seed(seed)
        prepared = thd.prepare(nn.Linear(dim, 1), lambda p: torch.optim.SGD(p, lr=0.1), ctx=ctx)
        count = steps - short_by if rank == 1 else steps
        batches = [(torch.randn(3, dim),) for _ in range(count)]
        began = time.monotonic()
        try:
            thd.train(
                prepared.model,
                prepared.optimizer,
                batches,
                steps=steps,
                ctx=ctx,
                policy=prepared.policy,
                loss_fn=lambda model, batch: model(batch[0]).square().mean(),
            )
        except InvalidArgumentError as exc:
            elapsed = time.monotonic() - began
            want = f"batches ran out after {steps - short_by} of {steps} steps on rank(s) [1]"
            assert want in str(exc), str(exc)
            assert elapsed < FAIL_WITHIN_S, f"the error took {elapsed:.1f} s"
            return "ok"
        raise AssertionError("train finished although rank 1 had too few batches")
    finally:
        store.add("sweep18_done", 1)  # stay alive until every rank has its outcome
        deadline = time.monotonic() + TIMEOUT.total_seconds() + 10
        while store.add("sweep18_done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.05)
        ctx.shutdown()


SCENARIOS = {"uneven": uneven}


def main() -> None:
    scenario, rank, world, out, seed = (
        sys.argv[1],
        int(sys.argv[2]),
        int(sys.argv[3]),
        Path(sys.argv[4]),
        int(sys.argv[5]),
    )
    try:
        outcome = SCENARIOS[scenario](rank, world, out, seed)
    except Exception:
        outcome = traceback.format_exc()
    (out / f"rank{rank}.json").write_text(json.dumps({scenario: outcome}))


if __name__ == "__main__":
    main()
