"""Settings the comparison would refuse are refused before anything is measured: too few
repetitions for compare(), an alpha too small for the Hodges–Lehmann interval at that size, a
relative quality threshold on a baseline that is its own reference, too few quality input sets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.evaluation.helpers import Counting, cpu_hal
from torchhal.evaluation.compare import MIN_SAMPLES, min_sample_size
from torchhal.evaluation.experiment import ExperimentConfig, run_experiment
from torchhal.evaluation.harness import Variant
from torchhal.evaluation.inputs import Inputs
from torchhal.evaluation.metrics import Threshold
from torchhal.evaluation.stats import hodges_lehmann_shift
from torchhal.hal_core.errors import InvalidArgumentError


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@pytest.mark.parametrize(
    ("repetitions", "alpha", "needed"),
    [(3, 0.05, 4), (1, 0.05, 4), (4, 0.01, 5), (4, 0.02, 5), (6, 0.001, 7)],
)
def test_too_few_repetitions_for_the_comparison_are_refused(repetitions, alpha, needed) -> None:
    """These ran every variant, then compare() refused the samples (3 < MIN_SAMPLES; at 4 per arm
    a 99% Hodges–Lehmann interval needs C(8, 4) = 70 >= 200, which fails)."""
    with pytest.raises(InvalidArgumentError) as info:
        ExperimentConfig(baseline="a", repetitions=repetitions, alpha=alpha)
    message = str(info.value)
    assert message.startswith(f"repetitions must be >= {needed} at alpha = {alpha:g}")
    assert message.endswith(f"got {repetitions}")
    ExperimentConfig(baseline="a", repetitions=needed, alpha=alpha)
    # quality alone takes no timing samples: repetitions do not matter there
    ExperimentConfig(
        baseline="a",
        reference="b",
        metrics=("quality",),
        thresholds={"quality": Threshold(absolute=1e-3)},
        repetitions=repetitions,
        alpha=alpha,
    )


@pytest.mark.parametrize("alpha", [0.2, 0.05, 0.03, 0.02, 0.01, 1e-3, 1e-4, 1e-6])
def test_the_size_rule_is_where_the_interval_compare_computes_starts_to_exist(alpha: float) -> None:
    """On tie-free random samples: the interval exists at min_sample_size(alpha) per arm, and
    (above MIN_SAMPLES) not at one less."""
    rng = np.random.default_rng(int(1 / alpha))
    n = min_sample_size(alpha)
    hodges_lehmann_shift(rng.normal(size=n), rng.normal(size=n), confidence=1 - alpha)
    if n > MIN_SAMPLES:
        with pytest.raises(InvalidArgumentError, match="too small for a"):
            hodges_lehmann_shift(rng.normal(size=n - 1), rng.normal(size=n - 1), confidence=1 - alpha)


def test_a_relative_quality_threshold_on_a_baseline_that_is_the_reference_is_refused() -> None:
    """The baseline's errors against itself are all 0, so a relative threshold scales 0: compare()
    refused it only after every variant had been measured."""
    with pytest.raises(
        InvalidArgumentError,
        match=r"thresholds\['quality'\] must be absolute when the reference is the baseline \('a'\): "
        r"a relative threshold of 0.1 ",
    ):
        ExperimentConfig(
            baseline="a", reference="a", metrics=("quality",), thresholds={"quality": Threshold(relative=0.1)}
        )
    ExperimentConfig(
        baseline="a", reference="a", metrics=("quality",), thresholds={"quality": Threshold(absolute=0.1)}
    )
    ExperimentConfig(
        baseline="a", reference="b", metrics=("quality",), thresholds={"quality": Threshold(relative=0.1)}
    )


def test_too_few_quality_input_sets_are_refused_before_any_call() -> None:
    cpu = cpu_hal().device("cpu")
    generator = torch.Generator().manual_seed(7)
    sets = Inputs(
        [(torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)) for _ in range(3)]
    )
    fa, fb = Counting(_mm), Counting(_mm)
    config = ExperimentConfig(
        baseline="a",
        reference="a",
        metrics=("latency", "quality"),
        thresholds={"quality": Threshold(absolute=1e-3)},
        repetitions=5,
        warmup=1,
    )
    with pytest.raises(
        InvalidArgumentError,
        match=r"metric 'quality' needs >= 4 input sets at alpha = 0.05 .* reference 'a' has 3",
    ):
        run_experiment([Variant("a", fa, cpu, sets), Variant("b", fb, cpu, sets)], config)
    assert fa.calls == fb.calls == 0
