"""Checkpoints in one process: round trip, keep-K, atomic commit, corrupt/incomplete fallback, async.

Without a default process group DCP writes and reads in this process alone; the multi-process
tests (test_resume.py, test_elastic.py) cover gloo ranks, DDP and restarts.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

from torchhal.distributed.checkpoint import (
    MANIFEST,
    Checkpointer,
    CheckpointError,
    latest_valid,
    step_dir,
    verify,
)
from torchhal.hal_core import InvalidArgumentError, telemetry

# DCP warns that it runs in one process, which is what these tests mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 7)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(optimizer.state.values())}
    return params, state


def assert_restored(model: nn.Module, optimizer: torch.optim.Optimizer, expected: tuple[dict, dict]) -> None:
    params, state = snapshot(model, optimizer)
    assert params.keys() == expected[0].keys() and state.keys() == expected[1].keys()
    for name, value in params.items():
        assert torch.equal(value, expected[0][name]), name
    for index, entry in state.items():
        for key, value in entry.items():
            assert torch.equal(value, expected[1][index][key]), (index, key)


def train_and_save(tmp_path, steps: int, keep: int = 3):
    model, optimizer = make(1)
    ckpt = Checkpointer(tmp_path, keep=keep)
    snapshots = {}
    for n in range(1, steps + 1):
        step(model, optimizer)
        ckpt.save(n, model, optimizer)
        snapshots[n] = snapshot(model, optimizer)
    return ckpt, snapshots


def test_round_trip_restores_model_optimizer_scaler_and_rng(tmp_path):
    model, optimizer = make(1)
    step(model, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler._scale = torch.tensor(float(torch.randint(2, 2**16, ()).item()))
    ckpt = Checkpointer(tmp_path)
    info = ckpt.save(1, model, optimizer, scaler=scaler)
    assert info is not None and info.step == 1 and info.world_size == 1
    expected, expected_scale = snapshot(model, optimizer), scaler.get_scale()
    after_save = torch.rand(5)

    other, other_optimizer = make(2)
    step(other, other_optimizer)
    other_scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    loaded = Checkpointer(tmp_path).load(other, other_optimizer, scaler=other_scaler)
    assert loaded == info
    assert_restored(other, other_optimizer, expected)
    assert other_scaler.get_scale() == expected_scale
    assert torch.equal(torch.rand(5), after_save)  # the CPU generator continues where it was saved


def test_layout_manifest_and_keep(tmp_path):
    train_and_save(tmp_path, 4, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    meta = json.loads((step_dir(tmp_path, 4) / MANIFEST).read_text())
    assert meta["step"] == 4 and meta["world_size"] == 1
    on_disk = {p.name for p in step_dir(tmp_path, 4).iterdir()} - {MANIFEST}
    assert set(meta["files"]) == on_disk and ".metadata" in on_disk and "rng_rank0.pt" in on_disk
    assert latest_valid(tmp_path).step == 4


def test_truncated_newest_falls_back_to_previous_and_loses_nothing_else(tmp_path):
    _, snapshots = train_and_save(tmp_path, 3)
    shard = next(step_dir(tmp_path, 3).glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = telemetry.counts().get("torchhal.checkpoint.skipped", 0)
    stream = io.StringIO()
    telemetry.configure(log_level="warning", log_stream=stream)
    info = latest_valid(tmp_path)
    assert info is not None and info.step == 2
    assert telemetry.counts()["torchhal.checkpoint.skipped"] == before + 1
    assert "checkpoint skipped" in stream.getvalue() and shard.name in stream.getvalue()
    model, optimizer = make(5)
    assert Checkpointer(tmp_path).load(model, optimizer).step == 2
    assert_restored(model, optimizer, snapshots[2])
    assert step_dir(tmp_path, 1).is_dir() and step_dir(tmp_path, 2).is_dir()  # nothing else touched


def test_incomplete_checkpoints_are_skipped(tmp_path):
    train_and_save(tmp_path, 2)
    (step_dir(tmp_path, 2) / MANIFEST).unlink()  # a crash before the manifest: never valid
    (tmp_path / ".step_3.tmp").mkdir()  # a crash before the rename: not even a candidate
    with pytest.raises(CheckpointError, match=f"no {MANIFEST}"):
        verify(step_dir(tmp_path, 2))
    assert latest_valid(tmp_path).step == 1


def test_edited_file_fails_its_hash(tmp_path):
    train_and_save(tmp_path, 1)
    rng = step_dir(tmp_path, 1) / "rng_rank0.pt"
    data = bytearray(rng.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rng.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rng_rank0\.pt has sha256"):
        verify(step_dir(tmp_path, 1))
    assert latest_valid(tmp_path) is None


def test_no_checkpoint_loads_nothing(tmp_path):
    model, optimizer = make(3)
    before = snapshot(model, optimizer)
    assert Checkpointer(tmp_path / "empty").load(model, optimizer) is None
    assert_restored(model, optimizer, before)


def test_async_save_holds_the_state_of_its_step(tmp_path, monkeypatch):
    """The save goes through DCP's async path (staged now, written in the background), never the
    blocking one, and the checkpoint holds the state of its step although training went on."""
    import torch.distributed.checkpoint as dcp

    async_calls = []
    real_async_save = dcp.async_save

    def spy(*args, **kwargs):
        async_calls.append(kwargs.get("checkpoint_id"))
        return real_async_save(*args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("blocking=False must not write through dcp.save")

    monkeypatch.setattr(dcp, "async_save", spy)
    monkeypatch.setattr(dcp, "save", refuse)
    model, optimizer = make(1)
    step(model, optimizer)
    expected = snapshot(model, optimizer)
    ckpt = Checkpointer(tmp_path)
    assert ckpt.save(1, model, optimizer, blocking=False) is None
    assert len(async_calls) == 1
    for _ in range(3):  # training goes on while the save runs
        step(model, optimizer)
    info = ckpt.wait()
    assert info is not None and info.step == 1 and verify(info.path) == info
    other, other_optimizer = make(2)
    step(other, other_optimizer)
    ckpt.load(other, other_optimizer)
    assert_restored(other, other_optimizer, expected)


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="keep must be >= 1, got 0"):
        Checkpointer(tmp_path, keep=0)
    model, optimizer = make(1)
    with pytest.raises(InvalidArgumentError, match="step must be >= 0, got -1"):
        Checkpointer(tmp_path).save(-1, model, optimizer)
    with pytest.raises(CheckpointError, match=r"no manifest\.json"):
        Checkpointer(tmp_path).load(model, optimizer, path=tmp_path / "step_9")
