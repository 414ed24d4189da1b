"""HeteroGroup's exchanges where one rank cannot give its figure (two gloo ranks, `_ft_hetero.py`):
every rank raises naming that rank and its error, at once. And split_batch's rates: any real
number, a NumPy float32 too; a bool or a string is refused naming its type."""

from __future__ import annotations

import importlib.util
import math
import random
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from tests.distributed.launch import check_outcome, run_world
from torchhal.distributed import split_batch
from torchhal.hal_core import InvalidArgumentError

WORKER = Path(__file__).with_name("_ft_hetero.py")


def _check_names(scenario: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("torchhal_ft_hetero_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.check_names(scenario)


@pytest.fixture(scope="module")
def exchange_world(tmp_path_factory):
    return run_world(WORKER, "exchange", 2, tmp_path_factory.mktemp("hetero_exchange"), wall_limit_s=60)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", _check_names("exchange"))
def test_exchange_world(exchange_world, name):
    results, seed = exchange_world
    check_outcome(results, seed, name)


def test_split_batch_takes_any_real_rate():
    """A NumPy float32 rate was refused as 'must be finite and > 0'."""
    base = random.uniform(0.5, 4.0)
    rates = [np.float32(base), 3 * base, Fraction(2), np.float64(base)]
    sizes = split_batch(70, rates)
    assert sizes == split_batch(70, [float(r) for r in rates])
    assert sum(sizes) == 70 and all(isinstance(s, int) for s in sizes)


@pytest.mark.parametrize("bad", [True, "2.0", None])
def test_split_batch_names_the_type_of_a_rate_that_is_not_a_number(bad):
    rank = random.randrange(3)
    rates: list[object] = [1.0, 2.0, 3.0]
    rates[rank] = bad
    with pytest.raises(
        InvalidArgumentError,
        match=rf"must be real numbers .*, got rank {rank}: {re.escape(repr(bad))} \({type(bad).__name__}\)$",
    ):
        split_batch(6, rates)  # type: ignore[arg-type]


def test_a_non_finite_numpy_rate_is_still_refused_with_its_value():
    with pytest.raises(InvalidArgumentError, match=r"finite and > 0, got \[\(1, np.float32\(nan\)\)\]"):
        split_batch(4, [1.0, np.float32(math.nan)])
