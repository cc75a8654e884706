"""When a stage heartbeats before its interval is up (``StageServer._until_next_beat``):
after a step commits, if the coordinator's policy asked for the next step's measurements;
as soon as the stage's measured compute moved by a quarter, in the middle of a step too;
never sooner than a quarter of the interval after its last beat; else at the interval."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from elasticpipe.stage_server import server as server_module
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.slicestate import LayerTiming
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.v1 import coordinator_pb2

pytestmark = pytest.mark.timeout(30)

INTERVAL = 0.8


def _server(asked: bool, compute_s: float) -> tuple[StageServer, threading.Event]:
    server = StageServer(StageConfig(name="s"), "127.0.0.1:1")
    committed = threading.Event()
    timing = LayerTiming(forward_s=compute_s / 2, backward_s=compute_s / 2)
    server.stage = SimpleNamespace(committed=committed, timings=lambda: {0: timing})  # type: ignore[assignment]
    server._report_asked, server._reported_s = asked, 1.0
    return server, committed


def _waited(server: StageServer, committed: threading.Event, commit_after_s: float) -> float:
    start = time.monotonic()
    threading.Timer(commit_after_s, committed.set).start()
    server._until_next_beat(INTERVAL)
    return time.monotonic() - start


def test_asked_for_the_next_step_it_reports_once_that_step_commits() -> None:
    server, committed = _server(asked=True, compute_s=1.0)
    assert 0.3 <= _waited(server, committed, 0.3) < 0.6  # the commit, not the interval
    # a commit right after the last beat waits for a quarter of the interval
    server, committed = _server(asked=True, compute_s=1.0)
    assert 0.2 <= _waited(server, committed, 0.01) < 0.5


def test_compute_that_moved_is_reported_at_once_without_waiting_for_the_commit() -> None:
    """A straggler is reported in the middle of its first slowed step: its figures then
    propose a re-split that the step's end confirms."""
    server, committed = _server(asked=False, compute_s=1.4)  # 40% slower than reported
    assert 0.2 <= _waited(server, committed, 0.7) < 0.45  # a quarter of the interval


def test_otherwise_it_waits_the_interval() -> None:
    server, committed = _server(asked=False, compute_s=1.1)  # within the noise
    assert _waited(server, committed, 0.1) >= INTERVAL - 0.05


def test_a_step_committed_while_the_last_report_was_on_its_way_is_not_lost() -> None:
    """The report takes its figures, then a step commits before its reply asks for the
    next step's measurements: the commit still ends the wait (the heartbeat, not the
    wait, forgets earlier commits), so the step's figures go out a quarter of the interval
    after the last beat, not a whole interval later."""
    server, committed = _server(asked=True, compute_s=1.0)
    committed.set()  # (during the Heartbeat call)
    start = time.monotonic()
    server._until_next_beat(INTERVAL)
    assert 0.2 - 0.01 <= time.monotonic() - start < 0.5


def test_a_heartbeat_forgets_the_commits_its_figures_include(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What ``_until_next_beat`` wakes on is cleared by the heartbeat itself, before it
    takes its figures: a commit from before them is in this report and wakes no early
    one."""
    server, committed = _server(asked=True, compute_s=1.0)
    monkeypatch.setattr(server_module, "state_to_proto", lambda state: None)
    monkeypatch.setattr(server_module, "holdings_to_proto", lambda holdings: [])
    zero = SimpleNamespace(at=lambda epoch: 0.0, value=lambda: 0.0)
    server.stage.__dict__.update(
        epoch=1,
        committed_step=3,
        slowdown=SimpleNamespace(factor=1.0),
        state=lambda: None,
        holdings=lambda: [],
        memory_bytes=0,
        pipeline_time=zero,
        reduce_rate=zero,
        optimizer_rate=zero,
        between_runs=zero,
        keep_from=lambda step: None,
        poisoned="",
    )
    seen: list[bool] = []

    def call(method: str, request: object, timeout: float) -> Any:
        seen.append(committed.is_set())
        return coordinator_pb2.HeartbeatResponse(report_after_step=True)

    server.stage_id = "st-1"
    server.coordinators = SimpleNamespace(call=call)  # type: ignore[assignment]
    committed.set()  # a step committed before this heartbeat
    server._heartbeat(INTERVAL)
    assert seen == [False] and not committed.is_set()
    start = time.monotonic()
    threading.Timer(0.3, committed.set).start()  # the next step commits
    server._until_next_beat(INTERVAL)
    assert 0.3 <= time.monotonic() - start < 0.6  # woken by that one, not the earlier one
