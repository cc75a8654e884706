"""Peers not reached at the first try (a connection refused, or timed out while hundreds
open at once): StagePool.all(retry_unreachable=True) calls them once more, and a snapshot
copy's push tries a few times, then gives up on a peer that stays unreachable."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from elasticpipe.errors import StageUnavailable
from elasticpipe.stage_server import transfers
from elasticpipe.stage_server.snapshots import Capture
from elasticpipe.transport import rpc, serving
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support.servers import free_port, serve_stage


class Stats(stage_pb2_grpc.StageServiceServicer):
    """A StageService that answers GetStats (the rest: UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.pushed: list[str] = []

    def GetStats(self, request: stage_pb2.StatsRequest, context: Any) -> stage_pb2.StageStats:
        return stage_pb2.StageStats()

    def PushSnapshot(
        self, chunks: Iterator[stage_pb2.SnapshotChunk], context: Any
    ) -> stage_pb2.Ack:
        self.pushed.extend(c.source for c in chunks if c.source)
        return stage_pb2.Ack()


class UpAfterFirstTry(rpc.StagePool):
    """A pool whose first ``each`` finds nothing on ``port`` and then starts the stage
    there, before ``all``'s pause: the stage is up before the retry is reached however
    slowly a loaded host starts a server (a server started from a timer on a thread came
    up after the retry in one CI run of five)."""

    def __init__(self, port: int) -> None:
        super().__init__()
        self.port = port
        self.started: list[serving.RunningServer] = []

    def each(self, address_requests: Any, method: str, timeout: float) -> list[Any]:
        out = super().each(address_requests, method, timeout)
        if not self.started:
            self.started.append(serve_stage(Stats(), f"127.0.0.1:{self.port}"))
        return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retry", [True, False])
def test_a_stage_up_before_the_retry_is_reached(retry: bool) -> None:
    port = free_port()
    pool = UpAfterFirstTry(port)
    try:
        calls = [(f"127.0.0.1:{port}", stage_pb2.StatsRequest())]
        if retry:
            replies = pool.all(calls, "GetStats", 5.0, retry_unreachable=True)
            assert len(replies) == 1 and isinstance(replies[0], stage_pb2.StageStats)
        else:
            with pytest.raises(StageUnavailable, match=str(port)):
                pool.all(calls, "GetStats", 5.0)
    finally:
        pool.close()
        for server in pool.started:
            server.stop(grace=0.1)


def push(pool: rpc.StagePool, port: int, after_a_refusal: Callable[[], bool] = bool) -> None:
    capture = Capture(job_id="j", step=0, source="me", states={}, peer="", generation=0)
    transfers.push_snapshot(
        pool, f"127.0.0.1:{port}", capture, [], 10.0, 1 << 20, superseded=after_a_refusal
    )


@pytest.mark.timeout(30)
def test_a_snapshot_copy_reaches_a_peer_up_after_the_first_try() -> None:
    port = free_port()
    servicer = Stats()
    started: list[serving.RunningServer] = []

    def start_the_peer() -> bool:  # asked after each failed try, before the pause
        if not started:
            started.append(serve_stage(servicer, f"127.0.0.1:{port}"))
        return False  # (nothing newer waits: the push goes on)

    pool = rpc.StagePool()
    try:
        push(pool, port, start_the_peer)
        assert servicer.pushed == ["me"] and started
    finally:
        pool.close()
        for server in started:
            server.stop(grace=0.1)


@pytest.mark.timeout(30)
def test_a_snapshot_copy_gives_up_on_an_unreachable_peer_after_a_few_tries() -> None:
    pool = rpc.StagePool()
    try:
        started = time.monotonic()
        with pytest.raises(StageUnavailable):
            push(pool, free_port())
        assert time.monotonic() - started < 5.0  # not PUSH_RETRIES pauses of up to 0.5 s
    finally:
        pool.close()
