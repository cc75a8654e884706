"""Coordinator behaviour seen by clients: partition watches and user model factories."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest
import torch

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import InvalidRequest
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.objectives import make_optimizer, reference_step
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support import jobs
from tests.support.numerics import assert_steps_match
from tests.support.servers import stage_servers

pytestmark = pytest.mark.timeout(120)
CUSTOM = "tests.support.custom_models:tiny"


@pytest.fixture
def cluster() -> Iterator[tuple[CoordinatorServer, list[StageServer]]]:
    """A coordinator and two stages that allow models under ``tests.support``."""
    with CoordinatorServer(
        CoordinatorConfig(policy=PolicyConfig(enabled=False), heartbeat_interval_s=0.2)
    ) as c:
        configs = [StageConfig(name=f"s{i}", allow_models=("tests.support",)) for i in range(2)]
        with stage_servers(c.address, configs) as stages:
            yield c, stages


def test_user_factory_under_an_allowed_prefix_trains_exactly(
    cluster: tuple[CoordinatorServer, list[StageServer]],
) -> None:
    """A factory given by import path, allowed by --allow-models, trains like local code."""
    coordinator, _ = cluster
    reference = models.build(CUSTOM, seed=2, allow=("tests.support",), width=8)
    optimizer = make_optimizer("adamw", reference.parameters(), {"lr": 0.01})
    g = torch.Generator().manual_seed(0)
    batches = (
        (torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)) for _ in range(3)
    )
    with Pipeline(
        coordinator=coordinator.address,
        model=CUSTOM,
        model_kwargs={"width": 8},
        seed=2,
        optimizer="adamw",
        optimizer_kwargs={"lr": 0.01},
        micro_batches=2,
        stages=2,
    ) as pipe:
        assert_steps_match(
            pipe, batches, partial(reference_step, reference, optimizer, "cross_entropy")
        )
        state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value)


def test_watch_partition_streams_every_new_epoch(
    cluster: tuple[CoordinatorServer, list[StageServer]],
) -> None:
    """WatchPartition sends the current partition, then each new epoch as it is committed."""
    coordinator, _ = cluster
    with jobs.mlp(coordinator.address, sizes=[4, 8, 8, 2], micro_batches=2, stages=2) as pipe:
        pipe.train_step(torch.randn(4, 4), torch.randint(0, 2, (4,)))
        first = pipe.partition
        channel = grpc.insecure_channel(coordinator.address)
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
        stream = stub.WatchPartition(coordinator_pb2.GetPartitionRequest(), timeout=30)
        seen: list[coordinator_pb2.Partition] = []
        got_two = threading.Event()

        def watch() -> None:
            for partition in stream:
                seen.append(partition)
                if len(seen) == 2:
                    got_two.set()
                    return

        thread = threading.Thread(target=watch, daemon=True)
        thread.start()
        target = [0, 1, 5] if first.boundaries != (0, 1, 5) else [0, 3, 5]
        stub.SetPartition(coordinator_pb2.SetPartitionRequest(boundaries=target), timeout=30)
        assert got_two.wait(15), f"watch saw {len(seen)} partitions"
        stream.cancel()
        assert seen[0].epoch == first.epoch
        assert seen[1].epoch == first.epoch + 1 and list(seen[1].boundaries) == target
        channel.close()


def test_slow_links_make_the_planner_cut_where_activations_are_small() -> None:
    """Given --link-bandwidth, the partition avoids cutting after wide layers."""
    with CoordinatorServer(
        CoordinatorConfig(
            policy=PolicyConfig(enabled=False), heartbeat_interval_s=0.2, link_bandwidth=1e4
        )
    ) as coordinator:
        # Two heavy 512x512 layers (2 and 4): compute alone would cut between them (3-5),
        # where activations are 512 wide; only the cuts at 7 and 8 are 4 wide.
        sizes = [4, 512, 512, 512, 4, 4]
        with (
            stage_servers(coordinator.address, [StageConfig(name=f"s{i}") for i in range(2)]),
            jobs.mlp(
                coordinator.address, sizes=sizes, loss="mse", micro_batches=2, stages=2
            ) as pipe,
        ):
            pipe.train_step(torch.randn(8, 4), torch.randn(8, 4))
            assert pipe.partition.boundaries[1] in (7, 8), pipe.partition.boundaries


def test_a_checkpoint_resumes_training_exactly_on_another_partition(
    cluster: tuple[CoordinatorServer, list[StageServer]],
    tmp_path: Path,
) -> None:
    """save() after 3 Adam steps, then load() into a fresh 1-stage job: the next 2 steps give
    the same losses and weights as continuing the original 2-stage job."""
    coordinator, _ = cluster
    sizes = [6, 16, 16, 3]
    g = torch.Generator().manual_seed(4)
    batches = [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(5)
    ]
    path = tmp_path / "ckpt.msgpack"

    def pipeline(stages: int) -> Pipeline:
        return jobs.mlp(
            coordinator.address,
            sizes=sizes,
            seed=9,
            optimizer="adam",
            optimizer_kwargs={"lr": 0.01},
            micro_batches=2,
            stages=stages,
        )

    with pipeline(2) as original:
        for x, y in batches[:3]:
            original.train_step(x, y)
        original.save(path)
        expected = [original.train_step(x, y) for x, y in batches[3:]]
        expected_state = original.state_dict()
    with pipeline(1) as resumed:
        resumed.load(path)
        assert resumed.step == 3
        got = [resumed.train_step(x, y) for x, y in batches[3:]]
        state = resumed.state_dict()
    torch.testing.assert_close(torch.tensor(got), torch.tensor(expected))
    for key, value in expected_state.items():
        torch.testing.assert_close(state[key], value)


def test_loading_a_foreign_or_corrupt_checkpoint_is_refused(
    cluster: tuple[CoordinatorServer, list[StageServer]],
    tmp_path: Path,
) -> None:
    """A file that is not a checkpoint, or one of another model, raises InvalidRequest."""
    coordinator, _ = cluster
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x93\x01\x02garbage")
    with jobs.mlp(coordinator.address, sizes=[4, 8, 2], stages=2) as pipe:
        pipe.train_step(torch.randn(4, 4), torch.randint(0, 2, (4,)))
        with pytest.raises(InvalidRequest):
            pipe.load(junk)
        pipe.save(tmp_path / "small.msgpack")
    with (
        jobs.mlp(coordinator.address, sizes=[4, 16, 2], stages=2) as other,
        pytest.raises(InvalidRequest, match="sizes"),
    ):
        other.load(tmp_path / "small.msgpack")
