"""On a host with 2 GPUs: the example under torchrun trains with DDP and with FSDP2 over the GPUs'
backend (NCCL), in bf16, one rank a GPU. Speed (all-reduce overhead, scaling, recovery time) is
measured by the benchmarks that benchmarks/gpu_distributed.sh runs, not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchhal import HardwareAbstractionLayer
from torchhal.hal_core.collectives import backend_for

ROOT = Path(__file__).resolve().parents[3]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.accelerator.is_available() or torch.accelerator.device_count() < 2,
        reason="needs 2 GPUs (torch.accelerator sees fewer)",
    ),
]


def torchrun(script: str, *args: str, timeout: int) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    try:
        done = subprocess.run(
            [*command, str(ROOT / script), *args], env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{script} hung past {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return done


@pytest.mark.parametrize(
    ("accumulate", "checkpointing"), [(1, False), (2, False), (2, True)], ids=["1", "2", "2-checkpointed"]
)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_example_trains_on_two_gpus(tmp_path, strategy, accumulate, checkpointing):
    torchrun(
        "examples/train_tiny_gpt.py",
        "--steps",
        "10",
        "--strategy",
        strategy,
        "--gradient-accumulation-steps",
        str(accumulate),
        *(["--activation-checkpointing"] if checkpointing else []),
        "--json-out",
        str(tmp_path),
        timeout=180,
    )
    hal = HardwareAbstractionLayer()
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        device = hal.device(report["context"]["device"])
        assert not device.simulated and device.torch_device.type != "cpu" and device.index == rank
        assert report["context"]["backend"] == backend_for([device])
        assert report["prepared"]["precision"]["policy"] == "bf16"
        assert report["prepared"]["checkpointed_blocks"] == (2 if checkpointing else 0)
        losses = [s["loss"] for s in report["steps"]]
        assert losses[-1] < 0.5 * losses[0], losses
        batch = report["batch"]  # every micro-batch of a step counted
        assert [s["tokens"] for s in report["steps"]] == [batch["local"] * batch["seq_len"]] * 10


def test_a_stopped_step_leaves_each_gpus_model_as_the_completed_steps_left_it(tmp_path):
    """DDP and FSDP2 over NCCL: BatchNorm's statistics (restored on the GPU by a fused copy) and
    the parameters after a step that stopped part-way equal those of the completed steps."""
    torchrun("tests/distributed/gpu/stopped_step.py", str(tmp_path), timeout=180)
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["ok"], report["error"]
        assert report["device"] == f"cuda:{rank}"
