"""Samples must be real numbers: numeric strings were converted silently and complex values lost
their imaginary part with only a warning; both are refused, naming the argument and the dtype."""

from __future__ import annotations

import numpy as np
import pytest

from torchhal.evaluation.compare import compare
from torchhal.evaluation.metrics import METRICS, Threshold
from torchhal.evaluation.outliers import tukey_fences
from torchhal.evaluation.stats import SequentialTest, mann_whitney_u, welch_t_test
from torchhal.hal_core.errors import InvalidArgumentError

NOT_REAL = [
    (["1", "2", "3", "4"], "<U1"),
    (np.array(["1.5", "2", "3", "4"]), "<U3"),
    (np.array([1 + 5j, 2, 3, 4]), "complex128"),
    ([1 + 0j, 2, 3, 4], "complex128"),  # complex even where the imaginary part is 0
    ([1.0, None, 3.0, 4.0], "object"),
]


@pytest.mark.parametrize(("values", "dtype"), NOT_REAL)
def test_statistics_refuse_samples_that_are_not_real_numbers(values, dtype: str) -> None:
    rng = np.random.default_rng(5)
    other = rng.normal(size=6)
    message = rf"sample 'a' must be numbers, got .*: dtype {dtype} is not bool, int or float"
    with pytest.raises(InvalidArgumentError, match=message):
        welch_t_test(values, other)
    with pytest.raises(InvalidArgumentError, match=message):
        mann_whitney_u(values, other)
    with pytest.raises(InvalidArgumentError, match=rf"sample 'b_batch' .*dtype {dtype} is not"):
        SequentialTest(higher_is_better=True).update(other, values)
    with pytest.raises(InvalidArgumentError, match=rf"latency samples of 'new' .*dtype {dtype} is not"):
        compare(values, other, metric=METRICS["latency"], threshold=Threshold(relative=0.05), variant="new")
    with pytest.raises(InvalidArgumentError, match=rf"Tukey fences' values .*dtype {dtype} is not"):
        tukey_fences(values)


def test_booleans_integers_and_floats_of_any_width_are_numbers() -> None:
    rng = np.random.default_rng(6)
    floats = rng.normal(size=8)
    for values in (
        rng.integers(0, 2, 8).astype(bool),
        rng.integers(-50, 50, 8),
        rng.integers(0, 200, 8).astype(np.uint8),
        floats.astype(np.float32),
        floats.tolist(),
    ):
        result = welch_t_test(values, floats + 1.0)
        assert result.n_a == 8 and np.isfinite(result.p_value)
