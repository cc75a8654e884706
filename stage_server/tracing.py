"""A stage's timeline: spans of its ops (forward, backward, send, receive wait, commit,
epoch changes) for the last few steps, in a bounded ring buffer.

Recording is cheap enough for the hot path: two ``time.perf_counter_ns()`` reads and one
append under a lock held only for the append. Spans are grouped by step, in increasing
order; the buffer keeps the newest ``steps_kept`` steps and at most ``MAX_SPANS_PER_STEP``
spans of each, so its memory is bounded whatever the clients do. Times are on the
stage's clock, in unix nanoseconds: a monotonic counter anchored to ``time.time_ns()``
once, so that spans never jump with the wall clock, and ``now_ns`` lets a collector
measure this stage's offset from its own clock.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from enum import Enum
from typing import NamedTuple

from elasticpipe.v1 import stage_pb2

DEFAULT_STEPS_KEPT = 16
# F, B, a receive wait and a send per micro-batch (ZB-H1's W: 5 each, up to 3276 of them);
# at most one response's worth (MAX_TRACE_SPANS), so one step always fits an answer
MAX_SPANS_PER_STEP = 4 * 4096 + 64
MAX_TRACE_SPANS = 20_000  # per response: about 1 MB on the wire


class SpanKind(Enum):
    """What a span measured (the wire's ``SpanKind``)."""

    FORWARD = stage_pb2.SPAN_FORWARD
    BACKWARD = stage_pb2.SPAN_BACKWARD  # ZB-H1: the input gradients (B)
    WEIGHT = stage_pb2.SPAN_WEIGHT  # ZB-H1: the weight gradients (W)
    SEND = stage_pb2.SPAN_SEND
    RECV_WAIT = stage_pb2.SPAN_RECV_WAIT
    COMMIT = stage_pb2.SPAN_COMMIT
    FREEZE = stage_pb2.SPAN_FREEZE
    PREPARE = stage_pb2.SPAN_PREPARE
    EPOCH_COMMIT = stage_pb2.SPAN_EPOCH_COMMIT
    REDUCE = stage_pb2.SPAN_REDUCE  # replicas: one group's reduction (micro_batch: the group)


class Span(NamedTuple):
    """One interval of a stage's work, on the stage's clock (unix ns). A named tuple:
    built on the hot path, where a frozen dataclass costs ten times as much."""

    kind: SpanKind
    start_ns: int
    end_ns: int
    step: int
    run: int = 0
    micro_batch: int = -1
    layer_lo: int = 0
    layer_hi: int = 0
    peer: str = ""
    epoch: int = 0
    # An inference run's: it runs under the number of the step committed last, so without
    # this its forwards would pass for that training step's.
    inference: bool = False

    def to_proto(self) -> stage_pb2.Span:
        """The span in wire form."""
        return stage_pb2.Span(
            kind=self.kind.value,
            start_ns=self.start_ns,
            duration_ns=self.end_ns - self.start_ns,
            step=self.step,
            run=self.run,
            micro_batch=self.micro_batch,
            layer_lo=self.layer_lo,
            layer_hi=self.layer_hi,
            peer=self.peer,
            epoch=self.epoch,
            inference=self.inference,
        )


class Tracer:
    """The spans of a stage's last ``steps_kept`` steps."""

    def __init__(self, steps_kept: int = DEFAULT_STEPS_KEPT):
        if steps_kept < 1:
            raise ValueError(f"steps_kept must be >= 1 (got {steps_kept})")
        self.steps_kept = steps_kept
        self._anchor = time.time_ns() - time.perf_counter_ns()
        self._lock = threading.Lock()
        self._steps: OrderedDict[int, list[Span]] = OrderedDict()
        self._newest: tuple[int, list[Span]] | None = None  # the last step's, for speed

    def now_ns(self) -> int:
        """This stage's clock: unix nanoseconds, monotonic."""
        return self._anchor + time.perf_counter_ns()

    def record(self, span: Span) -> None:
        """Keeps ``span`` under its step; drops the oldest step when too many are kept."""
        with self._lock:
            newest = self._newest
            if newest is not None and newest[0] == span.step:
                if len(newest[1]) < MAX_SPANS_PER_STEP:
                    newest[1].append(span)
                return
            if self._steps and span.step < next(reversed(self._steps)):
                # An earlier step than the newest kept: the job rolled back (recovery, a
                # load), and what was kept of it and later is of an abandoned history.
                for later in [s for s in self._steps if s >= span.step]:
                    del self._steps[later]
            spans = self._steps.get(span.step)
            if spans is None:
                spans = self._steps[span.step] = []
                while len(self._steps) > self.steps_kept:
                    self._steps.popitem(last=False)
            step, last = next(reversed(self._steps.items()))
            self._newest = (step, last)
            if len(spans) < MAX_SPANS_PER_STEP:
                spans.append(span)

    @contextmanager
    def span(
        self, kind: SpanKind, step: int | None = None, run: int = 0, epoch: int = 0
    ) -> Iterator[None]:
        """Records the time the ``with`` block takes (also when it raises).

        Args:
            step: the step it belongs to; None: the newest step kept (an epoch change
                happens at the cut after it).
        """
        start = self.now_ns()
        try:
            yield
        finally:
            end = self.now_ns()
            if step is None:
                with self._lock:
                    step = next(reversed(self._steps), 0)
            self.record(Span(kind, start, end, step, run=run, epoch=epoch))

    def last(self, steps: int, most: int = MAX_TRACE_SPANS) -> tuple[list[Span], bool]:
        """The spans of the newest ``steps`` steps kept, oldest first.

        Returns:
            The spans, and whether some were left out to stay within ``most`` (the
            oldest steps' go first).
        """
        with self._lock:
            chosen = list(self._steps.items())[-steps:] if steps > 0 else []
            chosen = [(step, list(spans)) for step, spans in chosen]
        out: list[list[Span]] = []
        total, truncated = 0, False
        for _, spans in reversed(chosen):
            if total + len(spans) > most:
                truncated = True
                break
            out.append(spans)
            total += len(spans)
        return [s for spans in reversed(out) for s in spans], truncated
