"""Streaming a load's layers (``init_state``, ``load``) to the stages that own them: every
owner at once, each chunk copied once from its tensor into its wire form.

A load sends every layer to its owner in each replica, over one ``RestoreLayers`` stream
per owner. The streams run side by side (gRPC calls, each reading its requests on a thread
of its own), so the owners receive, check and build their layers at the same time; the
source is read one layer at a time under a lock (a file reader need not be thread-safe),
and the rest of each stream -- the chunks' encoding, the SHA-256, the sending -- overlaps
with the others'.

Each chunk goes as ``layer_state.encoded_chunks`` writes it: the protobuf wire form built
straight from the tensor's memory (one copy, where building a message and serialising it
copies twice more), without per-chunk CRC-32s; the layer's SHA-256 in its trailer is the one
checksum, and the stage accepts a layer only whole and matching it (as a snapshot copy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from elasticpipe.errors import TransferError
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec, layer_state

_CHUNK_FIELD = stage_pb2.RestoreChunk.DESCRIPTOR.fields_by_name["chunk"].number


@dataclass(frozen=True)
class Load:
    """One load's stream parameters: what every owner's first message says."""

    epoch: int  # the load's epoch change (``BeginRestore``'s)
    step: int  # the step the state takes effect at
    overrides_json: str  # optimizer hyper-parameters to set after loading ("": none)


def stream(
    pool: rpc.StagePool,
    owners: Sequence[tuple[str, range]],
    state_of: Callable[[int], Any],
    load: Load,
    timeout: float,
) -> None:
    """Streams each owner's layers (``state_of(layer)``) to it, every owner at once, and
    returns once every owner has taken all of them.

    The first failure cancels every other stream at once (as does an interrupt), and no
    read of the state is under way when this returns: the caller may close the source.

    Args:
        owners: (a stage's address, the layers it owns), one per stage of each replica.

    Raises:
        ElasticPipeError: an owner refused or could not be reached (the first failure).
        Exception: reading the state failed: the reader's own error, not gRPC's.
    """
    lock = threading.Lock()  # held by a read of the state
    stop = threading.Event()
    calls: list[grpc.Future[Any]] = []
    watched: list[threading.Event] = []
    failures: list[Exception] = []  # in the order they came

    def read(layer: int) -> layer_state.PackedLayer | None:
        with lock:
            return None if stop.is_set() else layer_state.pack(state_of(layer))

    def stop_all() -> None:
        stop.set()
        for call in list(calls):
            call.cancel()

    def watch(
        address: str, unread: list[Exception], settled: threading.Event
    ) -> Callable[[grpc.Future[Any]], None]:
        def done(call: grpc.Future[Any]) -> None:
            try:
                error = None if call.cancelled() else call.exception()
                if error is None:
                    return
                try:
                    assert isinstance(error, grpc.RpcError)
                    failure = unread[0] if unread else rpc.translate(error, address)
                except Exception:  # (a status it cannot read: gRPC would only log this)
                    failure = TransferError(f"streaming the load to {address} failed: {error}")
                failures.append(failure)
                stop_all()
            finally:
                settled.set()

        return done

    try:
        for address, owned in owners:
            if stop.is_set():
                break
            unread: list[Exception] = []  # reading the state failed: gRPC hides why
            started: grpc.Future[Any] = rpc.call(
                address,
                pool.encoded(address, "RestoreLayers").future,
                _messages(owned, read, load, stop, unread),
                timeout=timeout,
            )
            calls.append(started)
            watched.append(threading.Event())  # its callback ran (after the call ended)
            started.add_done_callback(watch(address, unread, watched[-1]))
        for settled in watched:  # each call's callback ran (gRPC runs it after the call
            settled.wait()  # is marked done: waiting for the call alone would be too soon)
    except BaseException:  # interrupted: every stream is cancelled
        stop_all()
        raise
    finally:
        stop.set()
        with lock:  # a read under way (on gRPC's thread) has ended; none starts now
            pass
    if failures:
        raise failures[0]


def _messages(
    owned: range,
    read: Callable[[int], layer_state.PackedLayer | None],
    load: Load,
    stop: threading.Event,
    unread: list[Exception],
) -> Iterator[bytes]:
    """One owner's ``RestoreChunk`` messages in wire form: the load's fields ride on the
    first (the first layer's header). It ends early once ``stop`` is set (the call is
    cancelled then)."""
    first = stage_pb2.RestoreChunk(
        epoch=load.epoch,
        committed_step=load.step,
        optimizer_overrides_json=load.overrides_json,
    ).SerializeToString()
    try:
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
    except Exception as exc:
        unread.append(exc)
        raise
