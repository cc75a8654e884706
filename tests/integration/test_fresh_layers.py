"""The empty layers a job whose weights are external starts with: a rollback that builds
them anew (``PrepareEpochRequest.fresh``), only for step 0 of such a job never loaded, whose
layers are empty and so never snapshotted (``tests/integration/test_recovery_regressions.py``
has the recovery that sends it); and its ``init_state`` load, written straight into them.
One in-process stage, spoken to over gRPC and its bulk channel as the coordinator and the
client would."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import grpc
import pytest
import torch

from elasticpipe.partition import Placement
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import bulk, bulk_layers, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import layer_state

pytestmark = pytest.mark.timeout(60)

EPOCH = 3


def _placement(epoch: int) -> stage_pb2.Assignment:
    """Layers [0, 2) of a 2-stage chain at ``epoch``."""
    return Placement(epoch=epoch, index=0, num_stages=2, lo=0, hi=2).to_proto()


@contextmanager
def _server(job: JobConfig) -> Iterator[tuple[StageServer, stage_pb2_grpc.StageServiceStub]]:
    """A stage assigned layers [0, 2) of ``job`` (an MLP: a Linear and a ReLU) at ``EPOCH``,
    and a stub to it."""
    with (
        StageServer(StageConfig(name="fresh-test"), "127.0.0.1:1") as server,
        rpc.channel(server.address) as chan,
    ):
        stub = stage_pb2_grpc.StageServiceStub(chan)
        stub.Assign(
            stage_pb2.AssignRequest(job=job.to_proto(), assignment=_placement(EPOCH)),
            timeout=30,
        )
        yield server, stub


@contextmanager
def _stage(job: JobConfig) -> Iterator[stage_pb2_grpc.StageServiceStub]:
    """``_server``'s stub."""
    with _server(job) as (_, stub):
        yield stub


def _load(stub: stage_pb2_grpc.StageServiceStub, job: JobConfig, epoch: int, value: float) -> None:
    """Streams layers [0, 2) with every weight ``value`` over the stage's bulk channel, as a
    client's load of ``epoch`` does, and prepares the epoch (not committed)."""
    stub.Freeze(stage_pb2.EpochRequest(epoch=epoch, lease_s=60), timeout=10)
    layers = {
        0: layer_state.pack(
            {"index": 0, "model": {"weight": torch.full((4, 4), value), "bias": torch.ones(4)}}
        ),
        1: layer_state.pack({"index": 1, "model": {}}),
    }
    deadline = time.monotonic() + 10
    with bulk.connect(stub, "127.0.0.1:1", None, deadline) as sock:
        answer = bulk_layers.send_layers(
            sock,
            "stage",
            stage_pb2.RestoreChunk(epoch=epoch),
            [0, 1],
            layers.get,
            threading.Event(),
            deadline,
        )
    assert answer is not None and sorted(answer.layers) == [0, 1]
    _prepare(stub, job, epoch, restored_by_client=True)


def _prepare(
    stub: stage_pb2_grpc.StageServiceStub, job: JobConfig, epoch: int, **fields: Any
) -> None:
    """``PrepareEpoch`` of ``epoch`` with ``fields`` (the coordinator froze the stage)."""
    request = stage_pb2.PrepareEpochRequest(
        epoch=epoch,
        assignment=_placement(epoch),
        job=job.to_proto(),
        timeout_s=30,
        lease_s=60,
        **fields,
    )
    stub.PrepareEpoch(request, timeout=30)


def _prepare_fresh(
    stub: stage_pb2_grpc.StageServiceStub,
    job: JobConfig,
    step: int,
    rollback: bool = True,
    epoch: int = EPOCH + 1,
) -> None:
    stub.Freeze(stage_pb2.EpochRequest(epoch=epoch, lease_s=60), timeout=10)
    _prepare(stub, job, epoch, committed_step=step, rollback=rollback, fresh=True)


def _job(external: bool) -> JobConfig:
    return JobConfig(
        model="mlp",
        model_kwargs={"sizes": [4, 4, 4]},
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.1},
        external_weights=external,
    )


@pytest.mark.parametrize(
    "external, step, rollback", [(False, 0, True), (True, 2, True), (True, 0, False)]
)
def test_fresh_layers_are_refused_where_a_snapshot_must_be_restored(
    external: bool, step: int, rollback: bool
) -> None:
    """A job drawn from its seed, a rollback past step 0, or a move (no rollback) has state
    to keep: building its layers anew would lose it, so the stage refuses, naming why, and
    keeps its epoch."""
    job = _job(external)
    with _stage(job) as stub:
        with pytest.raises(grpc.RpcError) as refused:
            _prepare_fresh(stub, job, step, rollback)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "built anew only at a rollback to step 0" in str(refused.value.details())
        assert stub.GetStats(stage_pb2.StatsRequest(), timeout=10).epoch == EPOCH


def test_fresh_layers_of_a_job_awaiting_its_init_state_commit() -> None:
    """Step 0 of an init_state job: the layers are built as Assign builds them, and the
    epoch commits with the stage owning them."""
    job = _job(external=True)
    with _stage(job) as stub:
        _prepare_fresh(stub, job, 0)
        stub.CommitEpoch(stage_pb2.EpochRequest(epoch=EPOCH + 1), timeout=10)
        stats = stub.GetStats(stage_pb2.StatsRequest(), timeout=10)
        assert (stats.epoch, stats.layer_lo, stats.layer_hi) == (EPOCH + 1, 0, 2)


def test_fresh_layers_are_refused_once_the_init_state_loaded() -> None:
    """A stage whose load of the job's init_state committed (step 0 still) refuses to build
    its layers anew: they hold the weights the client streamed."""
    job = _job(external=True)
    with _stage(job) as stub:
        _load(stub, job, EPOCH + 1, 1.0)
        stub.CommitEpoch(stage_pb2.EpochRequest(epoch=EPOCH + 1), timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            _prepare_fresh(stub, job, 0, epoch=EPOCH + 2)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "loaded the job's init_state" in str(refused.value.details())


def test_an_init_state_load_writes_into_the_empty_layers_and_a_later_load_stages_its_own() -> None:
    """The load of a job awaiting its init_state streams the weights straight into the empty
    layers in use (their memory, mapped at Assign: no second copy of the weights). Once
    loaded, a load (a checkpoint) goes into layers of its own until its epoch commits, so
    that one that fails leaves the weights in use as they were."""
    job = _job(external=True)
    with _server(job) as (server, stub):
        assert server.stage.slice is not None
        empty = server.stage.slice.layers[0].weight
        _load(stub, job, EPOCH + 1, 2.0)
        assert torch.equal(empty, torch.full((4, 4), 2.0))  # written where it lies
        stub.CommitEpoch(stage_pb2.EpochRequest(epoch=EPOCH + 1), timeout=10)
        live = server.stage.slice.layers[0].weight
        assert live.data_ptr() == empty.data_ptr()

        _load(stub, job, EPOCH + 2, 3.0)
        assert torch.equal(live, torch.full((4, 4), 2.0))  # staged apart: in use unchanged
        stub.CommitEpoch(stage_pb2.EpochRequest(epoch=EPOCH + 2), timeout=10)
        loaded = server.stage.slice.layers[0].weight
        assert loaded.data_ptr() != live.data_ptr()
        assert torch.equal(loaded, torch.full((4, 4), 3.0))


def test_a_failed_init_state_load_leaves_the_next_load_to_layers_of_its_own() -> None:
    """Only the first load writes into the empty layers: once it is abandoned (its
    writer may still be at it), the next load stages layers apart, and its commit
    installs them."""
    job = _job(external=True)
    with _server(job) as (server, stub):
        assert server.stage.slice is not None
        first = server.stage.slice.layers[0].weight
        _load(stub, job, EPOCH + 1, 2.0)
        stub.AbortEpoch(stage_pb2.EpochRequest(epoch=EPOCH + 1), timeout=10)
        _load(stub, job, EPOCH + 2, 3.0)
        assert torch.equal(first, torch.full((4, 4), 2.0))  # the first load's, untouched
        stub.CommitEpoch(stage_pb2.EpochRequest(epoch=EPOCH + 2), timeout=10)
        loaded = server.stage.slice.layers[0].weight
        assert loaded.data_ptr() != first.data_ptr()
        assert torch.equal(loaded, torch.full((4, 4), 3.0))


def test_layers_a_stage_took_over_by_a_move_at_step_0_are_not_taken_for_empty() -> None:
    """A stage that joins after the init_state load, taking the loaded layers over by a
    move while the job is still at step 0, holds weights: a later load that is abandoned
    leaves them as they were."""
    job = _job(external=True)
    with _server(job) as (holder, stub):
        _load(stub, job, EPOCH + 1, 2.0)
        stub.CommitEpoch(stage_pb2.EpochRequest(epoch=EPOCH + 1), timeout=10)
        with (
            StageServer(StageConfig(name="spare"), "127.0.0.1:1") as spare,
            rpc.channel(spare.address) as chan,
        ):
            to_spare = stage_pb2_grpc.StageServiceStub(chan)
            moved = EPOCH + 2
            to_spare.Freeze(stage_pb2.EpochRequest(epoch=moved, lease_s=60), timeout=10)
            sources = [stage_pb2.LayerSource(layer=i, address=holder.address) for i in (0, 1)]
            _prepare(to_spare, job, moved, source_epoch=EPOCH + 1, incoming=sources)
            to_spare.CommitEpoch(stage_pb2.EpochRequest(epoch=moved), timeout=10)
            assert spare.stage.slice is not None
            weight = spare.stage.slice.layers[0].weight
            assert torch.equal(weight, torch.full((4, 4), 2.0))
            _load(to_spare, job, moved + 1, 3.0)
            to_spare.AbortEpoch(stage_pb2.EpochRequest(epoch=moved + 1), timeout=10)
            assert spare.stage.slice.layers[0].weight is weight
            assert torch.equal(weight, torch.full((4, 4), 2.0))
