"""A load's layers over the bulk channel (``elasticpipe.transport.bulk_layers``): the same
weights as over gRPC, refused as ``RestoreLayers`` refuses, and no stream a peer can send
takes the stage down or stages a layer that did not arrive whole."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from elasticpipe.client import streaming
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import InvalidRequest, NotReady, PermissionDenied, TransferError
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.models.contract import build
from elasticpipe.security import authz
from elasticpipe.stage_server.server import StageServer
from elasticpipe.transport import bulk, bulk_layers, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import layer_state
from tests.support import bulk_stage
from tests.support.bulk_stage import EPOCH, connect_bulk, open_bulk, refused

stage = bulk_stage.stage  # the fixture: one in-process stage owning layer 1 (a ReLU)

pytestmark = pytest.mark.timeout(120)

MLP = {"sizes": [16, 32, 32, 4]}


def _train(cluster: LocalCluster, init: dict[str, torch.Tensor]) -> tuple[list[float], Any]:
    g = torch.Generator().manual_seed(5)
    with Pipeline(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs=MLP,
        optimizer="adam",
        optimizer_kwargs={"lr": 1e-2},
        micro_batches=2,
        stages=2,
        init_state=init,
    ) as pipe:
        losses = [
            pipe.train_step(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(2)
        ]
        return losses, pipe.state_dict()


def test_init_state_over_the_bulk_channel_equals_it_over_grpc(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same job from the same init_state, streamed over each stage's bulk channel and
    then over gRPC (as to stages without one): the same losses and weights, bit for bit,
    and the first went over the bulk channel to both stages."""
    init = build("mlp", seed=9, **MLP).state_dict()
    streams: list[str] = []
    send_layers = bulk_layers.send_layers

    def counted(sock: Any, address: str, *args: Any) -> Any:
        streams.append(address)
        return send_layers(sock, address, *args)

    with LocalCluster(stages=2, auto_rebalance=False) as cluster:
        monkeypatch.setattr(streaming.bulk_layers, "send_layers", counted)
        over_bulk = _train(cluster, init)
        assert len(streams) == 2 and len(set(streams)) == 2

        def no_channel(*args: Any) -> Any:
            raise bulk.NoChannel("a stage without a bulk channel")

        monkeypatch.setattr(streaming.bulk, "connect", no_channel)
        over_grpc = _train(cluster, init)
        assert len(streams) == 2
    assert over_bulk[0] == over_grpc[0]
    for key, value in over_bulk[1].items():
        assert torch.equal(value, over_grpc[1][key]), key


# ---- one in-process stage, spoken to directly ------------------------------------------------


def _stub(server: StageServer) -> stage_pb2_grpc.StageServiceStub:
    return stage_pb2_grpc.StageServiceStub(rpc.channel(server.address))


def _open(stub: stage_pb2_grpc.StageServiceStub) -> Any:
    port, token = open_bulk(stub)
    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    return sock


def _begin(sock: Any, epoch: int, count: int, body: bytes | None = None) -> bytes:
    """Sends a stream's first frame; returns the stage's answer byte."""
    if body is None:
        body = stage_pb2.RestoreChunk(epoch=epoch).SerializeToString()
    sock.sendall(bulk.FRAME.pack(len(body), bulk_layers.LAYERS, count) + body)
    return bytes(sock.recv(1))


def test_a_bulk_load_is_refused_as_restore_layers_is_and_the_stage_survives(
    stage: StageServer,
) -> None:
    """No load under way, a malformed first message, too many layers, a layer the stage
    does not own, one unlike the stage's layer, one sent twice and one whose digest does
    not match: each is refused with ``RestoreLayers``' error and ends its stream; a
    stream of an earlier release's kind is closed unanswered; an honest stream then stages
    its layer, and the stage answers as before."""
    stub = _stub(stage)
    relu = layer_state.pack({"index": 1, "model": {}})

    sock = _open(stub)
    assert _begin(sock, EPOCH + 1, 1) == bulk.ERR  # not frozen for a load
    refused(sock, NotReady, "")

    stub.Freeze(stage_pb2.EpochRequest(epoch=EPOCH + 1, lease_s=60), timeout=10)

    sock = _open(stub)
    assert _begin(sock, EPOCH + 1, 1, body=b"\xff\xff\xff") == bulk.ERR
    refused(sock, InvalidRequest, "malformed bulk load header")

    sock = _open(stub)
    assert _begin(sock, EPOCH + 1, bulk_layers.MAX_LAYERS + 1) == bulk.ERR
    refused(sock, InvalidRequest, "layers (at most")

    sock = _open(stub)
    assert _begin(sock, EPOCH + 1, 1) == bulk.GO
    sock.sendall(bulk_layers.header_frame(0, relu))
    assert sock.recv(1) == bulk.ERR
    refused(sock, NotReady, "does not own layer 0")

    sock = _open(stub)
    assert _begin(sock, EPOCH + 1, 1) == bulk.GO
    unlike = layer_state.pack({"index": 1, "model": {"weight": torch.ones(3)}})
    sock.sendall(bulk_layers.header_frame(1, unlike))
    assert sock.recv(1) == bulk.ERR
    refused(sock, InvalidRequest, "")

    sock = _open(stub)
    assert _begin(sock, EPOCH + 1, 1) == bulk.GO
    sock.sendall(bulk_layers.header_frame(1, relu))
    assert sock.recv(1) == bulk.GO
    sock.sendall(bytes(bulk_layers.DIGEST_BYTES))  # not the layer's digest
    assert sock.recv(1) == bulk.ERR
    refused(sock, TransferError, "digest mismatch")

    sock = _open(stub)  # an earlier release's load (kind L, SHA-256): closed unanswered
    body = stage_pb2.RestoreChunk(epoch=EPOCH + 1).SerializeToString()
    sock.sendall(bulk.FRAME.pack(len(body), b"L", 1) + body)
    try:  # so that sender falls back to gRPC (``NoChannel``, a ConnectionError caught)
        closed = sock.recv(1) == b""
    except ConnectionResetError:
        closed = True  # closed with the frame's body unread: a reset
    assert closed
    sock.close()

    sock = _open(stub)
    first = stage_pb2.RestoreChunk(epoch=EPOCH + 1)
    deadline = time.monotonic() + 10
    with pytest.raises(InvalidRequest, match="sent twice"):
        bulk_layers.send_layers(
            sock, "stage", first, [1, 1], lambda layer: relu, threading.Event(), deadline
        )
    sock.close()

    sock = _open(stub)
    answer = bulk_layers.send_layers(
        sock, "stage", first, [1], lambda layer: relu, threading.Event(), deadline
    )
    sock.close()
    assert answer is not None and list(answer.layers) == [1]
    assert stub.GetStats(stage_pb2.StatsRequest(), timeout=10).name == "bulk-test"


def test_a_bulk_load_needs_a_role_that_may_call_restore_layers() -> None:
    """With TLS, a bulk connection's caller is checked against ``RestoreLayers``' row (the
    client's role), as a gRPC call is: a stage may open a bulk channel, not load into it."""
    done: list[BaseException | None] = []

    def as_caller(identity: tuple[str, str] | None) -> None:
        authz.act_as(identity)  # (a thread of its own: a bulk connection's)
        try:
            authz.permit("StageService/RestoreLayers")
            done.append(None)
        except PermissionDenied as exc:
            done.append(exc)

    for identity in (("trainer", authz.CLIENT), ("stage-3", authz.STAGE), None):
        thread = threading.Thread(target=as_caller, args=(identity,))
        thread.start()
        thread.join()
    assert done[0] is None and done[2] is None
    assert isinstance(done[1], PermissionDenied) and "RestoreLayers" in str(done[1])
