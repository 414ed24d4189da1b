"""One process: a PrecisionPolicy refuses fields that contradict each other, init checks its
arguments before the rendezvous, and the mesh and the batch split name the bad value they got."""

from __future__ import annotations

import re
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.ports import free_port
from torchhal import HardwareAbstractionLayer
from torchhal import distributed as thd
from torchhal.hal_core import ConfigurationError, InvalidArgumentError, UnsupportedError
from torchhal.hal_core.settings import Settings

NO_AUTOLOAD = Settings.from_env({"TORCHHAL_DISABLE_PLUGIN_AUTOLOAD": "1"})
HAND_MADE = {"name": "bf16", "compute_dtype": torch.bfloat16, "device_type": "cpu", "reason": "made by hand"}


@pytest.fixture(autouse=True)
def _no_rendezvous_env(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


# -- precision policy ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        # fp16 compute under a bf16 name: no gradient scaler, so fp16 gradients underflowed silently
        ({"compute_dtype": torch.float16}, InvalidArgumentError,
         r"compute_dtype must be torch.bfloat16 for name 'bf16', got torch.float16"),
        ({"name": "fp32"}, InvalidArgumentError,
         r"compute_dtype must be torch.float32 for name 'fp32', got torch.bfloat16"),
        ({"name": "fp8"}, InvalidArgumentError, r"name must be one of \['bf16', 'fp16', 'fp32'\], got 'fp8'"),
        ({"reduce_dtype": torch.int32}, InvalidArgumentError,
         r"reduce_dtype must be a floating-point torch.dtype, got torch.int32"),
        ({"device_type": "cuda:0"}, InvalidArgumentError,
         r"device_type must be a torch device type such as 'cuda', got 'cuda:0'"),
        ({"strategy": "FSDP"}, UnsupportedError,
         r"strategy must be one of \('ddp', 'fsdp', 'local'\) or None, got 'FSDP'"),
    ],
)  # fmt: skip
def test_a_policy_whose_fields_contradict_each_other_is_refused_naming_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        thd.PrecisionPolicy(**{**HAND_MADE, **fields})


def test_every_policy_choose_precision_makes_passes_its_own_checks():
    cpu = HardwareAbstractionLayer(settings=NO_AUTOLOAD).device("cpu")
    for name in ("bf16", "fp16", "fp32"):
        policy = thd.choose_precision(cpu, prefer=name)
        assert [policy.for_strategy(s).strategy for s in ("ddp", "fsdp", "local")] == ["ddp", "fsdp", "local"]


# -- init ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"timeout": 5}, "init: timeout must be a positive datetime.timedelta, got 5"),
        ({"timeout": timedelta(seconds=-1)},
         "init: timeout must be a positive datetime.timedelta, got datetime.timedelta(days=-1, "),
        ({"rank": "0"}, "init: rank must be an int, got str '0'"),
        ({"world_size": 1.0}, "init: world_size must be an int, got float 1.0"),
    ],
)  # fmt: skip
def test_a_prefixed_init_names_a_bad_argument_before_the_rendezvous(monkeypatch, arguments, message):
    """The rendezvous came first: a raw TypeError from the store's constructor, a socket timeout of
    -1000 ms with a C++ stack dump, or a rank refused for its type only after it."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    given = {"rank": 0, "world_size": 1, "timeout": timedelta(seconds=5), **arguments}
    with pytest.raises(ConfigurationError, match=re.escape(message)):
        thd.init(HardwareAbstractionLayer(settings=NO_AUTOLOAD), device="cpu", prefix="gen0", **given)
    assert not dist.is_initialized()


def test_a_prefixed_init_takes_ranks_of_any_integer_type(tmp_path):
    """np.int64(0) was refused as "need 0 <= rank < world_size; got rank np.int64(0), world size 1"."""
    ctx = thd.init(
        HardwareAbstractionLayer(settings=NO_AUTOLOAD),
        device="cpu",
        rank=np.int64(0),
        world_size=np.int64(1),
        local_rank=np.int64(0),
        init_method=(tmp_path / "rendezvous").as_uri(),
        prefix="gen0",
        timeout=timedelta(seconds=10),
    )
    try:
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.prefix) == (0, 1, 0, "gen0")
    finally:
        ctx.shutdown()


# -- mesh and batch split --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "names", "message"),
    [
        # a str was taken as its characters: ('t', 'p')
        ((1, 1), "tp", r"mesh names 'tp': need a sequence of 2 distinct non-empty names \(str\)"),
        # was int's "'int' object is not iterable"
        (1, None, r"mesh shape 1: needs a sequence of at least one integer size >= 1"),
        ("1", None, r"mesh shape '1': needs a sequence"),
    ],
)  # fmt: skip
def test_a_mesh_shape_or_names_of_the_wrong_kind_is_named_whole(ctx, shape, names, message):
    with pytest.raises(ConfigurationError, match=message):
        thd.Mesh.create(ctx, shape, names)


def test_a_mesh_takes_sizes_of_any_integer_type(ctx):
    mesh = thd.Mesh.create(ctx, (np.int64(1), 1), ("outer", "inner"))
    assert mesh.shape == (1, 1) and mesh.names == ("outer", "inner")


def test_split_batch_takes_numpy_integers_and_refuses_a_bool():
    assert thd.split_batch(np.int64(8), [1.0, 3.0]) == (
        2,
        6,
    )  # was refused as "an integer ... got np.int64(8)"
    with pytest.raises(
        InvalidArgumentError, match=r"global_batch must be an integer \(not bool\) .* got True \(bool\)"
    ):
        thd.split_batch(True, [1.0])  # was (1,)


@pytest.mark.parametrize(
    ("batch_sizes", "step_times", "message"),
    [
        # a raw TypeError from math.isfinite
        ([4, 4], ["a", 1.0], r"rebalanced_split: step_times_s must be real .*got rank 0: 'a' \(str\)"),
        # taken as a time of 1 s
        ([4, 4], [True, 1.0], r"rebalanced_split: step_times_s must be real .*got rank 0: True \(bool\)"),
        # blamed on "split_batch: throughputs"
        ([0, 8], [1.0, 1.0], r"rebalanced_split: batch_sizes must be integers .* >= 1, got \[\(0, 0\)\]"),
        ([4, 4.0], [1.0, 1.0], r"batch_sizes must be integers \(not bool\) >= 1, got \[\(1, 4.0\)\]"),
    ],
)  # fmt: skip
def test_rebalanced_split_names_the_argument_it_refuses(batch_sizes, step_times, message):
    with pytest.raises(InvalidArgumentError, match=message):
        thd.rebalanced_split(8, batch_sizes, step_times)
