"""An optimizer step that fails: real stage servers on loopback, driven by hand
(``driver.run`` and ``driver.commit``), one stage's optimizer step broken.

The stage gives up its job (its layers are no step's any more; recovery restores them),
whether CommitStep applied the step or the next RunStep did, carrying a lost commit's
decision. Either way it is left idle, not in a run it never began, and takes a new job."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from elasticpipe.client import driver
from elasticpipe.errors import ElasticPipeError
from elasticpipe.partition import Partition, StageRef
from elasticpipe.stage_server.protocol import Phase
from elasticpipe.stage_server.server import StageServer
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire.structure import split_batch
from tests.support.replica_jobs import JOB, M, batch
from tests.support.servers import assign_by_hand, unregistered_stage_servers

pytestmark = pytest.mark.timeout(120)

ALLOW = ("tests.support",)
CUTS = (0, 3, 7)


@pytest.fixture
def servers() -> Iterator[list[StageServer]]:
    with unregistered_stage_servers(2, ALLOW) as started:
        yield started


def _partition(servers: list[StageServer]) -> Partition:
    refs = tuple(StageRef(f"st-{n}", s.address) for n, s in enumerate(servers))
    return Partition(epoch=1, job_id="j", boundaries=CUTS, stages=refs)


def _assign(partition: Partition, seed: int = 5) -> None:
    assign_by_hand(JobConfig(**{**JOB, "seed": seed}).with_id(), partition)  # type: ignore[arg-type]


def _run(
    clients: driver.StageClients,
    partition: Partition,
    step: int,
    run: int = 0,
    previous: Sequence[stage_pb2.StepDecision] = (),
) -> None:
    xs, ys, scales = split_batch(*batch(step), M, torch.device("cpu"))
    secret = driver.new_secret()
    run = run or step
    driver.run(
        clients,
        partition,
        run,
        step,
        xs,
        ys,
        scales,
        "1f1b",
        60.0,
        previous=previous,
        secret=secret,
    )


def _break_steps(server: StageServer) -> None:
    stage = server.stage
    assert stage is not None and stage.slice is not None

    def broken(*args: Any) -> float | None:
        raise RuntimeError("injected: the optimizer step failed")

    stage.slice.timed_step = broken  # type: ignore[method-assign]


@pytest.mark.parametrize("decided", ["by CommitStep", "in the next RunStep"])
def test_a_failed_optimizer_step_leaves_an_idle_stage_that_takes_a_new_job(
    servers: list[StageServer], decided: str
) -> None:
    partition = _partition(servers)
    _assign(partition)
    _break_steps(servers[0])
    stage = servers[0].stage
    assert stage is not None
    with contextlib.closing(driver.StageClients()) as clients:
        _run(clients, partition, 1)
        if decided == "by CommitStep":
            # (the client asks again; the stage recorded the decision before the step failed)
            with contextlib.suppress(ElasticPipeError):
                driver.commit(clients, partition, 1, 1)
            with pytest.raises(ElasticPipeError, match="stage st0 has no job assigned"):
                _run(clients, partition, 2)
        else:  # the commit was lost: the next run carries its decision
            decision = stage_pb2.StepDecision(run=1, step=1, commit=True)
            with pytest.raises(ElasticPipeError):  # (the RunStep's error, or the feeder's)
                _run(clients, partition, 2, previous=[decision])
        assert "optimizer step of step 1 failed" in stage.poisoned
        assert stage.machine.phase is Phase.IDLE
        _assign(partition, seed=6)
        _run(clients, partition, 1, run=20)
        driver.commit(clients, partition, 20, 1)
        assert stage.committed_step == 1
