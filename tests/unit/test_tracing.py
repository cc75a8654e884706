"""A stage's span buffer keeps the newest steps, bounded, and answers bounded."""

from __future__ import annotations

import threading

import pytest

from elasticpipe.stage_server.tracing import MAX_SPANS_PER_STEP, Span, SpanKind, Tracer


def _span(step: int, i: int = 0, kind: SpanKind = SpanKind.FORWARD) -> Span:
    return Span(kind, 10 * i, 10 * i + 5, step, run=step, micro_batch=i)


def test_only_the_newest_steps_are_kept() -> None:
    """After more steps than it keeps, the buffer holds the newest ones, oldest first."""
    tracer = Tracer(steps_kept=3)
    for step in range(1, 7):
        tracer.record(_span(step))
    spans, truncated = tracer.last(10)
    assert [s.step for s in spans] == [4, 5, 6]
    assert not truncated
    assert [s.step for s in tracer.last(2)[0]] == [5, 6]
    assert tracer.last(0) == ([], False)


def test_a_rollback_drops_the_abandoned_later_steps() -> None:
    """A span of an earlier step than the newest (a replay) discards the later steps."""
    tracer = Tracer(steps_kept=8)
    for step in (1, 2, 3, 4):
        tracer.record(_span(step))
    tracer.record(_span(2, 1))
    assert [(s.step, s.micro_batch) for s in tracer.last(8)[0]] == [(1, 0), (2, 1)]


def test_spans_per_step_are_capped() -> None:
    """A step cannot hold more than MAX_SPANS_PER_STEP spans, whatever is recorded."""
    tracer = Tracer(steps_kept=1)
    for i in range(MAX_SPANS_PER_STEP + 10):
        tracer.record(_span(1, i))
    assert len(tracer.last(1)[0]) == MAX_SPANS_PER_STEP


def test_the_answer_is_bounded_and_says_so() -> None:
    """Asking for more spans than allowed returns the newest whole steps and truncated."""
    tracer = Tracer(steps_kept=4)
    for step in (1, 2, 3):
        for i in range(5):
            tracer.record(_span(step, i))
    spans, truncated = tracer.last(3, most=12)
    assert truncated
    assert {s.step for s in spans} == {2, 3}


def test_the_span_context_times_the_block_under_the_newest_step() -> None:
    """``span()`` records start and end on the stage clock; no step means the newest."""
    tracer = Tracer()
    tracer.record(_span(7))
    before = tracer.now_ns()
    with pytest.raises(RuntimeError), tracer.span(SpanKind.FREEZE, epoch=3):
        raise RuntimeError("a failed freeze is still a span")
    freeze = tracer.last(1)[0][-1]
    assert (freeze.kind, freeze.step, freeze.epoch) == (SpanKind.FREEZE, 7, 3)
    assert before <= freeze.start_ns <= freeze.end_ns <= tracer.now_ns()
    assert freeze.to_proto().duration_ns == freeze.end_ns - freeze.start_ns


def test_concurrent_recorders_lose_nothing() -> None:
    """Spans recorded from several threads at once (links, executor, RPCs) all arrive."""
    tracer = Tracer(steps_kept=2)
    tracer.record(_span(1))

    def work(k: int) -> None:
        for i in range(500):
            tracer.record(_span(1, k * 1000 + i, SpanKind.SEND))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(tracer.last(1)[0]) == 1 + 4 * 500
