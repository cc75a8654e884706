"""One in-process stage holding a job, for the tests that speak to its bulk channel
directly: the ``stage`` fixture and the two steps of a bulk connection."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from elasticpipe.partition import Placement
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import bulk, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

EPOCH = 3  # the epoch the ``stage`` fixture's job is at


@pytest.fixture
def stage() -> Iterator[StageServer]:
    """A stage server that owns layer 1 (a ReLU) of a 2-stage job at ``EPOCH`` (nobody
    registers it: no coordinator is needed to take data)."""
    config = StageConfig(name="bulk-test", max_tensor_bytes=64 << 20, mailbox_bytes=32 << 20)
    with StageServer(config, "127.0.0.1:1") as server:
        job = JobConfig(
            model="mlp", model_kwargs={"sizes": [4, 4, 4]}, optimizer="sgd", optimizer_kwargs={}
        )
        placement = Placement(epoch=EPOCH, index=1, num_stages=2, lo=1, hi=2)
        with rpc.channel(server.address) as chan:
            reply = stage_pb2_grpc.StageServiceStub(chan).Assign(
                stage_pb2.AssignRequest(job=job.to_proto(), assignment=placement.to_proto()),
                timeout=30,
            )
        assert reply.num_layers == 1
        yield server


def open_bulk(stub: stage_pb2_grpc.StageServiceStub) -> tuple[int, bytes]:
    """Asks the stage for its bulk port and a token."""
    reply = stub.OpenBulk(stage_pb2.OpenBulkRequest(), timeout=10)
    assert reply.port
    return reply.port, reply.token


def connect_bulk(port: int, token: bytes) -> socket.socket:
    """A bulk connection to the stage on ``port``, past its magic and token."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(bulk.MAGIC + token)
    return sock


def refused(sock: socket.socket, kind: type[Exception], match: str) -> None:
    """Reads the error frame a refused bulk stream got (its kind, a message holding
    ``match``), then checks that the stage closed the connection with it."""
    error = bulk.read_error(sock, "stage")
    assert isinstance(error, kind), error
    assert match in str(error), error
    assert sock.recv(1) == b""  # the stream ended: the stage closed the connection
    sock.close()
