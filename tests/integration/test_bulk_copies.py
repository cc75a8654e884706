"""Snapshot copies over the bulk channel (``transport.bulk_layers``, kind ``COPY``), to a
real in-process stage: a copy is kept exact under its sealed digest, received at the lowest
CPU priority on a connection that ends with it, and never touches gRPC; every check of
``PushSnapshot`` refuses what it refuses there, with its error, and the stage survives
each; a stage of an earlier release (which closes the unknown kind) gets the copy over
gRPC. (``test_snapshot_push.py``: the gRPC path.)"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from elasticpipe.errors import InvalidRequest, NotReady, TransferError
from elasticpipe.partition import Placement, StageRef
from elasticpipe.stage_server import bulk as stage_bulk
from elasticpipe.stage_server import snapshots, transfers
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.snapshots import Capture
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import bulk, bulk_layers, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import PackedLayer
from tests.support.bulk_stage import refused

pytestmark = pytest.mark.timeout(60)

EPOCH, STEP, SOURCE = 3, 6, "st-source"
JOB = JobConfig(
    model="mlp", model_kwargs={"sizes": [4, 8, 4]}, optimizer="sgd", optimizer_kwargs={"lr": 0.1}
)


@pytest.fixture
def keeper() -> Iterator[StageServer]:
    """A stage owning layers [1, 3) of a 2-stage chain whose first stage, ``SOURCE``, owns
    layer 0 (a Linear): the stage that keeps ``SOURCE``'s snapshot copies."""
    with StageServer(StageConfig(name="keeper"), "127.0.0.1:1") as server:
        chain = (StageRef(SOURCE, "127.0.0.1:9"), StageRef(server.stage.stage_id, server.address))
        placement = Placement(
            epoch=EPOCH,
            index=1,
            num_stages=2,
            lo=1,
            hi=3,
            chain=chain,
            names=("source", "keeper"),
            ranges=((0, 1), (1, 3)),
        )
        with rpc.channel(server.address) as chan:
            stage_pb2_grpc.StageServiceStub(chan).Assign(
                stage_pb2.AssignRequest(job=JOB.to_proto(), assignment=placement.to_proto()),
                timeout=30,
            )
        yield server


def _layer0() -> PackedLayer:
    gen = torch.Generator().manual_seed(5)
    state = {
        "index": 0,
        "model": {"weight": torch.randn(8, 4, generator=gen), "bias": torch.ones(8)},
    }
    return layer_state.seal(layer_state.pack(state))


def _open(server: StageServer) -> Any:
    pool = rpc.StagePool()
    return bulk.connect(pool.stub(server.address), server.address, None, time.monotonic() + 10)


def _first(source: str = SOURCE, job_id: str = JOB.job_id) -> stage_pb2.SnapshotChunk:
    return stage_pb2.SnapshotChunk(job_id=job_id, step=STEP, source=source)


def test_a_copy_over_the_bulk_channel_is_kept_exact_at_low_priority(
    keeper: StageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The push goes over the bulk channel only (its gRPC path would fail the test), the
    stage keeps the layer's bytes under its digest; the bytes are received on a thread at
    the lowest priority, and kept (under the stage's lock, where a deferred optimizer step
    may run) at the connection thread's own."""
    packed = _layer0()
    stage = keeper.stage
    priorities: dict[str, list[int]] = {"received": [], "kept": []}

    def priority() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    keep, allocate = stage.keep_copy, layer_state.Destination.allocate

    def keep_copy(*args: Any) -> None:
        priorities["kept"].append(priority())
        keep(*args)

    def allocated(self: Any, *args: Any) -> torch.Tensor:
        priorities["received"].append(priority())
        return allocate(self, *args)

    monkeypatch.setattr(stage, "keep_copy", keep_copy)
    monkeypatch.setattr(layer_state.Destination, "allocate", allocated)
    pool = rpc.StagePool()

    def no_grpc(*args: Any) -> Any:
        raise AssertionError("the copy went over gRPC")

    monkeypatch.setattr(pool, "encoded", no_grpc)
    capture = Capture(job_id=JOB.job_id, step=STEP, source=SOURCE, states={}, peer="", generation=0)
    assert transfers.push_snapshot(pool, keeper.address, capture, [(0, packed)], 30, 1 << 20)
    kept = stage.snapshots.get(JOB.job_id, STEP, 0)
    assert kept is not None and kept.digest == packed.digest
    for got, want in zip(kept.tensors, packed.tensors, strict=True):
        assert torch.equal(got, want)
    assert set(priorities["received"]) == {snapshots.SNAPSHOT_NICE}
    assert priorities["kept"] == [os.getpriority(os.PRIO_PROCESS, 0)]  # the process's own


def test_a_bulk_copy_is_refused_as_push_snapshot_is_and_the_stage_survives(
    keeper: StageServer,
) -> None:
    """A malformed first message, another job, a source outside the chain, a layer the
    source does not own, one sent twice and one whose digest does not match: each is
    refused with ``PushSnapshot``'s error, ends its stream, and keeps nothing."""
    packed = _layer0()
    deadline = time.monotonic() + 10
    invalid = keeper.stage.metrics.rpc_errors.labels(
        method="StageService/PushSnapshot", code="INVALID_ARGUMENT"
    )
    counted = invalid._value.get()

    def begin(first: bytes, count: int = 1) -> Any:
        sock = _open(keeper)
        sock.sendall(bulk.FRAME.pack(len(first), bulk_layers.COPY, count) + first)
        return sock

    sock = begin(b"\xff\xff\xff")
    assert sock.recv(1) == bulk.ERR
    refused(sock, InvalidRequest, "malformed bulk snapshot copy header")

    sock = begin(stage_pb2.SnapshotChunk(job_id=JOB.job_id, step=STEP).SerializeToString())
    assert sock.recv(1) == bulk.ERR
    refused(sock, InvalidRequest, "must start with its job, step and source")

    sock = begin(_first(job_id="another").SerializeToString())
    assert sock.recv(1) == bulk.ERR
    refused(sock, NotReady, "but this stage runs")

    sock = begin(_first(source="st-stranger").SerializeToString())
    assert sock.recv(1) == bulk.ERR
    refused(sock, NotReady, "not in the chain")

    sock = begin(_first().SerializeToString())
    assert sock.recv(1) == bulk.GO
    sock.sendall(bulk_layers.header_frame(1, packed))  # layer 1: the keeper's own
    assert sock.recv(1) == bulk.ERR
    refused(sock, InvalidRequest, "outside the layers it owns")

    sock = begin(_first().SerializeToString())
    assert sock.recv(1) == bulk.GO
    sock.sendall(bulk_layers.header_frame(0, packed))
    assert sock.recv(1) == bulk.GO
    for tensor in packed.tensors:
        sock.sendall(layer_state.bytes_of(tensor))
    sock.sendall(bytes(bulk_layers.DIGEST_BYTES))  # not the layer's digest
    assert sock.recv(1) == bulk.ERR
    refused(sock, TransferError, "digest mismatch")

    sock = _open(keeper)
    with pytest.raises(InvalidRequest, match="sent twice"):
        bulk_layers.send_copy(sock, "keeper", _first(), [(0, packed), (0, packed)], deadline)
    sock.close()

    assert keeper.stage.snapshots.get(JOB.job_id, STEP, 0) is None
    # counted as gRPC counts PushSnapshot's refusals: four of them were invalid requests
    assert invalid._value.get() == counted + 4
    sock = _open(keeper)
    bulk_layers.send_copy(sock, "keeper", _first(), [(0, packed)], deadline)
    assert sock.recv(1) == b""  # a copy is its connection's last message
    sock.close()
    assert keeper.stage.snapshots.get(JOB.job_id, STEP, 0) is not None


def test_a_stage_that_closes_the_unknown_kind_gets_the_copy_over_grpc(
    keeper: StageServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stage of an earlier release closes a ``COPY`` stream unanswered: the push then
    goes over gRPC, and the copy is kept all the same."""
    take = stage_bulk.BulkListener._take_layers

    def earlier_release(self: Any, conn: Any, kind: bytes, *args: Any) -> bool:
        if kind == bulk_layers.COPY:
            raise InvalidRequest(f"bulk message of unknown kind {kind!r}")  # closes, unanswered
        return take(self, conn, kind, *args)

    monkeypatch.setattr(stage_bulk.BulkListener, "_take_layers", earlier_release)
    packed = _layer0()
    pool = rpc.StagePool()
    encoded: list[str] = []
    grpc_push = pool.encoded

    def counted(address: str, method: str) -> Any:
        encoded.append(method)
        return grpc_push(address, method)

    monkeypatch.setattr(pool, "encoded", counted)
    capture = Capture(job_id=JOB.job_id, step=STEP, source=SOURCE, states={}, peer="", generation=0)
    assert transfers.push_snapshot(pool, keeper.address, capture, [(0, packed)], 30, 1 << 20)
    assert encoded == ["PushSnapshot"]
    kept = keeper.stage.snapshots.get(JOB.job_id, STEP, 0)
    assert kept is not None and kept.digest == packed.digest
