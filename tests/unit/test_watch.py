"""The live status view: frames rendered from two statuses, and the polling loop."""

from __future__ import annotations

import dataclasses
import io
import json
from collections.abc import Callable, Iterator

import pytest
from rich.console import Console

from elasticpipe.cli.watch import efficiency, render, step_rate, watch
from elasticpipe.client.admin import Status, from_proto
from elasticpipe.errors import CoordinatorUnavailable
from elasticpipe.v1 import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(20)


def _status(step: int, job: str = "job-1", history: int = 2) -> Status:
    """A status as ``Admin.status`` returns it (typed, from the wire's message)."""
    message = pb.StatusResponse(
        job_id=job,
        job_model="gpt",
        num_layers=8,
        committed_step=step,
        partition=pb.Partition(epoch=history, boundaries=[0, 3, 8]),
        stages=[
            pb.StageInfo(name="spare-9", state="spare", index=-1, slowdown=1.0),
            _chain("right", 1, 3, 8, speed=0.9, slowdown=3.0, committed_step=step),
            _chain("left", 0, 0, 3, speed=1.4, slowdown=1.0, committed_step=step),
        ],
        history=[
            pb.EpochRecord(epoch=e, kind="move", boundaries=[0, e, 8], reason=f"decision-{e}")
            for e in range(1, history + 1)
        ],
    )
    return _typed(message)


def _typed(message: pb.StatusResponse) -> Status:
    return from_proto(Status, message)


def _chain(name: str, index: int, lo: int, hi: int, **fields: float) -> pb.StageInfo:
    """A chain stage's row: its place, its layers ``[lo, hi)``, and its other ``fields``."""
    return pb.StageInfo(name=name, state="chain", index=index, layer_lo=lo, layer_hi=hi, **fields)


def _text(previous: Status | None, current: Status, elapsed: float, **kw: int) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(render(previous, current, elapsed, **kw))
    return console.export_text()


def test_step_rate_is_the_committed_step_delta_over_the_interval() -> None:
    """12 more committed steps in 4 s read 3.00/s; the first frame has no rate."""
    assert "step rate 3.00/s" in _text(_status(10), _status(22), 4.0)
    assert "step rate -" in _text(None, _status(22), 0.0)


@pytest.mark.parametrize(
    ("previous", "current", "expected"),
    [
        (_status(30), _status(25), 0.0),  # a rollback: no negative rate
        (_status(30, job="job-1"), _status(35, job="job-2"), None),  # another job
        (_status(30), _status(40), 5.0),
    ],
)
def test_step_rate_edges(previous: Status, current: Status, expected: float | None) -> None:
    """A rollback reads 0, a new job has no rate, otherwise delta over time."""
    assert step_rate(previous, current, 2.0) == expected


def test_stages_are_listed_in_chain_order_with_speed_slowdown_layers_and_step() -> None:
    """Chain stages come first in chain order (spares after), each with its layer count."""
    text = _text(_status(10), _status(12), 1.0)
    left, right, spare = text.index("left"), text.index("right"), text.index("spare-9")
    assert left < right < spare
    right_row = next(line for line in text.splitlines() if "right" in line)
    for cell in ("chain", "0.900", "3x", "3:8 (5)", "12"):
        assert cell in right_row


def test_only_the_newest_decisions_are_shown() -> None:
    """With 9 epoch records and 3 shown, the last three reasons appear and older do not."""
    text = _text(None, _status(5, history=9), 0.0, decisions=3)
    assert "last decisions (of 9)" in text
    assert all(f"decision-{e}" in text for e in (7, 8, 9))
    assert "decision-6" not in text


def test_efficiency_shows_once_the_client_reported_one() -> None:
    """No efficiency step: nothing shown; with one: the figure and its step."""
    assert efficiency(_status(1)) is None
    assert "efficiency" not in _text(None, _status(1), 0.0)
    status = dataclasses.replace(_status(12), efficiency=0.73, efficiency_step=11)
    assert efficiency(status) == (pytest.approx(0.73), 11)
    assert "efficiency 73% (step 11)" in _text(None, status, 0.0)


def _polls(*items: Status | Exception) -> Callable[[], Status]:
    it: Iterator[Status | Exception] = iter(items)

    def fetch() -> Status:
        item = next(it)
        if isinstance(item, Exception):
            raise item
        return item

    return fetch


def test_watch_prints_count_frames_and_keeps_going_after_a_failed_poll() -> None:
    """Off a terminal each poll is printed; a failed poll shows a note over the last status."""
    out = io.StringIO()
    console = Console(file=out, width=160)
    fetch = _polls(_status(1), CoordinatorUnavailable("gone for a moment"), _status(9))
    assert watch(fetch, console, interval_s=0.01, count=3) == 0
    text = out.getvalue()
    assert text.count("stages") == 3
    assert "poll failed (showing the last good status): gone for a moment" in text
    assert "step 9" in text


def test_watch_json_prints_one_object_per_poll_and_errors_as_json() -> None:
    """With a JSON converter every poll is one line: the status, or an error object."""
    out = io.StringIO()
    fetch = _polls(_status(1), CoordinatorUnavailable("down"), _status(2))
    watch(fetch, Console(file=out), 0.01, 3, lambda s: {"step": s.committed_step})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0] == {"step": 1} and lines[2] == {"step": 2}
    assert lines[1] == {"error": {"code": "UNAVAILABLE", "message": "down"}}


def test_the_first_failed_poll_propagates() -> None:
    """Nothing to show yet: the error of the first poll reaches the caller."""
    with pytest.raises(CoordinatorUnavailable):
        watch(_polls(CoordinatorUnavailable("nobody")), Console(file=io.StringIO()), 0.01, 1)


def test_on_a_terminal_the_view_is_redrawn_in_place() -> None:
    """A terminal gets a live display: the last frame is on screen, with its step rate."""
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=True)
    assert watch(_polls(_status(1), _status(7)), console, 0.01, count=2) == 0
    text = out.getvalue()
    assert "step 7" in text and "step rate" in text
    assert "\x1b[" in text  # cursor movement / styling: drawn live, not appended as a log
