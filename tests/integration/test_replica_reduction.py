"""Replicas over the network: real stage servers on loopback, assigned a layout of two
replicas of different shapes by hand (as the coordinator would assign them), each
run its share of the step and reduce their gradients with the other replica's holders over
their data channels; the losses and every replica's weights equal ``LocalPipeline``'s bit
for bit, whatever the shares."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest
import torch

from elasticpipe import LocalPipeline
from elasticpipe.client import driver
from elasticpipe.errors import UserCodeError
from elasticpipe.layout import Layout
from elasticpipe.partition import Partition, StageRef
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.tracing import SpanKind
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire.structure import split_batch
from tests.support.replica_jobs import JOB, STEPS, M, batch
from tests.support.servers import assign_by_hand, unregistered_stage_servers

pytestmark = pytest.mark.timeout(120)

ALLOW = ("tests.support",)
BOUNDARIES = [(0, 3, 7), (0, 2, 5, 7)]  # replica 0: 2 stages, replica 1: 3 stages


@pytest.fixture
def servers() -> Iterator[list[StageServer]]:
    """Five stage servers that no coordinator knows (each is assigned by hand)."""
    with unregistered_stage_servers(5, ALLOW) as started:
        yield started


def _layout(servers: list[StageServer], shares: tuple[int, ...]) -> Layout:
    refs = iter(StageRef(f"st-{n}", s.address) for n, s in enumerate(servers))
    replicas = tuple(
        Partition(epoch=1, job_id="j", boundaries=cuts, stages=tuple(next(refs) for _ in cuts[1:]))
        for cuts in BOUNDARIES
    )
    return Layout(replicas, shares).validate(7, M)


def _assign(layout: Layout) -> None:
    """Assigns every stage its place in ``layout``, by hand (as the coordinator will)."""
    assign_by_hand(JobConfig(**JOB).with_id(), layout)  # type: ignore[arg-type]


def _step(
    clients: driver.StageClients, layout: Layout, step: int, run_id: int = 0
) -> list[list[stage_pb2.StepReport]]:
    """One step on every replica at once (``driver.run_replicas``); the reports by replica."""
    xs, ys, scales = split_batch(*batch(step), M, torch.device("cpu"))
    run = run_id or step
    secret = driver.new_secret()
    return driver.run_replicas(
        clients, layout, run, step, xs, ys, scales, "1f1b", 60.0, secret=secret
    )


def _train(
    servers: list[StageServer], shares: tuple[int, ...]
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    layout = _layout(servers, shares)
    _assign(layout)
    losses = []
    with contextlib.closing(driver.StageClients()) as clients:
        for step in range(1, STEPS + 1):
            reports = _step(clients, layout, step)
            for replica in layout.replicas:
                driver.commit(clients, replica, step, step)
            losses.append(sum(loss for replica in reports for loss in replica[-1].losses))
    weights = []
    by_address = {s.address: s for s in servers}
    for replica in layout.replicas:
        state = {}
        for ref in replica.stages:
            stage = by_address[ref.address].stage
            assert stage is not None
            stage.settle()  # (a commit replies before its optimizer step)
            assert stage.slice is not None
            for i in stage.slice.indices:
                for name, tensor in stage.slice.layers[i].state_dict().items():
                    state[f"{i}.{name}"] = tensor.detach().clone()
        weights.append(state)
    return losses, weights


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("shares", [(4, 4), (5, 3), (1, 7)], ids=["4:4", "5:3", "1:7"])
def test_two_replicas_reduce_over_their_data_channels_bit_for_bit(
    servers: list[StageServer], shares: tuple[int, ...]
) -> None:
    """Replicas of 2 and 3 stage servers, shares 4:4, 5:3 and 1:7 of 8 micro-batches,
    AdamW, dropout, a frozen weight and a parameter nothing reaches: the losses and both
    replicas' weights and buffers equal LocalPipeline's, bit for bit."""
    with LocalPipeline(allow=ALLOW, **JOB) as pipe:  # type: ignore[arg-type]
        want_losses = [pipe.train_step(*batch(step)) for step in range(1, STEPS + 1)]
        want = pipe.state_dict()
    losses, weights = _train(servers, shares)
    assert losses == want_losses
    for r, state in enumerate(weights):
        assert state.keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(_bits(state[key]), _bits(value)), (r, key)


def test_a_failure_in_one_replica_aborts_the_others_at_once(servers: list[StageServer]) -> None:
    """A target out of range in replica 1's share fails its last stage: the run is aborted
    on every stage of both replicas at once (replica 0's holders do not wait out the 60 s
    deadline for pieces that will not come), the error names the cause, and the next step
    trains."""
    layout = _layout(servers, (5, 3))
    _assign(layout)
    xs, ys, scales = split_batch(*batch(1), M, torch.device("cpu"))
    bad = [y.clone() for y in ys]
    bad[6][0] = 99  # replica 1 runs micro-batches 5-7
    with contextlib.closing(driver.StageClients()) as clients:
        started = time.monotonic()
        with pytest.raises(UserCodeError, match="99"):
            driver.run_replicas(
                clients, layout, 1, 1, xs, bad, scales, "1f1b", 60.0, secret=driver.new_secret()
            )
        assert time.monotonic() - started < 20.0
        reports = _step(clients, layout, 1, run_id=2)
        assert len(reports) == 2 and all(r[-1].losses for r in reports)


def test_a_group_reduces_while_the_backward_goes_on_below_it(servers: list[StageServer]) -> None:
    """Replica 1 is cut elsewhere than replica 0, so each of replica 0's stages holds two
    reduction groups: in the run's last backward the upper group's reduction starts as
    soon as its layers are done, while the backward goes on below it (before the op
    ends, in the stage's trace), and the results stay LocalPipeline's bit for bit."""
    with LocalPipeline(allow=ALLOW, **JOB) as pipe:  # type: ignore[arg-type]
        want_losses = [pipe.train_step(*batch(step)) for step in range(1, STEPS + 1)]
    losses, _ = _train(servers, (4, 4))
    assert losses == want_losses
    for server in servers[:2]:  # replica 0's
        assert server.stage is not None
        spans, _ = server.stage.tracer.last(1)
        backward_end = max(s.end_ns for s in spans if s.kind is SpanKind.BACKWARD)
        reduced = sorted((s for s in spans if s.kind is SpanKind.REDUCE), key=lambda s: s.start_ns)
        assert len(reduced) == 2, reduced
        upper, lower = reduced
        assert upper.layer_lo > lower.layer_lo, (upper, lower)
        assert upper.start_ns < backward_end, (upper.start_ns, backward_end)
