"""One process: bad input to init, prepare, train, checkpoints, the mesh, the health monitor
and the heterogeneous model is refused naming the value, and nothing is half done."""

from __future__ import annotations

import itertools
import math
import random
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torchhal_nvidia.adapter import NvidiaAdapter
from torchhal_nvidia.recorded import RecordedCudaProbe

from tests.plugins.facts import load
from tests.ports import free_port
from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.distributed.checkpoint import Checkpointer, CheckpointError, latest_valid, verify
from torchhal.distributed.elastic import ElasticJob
from torchhal.distributed.health import HealthMonitor
from torchhal.hal_core import ConfigurationError, InvalidArgumentError, UnsupportedError, telemetry
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True)
def _no_rendezvous_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


# -- init ------------------------------------------------------------------------------------------


def test_a_prefixed_init_with_a_rank_outside_the_world_fails_before_the_rendezvous(monkeypatch):
    """It waited in the rendezvous for the whole timeout (300 s by default), then named a socket."""
    world = random.randint(1, 3)
    rank = world + random.randint(0, 2)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    began = time.monotonic()
    with pytest.raises(
        ConfigurationError, match=rf"need 0 <= rank < world_size.*got rank {rank}, world size {world} "
    ):
        thd.init(
            HardwareAbstractionLayer(settings=NO_AUTOLOAD),
            device="cpu",
            prefix="gen0",
            timeout=timedelta(seconds=5),
        )
    assert time.monotonic() - began < 2
    assert not dist.is_initialized()


def test_a_prefixed_init_without_rank_says_it_was_not_given(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigurationError, match=r"got rank None, world size 2 \(None: not given\)"):
        thd.init(HardwareAbstractionLayer(settings=NO_AUTOLOAD), device="cpu", prefix="gen0")


@pytest.mark.parametrize("local_rank", ["0", 1.0, True])
def test_a_local_rank_that_is_not_an_integer_is_refused(local_rank):
    with pytest.raises(ConfigurationError, match=rf"local_rank must be >= 0, got {local_rank!r}"):
        thd.init(
            HardwareAbstractionLayer(settings=NO_AUTOLOAD),
            device="cpu",
            rank=0,
            world_size=1,
            local_rank=local_rank,
        )
    assert not dist.is_initialized()


@pytest.mark.parametrize("name", ["RANK", "WORLD_SIZE"])
def test_an_elastic_start_with_a_malformed_rank_variable_names_it(monkeypatch, tmp_path, name):
    """It was int()'s "invalid literal for int() with base 10", naming no variable."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for key, value in {**env, name: "two"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigurationError, match=rf"{name} must be an integer, got 'two'"):
        ElasticJob.start(tmp_path / "ckpt", device="cpu", gen=0)
    assert not dist.is_initialized()


# -- prepare and train -----------------------------------------------------------------------------


def test_a_policy_made_for_another_device_type_is_refused_by_prepare_and_train(ctx):
    """A bf16 policy for a CUDA device trained a CPU model in fp32 (autocast for cuda does nothing
    to CPU ops) while its report said bf16."""
    gpu_hal = HardwareAbstractionLayer(
        adapters=[NvidiaAdapter(probe=RecordedCudaProbe(load("nvidia-h200x2")))], settings=NO_AUTOLOAD
    )
    policy = thd.choose_precision(gpu_hal.device("cuda:0"))
    assert policy.device_type == "cuda" and policy.name == "bf16"
    dim = random.randint(2, 6)
    model = nn.Linear(dim, 1)
    with pytest.raises(
        UnsupportedError, match=r"prepare: precision policy 'bf16' is for cuda tensors, but cpu"
    ):
        thd.prepare(model, sgd, ctx=ctx, policy=policy)
    prepared = thd.prepare(model, sgd, ctx=ctx, strategy="local")
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(UnsupportedError, match=r"train: precision policy 'bf16' is for cuda tensors"):
        thd.train(
            model,
            prepared.optimizer,
            [(torch.randn(3, dim),)],
            steps=1,
            ctx=ctx,
            policy=policy,
            loss_fn=lambda m, b: m(b[0]).sum(),
        )
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))  # nothing ran


def test_a_model_already_wrapped_in_ddp_is_refused(ctx):
    """It was wrapped again: every gradient reduced twice, state-dict keys under module.module."""
    wrapped = DistributedDataParallel(
        nn.Linear(random.randint(2, 5), 2), process_group=ctx.communicator.group
    )
    with pytest.raises(
        InvalidArgumentError, match=r"already wrapped in DistributedDataParallel.*model\.module"
    ):
        thd.prepare(wrapped, sgd, ctx=ctx)


def test_the_ranks_agree_on_batches_only_where_steps_synchronise(ctx, monkeypatch):
    """A world of one rank synchronises nothing, so train adds no collective (and says nothing new)."""
    calls = []
    monkeypatch.setattr(ctx.communicator, "all_gather", lambda t: calls.append(t) or t)
    prepared = thd.prepare(nn.Linear(3, 1), sgd, ctx=ctx)
    with pytest.raises(InvalidArgumentError, match=r"^train: batches ran out after 1 of 2 steps$"):
        thd.train(
            prepared.model,
            prepared.optimizer,
            [(torch.randn(2, 3),)],
            steps=2,
            ctx=ctx,
            policy=prepared.policy,
            loss_fn=lambda m, b: m(b[0]).sum(),
        )
    assert calls == []


# -- checkpoints -----------------------------------------------------------------------------------


def mlp(widths: list[int]) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))


def saved(tmp_path, widths: list[int]):
    model = mlp(widths)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, widths[0])).square().mean().backward()
    optimizer.step()
    return Checkpointer(tmp_path).save(1, model, optimizer)


def assert_refused_untouched(tmp_path, widths: list[int], message: str) -> None:
    model = mlp(widths)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message):
        Checkpointer(tmp_path).load(model, optimizer)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optimizer.state


def test_a_checkpoint_of_a_bigger_model_is_refused_not_loaded_in_part(tmp_path):
    """The checkpoint's extra layer was ignored and the rest loaded, silently."""
    widths = [random.randint(2, 6) for _ in range(3)]
    saved(tmp_path, widths)
    assert_refused_untouched(
        tmp_path,
        widths[:2],
        r"does not fit the model: 2 key\(s\) only in the checkpoint \('1\.bias'; '1\.weight'\)",
    )


def test_a_checkpoint_with_other_shapes_names_each_key_and_both_shapes(tmp_path):
    """The shapes were in DCP's CheckpointException, inside a traceback of another rank's plan."""
    a, b, c = (random.randint(2, 6) for _ in range(3))
    saved(tmp_path, [a, b, c])
    assert_refused_untouched(
        tmp_path,
        [a, b + 1, c],
        rf"3 shape\(s\) differ \('0\.bias': saved \({b},\), model \({b + 1},\); '0\.weight': saved "
        rf"\({b}, {a}\), model \({b + 1}, {a}\); '1\.weight': saved \({c}, {b}\), model \({c}, {b + 1}\)\)",
    )


def test_a_model_with_keys_the_checkpoint_lacks_is_refused_naming_them(tmp_path):
    widths = [random.randint(2, 6) for _ in range(3)]
    saved(tmp_path, widths[:2])
    assert_refused_untouched(tmp_path, widths, r"2 key\(s\) only in the model \('1\.bias'; '1\.weight'\)")


def test_a_rollback_sets_the_abandoned_later_checkpoints_aside(tmp_path):
    """Resumed from an older step (a rollback) with keep=1, the save deleted the checkpoint it had
    just written; kept, the later one was what the next crash resumed from, undoing the rollback."""
    model = nn.Linear(3, 2)
    optimizer = sgd(model.parameters())
    later, earlier = random.randint(5, 9), random.randint(1, 4)
    ckpt = Checkpointer(tmp_path, keep=1)
    ckpt.save(later, model, optimizer)
    before = telemetry.counts().get("torchhal.checkpoint.superseded", 0)
    info = ckpt.save(earlier, model, optimizer)
    assert info is not None and verify(info.path) == info
    assert telemetry.counts()["torchhal.checkpoint.superseded"] == before + 1
    assert latest_valid(tmp_path).step == earlier  # a crash now resumes the rolled-back timeline
    ckpt.save(earlier + 1, model, optimizer)  # keep=1 still removes the older one of this run
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"step_{earlier + 1}", f"superseded_step_{later}_by_{earlier}"]
    )
    assert latest_valid(tmp_path).step == earlier + 1
    assert verify(tmp_path / f"superseded_step_{later}_by_{earlier}").step == later  # kept whole


def test_python_and_numpy_generators_resume_where_they_were(tmp_path):
    """Data pipelines draw from random and numpy (shuffles, crops): only torch's were restored."""
    import numpy as np

    model = nn.Linear(3, 2)
    optimizer = sgd(model.parameters())
    ckpt = Checkpointer(tmp_path)
    ckpt.save(1, model, optimizer)
    expected = (random.random(), np.random.random(), np.random.standard_normal(), torch.rand(1).item())
    random.random(), np.random.random(), torch.rand(1)  # drift past the saved point
    ckpt.load(model, optimizer)
    assert (
        random.random(),
        np.random.random(),
        np.random.standard_normal(),
        torch.rand(1).item(),
    ) == expected


# -- mesh ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "names"), [((), None), ((1.0,), None), ((True,), None), ((1,), (3,)), ((1,), ("",))]
)
def test_bad_mesh_shapes_and_names_are_refused(ctx, shape, names):
    with pytest.raises(ConfigurationError, match=r"mesh (shape|names)"):
        thd.Mesh.create(ctx, shape, names)


# -- health and heterogeneous rates ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"straggler_factor": math.nan}, r"straggler_factor must be > 1, got nan"),
        ({"straggler_factor": math.inf}, r"straggler_factor must be > 1, got inf \(and finite\)"),
        ({"deadline": math.inf}, r"got interval 0.5, deadline inf \(both finite\)"),
        ({"max_scaler_skips": math.nan}, r"max_scaler_skips must be >= 1, got nan"),
        ({"window": 2.5}, r"window must be >= 1, got 2.5 \(a whole number of steps\)"),
    ],
)
def test_health_thresholds_that_would_switch_a_check_off_are_refused(tmp_path, kwargs, message):
    """NaN compares false: a NaN factor or skip limit disabled straggler and divergence checks, and
    an infinite deadline let diagnose() wait for a hung peer forever."""
    store = dist.FileStore(str(tmp_path / "health"), 1)
    with pytest.raises(InvalidArgumentError, match=message):
        HealthMonitor(store, rank=0, world_size=1, **kwargs)


@pytest.mark.parametrize("bad", [0.0, -1.5, math.nan, math.inf])
def test_modelled_step_times_refuse_rates_that_are_not_positive_and_finite(bad):
    """Zero divided by zero (ZeroDivisionError); NaN and negative rates gave NaN and negative times."""
    rates = [random.uniform(1, 100) for _ in range(3)]
    rank = random.randrange(3)
    rates[rank] = bad
    with pytest.raises(
        InvalidArgumentError,
        match=rf"modelled_step_times: throughputs must be finite and > 0, got \[\({rank}, {bad}\)\]",
    ):
        thd.modelled_step_times([4, 4, 4], rates, 1e9)


def test_only_steps_that_wait_on_other_ranks_make_them_agree_on_batches(ctx):
    """A policy that never went through prepare counted as synchronising: ranks training models
    of their own (an ensemble, a sweep) with different step counts then failed in the agreement."""
    from torchhal.distributed.loop import steps_synchronise

    policy = thd.choose_precision(ctx.device)
    assert policy.strategy is None
    assert not steps_synchronise(2, policy, None)
    assert not steps_synchronise(2, policy.for_strategy("local"), None)
    assert steps_synchronise(2, policy.for_strategy("local"), grad_sync=lambda model: None)
    assert steps_synchronise(2, policy.for_strategy("ddp"), None)
    assert steps_synchronise(2, policy.for_strategy("fsdp"), None)
    assert not steps_synchronise(1, policy.for_strategy("ddp"), None)


def test_set_aside_timelines_are_kept_keep_at_most(tmp_path):
    """Each set-aside checkpoint is a whole one: rollbacks kept every one of them, without bound."""
    model = nn.Linear(3, 2)
    optimizer = sgd(model.parameters())
    ckpt = Checkpointer(tmp_path, keep=1)
    for step in (9, 2, 8, 3):  # two rollbacks: 9 set aside by 2, then 8 by 3
        ckpt.save(step, model, optimizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "superseded_step_8_by_3"]
