"""StagePool.all(retry_unreachable=True): a stage that cannot be reached at the first call
(a connection refused or timed out while hundreds open at once) is called once more."""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest

from elasticpipe import rpc, serving
from elasticpipe.errors import StageUnavailable
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc


class Stats(stage_pb2_grpc.StageServiceServicer):
    """A StageService that answers GetStats (the rest: UNIMPLEMENTED)."""

    def GetStats(self, request: stage_pb2.StatsRequest, context: Any) -> stage_pb2.StageStats:
        return stage_pb2.StageStats()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_later(port: int, delay: float) -> tuple[threading.Thread, list[serving.RunningServer]]:
    started: list[serving.RunningServer] = []

    def run() -> None:
        threading.Event().wait(delay)
        descriptor = stage_pb2.DESCRIPTOR.services_by_name["StageService"]
        started.append(serving.start_server(f"127.0.0.1:{port}", [(descriptor, Stats())]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, started


@pytest.mark.timeout(30)
@pytest.mark.parametrize("retry", [True, False])
def test_a_stage_up_before_the_retry_is_reached(retry: bool) -> None:
    port = free_port()
    thread, started = serve_later(port, 0.1)  # after the first call, before the retry
    pool = rpc.StagePool()
    try:
        calls = [(f"127.0.0.1:{port}", stage_pb2.StatsRequest())]
        if retry:
            replies = pool.all(calls, "GetStats", 5.0, retry_unreachable=True)
            assert len(replies) == 1 and isinstance(replies[0], stage_pb2.StageStats)
        else:
            with pytest.raises(StageUnavailable, match=str(port)):
                pool.all(calls, "GetStats", 5.0)
    finally:
        thread.join()
        pool.close()
        for server in started:
            server.stop(grace=0.1)
