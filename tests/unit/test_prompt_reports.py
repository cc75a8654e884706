"""When a stage heartbeats before its interval is up (``StageServer._until_next_beat``):
after a step commits, if the coordinator's policy asked for the next step's measurements;
as soon as the stage's measured compute moved by a quarter, in the middle of a step too;
never sooner than a quarter of the interval after its last beat; else at the interval."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.slicestate import LayerTiming
from elasticpipe.stage_server.stage import StageConfig

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
