"""A snapshot copy over real gRPC: pushed with its kept digest and no chunk CRCs, received
on a low-priority thread, kept exact; a copy whose bytes changed on the way is refused."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from elasticpipe.errors import TransferError
from elasticpipe.stage_server import transfers
from elasticpipe.stage_server.snapshots import Capture, receive_copy
from elasticpipe.transport import rpc, serving
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import PackedLayer

pytestmark = pytest.mark.timeout(30)


class Keeper(stage_pb2_grpc.StageServiceServicer):
    """A StageService's PushSnapshot as the stage's: ``receive_copy``, then kept."""

    def __init__(self) -> None:
        self.kept: dict[int, PackedLayer] = {}
        self.priorities: set[int] = set()

    def PushSnapshot(
        self, chunks: Iterator[stage_pb2.SnapshotChunk], context: Any
    ) -> stage_pb2.Ack:
        first = next(chunks)
        assert first.source == "me"

        def pieces() -> Iterator[stage_pb2.LayerChunk]:
            for message in chunks:
                self.priorities.add(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
                yield message.chunk

        self.kept = receive_copy(pieces(), (1 << 30, 1 << 30))
        return stage_pb2.Ack()


@pytest.fixture
def pushing() -> Iterator[tuple[Keeper, Callable[[list[tuple[int, PackedLayer]]], None]]]:
    """A keeping server on a free loopback port, and a push of layers to it."""
    keeper = Keeper()
    descriptor = stage_pb2.DESCRIPTOR.services_by_name["StageService"]
    server = serving.start_server("127.0.0.1:0", [(descriptor, keeper)])
    pool = rpc.StagePool()
    capture = Capture(job_id="j", step=10, source="me", states={}, peer="", generation=0)

    def push(layers: list[tuple[int, PackedLayer]]) -> None:
        transfers.push_snapshot(pool, server.address, capture, layers, 10.0, 4096)

    try:
        yield keeper, push
    finally:
        pool.close()
        server.stop(grace=0.1)


def _layers() -> list[tuple[int, PackedLayer]]:
    def state() -> dict[str, Any]:
        return {"model": {"w": torch.randn(300, 70)}, "optimizer": {"m": torch.randn(21000)}}

    return [(i, layer_state.seal(layer_state.pack(state()))) for i in (4, 5)]


def test_a_pushed_copy_arrives_exact_with_its_digest_at_low_priority(
    pushing: tuple[Keeper, Callable[[list[tuple[int, PackedLayer]]], None]],
) -> None:
    keeper, push = pushing
    layers = _layers()
    push(layers)
    assert sorted(keeper.kept) == [4, 5]
    for layer, packed in layers:
        got = keeper.kept[layer]
        assert got.digest == packed.digest == got.computed_digest()
        assert all(torch.equal(a, b) for a, b in zip(got.tensors, packed.tensors, strict=True))
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert mine == os.getpriority(os.PRIO_PROCESS, 0)  # the caller's is left as it was
    assert keeper.priorities and min(keeper.priorities) > mine  # received at low priority


def test_a_copy_whose_bytes_changed_after_sealing_is_refused(
    pushing: tuple[Keeper, Callable[[list[tuple[int, PackedLayer]]], None]],
) -> None:
    """The held clone changed after its digest was taken (or on the way): the receiver's
    digest check fails the push, and nothing is kept."""
    keeper, push = pushing
    layers = _layers()
    layers[1][1].tensors[1][7] += 1.0
    with pytest.raises(TransferError, match="layer 5: digest mismatch"):
        push(layers)
    assert keeper.kept == {}
