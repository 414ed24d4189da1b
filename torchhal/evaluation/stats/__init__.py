"""The statistics engine: is A really better than B, and by how much?

numpy only at run time; the special functions (incomplete beta and gamma, the noncentral t) are
written in `special` and `distributions` and checked against scipy in the tests. Every function
takes per-run aggregates, refuses bad input with `InvalidArgumentError`, and returns a small
frozen dataclass. One module per family:

- `hypothesis_tests`: Welch's t, Mann–Whitney U, TOST equivalence
- `intervals`: Hodges–Lehmann shift, order-statistic quantile intervals
- `bootstrap`: percentile and BCa intervals for a ratio of medians
- `corrections`: Holm and Benjamini–Hochberg adjusted p-values
- `power`: power of Welch's test, sample size, minimum detectable effect
- `sequential`: always-valid monitoring (mSPRT confidence sequence)
- `group_sequential`: alpha-spending looks up to a planned size (spends exactly α there)
- `assignment`: deterministic variant assignment and the sample-ratio-mismatch checks (one look,
  and anytime-valid)
"""

from torchhal.evaluation.stats.assignment import (
    SampleRatioMismatch,
    SequentialSampleRatioMismatch,
    assign,
    sample_ratio_mismatch,
    sequential_sample_ratio_mismatch,
)
from torchhal.evaluation.stats.bootstrap import BootstrapRatioResult, bootstrap_ratio_of_medians
from torchhal.evaluation.stats.corrections import CorrectedPValues, benjamini_hochberg, holm
from torchhal.evaluation.stats.group_sequential import GroupSequentialState, GroupSequentialTest
from torchhal.evaluation.stats.group_sequential import boundaries as group_boundaries
from torchhal.evaluation.stats.hypothesis_tests import (
    MannWhitneyResult,
    TostResult,
    WelchResult,
    mann_whitney_u,
    tost,
    welch_t_test,
)
from torchhal.evaluation.stats.intervals import (
    HodgesLehmannResult,
    QuantileInterval,
    hodges_lehmann_shift,
    quantile_ci,
)
from torchhal.evaluation.stats.power import (
    MinimumDetectableEffect,
    PowerResult,
    SampleSizeResult,
    minimum_detectable_effect,
    power_welch,
    sample_size,
)
from torchhal.evaluation.stats.sequential import Decision, SequentialState, SequentialTest

__all__ = [
    "BootstrapRatioResult",
    "CorrectedPValues",
    "Decision",
    "GroupSequentialState",
    "GroupSequentialTest",
    "HodgesLehmannResult",
    "MannWhitneyResult",
    "MinimumDetectableEffect",
    "PowerResult",
    "QuantileInterval",
    "SampleRatioMismatch",
    "SampleSizeResult",
    "SequentialSampleRatioMismatch",
    "SequentialState",
    "SequentialTest",
    "TostResult",
    "WelchResult",
    "assign",
    "benjamini_hochberg",
    "bootstrap_ratio_of_medians",
    "group_boundaries",
    "hodges_lehmann_shift",
    "holm",
    "mann_whitney_u",
    "minimum_detectable_effect",
    "power_welch",
    "quantile_ci",
    "sample_ratio_mismatch",
    "sample_size",
    "sequential_sample_ratio_mismatch",
    "tost",
    "welch_t_test",
]
