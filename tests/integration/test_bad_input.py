"""A stage answers every malformed request with a precise status naming the bad value."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.errors import PermissionDenied, UserCodeError
from elasticpipe.security import bounds
from elasticpipe.stage_server.server import StageServer
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from elasticpipe.wire import codec
from tests.support import jobs

pytestmark = pytest.mark.timeout(120)

KWARGS = {"sizes": [12, 16, 6]}

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


@pytest.fixture
def trained(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer]
) -> Iterator[tuple[Pipeline, StageServer]]:
    """A 2-stage mlp job that has run one step, and its first stage."""
    with jobs.mlp(coordinator_server.address, **KWARGS, micro_batches=2, stages=2) as pipe:
        pipe.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,)))
        first = next(s for s in stage_servers if s.address == pipe.partition.addresses[0])
        yield pipe, first


def _stub(server: StageServer) -> stage_pb2_grpc.StageServiceStub:
    return stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(server.address))


def _forward(
    stub: stage_pb2_grpc.StageServiceStub, header: stage_pb2.DataHeader, *chunks: bytes
) -> None:
    messages = [stage_pb2.DataChunk(header=header)] + [stage_pb2.DataChunk(data=c) for c in chunks]
    stub.Forward(iter(messages), timeout=10)


def _status(fn: object, *args: object) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        fn(*args)  # type: ignore[operator]
    return info.value


def _assert_still_serving(pipe: Pipeline, server: StageServer) -> None:
    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(server.address))
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    loss = pipe.train_step(torch.randn(4, 12), torch.randint(0, 6, (4,)))
    assert loss > 0


def test_byte_count_disagreeing_with_shape_is_invalid(
    trained: tuple[Pipeline, StageServer],
) -> None:
    """A header whose nbytes disagrees with dtype and shape gets INVALID_ARGUMENT naming both."""
    pipe, server = trained
    meta = tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[2, 3], nbytes=20)
    header = stage_pb2.DataHeader(secret=STRANGER, epoch=pipe.partition.epoch, run=1, meta=meta)
    err = _status(_forward, _stub(server), header, b"\0" * 20)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "[2, 3]" in err.details() and "24 bytes" in err.details() and "20" in err.details()
    _assert_still_serving(pipe, server)


def test_missing_and_extra_bytes_are_invalid(trained: tuple[Pipeline, StageServer]) -> None:
    """Fewer or more bytes than declared get INVALID_ARGUMENT with both counts."""
    pipe, server = trained
    meta = codec.tensor_meta(torch.zeros(2, 3))
    header = stage_pb2.DataHeader(secret=STRANGER, epoch=pipe.partition.epoch, run=1, meta=meta)
    short = _status(_forward, _stub(server), header, b"\0" * 8)
    assert short.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "received 8 bytes" in short.details() and "24 bytes" in short.details()
    extra = _status(_forward, _stub(server), header, b"\0" * 16, b"\0" * 16)
    assert extra.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "32" in extra.details()
    _assert_still_serving(pipe, server)


def test_unknown_dtype_is_invalid(trained: tuple[Pipeline, StageServer]) -> None:
    """A dtype number the codec does not know gets INVALID_ARGUMENT naming it."""
    pipe, server = trained
    meta = tensor_pb2.TensorMeta(dtype=99, shape=[1], nbytes=4)  # type: ignore[arg-type]
    header = stage_pb2.DataHeader(secret=STRANGER, epoch=pipe.partition.epoch, run=1, meta=meta)
    err = _status(_forward, _stub(server), header, b"\0" * 4)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "99" in err.details()
    _assert_still_serving(pipe, server)


@pytest.mark.parametrize(
    "bad", [torch.randn(2, 5), torch.ones(2, 12, dtype=torch.int64)], ids=["shape", "dtype"]
)
def test_input_the_model_cannot_take_is_invalid(
    trained: tuple[Pipeline, StageServer], bad: torch.Tensor
) -> None:
    """Well-formed bytes of the wrong shape or dtype for the layer fail the run with
    INVALID_ARGUMENT naming the layer, the micro-batch and the input, and the client gets
    that error (the user's, with the model's own message), not an internal one."""
    pipe, server = trained
    with pytest.raises(UserCodeError) as info:
        pipe.train_step(bad, torch.randint(0, 6, (2,)))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    micro_batch_shape = [1, *bad.shape[1:]]  # 2 samples over 2 micro-batches
    message = str(info.value)
    assert "layer 0 (Linear)" in message and str(micro_batch_shape) in message
    assert "micro-batch 0" in message and "RuntimeError" in message
    _assert_still_serving(pipe, server)


def test_request_of_another_epoch_is_failed_precondition(
    trained: tuple[Pipeline, StageServer],
) -> None:
    """Data and RunStep of a stale epoch get FAILED_PRECONDITION stating the current epoch."""
    pipe, server = trained
    epoch = pipe.partition.epoch
    header = stage_pb2.DataHeader(
        secret=STRANGER, epoch=epoch + 7, run=1, meta=codec.tensor_meta(torch.zeros(1))
    )
    err = _status(_forward, _stub(server), header, b"\0" * 4)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"stale epoch {epoch + 7}" in err.details() and f"at epoch {epoch}" in err.details()
    client = _stub(server).GetStats(stage_pb2.StatsRequest(), timeout=5).state.fence
    run = stage_pb2.RunStepRequest(
        epoch=epoch - 1,
        run=(client << bounds.RUN_ID_BITS) + 5,
        step=2,
        micro_batches=1,
        schedule=stage_pb2.GPIPE,
        mode=stage_pb2.TRAIN,
        client=client,  # the job's own client: the epoch is what is wrong
        timeout_s=5,
        secret=bytes(bounds.RUN_SECRET_BYTES),
    )
    err = _status(_stub(server).RunStep, run)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"stale epoch {epoch - 1}" in err.details()
    _assert_still_serving(pipe, server)


def test_model_outside_allowed_prefixes_is_permission_denied(
    trained: tuple[Pipeline, StageServer],
    coordinator_server: CoordinatorServer,
) -> None:
    """A factory path outside --allow-models gets PERMISSION_DENIED naming it, at the stage
    and through the coordinator to the client."""
    pipe, server = trained
    spec = stage_pb2.DescribeRequest(job=pipe._job.to_proto())
    spec.job.model = "os.path:join"
    err = _status(_stub(server).Describe, spec)
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "os.path:join" in err.details()
    pipe.close()  # free the job, so that a new one may be set up
    with (
        Pipeline(
            coordinator=coordinator_server.address, model="subprocess:getoutput", stages=2
        ) as evil,
        pytest.raises(PermissionDenied, match="subprocess:getoutput"),
    ):
        evil.train_step(torch.zeros(2, 3), torch.zeros(2))
    with jobs.mlp(coordinator_server.address, **KWARGS, stages=2) as again:
        _assert_still_serving(again, server)


def test_oversized_tensor_is_resource_exhausted(trained: tuple[Pipeline, StageServer]) -> None:
    """A declared size over the stage's limit gets RESOURCE_EXHAUSTED before any allocation,
    and a single gRPC message over the transport limit is refused the same way."""
    pipe, server = trained
    huge = tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[1 << 40], nbytes=4 << 40)
    header = stage_pb2.DataHeader(secret=STRANGER, epoch=pipe.partition.epoch, run=1, meta=huge)
    err = _status(_forward, _stub(server), header)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(4 << 40) in err.details() and str(1 << 20) in err.details()
    big = stage_pb2.DataChunk(data=b"\0" * (65 << 20))
    channel = grpc.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 100 << 20)]
    )
    err = _status(stage_pb2_grpc.StageServiceStub(channel).Forward, iter([big]))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _assert_still_serving(pipe, server)


@pytest.mark.parametrize("method", ["RunStep", "Assign", "ExportLayers", "Forward", "Deliver"])
def test_garbage_bytes_are_invalid_argument(
    trained: tuple[Pipeline, StageServer], method: str
) -> None:
    """Bytes that are not a protobuf message get INVALID_ARGUMENT naming the message type."""
    pipe, server = trained
    channel = grpc.insecure_channel(server.address)
    path = f"/elasticpipe.v1.StageService/{method}"
    garbage = b"\xff\xff\xff\xff\x0f\x01garbage"
    if method == "Forward":
        call = channel.stream_unary(path)
        err = _status(call, iter([garbage]), 5)
    elif method == "ExportLayers":
        err = _status(lambda: list(channel.unary_stream(path)(garbage, timeout=5)))
    else:
        err = _status(channel.unary_unary(path), garbage, 5)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed elasticpipe.v1." in err.details()
    _assert_still_serving(pipe, server)


def test_coordinator_survives_garbage_and_bad_arguments(
    coordinator_server: CoordinatorServer,
) -> None:
    """The coordinator answers garbage and empty registrations with INVALID_ARGUMENT."""
    channel = grpc.insecure_channel(coordinator_server.address)
    err = _status(
        channel.unary_unary("/elasticpipe.v1.CoordinatorService/Register"), b"\xff\xff\xff", 5
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    err = _status(channel.unary_unary("/elasticpipe.v1.CoordinatorService/Register"), b"", 5)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "name" in err.details()
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1


def test_single_message_delivery_is_checked_like_a_stream(
    trained: tuple[Pipeline, StageServer],
) -> None:
    """The unary Deliver path refuses a byte count that disagrees with the header, an
    oversized declaration and an unknown slot, each with the precise status."""
    pipe, server = trained
    stub = _stub(server)
    header = stage_pb2.DataHeader(
        secret=STRANGER,
        epoch=pipe.partition.epoch,
        run=1,
        meta=codec.tensor_meta(torch.zeros(2, 3)),
    )
    err = _status(
        stub.Deliver, stage_pb2.DataMessage(slot=stage_pb2.INPUT, header=header, data=b"\0" * 23), 5
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "23" in err.details()
    err = _status(
        stub.Deliver,
        stage_pb2.DataMessage(
            slot=7,
            header=header,  # type: ignore[arg-type]
            data=b"\0" * 24,
        ),
        5,
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "slot 7" in err.details()
    huge = stage_pb2.DataHeader(
        secret=STRANGER,
        epoch=pipe.partition.epoch,
        run=1,
        meta=tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[1 << 30], nbytes=4 << 30),
    )
    err = _status(stub.Deliver, stage_pb2.DataMessage(slot=stage_pb2.INPUT, header=huge), 5)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(4 << 30) in err.details()
    _assert_still_serving(pipe, server)
