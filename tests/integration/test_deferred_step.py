"""A commit replies before its optimizer step: real stage servers on loopback, driven by
hand (``driver.run`` and ``driver.commit``), with one stage's optimizer step slowed.

The reply must not wait for the step, and nothing may read the weights before it: the
next run and an export each apply it first, exactly once. Some tests hold the
``optimizer`` thread off (``held_off``), so that only those paths can apply it. A deferred
step that fails leaves a stage without its job, which refuses to run (recovery replaces
it) and takes a new one."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from elasticpipe.client import driver
from elasticpipe.errors import ElasticPipeError, NotReady
from elasticpipe.partition import Partition, StageRef
from elasticpipe.stage_server import stage as stage_module
from elasticpipe.stage_server.protocol import Phase
from elasticpipe.stage_server.server import StageServer
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire.structure import split_batch
from tests.support.servers import unregistered_stage_servers

pytestmark = pytest.mark.timeout(120)

MODEL = "tests.support.zb_models:unreached"
ALLOW = ("tests.support",)
M = 4
CUTS = (0, 3, 7)
SLOW_STEP_S = 0.6  # the slowed optimizer step: far longer than a loopback round trip


@pytest.fixture
def servers() -> Iterator[list[StageServer]]:
    with unregistered_stage_servers(2, ALLOW) as started:
        yield started


@pytest.fixture
def held_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``optimizer`` thread never hears of a reply and waits a minute for one."""
    monkeypatch.setattr(stage_module, "REPLY_HEAD_START_S", 60.0)
    monkeypatch.setattr(stage_module.Stage, "replied", lambda self: None)


def _partition(servers: list[StageServer]) -> Partition:
    refs = tuple(StageRef(f"st-{n}", s.address) for n, s in enumerate(servers))
    return Partition(epoch=1, job_id="j", boundaries=CUTS, stages=refs)


def _assign(partition: Partition, seed: int = 5) -> None:
    job = JobConfig(model=MODEL, seed=seed, micro_batches=M, optimizer="adamw").with_id()
    for ref in partition.stages:
        with rpc.channel(ref.address) as chan:
            stage_pb2_grpc.StageServiceStub(chan).Assign(
                stage_pb2.AssignRequest(
                    job=job.to_proto(), assignment=partition.assignment(ref.stage_id).to_proto()
                ),
                timeout=30,
            )


def _run(
    clients: driver.StageClients,
    partition: Partition,
    step: int,
    run: int = 0,
    previous: Sequence[stage_pb2.StepDecision] = (),
) -> None:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)
    xs, ys, scales = split_batch(x, y, M, torch.device("cpu"))
    driver.run(
        clients,
        partition,
        run or step,
        step,
        xs,
        ys,
        scales,
        "1f1b",
        60.0,
        previous=previous,
        secret=driver.new_secret(),
    )


def _slow_steps(server: StageServer, fail: bool = False) -> list[float]:
    """Slows (or breaks) the optimizer step of ``server``'s slice; the times each ended."""
    stage = server.stage
    assert stage is not None and stage.slice is not None
    ended: list[float] = []
    timed_step = stage.slice.timed_step

    def slow(*args: Any) -> float | None:
        time.sleep(SLOW_STEP_S)
        if fail:
            raise RuntimeError("injected: the optimizer step failed")
        out = timed_step(*args)
        ended.append(time.monotonic())
        return out

    stage.slice.timed_step = slow  # type: ignore[method-assign]
    return ended


def _weights(server: StageServer) -> dict[str, torch.Tensor]:
    """The stage's layers as an export sees them (the client's ``state_dict`` path)."""
    stage = server.stage
    assert stage is not None and stage.slice is not None
    out = {}
    for index, packed in stage.export_layers(0, stage.slice.indices, False):
        for name, tensor in packed.unpack()["model"].items():
            out[f"{index}.{name}"] = tensor.clone()
    return out


@pytest.mark.parametrize("thread", ["applies", "held off"])
def test_the_reply_does_not_wait_for_the_step_and_an_export_does(
    servers: list[StageServer], thread: str, request: pytest.FixtureRequest
) -> None:
    """The commit replies before the slowed step ends; an export then returns the stepped
    weights: waiting for the thread's step, or (the thread held off) applying it itself."""
    if thread == "held off":
        request.getfixturevalue("held_off")
    partition = _partition(servers)
    _assign(partition)
    before = _weights(servers[0])
    ended = _slow_steps(servers[0])
    with contextlib.closing(driver.StageClients()) as clients:
        _run(clients, partition, 1)
        started = time.monotonic()
        driver.commit(clients, partition, 1, 1)
        replied = time.monotonic()
        assert replied - started < SLOW_STEP_S / 2, "the commit's reply waited for the step"
        if thread == "held off":
            time.sleep(SLOW_STEP_S + 0.2)
            assert ended == [], "the optimizer thread was not held off"
        after = _weights(servers[0])
    assert len(ended) == 1 and replied < ended[0] <= time.monotonic()
    assert any(not torch.equal(before[k], after[k]) for k in before), "no step was applied"


@pytest.mark.parametrize("thread", ["applies", "held off"])
def test_the_next_run_applies_the_step_first_and_exactly_once(
    servers: list[StageServer], thread: str, request: pytest.FixtureRequest
) -> None:
    """Two steps with the first stage's optimizer deferred and slow, against the same two
    steps with plain ones (a fresh job of the same seed): the same weights, bit for bit.
    With the thread held off, only the next run can apply the first step."""
    partition = _partition(servers)

    def train(slow: bool) -> tuple[dict[str, torch.Tensor], list[float]]:
        _assign(partition)
        ended = _slow_steps(servers[0]) if slow else []
        with contextlib.closing(driver.StageClients()) as clients:
            for step in (1, 2):
                run = step + (10 if slow else 0)  # (a stage takes no run id twice)
                _run(clients, partition, step, run)  # step 2's run waits for step 1's apply
                driver.commit(clients, partition, run, step)
        return _weights(servers[0]), ended

    plain, _ = train(slow=False)
    if thread == "held off":
        request.getfixturevalue("held_off")
    slowed, ended = train(slow=True)
    assert len(ended) == 2
    assert plain.keys() == slowed.keys()
    for name in plain:
        assert torch.equal(plain[name], slowed[name]), name


def test_a_deferred_step_that_fails_leaves_a_stage_that_refuses_to_run(
    servers: list[StageServer],
) -> None:
    partition = _partition(servers)
    _assign(partition)
    _slow_steps(servers[0], fail=True)
    with contextlib.closing(driver.StageClients()) as clients:
        _run(clients, partition, 1)
        driver.commit(clients, partition, 1, 1)  # the decision is recorded: it replies
        stage = servers[0].stage
        assert stage is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not stage.poisoned:
            time.sleep(0.05)
        assert "optimizer step of step 1 failed" in stage.poisoned
        with pytest.raises(NotReady, match="stage st0 has no job assigned"):
            _run(clients, partition, 2)


@pytest.mark.parametrize("decided", ["by CommitStep", "in the next RunStep"])
def test_a_step_that_fails_as_the_next_run_applies_it_leaves_no_run_behind(
    servers: list[StageServer], held_off: None, decided: str
) -> None:
    """The next RunStep applies step 1, which fails: a step CommitStep deferred, or a lost
    commit's decision that the RunStep carries. That run fails (the stage gave up its job),
    the stage is idle, not stuck in a run it never began, and it takes a new job and
    trains."""
    partition = _partition(servers)
    _assign(partition)
    _slow_steps(servers[0], fail=True)
    stage = servers[0].stage
    assert stage is not None
    with contextlib.closing(driver.StageClients()) as clients:
        _run(clients, partition, 1)
        previous = []
        if decided == "by CommitStep":
            driver.commit(clients, partition, 1, 1)
        else:
            previous = [stage_pb2.StepDecision(run=1, step=1, commit=True)]
        with pytest.raises(ElasticPipeError):  # (the RunStep's error, or the feeder's)
            _run(clients, partition, 2, previous=previous)
        assert "optimizer step of step 1 failed" in stage.poisoned
        assert stage.machine.phase is Phase.IDLE
        _assign(partition, seed=6)
        _run(clients, partition, 1, run=20)
        driver.commit(clients, partition, 20, 1)
