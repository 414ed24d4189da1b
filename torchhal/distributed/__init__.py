"""Training on the HAL with PyTorch's own distributed engine: init, meshes, prepare, train, heterogeneous.

`init()` joins the job on this rank's HAL device; `Mesh` lays a DeviceMesh out along the
fastest links; `prepare()` wraps a model with DDP or FSDP2 under a precision policy chosen
from the device's capabilities; `train()` runs steps with a span each; `HeteroGroup` splits
the batch by measured throughput across devices of different vendors or speeds.
"""

from torchhal.distributed.hetero import (
    HeteroGroup,
    measured_throughput,
    modelled_step_times,
    profiled_throughput,
    rebalanced_split,
    split_batch,
)
from torchhal.distributed.init import DistContext, init, local_device
from torchhal.distributed.loop import StepStats, train
from torchhal.distributed.mesh import Mesh, rank_order
from torchhal.distributed.precision import PrecisionPolicy, choose_precision
from torchhal.distributed.prepare import Prepared, prepare, transformer_blocks

__all__ = [
    "DistContext",
    "HeteroGroup",
    "Mesh",
    "PrecisionPolicy",
    "Prepared",
    "StepStats",
    "choose_precision",
    "init",
    "local_device",
    "measured_throughput",
    "modelled_step_times",
    "prepare",
    "profiled_throughput",
    "rank_order",
    "rebalanced_split",
    "split_batch",
    "train",
    "transformer_blocks",
]

from torchhal.distributed.checkpoint import (
    Checkpointer,
    CheckpointInfo,
    latest_valid,
)
from torchhal.distributed.checkpoint_errors import CheckpointError
from torchhal.distributed.elastic import ElasticJob
from torchhal.distributed.health import HealthMonitor, NonFiniteError

__all__ += [
    "CheckpointError",
    "CheckpointInfo",
    "Checkpointer",
    "ElasticJob",
    "HealthMonitor",
    "NonFiniteError",
    "latest_valid",
]
