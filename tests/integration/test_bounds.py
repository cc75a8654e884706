"""Every numeric field is bounded: out-of-range heartbeats, steps, runs, epochs and client
generations get INVALID_ARGUMENT naming field, value and bound, and change nothing."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest
import torch

from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.security import bounds
from elasticpipe.stage_server.server import StageServer
from elasticpipe.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    stage_pb2,
    stage_pb2_grpc,
)
from tests.support import jobs

pytestmark = pytest.mark.timeout(120)
NAN, INF = math.nan, math.inf
Job = tuple[
    coordinator_pb2_grpc.CoordinatorServiceStub, StageServer
]  # a coordinator stub, a stage of the job


@pytest.fixture
def job(coordinator_server: CoordinatorServer, stage_servers: list[StageServer]) -> Iterator[Job]:
    """A coordinator stub and a stage of a job that ran one step."""
    with jobs.mlp(coordinator_server.address, sizes=[4, 4, 4]) as pipe:
        pipe.train_step(torch.randn(2, 4), torch.randint(0, 4, (2,)))
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(
            grpc.insecure_channel(coordinator_server.address)
        )
        stage = next(s for s in stage_servers if s.address == pipe.partition.addresses[0])
        yield stub, stage


def _timing(**fields: float) -> stage_pb2.LayerTiming:
    return stage_pb2.LayerTiming(layer=0, **fields)  # type: ignore[arg-type]


HEARTBEATS = [
    ({"timings": [_timing(forward_s=NAN)]}, "timings[0].forward_s", "nan"),
    ({"timings": [_timing(backward_s=-1.0)]}, "timings[0].backward_s", "-1.0"),
    ({"timings": [_timing(forward_s=INF)]}, "timings[0].forward_s", "inf"),
    ({"timings": [_timing(output_bytes=2**63)]}, "timings[0].output_bytes", str(2**63)),
    ({"timings": [_timing(samples=2**60)]}, "timings[0].samples", str(2**60)),
    (
        {"timings": [_timing(forward_s=1.0)] * (bounds.MAX_LAYERS + 1)},
        "timings holds",
        str(bounds.MAX_LAYERS + 1),
    ),
    ({"committed_step": 2**64 - 1}, "committed_step", str(2**64 - 1)),
    ({"slowdown": NAN}, "slowdown", "nan"),
    ({"slowdown": -5.0}, "slowdown", "-5.0"),
    ({"slowdown": 0.5}, "slowdown", "0.5"),
    ({"epoch": 2**40}, "epoch", str(2**40)),
    ({"reduce_bytes_per_s": NAN}, "reduce_bytes_per_s", "nan"),
    ({"reduce_bytes_per_s": -1.0}, "reduce_bytes_per_s", "-1.0"),
]


@pytest.mark.parametrize(("fields", "field", "value"), HEARTBEATS)
def test_heartbeat_fields_out_of_bounds_are_refused(
    job: Job,
    fields: dict[str, object],
    field: str,
    value: str,
) -> None:
    """A heartbeat with a NaN, negative, infinite or huge figure, too many timings or a
    slowdown outside [1, 1000] is refused naming the field and the value, and the stage's
    recorded figures are not the refused ones."""
    stub, stage = job
    before = stub.Status(coordinator_pb2.StatusRequest(), timeout=10)
    request = coordinator_pb2.HeartbeatRequest(stage_id=stage.stage_id, **fields)  # type: ignore[arg-type]
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(request, timeout=20)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details() and value in info.value.details()
    after = stub.Status(coordinator_pb2.StatusRequest(), timeout=10)
    mine = next(s for s in after.stages if s.stage_id == stage.stage_id)
    was = next(s for s in before.stages if s.stage_id == stage.stage_id)
    assert mine.slowdown == was.slowdown
    assert mine.committed_step <= 1  # the step the job ran, never the refused figure


def test_a_well_formed_heartbeat_still_passes(
    job: Job,
) -> None:
    """Figures inside their bounds (and an unreported slowdown of 0) are accepted."""
    stub, stage = job
    reply = stub.Heartbeat(
        coordinator_pb2.HeartbeatRequest(
            stage_id=stage.stage_id, epoch=1, timings=[_timing(forward_s=0.01)], slowdown=0.0
        ),
        timeout=10,
    )
    assert not reply.dead


COORDINATOR_CALLS = [
    ("ResolveRun", coordinator_pb2.ResolveRunRequest(run=2**64 - 1), "run"),
    ("ResolveRun", coordinator_pb2.ResolveRunRequest(step=2**60), "step"),
    ("EpochOutcome", coordinator_pb2.EpochOutcomeRequest(epoch=2**63), "epoch"),
    ("EndRestore", coordinator_pb2.RestoreEndRequest(epoch=2**50), "epoch"),
    ("EndRestore", coordinator_pb2.RestoreEndRequest(step=2**60), "step"),
    ("RenewLease", coordinator_pb2.LeaseRequest(client=2**60), "client"),
    (
        "RenewLease",
        coordinator_pb2.LeaseRequest(loop_pauses=[coordinator_pb2.LoopPause(epoch=2**60)]),
        "loop_pauses[0].epoch",
    ),
    (
        "RenewLease",
        coordinator_pb2.LeaseRequest(loop_pauses=[coordinator_pb2.LoopPause(pause_s=-1.0)]),
        "loop_pauses[0].pause_s",
    ),
    ("BeginRestore", coordinator_pb2.RestoreBeginRequest(client=2**60), "client"),
    ("ProfileJob", coordinator_pb2.ProfileJobRequest(client=2**60), "client"),
]


@pytest.mark.parametrize(("method", "request_", "field"), COORDINATOR_CALLS)
def test_coordinator_steps_runs_epochs_and_clients_are_bounded(
    job: Job, method: str, request_: object, field: str
) -> None:
    """Steps, runs, epochs and client generations past their bounds are refused naming
    the field and the bound."""
    stub, _ = job
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, method)(request_, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field} must be in [0, ")


@pytest.mark.timeout(60)
def test_a_lease_renewal_carries_at_most_16_loop_pauses(job: Job) -> None:
    """More loop pauses than a client ever keeps are refused naming the field (the
    unknown epochs, jobs and abandoned rows the store leaves alone: test_store)."""
    stub, _ = job
    many = [coordinator_pb2.LoopPause(epoch=e, pause_s=0.1) for e in range(17)]
    with pytest.raises(grpc.RpcError) as info:
        stub.RenewLease(coordinator_pb2.LeaseRequest(loop_pauses=many), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "loop_pauses" in info.value.details()


STAGE_CALLS = [
    ("CommitStep", stage_pb2.CommitStepRequest(epoch=2**50), "epoch"),
    ("CommitStep", stage_pb2.CommitStepRequest(run=2**64 - 1), "run"),
    ("CommitStep", stage_pb2.CommitStepRequest(step=2**60), "step"),
    ("FetchOutput", stage_pb2.FetchOutputRequest(micro_batch=5000), "micro_batch"),
    ("ExportLayers", stage_pb2.ExportLayersRequest(snapshot_step=2**60), "snapshot_step"),
    ("Profile", stage_pb2.ProfileRequest(repeats=0), "repeats"),
]


@pytest.mark.parametrize(("method", "request_", "field"), STAGE_CALLS)
def test_stage_steps_runs_epochs_and_micro_batches_are_bounded(
    job: Job, method: str, request_: object, field: str
) -> None:
    """A stage refuses out-of-range steps, runs, epochs, micro-batch indices and profile
    repeats (repeats before it decodes the sample) naming the field."""
    _, stage = job
    stub = stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(stage.address))
    with pytest.raises(grpc.RpcError) as info:
        result = getattr(stub, method)(request_, timeout=10)
        list(result) if not hasattr(result, "ByteSize") else result
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(f"{field} must be in ")
