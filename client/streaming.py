"""Streaming a load's layers (``init_state``, ``load``) to the stages that own them: every
owner at once, over the bulk channel where the stage has one.

A load sends every layer to its owner in each replica, one stream per owner, each on a
thread of its own, so the owners receive, check and build their layers at the same time;
the source is read one layer at a time under a lock (a file reader need not be
thread-safe), and the rest of each stream -- the digest, the sending -- overlaps with the
others'.

A stream goes over the stage's bulk channel (``transport.bulk_layers``): each tensor's
bytes are sent from its own memory and received straight into the layer they become, and
the layer's digest is the one checksum. A stage that offers no bulk channel gets a
``RestoreLayers`` gRPC stream instead, each chunk as ``layer_state.encoded_chunks`` writes
it (the protobuf wire form built straight from the tensor's memory, without per-chunk
CRC-32s; the trailer's digest is the checksum there too). On 2 cores, a GPT-2 small's
weights streamed to 4 stages at 0.28 GB/s over gRPC (``bench/first_step.py``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    StageUnavailable,
    TransferError,
)
from elasticpipe.transport import bulk, bulk_layers, rpc
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec, layer_state

_CHUNK_FIELD = stage_pb2.RestoreChunk.DESCRIPTOR.fields_by_name["chunk"].number
STOP_WAIT_S = 10.0  # for the streams to end once stopped (their sockets are shut down)


@dataclass(frozen=True)
class Load:
    """One load's stream parameters: what every owner's first message says."""

    epoch: int  # the load's epoch change (``BeginRestore``'s)
    step: int  # the step the state takes effect at
    overrides_json: str  # optimizer hyper-parameters to set after loading ("": none)

    def first(self) -> stage_pb2.RestoreChunk:
        """Every stream's first message, without a chunk."""
        return stage_pb2.RestoreChunk(
            epoch=self.epoch,
            committed_step=self.step,
            optimizer_overrides_json=self.overrides_json,
        )


class _Streams:
    """The streams of one load: the first failure, and stopping every stream."""

    def __init__(self, state_of: Callable[[int], Any], count: int):
        self._state_of = state_of
        self._left = count  # streams not ended yet
        self.ended = threading.Event()  # every stream ended, or one failed
        self._lock = threading.Lock()  # held by a read of the state
        self._guard = threading.Lock()  # the lists below
        self.stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._calls: list[grpc.Future[Any]] = []
        self.failures: list[BaseException] = []  # in the order they came

    def read(self, layer: int) -> layer_state.PackedLayer | None:
        with self._lock:
            return None if self.stop.is_set() else layer_state.pack(self._state_of(layer))

    def watch(self, resource: socket.socket | grpc.Future[Any]) -> None:
        """Stops ``resource`` with the others (at once, if they are stopped already)."""
        with self._guard:
            if isinstance(resource, socket.socket):
                self._sockets.append(resource)
            else:
                self._calls.append(resource)
            stopped = self.stop.is_set()
        if stopped:
            _stop(resource)

    def end(self) -> None:
        """One stream ended (however)."""
        with self._guard:
            self._left -= 1
            if self._left <= 0:
                self.ended.set()

    def fail(self, failure: BaseException) -> None:
        """Records a stream's failure (one after a stop is its consequence: dropped) and
        stops every stream."""
        with self._guard:
            if not self.stop.is_set():
                self.failures.append(failure)
        self.stop_all()
        self.ended.set()

    def stop_all(self) -> None:
        with self._guard:
            self.stop.set()
            resources: list[socket.socket | grpc.Future[Any]] = [*self._sockets, *self._calls]
        for resource in resources:
            _stop(resource)

    def quiesce(self) -> None:
        """Waits for a read under way to end; none starts after ``stop``."""
        self.stop.set()
        with self._lock:
            pass


def _stop(resource: socket.socket | grpc.Future[Any]) -> None:
    if isinstance(resource, socket.socket):
        with contextlib.suppress(OSError):  # a blocked send or read ends at once
            resource.shutdown(socket.SHUT_RDWR)
    else:
        resource.cancel()


def stream(
    pool: rpc.StagePool,
    owners: Sequence[tuple[str, range]],
    state_of: Callable[[int], Any],
    load: Load,
    timeout: float,
) -> None:
    """Streams each owner's layers (``state_of(layer)``) to it, every owner at once, and
    returns once every owner has taken all of them.

    The first failure stops every other stream at once (as does an interrupt), and no
    read of the state is under way when this returns: the caller may close the source.

    Args:
        owners: (a stage's address, the layers it owns), one per stage of each replica.

    Raises:
        ElasticPipeError: an owner refused or could not be reached (the first failure).
        Exception: reading the state failed: the reader's own error.
    """
    streams = _Streams(state_of, len(owners))
    deadline = time.monotonic() + timeout
    threads = [
        threading.Thread(
            target=_owner,
            args=(pool, address, owned, streams, load, deadline),
            name=f"load-{address}",
            daemon=True,
        )
        for address, owned in owners
    ]
    try:
        for thread in threads:
            thread.start()
        if not threads:
            streams.ended.set()
        streams.ended.wait()  # all ended, or the first failure (an interrupt comes here too)
    except BaseException:  # interrupted: every stream is stopped
        streams.stop_all()
        raise
    finally:
        if streams.failures:
            streams.stop_all()
        streams.quiesce()
        until = time.monotonic() + STOP_WAIT_S  # one wait for them all, not one each
        for thread in threads:
            if thread.ident is not None:
                thread.join(max(0.0, until - time.monotonic()))
    if streams.failures:
        raise streams.failures[0]


def _owner(
    pool: rpc.StagePool,
    address: str,
    owned: range,
    streams: _Streams,
    load: Load,
    deadline: float,
) -> None:
    """One owner's stream, on its own thread: over the bulk channel, or else gRPC. Its
    failure is recorded in ``streams`` (translated as gRPC's would be, or the reader's own
    error as itself), not raised; its end, however it ends, too."""
    unread: list[BaseException] = []  # reading the state failed: the reader's own error

    def read(layer: int) -> layer_state.PackedLayer | None:
        try:
            return streams.read(layer)
        except BaseException as exc:
            unread.append(exc)
            raise

    try:
        if streams.stop.is_set():
            return
        try:
            sock = bulk.connect(pool.stub(address), address, pool.tls, deadline)
        except bulk.NoChannel:
            _over_grpc(pool, address, owned, streams, read, load, deadline)
            return
        try:
            with sock:
                streams.watch(sock)
                bulk_layers.send_layers(
                    sock, address, load.first(), owned, read, streams.stop, deadline
                )
        except bulk.NoChannel:
            _over_grpc(pool, address, owned, streams, read, load, deadline)
    except BaseException as exc:
        if unread:
            streams.fail(unread[0])
        elif isinstance(exc, ElasticPipeError) or not isinstance(exc, Exception):
            streams.fail(exc)
        elif isinstance(exc, TimeoutError):
            streams.fail(DeadlineExceeded(f"streaming the load to {address}: {exc}"))
        elif isinstance(exc, (OSError, ConnectionError)):
            streams.fail(StageUnavailable(f"streaming the load to {address}: {exc}"))
        else:
            streams.fail(TransferError(f"streaming the load to {address} failed: {exc!r}"))
    finally:
        streams.end()


def _over_grpc(
    pool: rpc.StagePool,
    address: str,
    owned: range,
    streams: _Streams,
    read: Callable[[int], layer_state.PackedLayer | None],
    load: Load,
    deadline: float,
) -> None:
    """One owner's stream as a ``RestoreLayers`` call (a stage without a bulk channel)."""
    call: grpc.Future[Any] = rpc.call(
        address,
        pool.encoded(address, "RestoreLayers").future,
        _messages(owned, read, load, streams.stop),
        timeout=max(0.001, deadline - time.monotonic()),
    )
    streams.watch(call)
    try:
        call.result()
    except grpc.FutureCancelledError:
        return  # stopped: by another stream's failure, which is the one reported
    except grpc.RpcError as exc:
        raise rpc.translate(exc, address) from exc


def _messages(
    owned: range,
    read: Callable[[int], layer_state.PackedLayer | None],
    load: Load,
    stop: threading.Event,
) -> Iterator[bytes]:
    """One owner's ``RestoreChunk`` messages in wire form: the load's fields ride on the
    first (the first layer's header). It ends early once ``stop`` is set (the call is
    cancelled then)."""
    first = load.first().SerializeToString()
    for layer in owned:
        packed = read(layer)
        if packed is None:
            return
        for encoded in layer_state.encoded_chunks(
            layer, packed, codec.DEFAULT_CHUNK_BYTES, _CHUNK_FIELD
        ):
            if stop.is_set():
                return
            yield first + encoded if first else encoded
            first = b""
