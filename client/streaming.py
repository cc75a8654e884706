"""Streaming a load's layers (``init_state``, ``load``) to the stages that own them: every
owner at once, each chunk copied once from its tensor into its wire form.

A load sends every layer to its owner in each replica, over one ``RestoreLayers`` stream
per owner. The streams run side by side (one thread each), so the owners receive, check
and build their layers at the same time; the source is read one layer at a time under a
lock (a file reader need not be thread-safe), and the rest of each stream -- the chunks'
encoding, the SHA-256, the sending -- overlaps with the others'.

Each chunk goes as ``layer_state.encoded_chunks`` writes it: the protobuf wire form built
straight from the tensor's memory (one copy, where building a message and serialising it
copies twice more), without per-chunk CRC-32s; the layer's SHA-256 in its trailer is the one
checksum, and the stage accepts a layer only whole and matching it (as a snapshot copy).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

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


class _Stopped(Exception):
    """Another owner's stream failed, or the caller was interrupted: this one stops."""


def stream(
    pool: rpc.StagePool,
    owners: Sequence[tuple[str, range]],
    state_of: Callable[[int], Any],
    load: Load,
    timeout: float,
) -> None:
    """Streams each owner's layers (``state_of(layer)``) to it, every owner at once, and
    returns once every owner has taken all of them.

    Args:
        owners: (a stage's address, the layers it owns), one per stage of each replica.

    Raises:
        ElasticPipeError: an owner refused or could not be reached, or the state could not
            be read (its own error, not gRPC's); the first failure, after every stream
            ended (the others are stopped at their next chunk).
    """
    read_lock = threading.Lock()
    stop = threading.Event()

    def read(layer: int) -> layer_state.PackedLayer:
        with read_lock:
            if stop.is_set():
                raise _Stopped
            return layer_state.pack(state_of(layer))

    def send(address: str, owned: range) -> None:
        unread: list[Exception] = []  # reading the state failed: gRPC hides why
        try:
            rpc.call(
                address,
                pool.encoded(address, "RestoreLayers"),
                _messages(owned, read, load, stop, unread),
                timeout=timeout,
            )
        except BaseException as exc:
            stopped = stop.is_set()  # (by another stream's failure: this one's follows)
            stop.set()
            if unread:
                raise unread[0] from None
            if stopped:
                raise _Stopped from exc
            raise

    if not owners:
        return
    failures: list[BaseException] = []
    with ThreadPoolExecutor(len(owners), thread_name_prefix="load") as streams:
        futures = [streams.submit(send, address, owned) for address, owned in owners]
        try:
            for future in futures:
                try:
                    future.result()
                except _Stopped:
                    pass
                except Exception as exc:
                    failures.append(exc)
        except BaseException:  # interrupted: the streams stop at their next chunk
            stop.set()
            raise
    if failures:
        raise failures[0]


def _messages(
    owned: range,
    read: Callable[[int], layer_state.PackedLayer],
    load: Load,
    stop: threading.Event,
    unread: list[Exception],
) -> Iterator[bytes]:
    """One owner's ``RestoreChunk`` messages in wire form: the load's fields ride on the
    first (the first layer's header)."""
    first = stage_pb2.RestoreChunk(
        epoch=load.epoch,
        committed_step=load.step,
        optimizer_overrides_json=load.overrides_json,
    ).SerializeToString()
    try:
        for layer in owned:
            packed = read(layer)
            for encoded in layer_state.encoded_chunks(
                layer, packed, codec.DEFAULT_CHUNK_BYTES, _CHUNK_FIELD
            ):
                if stop.is_set():
                    raise _Stopped
                yield first + encoded if first else encoded
                first = b""
    except _Stopped:
        raise
    except Exception as exc:
        unread.append(exc)
        raise
