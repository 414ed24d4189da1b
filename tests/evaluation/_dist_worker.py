"""One rank of a sharded evaluation (run as a script by test_distributed.py, never collected).

    python _dist_worker.py RANK WORLD DIR SEED STOP_AFTER RUN
DIR holds the shared sample store, the rendezvous file of run RUN, and each rank's call log and
result.
STOP_AFTER > 0: raise after that many evaluations on this rank; < 0: SIGKILL itself after
that many (an interruption); 0: run to the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

from tests.evaluation import dist_tasks
from tests.evaluation.helpers import cpu_hal
from torchhal.evaluation.distributed import evaluate_sharded
from torchhal.evaluation.store import SampleStore


def main() -> None:
    rank, world, directory, seed, stop_after, run = (
        int(sys.argv[1]),
        int(sys.argv[2]),
        Path(sys.argv[3]),
        int(sys.argv[4]),
        int(sys.argv[5]),
        sys.argv[6],
    )
    log = directory / f"calls-{rank}.log"
    variants = dist_tasks.variants(log)
    done = [0]

    def interrupt(fn):
        def run(item):
            if stop_after and done[0] == abs(stop_after):
                if stop_after < 0:
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"planted interruption on rank {rank}")
            done[0] += 1
            return fn(item)

        return run

    variants = {name: interrupt(fn) for name, fn in variants.items()}
    comm = None
    if world > 1:
        comm = cpu_hal().communicator(
            device="cpu",
            rank=rank,
            world_size=world,
            init_method=(directory / f"rendezvous-{run}").as_uri(),
            timeout=timedelta(seconds=30),
        )
    try:
        with SampleStore(directory / "samples.sqlite") as store:
            result = evaluate_sharded(
                variants,
                dist_tasks.items(seed),
                dist_tasks.METRICS,
                name="rms_norm-error",
                store=store,
                communicator=comm,
            )
    finally:
        if comm is not None:
            comm.destroy()
    (directory / f"result-{rank}.json").write_text(
        json.dumps({"values": result.values.tolist(), "computed": result.computed, "cached": result.cached})
    )


if __name__ == "__main__":
    main()
