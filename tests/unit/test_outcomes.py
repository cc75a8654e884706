"""A run's waiter (``client.outcomes.Outcomes``): outcomes posted from other threads wake
it, RunSteps on bulk channels are read when their answers come, and every wait ends --
by the deadline, sooner after an abort -- with each caller's lock released."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from elasticpipe.client.outcomes import Outcomes
from elasticpipe.errors import DeadlineExceeded, StageUnavailable, StaleEpoch
from elasticpipe.transport import bulk
from elasticpipe.transport.bulk_calls import BulkCaller
from elasticpipe.v1 import stage_pb2

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def called() -> Iterator[tuple[BulkCaller, socket.socket]]:
    """A caller whose RunStep was written (its lock held), and the stage's end of its
    connection (a socket pair stands for the bulk connection)."""
    ours, theirs = socket.socketpair()
    caller = BulkCaller(None, "stage-a", None)  # type: ignore[arg-type]  # no gRPC needed
    caller._sock = ours  # as ``start`` leaves it
    caller.lock.acquire()
    yield caller, theirs
    theirs.close()


def test_a_post_from_another_thread_wakes_the_wait(
    called: tuple[BulkCaller, socket.socket],
) -> None:
    caller, _ = called
    with Outcomes(time.monotonic() + 10) as outcomes:
        outcomes.expect("stage-a", caller)
        threading.Timer(0.05, outcomes.post, ("client", None)).start()
        assert outcomes.next() == ("client", None)
    assert caller.connection is None and not caller.lock.locked()  # unanswered: closed


def test_an_answer_is_read_when_it_comes_and_frees_its_caller(
    called: tuple[BulkCaller, socket.socket],
) -> None:
    caller, stage = called
    report = stage_pb2.StepReport(run=7, losses=[0.5]).SerializeToString()
    with Outcomes(time.monotonic() + 10) as outcomes:
        outcomes.expect("stage-a", caller)
        stage.sendall(bulk.OK + bulk.U32.pack(len(report)) + report)
        address, answered = outcomes.next()
        assert address == "stage-a" and answered.result().losses == [0.5]
        assert not caller.lock.locked() and caller.connection is not None  # still of use


def test_a_refusal_is_raised_as_its_kind(called: tuple[BulkCaller, socket.socket]) -> None:
    caller, stage = called
    with Outcomes(time.monotonic() + 10) as outcomes:
        outcomes.expect("stage-a", caller)
        bulk.send_error(stage, StaleEpoch("stale epoch 3: stage stage-a is at epoch 4"))
        _, answered = outcomes.next()
        with pytest.raises(StaleEpoch, match="at epoch 4"):
            answered.result()
    assert not caller.lock.locked()


def test_no_answer_by_the_deadline_is_deadline_exceeded(
    called: tuple[BulkCaller, socket.socket],
) -> None:
    caller, _ = called
    with Outcomes(time.monotonic() + 0.2) as outcomes:
        outcomes.expect("stage-a", caller)
        _, answered = outcomes.next()
        with pytest.raises(DeadlineExceeded, match="stage-a"):
            answered.result()
        assert caller.connection is None and not caller.lock.locked()


def test_after_an_abort_a_silent_stage_is_taken_as_gone_soon(
    called: tuple[BulkCaller, socket.socket],
) -> None:
    caller, _ = called
    with Outcomes(time.monotonic() + 60) as outcomes:
        outcomes.expect("stage-a", caller)
        start = time.monotonic()
        outcomes.shorten(0.2)
        _, answered = outcomes.next()
        assert time.monotonic() - start < 5
        with pytest.raises(StageUnavailable, match="answered nothing after the abort"):
            answered.result()


def test_a_connection_that_ends_before_the_answer_is_stage_unavailable(
    called: tuple[BulkCaller, socket.socket],
) -> None:
    caller, stage = called
    with Outcomes(time.monotonic() + 10) as outcomes:
        outcomes.expect("stage-a", caller)
        stage.close()  # as a SIGKILLed stage's
        _, answered = outcomes.next()
        with pytest.raises(StageUnavailable):
            answered.result()
    assert caller.connection is None and not caller.lock.locked()


def test_an_answer_already_here_at_the_deadline_is_read_not_dropped(
    called: tuple[BulkCaller, socket.socket],
) -> None:
    caller, stage = called
    report = stage_pb2.StepReport(run=7).SerializeToString()
    with Outcomes(time.monotonic() + 60) as outcomes:
        outcomes.expect("stage-a", caller)
        stage.sendall(bulk.OK + bulk.U32.pack(len(report)) + report)
        time.sleep(0.05)  # (the answer is in the socket's buffer)
        outcomes.shorten(0)
        _, answered = outcomes.next()
        assert answered.result().run == 7
        assert caller.connection is not None and not caller.lock.locked()
