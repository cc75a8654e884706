"""A snapshot copy over real gRPC, to a peer without a bulk channel: pushed with its kept
digest and no chunk CRCs, received on a low-priority thread, kept exact; a copy whose bytes
changed on the way is refused; a copy its peer keeps refusing gives way to a newer
snapshot's. (``test_bulk_copies.py``: the same over the bulk channel.)"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

from elasticpipe.errors import NotReady, TransferError
from elasticpipe.stage_server import transfers
from elasticpipe.stage_server.snapshots import Capture, SnapshotStore, Snapshotter, receive_copy
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import PackedLayer
from tests.support.servers import serve_stage

pytestmark = pytest.mark.timeout(30)


class NoBulk(stage_pb2_grpc.StageServiceServicer):
    """A stage without a bulk channel (``--no-bulk``): its copies come over gRPC."""

    def OpenBulk(self, request: stage_pb2.OpenBulkRequest, context: Any) -> stage_pb2.OpenBulkReply:
        return stage_pb2.OpenBulkReply()  # no port


class Keeper(NoBulk):
    """A StageService's PushSnapshot as the stage's: ``receive_copy``, then kept."""

    def __init__(self) -> None:
        self.kept: dict[int, PackedLayer] = {}
        self.steps: list[int] = []
        self.priorities: set[int] = set()

    def PushSnapshot(
        self, chunks: Iterator[stage_pb2.SnapshotChunk], context: Any
    ) -> stage_pb2.Ack:
        first = next(chunks)
        assert first.source == "me"
        self.steps.append(first.step)

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
    server = serve_stage(keeper)
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


class Refuser(NoBulk):
    """A peer that has just left the chain: it refuses every copy as not ready."""

    def __init__(self) -> None:
        self.refusals = 0

    def PushSnapshot(
        self, chunks: Iterator[stage_pb2.SnapshotChunk], context: Any
    ) -> stage_pb2.Ack:
        self.refusals += 1
        raise NotReady("snapshot copy from 'me', which is not in the chain []")


def test_a_copy_its_peer_keeps_refusing_gives_way_to_a_newer_snapshot() -> None:
    """A leave's epoch change, as it failed one full-suite run in two: step 3's copy goes to
    the stage that has just left the chain, which refuses it (not ready) to the last of
    ``PUSH_RETRIES``, about 14 s of pauses; the new epoch's first snapshot (step 4, to the
    new peer) is queued meanwhile, and the leave waits for its copy. The older push gives up
    at its next refusal, so the newer copy is kept well within those 14 s (10 s allowed:
    the copies travel at the lowest CPU priority), and the older is not tried again."""
    refuser, keeper = Refuser(), Keeper()
    servers = [serve_stage(refuser), serve_stage(keeper)]
    pool = rpc.StagePool()

    def push(
        peer: str,
        capture: Capture,
        blobs: Sequence[tuple[int, PackedLayer]],
        superseded: Callable[[], bool],
    ) -> bool:
        return transfers.push_snapshot(pool, peer, capture, blobs, 60.0, 4096, superseded)

    snapshotter = Snapshotter(SnapshotStore(), push, lambda: None)
    states = {4: {"model": {"w": torch.randn(30, 7)}}}
    try:
        snapshotter.submit(Capture("j", 3, "me", states, servers[0].address, generation=0))
        deadline = time.monotonic() + 10
        while refuser.refusals < 2:  # refused, and retrying
            assert time.monotonic() < deadline
            time.sleep(0.01)
        snapshotter.submit(Capture("j", 4, "me", states, servers[1].address, generation=0))
        assert snapshotter.flush(10.0)
        assert keeper.steps == [4] and sorted(keeper.kept) == [4]
        refused = refuser.refusals
        time.sleep(1.0)  # > the retries' longest pause (0.5 s)
        assert refuser.refusals == refused
    finally:
        snapshotter.close()
        pool.close()
        for server in servers:
            server.stop(grace=0.1)
