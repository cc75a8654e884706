"""A stage's optimizer step, after CommitStep's reply: real stage servers on loopback,
driven by hand (``driver.run`` and ``driver.commit``), one stage's optimizer step held
back or broken.

CommitStep replies once the stage holds the decision; the optimizer step runs after, and
nothing the stage does next sees the state before it (``stage_server.deferral``). A step
that fails makes the stage give up its job (its layers are no step's any more; recovery
restores them), whether it ran after CommitStep or in the next RunStep, carrying a lost
commit's decision. Either way it is left idle, not in a run it never began, and takes a
new job."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from elasticpipe.client import driver
from elasticpipe.errors import ElasticPipeError
from elasticpipe.partition import Partition, StageRef
from elasticpipe.stage_server.protocol import Phase
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.tracing import SpanKind
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


def test_commit_replies_before_the_optimizer_step_and_the_next_run_waits_for_it(
    servers: list[StageServer],
) -> None:
    """CommitStep returns while stage 0's optimizer step is held back; the next run's
    first forward on that stage starts only after the step ends, and the step counts."""
    partition = _partition(servers)
    _assign(partition)
    stage = servers[0].stage
    assert stage is not None and stage.slice is not None
    release, stepping = threading.Event(), threading.Event()
    original = stage.slice.timed_step

    def held(*args: Any) -> float | None:
        stepping.set()
        assert release.wait(30), "the test never released the optimizer step"
        return original(*args)

    stage.slice.timed_step = held  # type: ignore[method-assign]
    with contextlib.closing(driver.StageClients()) as clients:
        try:
            _run(clients, partition, 1)
            driver.commit(clients, partition, 1, 1)  # returns: the step is decided, not applied
            assert not release.is_set()
            assert stepping.wait(10), "the optimizer step never began"
            assert stage.committed_step == 1
            nxt = threading.Thread(target=_run, args=(clients, partition, 2))
            nxt.start()
            nxt.join(0.5)
            assert nxt.is_alive()  # its ops wait for the optimizer step
        finally:
            release.set()  # (a failed assertion must not leave the stage's lock held)
        nxt.join(60)
        assert not nxt.is_alive()
        driver.commit(clients, partition, 2, 2)
    spans, _ = stage.tracer.last(4)
    step_1 = [s for s in spans if s.kind is SpanKind.COMMIT and s.step == 1]
    forwards_2 = [s for s in spans if s.kind is SpanKind.FORWARD and s.step == 2]
    assert len(step_1) == 1 and forwards_2
    assert min(s.start_ns for s in forwards_2) >= step_1[0].end_ns
