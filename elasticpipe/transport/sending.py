"""Sending one tensor (or a tuple or flat dict of tensors, ``elasticpipe.wire.bundle``) to a
stage: over the bulk channel (``elasticpipe.transport.bulk``); where the peer has none, a
unary ``Deliver`` for a small one or the header-then-chunks stream of
Forward/Backward/Targets for a large one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from elasticpipe.security.tls import TLS
from elasticpipe.transport import bulk, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from elasticpipe.wire import bundle, codec, structure
from elasticpipe.wire.structure import Value


@dataclass(frozen=True)
class Outgoing:
    """One tensor (or tuple or flat dict of tensors) to send to a peer."""

    method: str  # "Forward", "Backward", "Targets" or "Reduce"
    epoch: int
    run: int
    step: int
    micro_batch: int
    tensor: Value
    loss_scale: float = 0.0
    secret: bytes = b""  # the run's (``RunStepRequest.secret``): the receiver checks it
    inference: bool = False  # of an inference run (for the sender's trace; not sent)


def header(msg: Outgoing, meta: tensor_pb2.TensorMeta | None) -> stage_pb2.DataHeader:
    """The header every data message of ``msg`` starts with (no ``meta``: declare
    ``msg.tensor`` with ``bundle.describe``)."""
    return stage_pb2.DataHeader(
        epoch=msg.epoch,
        run=msg.run,
        step=msg.step,
        micro_batch=msg.micro_batch,
        meta=meta,
        loss_scale=msg.loss_scale,
        secret=msg.secret,
    )


def data_stream(
    msg: Outgoing, chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES
) -> Iterator[stage_pb2.DataChunk]:
    """The header-then-chunks stream for one tensor."""
    if not isinstance(msg.tensor, torch.Tensor):
        head = header(msg, None)
        bundle.describe(head, msg.tensor)
        yield stage_pb2.DataChunk(header=head)
        for piece in bundle.chunks(msg.tensor, chunk_bytes):
            yield stage_pb2.DataChunk(data=piece)
        return
    meta, chunks = codec.tensor_chunks(msg.tensor, chunk_bytes)
    yield stage_pb2.DataChunk(header=header(msg, meta))
    for chunk in chunks:
        yield stage_pb2.DataChunk(data=chunk)


_SLOTS = {
    "Forward": stage_pb2.INPUT,
    "Backward": stage_pb2.GRAD,
    "Targets": stage_pb2.TARGET,
    "Reduce": stage_pb2.REDUCE,
}


def data_message(msg: Outgoing) -> stage_pb2.DataMessage:
    """``msg`` whole, as one ``DataMessage`` (as a RunStep carries its inline data)."""
    head = header(msg, None)
    bundle.describe(head, msg.tensor)
    return stage_pb2.DataMessage(slot=_SLOTS[msg.method], header=head, data=bundle.data(msg.tensor))


def send(
    stub: stage_pb2_grpc.StageServiceStub,
    address: str,
    msg: Outgoing,
    timeout: float,
    chunk_bytes: int = codec.DEFAULT_CHUNK_BYTES,
) -> None:
    """Sends one tensor synchronously, translating failures to the domain tree.

    A tensor of at most one chunk goes in a single unary ``Deliver`` call; a larger one is
    streamed in chunks (grpcio runs a thread per client stream, a unary call needs none).
    """
    if not isinstance(msg.tensor, torch.Tensor):
        head = header(msg, None)
        if bundle.describe(head, msg.tensor) <= chunk_bytes:
            request = stage_pb2.DataMessage(
                slot=_SLOTS[msg.method], header=head, data=bundle.data(msg.tensor)
            )
            rpc.call(address, stub.Deliver, request, timeout=timeout)
            return
        rpc.call(address, getattr(stub, msg.method), data_stream(msg, chunk_bytes), timeout=timeout)
        return
    meta = codec.tensor_meta(msg.tensor)
    if meta.nbytes <= chunk_bytes:
        request = stage_pb2.DataMessage(
            slot=_SLOTS[msg.method], header=header(msg, meta), data=codec.tensor_bytes(msg.tensor)
        )
        rpc.call(address, stub.Deliver, request, timeout=timeout)
        return
    method = getattr(stub, msg.method)
    rpc.call(address, method, data_stream(msg, chunk_bytes), timeout=timeout)


class Sender:
    """Sends to one stage, one message at a time: over the bulk channel when the stage has
    one and ``use_bulk`` (one round trip for a micro-batch's activations, no protobuf copy
    of the bytes), else over gRPC."""

    def __init__(
        self,
        stub: stage_pb2_grpc.StageServiceStub,
        address: str,
        tls: TLS | None = None,
        use_bulk: bool = True,
    ):
        self.stub = stub
        self.address = address
        self._bulk = bulk.BulkSender(stub, address, tls) if use_bulk else None

    def send(self, msg: Outgoing, timeout: float) -> None:
        """Sends one message synchronously (see ``send``; the same errors)."""
        if self._bulk is not None:
            head = header(msg, None)
            bundle.describe(head, msg.tensor)
            if self._bulk.send(_SLOTS[msg.method], head, msg.tensor, timeout):
                return
        send(self.stub, self.address, msg, timeout)

    def write_now(self, msg: Outgoing, timeout: float) -> tuple[float, bool] | None:
        """Writes ``msg`` on the open bulk connection from this thread without waiting,
        its answer left for ``read_answer`` (``bulk.BulkSender.write_eager``): the deadline
        and whether ``finish`` must write the rest; None when it must go by ``send``."""
        nbytes = structure.nbytes(msg.tensor)
        if self._bulk is None or not self._bulk.writable(nbytes):
            return None
        head = header(msg, None)
        bundle.describe(head, msg.tensor)
        return self._bulk.write_eager(_SLOTS[msg.method], head, msg.tensor, timeout, nbytes)

    def finish(self, deadline: float) -> None:
        """Writes the rest of the message ``write_now`` began (``bulk.BulkSender.finish``)."""
        assert self._bulk is not None
        self._bulk.finish(deadline)

    def read_answer(self, deadline: float) -> None:
        """The answer to the oldest message ``write_now`` wrote (its errors, as ``send``'s)."""
        assert self._bulk is not None
        self._bulk.read_answer(deadline)

    def answer_waiting(self, timeout: float = 0.0) -> bool:
        """Whether ``read_answer`` can read without waiting, after up to ``timeout``
        seconds (``bulk.BulkSender.answer_waiting``)."""
        assert self._bulk is not None
        return self._bulk.answer_waiting(timeout)

    def close(self) -> None:
        """Closes the bulk connection, if any (the gRPC channel is the caller's)."""
        if self._bulk is not None:
            self._bulk.close()
