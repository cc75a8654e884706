"""Settling undecided runs: a stage's question never fences a live client, a run is settled
once, and a fenced commit reaches the client as ``Fenced`` (real in-process servers)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from elasticpipe.client import driver
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import Fenced
from elasticpipe.security import bounds
from elasticpipe.stage_server.server import StageServer
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support import jobs

pytestmark = pytest.mark.timeout(60)


def _pipeline(coordinator: CoordinatorServer) -> Pipeline:
    return jobs.mlp(coordinator.address, sizes=[12, 16, 6], micro_batches=2, stages=2, lease_s=30.0)


def test_a_run_is_settled_once_and_a_live_client_is_never_fenced(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer]
) -> None:
    """While a client holds the job, a stage's question is answered "wait" and fences
    nobody; once it is gone, the run is settled once (one new generation) and every
    repeated question gets the same answer; runs outside the job are answered "abort"."""
    coordinator = coordinator_server.coordinator
    assert coordinator is not None
    jobs, store = coordinator.jobs, coordinator.store
    pipe = _pipeline(coordinator_server)
    pipe.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,)))
    stage_id = pipe.partition.stage_ids[0]
    run = (pipe._client << bounds.RUN_ID_BITS) + 999  # a run of step 2 nobody committed
    generation = store.get("client_generation")
    assert jobs.resolve_run(stage_id, run, 2) == "wait"
    assert store.get("client_generation") == generation  # the live client is not fenced
    pipe.close()
    assert jobs.resolve_run(stage_id, run, 2) == "abort"
    assert store.get("client_generation") == generation + 1
    for _ in range(3):  # every stage asks, and asks again: answered from the decision
        assert jobs.resolve_run(stage_id, run, 2) == "abort"
    assert store.get("client_generation") == generation + 1
    never_issued = (generation + 5) << bounds.RUN_ID_BITS
    assert jobs.resolve_run(stage_id, never_issued + 1, 2) == "abort"
    assert jobs.resolve_run("not-a-chain-stage", run + 1, 2) == "abort"
    assert store.get("client_generation") == generation + 1
    with _pipeline(coordinator_server) as resumed:  # the job still trains
        assert resumed.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,))) > 0


def test_a_commit_refused_as_fenced_raises_fenced(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer]
) -> None:
    """A stage that follows a newer client generation refuses the commit: the client gets
    Fenced (it lost the job), never a CommitIncomplete that would count the step."""
    with _pipeline(coordinator_server) as pipe:
        pipe.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,)))
        partition = pipe.partition
        stub = stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(partition.addresses[1]))
        stub.Fence(stage_pb2.FenceRequest(client=pipe._client + 1), timeout=10)
        run = (pipe._client << bounds.RUN_ID_BITS) + 999
        with pytest.raises(Fenced, match="fenced"):
            driver.commit(pipe._clients, partition, run, 2, pipe._client)


def test_a_stage_asking_while_a_client_attaches_learns_that_client(
    coordinator_server: CoordinatorServer,
    stage_servers: list[StageServer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stage that asks for the job's grant after a client's new generation was issued but
    before its lease exists (a data call from the client arriving early) is told that
    generation's holder, not "nobody": told "nobody", the stage refused the new client's
    data until it asked again (seen once in the fuzz test under TLS)."""
    coordinator = coordinator_server.coordinator
    assert coordinator is not None
    jobs = coordinator.jobs
    pipe = _pipeline(coordinator_server)
    pipe.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,)))
    pipe.close()
    asked: list[tuple[str, int, str]] = []
    settle = jobs.settle

    def asking_settle(partition: Any, client: int, holder: str = "") -> int:
        asked.append(jobs.grant())  # between the generation and its lease
        return settle(partition, client, holder)

    monkeypatch.setattr(jobs, "settle", asking_settle)
    job = coordinator.cluster.job
    assert job is not None
    attached = jobs._attach(job, 30.0, "alice")
    assert asked == [(job.job_id, attached.client, "alice")]
    assert jobs.grant() == (job.job_id, attached.client, "alice")
