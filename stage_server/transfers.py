"""Layer state between stages: pulling a layer (migration, recovery), pushing a snapshot copy.

A pull travels as a ``LayerChunk`` stream, tensor by tensor (see
``elasticpipe.wire.layer_state``: a BLAKE3 digest per layer, no CRC-32 per chunk): a puller
accepts a layer only whole and intact, so a transfer cut short or corrupted fails the epoch
change that asked for it, which then leaves the old epoch in force. A snapshot copy goes
over the peer's bulk channel (``transport.bulk_layers``: straight from the sealed tensors'
memory into the kept ones, each layer under the digest it was sealed with), else as such a
stream over gRPC.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    NotReady,
    StageUnavailable,
    TransferError,
)
from elasticpipe.logs import get_logger
from elasticpipe.stage_server.faults import Fault
from elasticpipe.stage_server.snapshots import Capture, lower_priority_here
from elasticpipe.transport import bulk, bulk_layers, rpc
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import Destination, PackedLayer, Received

log = get_logger(__name__)

PUSH_RETRIES = 40
UNREACHABLE_RETRIES = 2  # of those, at most this many after the peer could not be reached,
UNREACHABLE_PAUSE_S = 0.3  # each after this pause (longer than a channel's reconnect backoff)
_CHUNK_FIELD = stage_pb2.SnapshotChunk.DESCRIPTOR.fields_by_name["chunk"].number


def pull_layer(
    pool: rpc.StagePool,
    address: str,
    request: stage_pb2.ExportLayersRequest,
    deadline: float,
    limits: tuple[int, int],
    destination: Destination,
    fault: Fault = Fault.NONE,
) -> Received:
    """Fetches one layer's state from the stage at ``address``.

    Args:
        pool: channels to stages.
        address: the stage holding the layer (its live state or a snapshot).
        request: an ``ExportLayers`` request naming exactly one layer.
        deadline: a ``time.monotonic()`` value.
        limits: the largest tensor and the largest layer (its tensors' sum) accepted.
        destination: where the layer's tensors go (checked against it first).
        fault: an injected fault (tests): corrupt the first chunk or cut the stream.

    Raises:
        TransferError: the stream failed, was cut short, or failed its checksums.
    """
    (layer,) = request.layers
    what = f"layer {layer} from {address}"
    stream = pool.stub(address).ExportLayers(request, timeout=max(0.1, deadline - time.monotonic()))

    def received() -> Iterator[stage_pb2.LayerChunk]:
        corrupt = fault is Fault.CORRUPT_NEXT_IMPORT  # the first chunk of data
        for n, chunk in enumerate(stream):
            if n == 0 and fault is Fault.CANCEL_NEXT_IMPORT:
                stream.cancel()  # type: ignore[no-untyped-call]
                raise TransferError(
                    f"{what}: transfer cancelled after {len(chunk.data)} bytes (injected fault)"
                )
            if corrupt and (chunk.data or chunk.digest):  # a layer without tensors: its digest
                corrupted = stage_pb2.LayerChunk()
                corrupted.CopyFrom(chunk)
                if chunk.data:
                    corrupted.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
                else:
                    corrupted.digest = bytes([chunk.digest[0] ^ 0xFF]) + chunk.digest[1:]
                yield corrupted
                corrupt = False
            else:
                yield chunk

    try:
        for got in layer_state.receive(received(), *limits, lambda _: destination):
            if got.layer != layer:
                raise TransferError(f"{what}: received layer {got.layer} instead")
            return got
    except grpc.RpcError as exc:
        raise TransferError(f"{what}: {rpc.translate(exc, address)}") from exc
    raise TransferError(f"{what}: stream ended before the final checksum")


def push_snapshot(
    pool: rpc.StagePool,
    address: str,
    capture: Capture,
    blobs: Sequence[tuple[int, PackedLayer]],
    timeout: float,
    chunk_bytes: int,
    superseded: Callable[[], bool] = lambda: False,
) -> bool:
    """Sends a snapshot's packed layers to the stage that keeps its copy, retrying while
    the peer is not ready or not reachable, unless ``superseded()`` (a newer snapshot waits:
    its copy replaces this one's, and a peer that left the chain at an epoch change would
    refuse this one to the last retry, holding the newer copy up for seconds).

    Returns:
        True once the peer kept the copy; False when it was given up as superseded.

    Raises:
        ElasticPipeError: the peer refused or could not be reached.
    """

    def messages() -> Iterator[bytes]:
        # gRPC reads a call's request stream on a thread of its own, which ends with it.
        lower_priority_here()
        yield stage_pb2.SnapshotChunk(
            job_id=capture.job_id, step=capture.step, source=capture.source
        ).SerializeToString()
        for layer, packed in blobs:
            yield from layer_state.encoded_chunks(layer, packed, chunk_bytes, _CHUNK_FIELD)

    deadline = time.monotonic() + timeout
    unreachable = 0
    attempt = 0
    over_bulk = True
    while True:
        try:
            if over_bulk:
                try:
                    _push_over_bulk(pool, address, capture, blobs, deadline)
                    return True
                except bulk.NoChannel as exc:  # a stage without it: gRPC from now on
                    log.debug("snapshot_copy_over_grpc", peer=address, why=str(exc))
                    over_bulk = False
                except StageUnavailable:  # broken on the way: the next try goes over gRPC
                    over_bulk = False
                    raise
            left = deadline - time.monotonic()
            if left <= 0:  # (the bulk tries took it all)
                raise DeadlineExceeded(f"snapshot copy to {address}: {timeout:.0f} s passed")
            rpc.call(address, pool.encoded(address, "PushSnapshot"), messages(), timeout=left)
            return True
        except (NotReady, StageUnavailable) as exc:
            # The peer may not have taken the job (or the chain) yet: at a job's start every
            # stage is assigned at once, and step 0's copy can arrive first. Or it could not
            # be reached: at a long chain's start every stage connects to its peer at once,
            # and a connection can time out on a loaded host (a few tries: it may be dead).
            if superseded():
                return False
            unreachable += isinstance(exc, StageUnavailable)
            delay = UNREACHABLE_PAUSE_S if unreachable else min(0.02 * (attempt + 1), 0.5)
            if (
                time.monotonic() + delay > deadline
                or attempt >= PUSH_RETRIES
                or unreachable > UNREACHABLE_RETRIES
            ):
                raise
            time.sleep(delay)
            attempt += 1


def _push_over_bulk(
    pool: rpc.StagePool,
    address: str,
    capture: Capture,
    blobs: Sequence[tuple[int, PackedLayer]],
    deadline: float,
) -> None:
    """One try of a snapshot copy on a bulk connection of its own (``bulk_layers.send_copy``).

    Raises:
        bulk.NoChannel: the peer has no bulk channel, or no copies on it (nothing was kept).
        ElasticPipeError: the peer refused the copy, or the connection broke
            (``StageUnavailable``).
    """
    sock = bulk.connect(pool.stub(address), address, pool.tls, deadline)
    first = stage_pb2.SnapshotChunk(job_id=capture.job_id, step=capture.step, source=capture.source)
    try:
        with sock:
            bulk_layers.send_copy(sock, address, first, blobs, deadline)
    except (ElasticPipeError, bulk.NoChannel):
        raise
    except (OSError, ConnectionError) as exc:  # (TimeoutError too)
        raise StageUnavailable(f"snapshot copy to {address}: {exc}") from exc
