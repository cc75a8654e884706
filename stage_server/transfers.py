"""Layer state between stages: pulling a layer (migration, recovery), pushing a snapshot copy.

Both travel as ``LayerChunk`` streams, tensor by tensor (see ``elasticpipe.wire.layer_state``:
CRC-32 per chunk, a BLAKE3 digest per layer): a puller accepts a layer only whole and intact, so
a transfer cut short or corrupted fails the epoch change that asked for it, which then
leaves the old epoch in force.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import grpc

from elasticpipe.errors import NotReady, StageUnavailable, TransferError
from elasticpipe.stage_server.faults import Fault
from elasticpipe.stage_server.snapshots import Capture, lower_priority_here
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import Destination, PackedLayer, Received

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
    while True:
        try:
            rpc.call(address, pool.encoded(address, "PushSnapshot"), messages(), timeout=timeout)
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
