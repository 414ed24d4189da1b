"""One rank of test_hetero_exchange.py's two-rank world: HeteroGroup.create and rebalance where one
rank cannot give its figure. Run as a script (never collected by pytest):
    python _ft_hetero.py SCENARIO RANK WORLD OUT_DIR SEED
and writes `rank<r>.json` ({check: "ok" | traceback}), as `launch.run_world` reads it.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from torchhal import distributed as thd
from torchhal.distributed import hetero
from torchhal.hal_core import CollectiveError, UnsupportedError

try:  # imported by a test: the checkout's root is on the path
    from tests.distributed import _worker as w
except ImportError:  # run as a script: its own directory is the path's first entry
    import _worker as w  # type: ignore[no-redef]

QUICK_S = 5.0  # the error comes from the exchange itself, not from a timeout


def check_create_names_the_rank_whose_throughput_failed(state: Any) -> None:
    """Rank 1's profile lookup raises: it raised alone, and rank 0 got gloo's bare "Connection
    closed by peer" (or waited out the timeout)."""
    store = torch.distributed.FileStore(str(state.out / "store"), state.world)
    state._ctx = ctx = thd.init(
        device="cpu", rank=state.rank, world_size=state.world, store=store, timeout=w.TIMEOUT
    )
    reason = f"its profile measured matmul only in ['fp32'] ({state.seed})"
    if state.rank == 1:

        def no_rate(hal, device, dtype) -> float:
            raise UnsupportedError(f"throughput of {device.id} in {dtype}: {reason}")

        hetero.profiled_throughput = no_rate
        throughput = None
    else:
        throughput = 2.0
    began = time.monotonic()
    try:
        thd.HeteroGroup.create(ctx, global_batch=8, throughput=throughput, dtype=torch.bfloat16)
    except CollectiveError as exc:
        took = time.monotonic() - began
        text = str(exc)
        want = "could not give their throughput"
        assert f"HeteroGroup.create (rank {state.rank} of 2): rank(s) [1] {want}" in text, text
        assert f"rank 1: UnsupportedError: throughput of cpu in torch.bfloat16: {reason}" in text, text
        assert took < QUICK_S, f"the error took {took:.1f} s"
        assert isinstance(exc.__cause__, UnsupportedError) == (state.rank == 1), repr(exc.__cause__)
        return
    raise AssertionError("HeteroGroup.create went on although rank 1 had no throughput")


def check_the_group_forms_after_the_failed_exchange(state: Any) -> None:
    """Nothing is left half done: the next exchange pairs with the next, on both ranks."""
    group = thd.HeteroGroup.create(state.ctx, global_batch=9, throughput=float(state.rank + 1))
    assert group.throughputs == (1.0, 2.0) and group.batch_sizes == (3, 6)


def check_rebalance_names_the_rank_whose_compute_time_failed(state: Any) -> None:
    group = thd.HeteroGroup.create(state.ctx, global_batch=9, throughput=float(state.rank + 1))
    compute_s = "slow" if state.rank == 0 else 0.25
    try:
        group.rebalance(compute_s)  # type: ignore[arg-type]
    except CollectiveError as exc:
        text = str(exc)
        assert f"HeteroGroup.rebalance (rank {state.rank} of 2): rank(s) [0]" in text, text
        assert "rank 0: InvalidArgumentError: compute time must be a real number, got 'slow' (str)" in text
        assert group.batch_sizes == (3, 6)  # the split stays as it was on every rank
    else:
        raise AssertionError("rebalance went on although rank 0 gave no compute time")
    assert group.rebalance(0.5 if state.rank == 0 else 0.25) == (2, 7)  # 6 and 24 samples/s


w.SCENARIOS["exchange"] = [
    check_create_names_the_rank_whose_throughput_failed,
    check_the_group_forms_after_the_failed_exchange,
    check_rebalance_names_the_rank_whose_compute_time_failed,
]
check_names = w.check_names

if __name__ == "__main__":
    w.main()
