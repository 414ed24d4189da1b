"""Evaluation: decide whether hardware A, kernel B or model variant C is really better.

Measurements come from the harness; `torchhal.evaluation.stats` turns per-run aggregates into
tests, intervals and decisions a careful reviewer accepts.
"""

from torchhal.evaluation.compare import Comparison, Verdict, compare
from torchhal.evaluation.cost import pareto_front
from torchhal.evaluation.distributed import ShardedResult, evaluate_sharded
from torchhal.evaluation.experiment import ExperimentConfig, ExperimentResult, run_experiment
from torchhal.evaluation.harness import Measurement, Variant, measure
from torchhal.evaluation.inputs import Inputs, sets_to_exceed_cache
from torchhal.evaluation.metrics import METRICS, Threshold
from torchhal.evaluation.monitor import LiveMonitor, MonitorDecision, MonitorStatus
from torchhal.evaluation.report import write_json, write_markdown
from torchhal.evaluation.store import SampleStore
from torchhal.evaluation.variants import device_variants, dtype_variants, hal_for_environment, kernel_variants

__all__ = [
    "METRICS",
    "Comparison",
    "ExperimentConfig",
    "ExperimentResult",
    "Inputs",
    "LiveMonitor",
    "Measurement",
    "MonitorDecision",
    "MonitorStatus",
    "SampleStore",
    "ShardedResult",
    "Threshold",
    "Variant",
    "Verdict",
    "compare",
    "device_variants",
    "dtype_variants",
    "evaluate_sharded",
    "hal_for_environment",
    "kernel_variants",
    "measure",
    "pareto_front",
    "run_experiment",
    "sets_to_exceed_cache",
    "write_json",
    "write_markdown",
]
