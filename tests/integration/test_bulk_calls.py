"""A step's RunSteps and commit on the bulk channel (``transport.bulk_calls``): the client
calls there when the stages have one, trains exactly as over gRPC (and over gRPC against
stages without one), and a stage answers a bad or refused call with the error gRPC would
give, its connection still of use."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
import torch

from elasticpipe.client import driver
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.server import StageServer
from elasticpipe.transport import bulk, bulk_calls, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support import bulk_stage, clusters, jobs
from tests.support.bulk_stage import connect_bulk, open_bulk

stage = bulk_stage.stage  # the fixture: one in-process stage holding a job

pytestmark = pytest.mark.timeout(120)

KWARGS = {"sizes": [8, 12, 12, 4]}
STEPS = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with clusters.quiet(2) as c:
        yield c


def _train(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch, bulk_calls_on: bool = True
) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    """Trains a fresh job, its RunSteps and commits on the bulk channel or (``bulk_calls_on``
    False: as to a stage without one) over gRPC; the losses, the weights, and the calls the
    client made: ``RunStep`` gRPC futures, gRPC fan-outs by method, bulk RunSteps."""
    called: list[str] = []
    each, stub_of, start_call = (
        driver.StageClients.each,
        driver.StageClients.stub,
        driver.StageClients.start_call,
    )

    def counted(self: driver.StageClients, pairs: Any, method: str, timeout: float) -> Any:
        called.append(method)
        return each(self, pairs, method, timeout)

    def stub(self: driver.StageClients, address: str) -> Any:
        real = stub_of(self, address)

        class Counted:
            def __getattr__(self, name: str) -> Any:
                if name == "RunStep":
                    called.append("RunStep")
                return getattr(real, name)

        return Counted()

    def started(self: driver.StageClients, *args: Any) -> Any:
        caller = start_call(self, *args)
        if caller is not None:
            called.append("bulk RunStep")
        return caller

    with monkeypatch.context() as patch:
        patch.setattr(driver.StageClients, "each", counted)
        patch.setattr(driver.StageClients, "start_call", started)
        patch.setattr(driver.StageClients, "stub", stub)
        if not bulk_calls_on:
            patch.setattr(bulk_calls.BulkCaller, "start", lambda *_: False)
        with jobs.mlp(
            cluster.coordinator, **KWARGS, optimizer="adam", micro_batches=2, stages=2
        ) as pipe:
            losses = [pipe.train_step(x, y) for x, y in jobs.mlp_batches(STEPS)]
            return losses, pipe.state_dict(), called


def _same(a: tuple[list[float], dict[str, torch.Tensor], list[str]], b: Any) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], v) for k, v in b[1].items())


def test_run_steps_and_commits_travel_on_the_bulk_channel_and_train_as_over_grpc(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_bulk = _train(cluster, monkeypatch)
    on_grpc = _train(cluster, monkeypatch, bulk_calls_on=False)
    assert "CommitStep" not in on_bulk[2] and "RunStep" not in on_bulk[2], on_bulk[2]
    assert on_bulk[2].count("bulk RunStep") == 2 * STEPS
    assert on_grpc[2].count("CommitStep") == STEPS  # the same client code, over gRPC
    assert on_grpc[2].count("RunStep") == 2 * STEPS and "bulk RunStep" not in on_grpc[2]
    _same(on_bulk, on_grpc)


def test_stages_without_a_bulk_channel_are_called_over_grpc(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Against stages started with ``--no-bulk`` (``OpenBulk`` answers no port) every call
    goes over gRPC, and trains alike."""
    with clusters.quiet(2, stage_args=["--no-bulk"]) as no_bulk:
        on_grpc = _train(no_bulk, monkeypatch)
    assert on_grpc[2].count("RunStep") == 2 * STEPS and "bulk RunStep" not in on_grpc[2]
    assert on_grpc[2].count("CommitStep") == STEPS
    _same(_train(cluster, monkeypatch), on_grpc)


def _call(sock: Any, body: bytes) -> bytes:
    sock.sendall(bulk.FRAME.pack(len(body), bulk_calls.COMMIT, 0) + body)
    return bulk.recv_bytes(sock, 1, time.monotonic() + 10)


def _over_grpc_then_bulk(
    stage: StageServer, method: str, request: Any
) -> tuple[Exception, socket.socket]:
    """The error ``method`` gets over gRPC for ``request``, and a bulk connection to the
    stage past its handshake."""
    with rpc.channel(stage.address) as chan:
        stub = stage_pb2_grpc.StageServiceStub(chan)
        with pytest.raises(grpc.RpcError) as over_grpc:
            getattr(stub, method)(request, timeout=10)
        sock = connect_bulk(*open_bulk(stub))
    assert sock.recv(1) == bulk.OK
    return rpc.translate(over_grpc.value, stage.address), sock


def test_a_bad_commit_gets_grpcs_error_and_the_connection_goes_on(stage: StageServer) -> None:
    """Malformed bytes are ``InvalidRequest`` naming the message; a commit of a run the
    stage never ran gets the error gRPC's ``CommitStep`` gives, on the same connection."""
    request = stage_pb2.CommitStepRequest(epoch=bulk_stage.EPOCH, run=5, step=1)
    expected, sock = _over_grpc_then_bulk(stage, "CommitStep", request)
    with sock:
        assert _call(sock, b"\xff\xff\xff") == bulk.ERR
        error = bulk.read_error(sock, stage.address)
        assert isinstance(error, InvalidRequest), error
        assert "malformed CommitStep request" in str(error)
        assert _call(sock, request.SerializeToString()) == bulk.ERR
        error = bulk.read_error(sock, stage.address)
        assert type(error) is type(expected), (error, expected)
        assert str(expected).split(" (")[0] in str(error), (error, expected)


def test_a_refused_run_step_gets_grpcs_error_and_a_bad_frame_closes(stage: StageServer) -> None:
    """A RunStep of a stale epoch is refused on the bulk channel with gRPC's error kind
    (counted as gRPC counts it), the connection still of use; a call frame announcing
    payload bytes is malformed and closes the connection."""
    request = stage_pb2.RunStepRequest(
        epoch=bulk_stage.EPOCH - 1,
        run=1,
        step=1,
        micro_batches=1,
        mode=stage_pb2.INFER,
        timeout_s=5,
        secret=bytes(range(16)),
    )
    expected, sock = _over_grpc_then_bulk(stage, "RunStep", request)
    errors = stage.stage.metrics.rpc_errors.labels(
        method="StageService/RunStep", code="FAILED_PRECONDITION"
    )
    counted = errors._value.get()
    body = request.SerializeToString()
    with sock:
        for _ in range(2):  # the same connection answers again
            sock.sendall(bulk.FRAME.pack(len(body), bulk_calls.RUN, 0) + body)
            assert bulk.recv_bytes(sock, 1, time.monotonic() + 10) == bulk.ERR
            error = bulk.read_error(sock, stage.address)
            assert type(error) is type(expected) and "epoch" in str(error), (error, expected)
        assert errors._value.get() == counted + 2
        sock.sendall(bulk.FRAME.pack(len(body), bulk_calls.RUN, 1) + body)
        try:
            answered = sock.recv(1)
        except ConnectionResetError:  # (closed with the body unread)
            answered = b""
        assert answered == b"", answered  # closed, nothing answered
