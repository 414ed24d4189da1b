"""torchrun --standalone --max-restarts 1 restarts the job after a rank kills itself; the restarted
generation (prefix gen1) resumes from the newest valid checkpoint and ends bit-identical to an
uninterrupted run. Also the torchrun command and environment `elastic` builds."""

from __future__ import annotations

import io

import pytest
import torch.distributed as dist

from tests.distributed.ft_launch import (
    FAULT_AT,
    SAVE_EVERY,
    assert_identical,
    reference_final,
    reports,
    run_torchrun,
    schedule,
    torch_load,
)
from torchhal.distributed import elastic
from torchhal.hal_core import ConfigurationError, InvalidArgumentError, telemetry


@pytest.mark.multiprocess
def test_torchrun_restart_resumes_bit_identical(tmp_path_factory):
    expected = reference_final(tmp_path_factory.getbasetemp())
    out = tmp_path_factory.mktemp("torchrun")
    fault = ["--fault", "kill", "--fault-at", str(FAULT_AT), "--fault-rank", "1"]
    code = run_torchrun(out, [str(out / "ckpt"), *schedule(), *fault], nproc=2, max_restarts=1)
    log = (out / "torchrun.log").read_text()
    assert code == 0, log[-6000:]
    assert (out / "fault.json").exists(), "generation 0 never reached the fault"
    for report in reports(out, 2):
        assert report["generation"] == 1, report
        assert report["resumed_step"] == FAULT_AT - FAULT_AT % SAVE_EVERY, report
        assert_identical(torch_load(out / report["final"]), expected)


def test_generation_comes_from_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert elastic.generation() == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "3")
    assert elastic.generation() == 3
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "x")
    with pytest.raises(ConfigurationError, match="TORCHELASTIC_RESTART_COUNT must be an integer, got 'x'"):
        elastic.generation()


def test_torchrun_command_and_environment():
    cmd = elastic.torchrun_command("train.py", ["--steps", "3"], nproc_per_node=2, max_restarts=1)
    assert cmd[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        "train.py",
        "--steps",
        "3",
    ]
    env = elastic.torchrun_env({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    with pytest.raises(InvalidArgumentError, match="nproc_per_node >= 1"):
        elastic.torchrun_command("train.py", nproc_per_node=0, max_restarts=1)


def test_start_outside_torchrun_names_what_is_missing(monkeypatch, tmp_path):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigurationError, match="missing RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"):
        elastic.ElasticJob.start(tmp_path)


def test_a_restart_on_torchruns_shared_store_is_warned_and_counted(monkeypatch, tmp_path):
    """torchrun's agent store, reused by a restarted generation, is the failure the workaround
    avoids: a generation after the first that finds it in use says so (and counts it)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    key = "torchhal.elastic.shared_store_restart"
    for gen, agent_store, warned in ((1, "False", False), (0, "True", False), (2, "True", True)):
        monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", agent_store)
        telemetry.configure(log_level="warning", log_stream=(stream := io.StringIO()))
        before = telemetry.counts().get(key, 0)
        store = dist.FileStore(str(tmp_path / f"store{gen}{agent_store}"), 1)
        job = elastic.ElasticJob.start(
            tmp_path / f"ckpt{gen}{agent_store}", device="cpu", store=store, gen=gen
        )
        try:
            assert telemetry.counts().get(key, 0) == before + warned
            assert ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in stream.getvalue()) == warned
            assert job.generation == gen
        finally:
            job.close()
