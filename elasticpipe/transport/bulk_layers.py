"""A load's layers on the bulk channel: sent from their tensors' memory, received straight
into the layers they become.

``RestoreLayers`` over gRPC costs each byte a copy into its message, gRPC's copies and
HTTP/2 framing, a protobuf parse and a copy into the layer on the stage, besides the two
digests; on 2 cores a GPT-2 small's weights streamed at a quarter of the data path's
bandwidth. Here the bytes go as the bulk channel's activations do (``bulk``: the same
``OpenBulk`` token, mutual TLS and limits), and the layer's digest stays its one
checksum: the sender computes it while it sends (or reuses a sealed snapshot's), the stage
while it reads each piece into the layer's own tensor, and a layer is accepted only whole
and matching it. One stream per owner::

    sender:   u32 length, b"B", u64 count, RestoreChunk (epoch, step, overrides; no chunk)
    receiver: GO -- or an error frame (not a load of this stage's, or not this caller's)
    then, count times, one layer:
    sender:   u32 length, LayerChunk (the layer's header: its state, its tensors' dtypes
              and shapes)
    receiver: GO -- or an error frame, and the stream ends (a layer that is not this
              stage's, sent twice, over the limits, or unlike the layer it would become)
    sender:   every tensor's bytes, in order, then the layer's digest (32 bytes)
    then:
    receiver: OK, u32 length, RestoreResponse -- or an error frame

An error after a layer's bytes (a digest mismatch) takes the place of the next ``GO`` or
of the final ``OK``. The receiver closes the connection after any error in a stream; the
checks are ``RestoreLayers``' own (``StageServicer.RestoreLayers``), so a layer accepted
here is staged exactly as one that came over gRPC.

A snapshot copy (``PushSnapshot``'s, from the stage whose snapshot it is to the one that
keeps it) is the same stream with kind ``COPY``: its first message is the
``SnapshotChunk`` naming the job, the step and the source (no chunk), its answer an
``Ack``, and its checks ``PushSnapshot``'s. The sealed layers go with the digests they
were sealed with. The copy is the connection's last message: the stage reads its layers
on a helper thread at the lowest CPU priority (as it receives a gRPC copy), keeps the copy
on the connection's own thread, and closes the connection after the answer.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence

from elasticpipe.errors import ElasticPipeError, InvalidRequest, StageUnavailable
from elasticpipe.transport.bulk import (
    ERR,
    FRAME,
    GO,
    OK,
    U32,
    NoChannel,
    read_error,
    recv_bytes,
    send_all,
)
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec, layer_state

COPY = b"P"  # a frame's kind: a snapshot copy's layers follow (PushSnapshot's; the last)
LAYERS = b"B"  # a frame's kind: a load's layers follow, each with its BLAKE3 digest
# (earlier releases sent kind "L", with SHA-256: a stage of either closes on the other's kind,
# and the load goes over gRPC, where the digest's field number differs too)
PIECE_BYTES = 1 << 20  # sent, received and hashed this many bytes at a time
DIGEST_BYTES = 32
MAX_LAYERS = 1 << 20  # layers in one stream
MAX_HEADER_BYTES = layer_state.MAX_HEADER_BYTES + (1 << 20)  # a layer's header message
MAX_ANSWER_BYTES = 1 << 20

__all__ = [
    "COPY",
    "DIGEST_BYTES",
    "LAYERS",
    "PIECE_BYTES",
    "header_frame",
    "parse_copy_first",
    "parse_first",
    "parse_layer_header",
    "read_frame_count",
    "send_copy",
    "send_layers",
]


def _expect(sock: socket.socket, want: bytes, address: str, deadline: float) -> None:
    answer = recv_bytes(sock, 1, deadline)
    if answer == ERR:
        raise read_error(sock, address, deadline)
    if answer != want:
        raise StageUnavailable(f"unexpected bulk answer {answer!r} from {address}")


def send_layers(
    sock: socket.socket,
    address: str,
    first: stage_pb2.RestoreChunk,
    owned: Sequence[int],
    read: Callable[[int], layer_state.PackedLayer | None],
    stop: threading.Event,
    deadline: float,
) -> stage_pb2.RestoreResponse | None:
    """Streams the layers ``owned`` (``read(layer)``) on an open bulk connection.

    Returns:
        The stage's answer; None when ``stop`` was set or ``read`` gave None first (the
        stream then ended unfinished: the stage stages nothing more of it).

    Raises:
        NoChannel: the stage closed the connection before it answered the first frame
            (nothing was staged: send the load over gRPC).
        ElasticPipeError: the stage refused the load or a layer (as ``RestoreLayers``
            would), or the connection broke (``StageUnavailable``).
        Exception: ``read``'s own.
    """
    answer = _stream(sock, address, LAYERS, first, owned, read, stop.is_set, deadline)
    return None if answer is None else stage_pb2.RestoreResponse.FromString(answer)


def send_copy(
    sock: socket.socket,
    address: str,
    first: stage_pb2.SnapshotChunk,
    blobs: Sequence[tuple[int, layer_state.PackedLayer]],
    deadline: float,
) -> None:
    """Streams a snapshot copy's sealed layers on a new bulk connection (its last message).

    Raises:
        NoChannel: the stage closed the connection before it answered the first frame (a
            stage without kind ``COPY``: push the copy over gRPC).
        ElasticPipeError: the stage refused the copy or a layer (as ``PushSnapshot``
            would), or the connection broke (``StageUnavailable``).
    """
    held = dict(blobs)
    answer = _stream(
        sock, address, COPY, first, [i for i, _ in blobs], held.get, lambda: False, deadline
    )
    try:
        stage_pb2.Ack.FromString(answer or b"")
    except Exception as exc:  # protobuf's DecodeError
        raise StageUnavailable(f"a malformed answer to a snapshot copy from {address}") from exc


def _stream(
    sock: socket.socket,
    address: str,
    kind: bytes,
    first: stage_pb2.RestoreChunk | stage_pb2.SnapshotChunk,
    layers: Sequence[int],
    read: Callable[[int], layer_state.PackedLayer | None],
    stopped: Callable[[], bool],
    deadline: float,
) -> bytes | None:
    """The stream of ``kind``: its first message, each layer, then the answer's bytes."""
    body = first.SerializeToString()
    try:
        send_all(sock, FRAME.pack(len(body), kind, len(layers)) + body, deadline)
        _expect(sock, GO, address, deadline)
    except (ElasticPipeError, TimeoutError):
        raise  # the stage's refusal (some kinds are OSErrors too), or the deadline
    except OSError as exc:  # closed without an answer (TLS: an EOF): a stage without this kind
        raise NoChannel(f"the stage closed the bulk stream unanswered: {exc}") from exc
    for layer in layers:
        packed = read(layer)
        if packed is None or stopped():
            return None
        hasher = None if packed.digest else layer_state.new_hasher(packed.state)
        send_all(sock, header_frame(layer, packed), deadline)
        _expect(sock, GO, address, deadline)
        for tensor in packed.tensors:
            raw = layer_state.bytes_of(tensor)
            for start in range(0, len(raw), PIECE_BYTES):
                if stopped():
                    return None
                piece = raw[start : start + PIECE_BYTES]
                if hasher is not None:
                    hasher.update(piece)
                send_all(sock, piece, deadline)
        send_all(sock, packed.digest if hasher is None else hasher.digest(), deadline)
    _expect(sock, OK, address, deadline)
    (n,) = U32.unpack(recv_bytes(sock, U32.size, deadline))
    if n > MAX_ANSWER_BYTES:
        raise StageUnavailable(f"a bulk answer of {n} bytes from {address}")
    return recv_bytes(sock, n, deadline)


def header_frame(layer: int, packed: layer_state.PackedLayer) -> bytes:
    """A layer's header as the stream carries it: its length, then the ``LayerChunk``."""
    body = stage_pb2.LayerChunk(
        layer=layer,
        header=stage_pb2.LayerHeader(
            state=packed.state,
            tensors=[codec.tensor_meta(t) for t in packed.tensors],
            unchecked_chunks=True,
        ),
    ).SerializeToString()
    return U32.pack(len(body)) + body


def read_frame_count(count: int) -> int:
    """A stream's announced layer count, bounded.

    Raises:
        InvalidRequest: more than ``MAX_LAYERS``.
    """
    if count > MAX_LAYERS:
        raise InvalidRequest(f"a bulk load of {count} layers (at most {MAX_LAYERS})")
    return count


def parse_first(body: bytes) -> stage_pb2.RestoreChunk:
    """A stream's first message: the load's fields, no chunk.

    Raises:
        InvalidRequest: not a RestoreChunk, or one that carries a chunk.
    """
    first = stage_pb2.RestoreChunk()
    try:
        first.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequest(f"malformed bulk load header ({len(body)} bytes)") from exc
    if first.HasField("chunk"):
        raise InvalidRequest("a bulk load's first message must not carry a chunk")
    return first


def parse_copy_first(body: bytes) -> stage_pb2.SnapshotChunk:
    """A copy's first message: its job, step and source, no chunk.

    Raises:
        InvalidRequest: not a SnapshotChunk, one that carries a chunk, or no source.
    """
    first = stage_pb2.SnapshotChunk()
    try:
        first.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequest(f"malformed bulk snapshot copy header ({len(body)} bytes)") from exc
    if first.HasField("chunk") or not first.source:
        raise InvalidRequest("a snapshot stream must start with its job, step and source")
    return first


def parse_layer_header(body: bytes) -> stage_pb2.LayerChunk:
    """A layer's header message.

    Raises:
        InvalidRequest: not a LayerChunk with a header.
    """
    piece = stage_pb2.LayerChunk()
    try:
        piece.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequest(f"malformed bulk layer header ({len(body)} bytes)") from exc
    if not piece.HasField("header") or piece.data or piece.digest:
        raise InvalidRequest(f"layer {piece.layer}: a bulk layer header must be a header only")
    return piece
