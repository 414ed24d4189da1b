"""A checkpoint saved by 2 FSDP2 ranks (each holding half of every parameter and optimizer state)
loads into one unsharded process, and into 4 FSDP2 ranks that train on: DCP reshards both ways."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from tests.distributed.ft_launch import assert_identical, logs, reports, run_ranks, torch_load
from tests.distributed.ft_train import example
from torchhal.distributed.checkpoint import Checkpointer
from torchhal.hal_core import telemetry

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),  # the loader is alone
]


def test_fsdp_checkpoint_of_two_ranks_loads_into_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    codes = run_ranks(2, tmp_path, [str(ckpt), "--generation", "0", "--strategy", "fsdp", "--steps", "4"])
    assert codes == [0, 0], f"exit codes {codes}:\n{logs(tmp_path, 2)}"
    gathered = [torch_load(tmp_path / r["final"]) for r in reports(tmp_path, 2)]

    gpt = example()
    data = gpt.parse_args(["--vocab", "32", "--dim", "32", "--heads", "2", "--seq-len", "12"])
    torch.manual_seed(12345)  # a different initialisation: everything must come from the checkpoint
    model = gpt.TinyGPT(data.vocab, data.dim, data.layers, data.heads, data.seq_len)
    optimizer = torch.optim.AdamW(model.parameters(), lr=data.lr)
    before = telemetry.counts().get("torchhal.checkpoint.rng_not_restored", 0)
    telemetry.configure(log_level="warning", log_stream=(stream := io.StringIO()))
    info = Checkpointer(ckpt).load(model, optimizer)
    assert info is not None and info.step == 4 and info.world_size == 2
    assert telemetry.counts()["torchhal.checkpoint.rng_not_restored"] == before + 1
    assert "saved at another world size" in stream.getvalue()
    assert_identical(gathered[1], gathered[0])
    params = {name: p.detach() for name, p in model.named_parameters()}
    assert_identical(params, gathered[0])  # the last checkpoint (step 4) is the final state
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        assert state["exp_avg"].shape == p.shape and int(state["step"]) == 4, name
        assert state["exp_avg_sq"].abs().sum() > 0, name  # real moments, not a fresh optimizer's zeros


def test_fsdp_checkpoint_of_two_ranks_resumes_on_four(tmp_path):
    """Growing the job: 2 FSDP2 ranks train 6 steps (checkpoints at 4 and 6); 4 ranks resume from
    step 4 and train steps 4-5 on the same global batches. DCP reshards parameters and optimizer
    moments from halves to quarters, so the 4-rank result equals the 2-rank one up to the order
    of the gradient reduction; moments lost or misplaced in the reshard would be off by about the
    learning rate (1e-3), far beyond the tolerance."""
    ckpt = tmp_path / "ckpt"
    two, four = tmp_path / "two", tmp_path / "four"
    codes = run_ranks(2, two, [str(ckpt), "--generation", "0", "--strategy", "fsdp", "--steps", "6"])
    assert codes == [0, 0], f"exit codes {codes}:\n{logs(two, 2)}"
    reference = torch_load(two / reports(two, 2)[0]["final"])
    grown = tmp_path / "grown"
    shutil.copytree(ckpt, grown)
    shutil.rmtree(grown / "step_6")  # the newest checkpoint left is step 4's
    codes = run_ranks(4, four, [str(grown), "--generation", "1", "--strategy", "fsdp", "--steps", "6"])
    assert codes == [0] * 4, f"exit codes {codes}:\n{logs(four, 4)}"
    runs = reports(four, 4)
    assert [(r["resumed_step"], r["first_step"]) for r in runs] == [(4, 4)] * 4
    finals = [torch_load(four / r["final"]) for r in runs]
    for other in finals[1:]:
        assert_identical(other, finals[0])
    assert finals[0].keys() == reference.keys()
    for name, expected in reference.items():
        torch.testing.assert_close(finals[0][name], expected, rtol=1e-5, atol=1e-6, msg=name)
