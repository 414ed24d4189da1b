"""ElasticJob.start and close leave nothing half done: arguments are refused before the rank joins,
a failure after the process group was made undoes it, close() stops the monitor and destroys the
groups even when the checkpoint commit fails; and a generation whose keys an earlier round left on
the store (torchelastic's membership-change restart on its shared store) is refused at once."""

from __future__ import annotations

import io
import random
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from torchhal.distributed import elastic
from torchhal.distributed.checkpoint import Checkpointer, CheckpointError
from torchhal.hal_core import ConfigurationError, InvalidArgumentError, telemetry

JOIN = timedelta(seconds=5)


@pytest.fixture
def world_of_one(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert not dist.is_initialized(), "an earlier test left a process group behind"
    yield
    assert not dist.is_initialized(), "the test left a process group behind"


def health_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("torchhal-health")]


def joined(store: dist.Store, gen: int) -> bool:
    return dist.PrefixStore(f"gen{gen}/", store).check(["torchhal_joined"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"heartbeat_interval": 5.0, "heartbeat_deadline": 1.0},
            r"ElasticJob \(heartbeat_interval, heartbeat_deadline\): need 0 < interval < deadline, "
            r"got interval 5.0, deadline 1.0",
        ),
        ({"keep": 0}, r"ElasticJob: keep must be an integer >= 1, got 0"),
        ({"save_every": 1.5}, r"ElasticJob: save_every must be an integer >= 1, got 1.5"),
    ],
    ids=["heartbeat", "keep", "save_every"],
)
def test_bad_arguments_are_refused_before_the_rank_joins(world_of_one, tmp_path, kwargs, message):
    """They were found by HealthMonitor and Checkpointer after the process group was made (and,
    for keep, the heartbeat thread started): a retry failed 'default process group already exists'."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(InvalidArgumentError, match=message):
        elastic.ElasticJob.start(tmp_path / "ckpt", device="cpu", store=store, gen=0, **kwargs)
    assert not dist.is_initialized() and health_threads() == []
    assert not joined(store, 0)  # so the same generation can be started again on the same store
    job = elastic.ElasticJob.start(tmp_path / "ckpt", device="cpu", store=store, gen=0, join_timeout=JOIN)
    job.close()


def test_a_failure_after_the_group_was_made_stops_the_monitor_and_destroys_the_group(world_of_one, tmp_path):
    telemetry.configure(log_level="warning", log_stream=(stream := io.StringIO()))
    in_the_way = tmp_path / "ckpt"
    in_the_way.write_text("a file where the checkpoint directory goes")
    before = telemetry.counts().get("torchhal.elastic.start_undone", 0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    with pytest.raises(FileExistsError):
        elastic.ElasticJob.start(in_the_way, device="cpu", store=store, gen=3, join_timeout=JOIN)
    assert not dist.is_initialized() and health_threads() == []
    assert telemetry.counts().get("torchhal.elastic.start_undone", 0) == before + 1
    (line,) = [x for x in stream.getvalue().splitlines() if "elastic start failed" in x]
    assert "generation=gen3" in line and "FileExistsError" in line
    job = elastic.ElasticJob.start(tmp_path / "other", device="cpu", store=store, gen=4, join_timeout=JOIN)
    job.close()


def test_close_stops_the_monitor_and_destroys_the_groups_when_the_commit_fails(
    world_of_one, tmp_path, monkeypatch
):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    job = elastic.ElasticJob.start(tmp_path / "ckpt", device="cpu", store=store, gen=0, join_timeout=JOIN)
    step = random.randint(1, 1000)

    def failed_commit(self: Checkpointer) -> None:  # an async save whose future raised: disk full
        raise CheckpointError(f"async checkpoint of step {step} failed: No space left on device")

    monkeypatch.setattr(Checkpointer, "wait", failed_commit)
    with pytest.raises(CheckpointError, match=f"step {step} failed: No space left"):
        job.close()
    assert not dist.is_initialized() and health_threads() == []


# -- the same generation twice on one store --------------------------------------------------------


def join_world(port: int, world: int) -> list[BaseException | None]:
    """`world` ranks (threads, each with its own client of the store at `port`) join generation
    gen0; what each raised."""
    outcome: list[BaseException | None] = [None] * world

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=JOIN)
        try:
            elastic._join(store, "gen0", JOIN)
        except Exception as exc:  # recorded for the assertion in the test's thread
            outcome[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcome


def test_a_second_round_of_one_generation_on_a_shared_store_is_refused_at_once(monkeypatch):
    """torchelastic restarts workers for a membership change without raising
    TORCHELASTIC_RESTART_COUNT, on its agent's shared TCPStore: round 2 read round 1's join keys,
    passed the join barrier without its peers, and gloo failed after its connect timeout."""
    world = random.randint(2, 4)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")  # every thread reads this process's RANK
    agent = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    assert join_world(agent.port, world) == [None] * world  # round 1
    before = telemetry.counts().get("torchhal.elastic.stale_generation", 0)
    began = time.monotonic()
    round_two = join_world(agent.port, world)
    assert time.monotonic() - began < JOIN.total_seconds() / 2
    for error in round_two:
        assert isinstance(error, ConfigurationError), round_two
        text = str(error)
        assert f"generation gen0 (rank 0 of {world})" in text
        assert "all-joined key was already set before this rank joined" in text
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text and "membership change" in text
    assert telemetry.counts().get("torchhal.elastic.stale_generation", 0) == before + world


def test_a_join_count_above_the_world_size_is_refused(monkeypatch):
    """A round whose last rank died between its add and the all-joined key left the count at the
    world size: the next rank to add counts past it."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    store = dist.HashStore()
    dist.PrefixStore("gen0/", store).add("torchhal_joined", 2)
    with pytest.raises(ConfigurationError, match=r"this rank was number 3 to join a world of 2"):
        elastic._join(store, "gen0", JOIN)


def test_elastic_job_on_a_store_an_earlier_round_used_is_refused(world_of_one, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    agent = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    elastic.ElasticJob.start(tmp_path / "ckpt", device="cpu", store=agent, gen=0, join_timeout=JOIN).close()
    with pytest.raises(ConfigurationError, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") as info:
        elastic.ElasticJob.start(tmp_path / "ckpt", device="cpu", store=agent, gen=0, join_timeout=JOIN)
    assert "TORCHELASTIC_USE_AGENT_STORE=True" in str(info.value)
    assert health_threads() == []


def test_the_shared_store_is_logged_and_counted_on_the_first_generation_too(
    world_of_one, tmp_path, monkeypatch
):
    """A membership change restarts generation 0 under the same prefix, so the shared store matters
    before any restart; the warning of a restarted generation stays as it was."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    telemetry.configure(log_level="info", log_stream=(stream := io.StringIO()))
    before = telemetry.counts().get("torchhal.elastic.shared_store", 0)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    elastic.ElasticJob.start(tmp_path / "ckpt", device="cpu", store=store, gen=0, join_timeout=JOIN).close()
    assert telemetry.counts().get("torchhal.elastic.shared_store", 0) == before + 1
    (line,) = [x for x in stream.getvalue().splitlines() if "shared rendezvous store" in x]
    assert "membership change" in line and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
    assert "generation=0" in line
