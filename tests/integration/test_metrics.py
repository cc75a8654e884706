"""The Prometheus endpoints of a live cluster report what actually happened."""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import pytest
import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support.clusters import set_partition
from tests.support.prometheus import scrape, value

STAGES = 3
STEPS_BEFORE, STEPS_AFTER = 3, 3
MLP = {"sizes": [12, 24, 24, 24, 24, 24, 6]}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stages and a coordinator, each with a metrics endpoint on a free port."""
    with LocalCluster(
        stages=STAGES,
        state=":memory:",
        auto_rebalance=False,
        metrics=True,
    ) as c:
        yield c


@pytest.mark.timeout(120)
def test_scraped_metrics_match_training_and_a_live_migration(cluster: LocalCluster) -> None:
    """Steps, epoch, layer ranges, bytes between neighbours, the migration and the members
    scraped from every endpoint equal what the test did and what the pipeline reports."""
    assert set(cluster.metrics_ports) == {"coordinator", *(f"stage-{i}" for i in range(STAGES))}
    for name, port in cluster.metrics_ports.items():  # each process logs the port it bound
        log = (cluster.log_dir / f"{name}.log").read_text()
        assert re.search(rf"metrics_serving.*port={port}\b", log), name
    g = torch.Generator().manual_seed(3)
    with Pipeline(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs=MLP,
        seed=1,
        micro_batches=3,
        stages=STAGES,
    ) as pipe:

        def train(steps: int) -> None:
            for _ in range(steps):
                pipe.train_step(
                    torch.randn(9, 12, generator=g), torch.randint(0, 6, (9,), generator=g)
                )

        train(STEPS_BEFORE)
        layers = pipe.partition.boundaries[-1]
        lopsided = [0, 1, 2, layers]  # the last stage gets most layers
        assert set_partition(cluster, lopsided).changed
        train(STEPS_AFTER)
        partition = pipe.partition
    assert list(partition.boundaries) == lopsided

    coordinator = scrape(cluster.metrics_url("coordinator"))
    assert value(coordinator, "elasticpipe_coordinator_epoch") == partition.epoch
    assert value(coordinator, "elasticpipe_coordinator_members", state="chain") == STAGES
    assert value(coordinator, "elasticpipe_coordinator_members", state="dead") == 0
    assert value(coordinator, "elasticpipe_coordinator_migrations_total", kind="move") == 1
    assert value(coordinator, "elasticpipe_coordinator_migration_bytes_total", kind="move") > 0
    pauses = value(
        coordinator, "elasticpipe_coordinator_migration_pause_seconds_count", kind="move"
    )
    assert pauses == 1
    assert value(coordinator, "elasticpipe_coordinator_predicted_step_seconds") > 0

    addresses = list(partition.addresses)
    stages = [scrape(cluster.metrics_url(cluster.name_of(a))) for a in addresses]
    for index, samples in enumerate(stages):
        steps = value(samples, "elasticpipe_stage_step_seconds_count", mode="train")
        assert steps == STEPS_BEFORE + STEPS_AFTER, f"stage {index}"
        assert value(samples, "elasticpipe_stage_epoch") == partition.epoch
        lo, hi = partition.boundaries[index], partition.boundaries[index + 1]
        assert value(samples, "elasticpipe_stage_first_layer") == lo
        assert value(samples, "elasticpipe_stage_last_layer") == hi - 1
        assert value(samples, "elasticpipe_stage_committed_step") == pipe.step
        ops = value(samples, "elasticpipe_stage_op_seconds_count", kind="forward")
        assert ops == 3 * (STEPS_BEFORE + STEPS_AFTER)
        assert value(samples, "elasticpipe_stage_stashed_bytes") > 0
        assert value(samples, "elasticpipe_stage_mailbox_entries") == 0
        measured = {
            int(dict(labels)["layer"])
            for name, labels in samples
            if name == "elasticpipe_stage_layer_seconds"
        }
        assert measured == set(range(lo, hi)), f"stage {index}"
    for i in range(STAGES - 1):
        here, there = stages[i], stages[i + 1]
        forward = value(here, "elasticpipe_stage_sent_bytes_total", peer=addresses[i + 1])
        assert forward > 0
        assert value(there, "elasticpipe_stage_received_bytes_total", peer=addresses[i]) == forward
        backward = value(there, "elasticpipe_stage_sent_bytes_total", peer=addresses[i])
        assert backward > 0
        assert value(here, "elasticpipe_stage_received_bytes_total", peer=addresses[i + 1]) == (
            backward
        )
    assert value(stages[0], "elasticpipe_stage_received_bytes_total", peer="client") > 0
    assert value(stages[-1], "elasticpipe_stage_received_bytes_total", peer="client") > 0


@pytest.mark.timeout(60)
def test_failed_calls_are_counted_by_method_and_code(cluster: LocalCluster) -> None:
    """A bad request and a call to a method that does not exist each add one to the error
    counter of the server that refused them, under the right method and code."""
    name = "stage-0"
    address = cluster.stage_addresses[0]
    before = scrape(cluster.metrics_url(name))
    with rpc.channel(address) as channel:
        stub = stage_pb2_grpc.StageServiceStub(channel)
        with pytest.raises(InvalidRequest, match="unknown run mode 0"):
            rpc.call(
                address, stub.RunStep, stage_pb2.RunStepRequest(micro_batches=0, timeout_s=5), 10
            )
        with pytest.raises(grpc.RpcError) as streamed:  # a server-streaming method
            list(stub.ExportLayers(stage_pb2.ExportLayersRequest(layers=[99]), timeout=10))
        with pytest.raises(grpc.RpcError) as empty:  # a client-streaming one
            stub.Forward(iter(()), timeout=10)
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        bogus = channel.unary_unary("/elasticpipe.v1.StageService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as unimplemented:
            bogus(b"", timeout=10)
        assert unimplemented.value.code() == grpc.StatusCode.UNIMPLEMENTED
    after = scrape(cluster.metrics_url(name))

    def delta(method: str, code: str) -> float:
        key = (
            "elasticpipe_stage_rpc_errors_total",
            frozenset({"method": method, "code": code}.items()),
        )
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("StageService/RunStep", "INVALID_ARGUMENT") == 1
    assert delta("unknown", "UNIMPLEMENTED") == 1
    assert delta("StageService/ExportLayers", streamed.value.code().name) == 1
    assert delta("StageService/Forward", "INVALID_ARGUMENT") == 1

    coordinator_before = scrape(cluster.metrics_url("coordinator"))
    with cluster.admin() as admin, pytest.raises(InvalidRequest):
        admin.set_partition([0, 9])
    coordinator_after = scrape(cluster.metrics_url("coordinator"))
    key = (
        "elasticpipe_coordinator_rpc_errors_total",
        frozenset(
            {"method": "CoordinatorService/SetPartition", "code": "INVALID_ARGUMENT"}.items()
        ),
    )
    assert coordinator_after[key] - coordinator_before.get(key, 0.0) == 1
