"""Tests of the mailbox: delivery before or after the wait, deadlines, failures, memory bound."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from elasticpipe.errors import DeadlineExceeded, StageUnavailable, StepAborted, TooLarge
from elasticpipe.stage_server.mailbox import (
    EARLY_ENTRIES,
    EARLY_HELD_RUNS,
    EARLY_RUNS,
    KNOWN_RUNS,
    MAX_ENTRIES,
    NO_SECRET,
    Mailbox,
    Slot,
)

pytestmark = pytest.mark.timeout(20)

SOON = 0.05  # how long a helper thread waits before acting
PATIENT = 5.0  # a deadline far enough away that reaching it means the wake-up was missed


def _box(max_bytes: int, **kwargs: Any) -> Mailbox:
    """A mailbox whose runs 1 to 9 were started, their data carrying no secret (the
    secrets themselves are tested below)."""
    box = Mailbox(max_bytes, **kwargs)
    for run in range(1, 10):
        box.expect(run, NO_SECRET)
    return box


def _later(action: Callable[[], None]) -> threading.Thread:
    """Runs ``action`` on another thread after a short delay."""

    def run() -> None:
        time.sleep(SOON)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _timed_take(box: Mailbox, run: int, slot: Slot, mb: int, wait: float) -> tuple[Any, float]:
    start = time.monotonic()
    try:
        value: Any = box.take(run, slot, mb, start + wait)
    except Exception as exc:
        value = exc
    return value, time.monotonic() - start


def test_put_before_take_is_delivered() -> None:
    """A message that arrives before its take is returned at once."""
    box = _box(1000, entry_overhead=0)
    box.put(1, Slot.INPUT, 0, "x0", 10)
    value, took = _timed_take(box, 1, Slot.INPUT, 0, PATIENT)
    assert value == "x0"
    assert took < 0.5


def test_slots_and_micro_batches_are_kept_apart() -> None:
    """Messages are keyed by run, slot and micro-batch: each take gets its own message."""
    box = _box(1000, entry_overhead=0)
    box.put(1, Slot.INPUT, 0, "in0", 1)
    box.put(1, Slot.GRAD, 0, "grad0", 1)
    box.put(1, Slot.INPUT, 1, "in1", 1)
    box.put(2, Slot.INPUT, 0, "run2", 1)
    deadline = time.monotonic() + PATIENT
    assert box.take(1, Slot.GRAD, 0, deadline) == "grad0"
    assert box.take(1, Slot.INPUT, 1, deadline) == "in1"
    assert box.take(2, Slot.INPUT, 0, deadline) == "run2"
    assert box.take(1, Slot.INPUT, 0, deadline) == "in0"


def test_take_wakes_on_put_from_another_thread() -> None:
    """A waiting take returns the message as soon as another thread puts it."""
    box = _box(1000, entry_overhead=0)
    sender = _later(lambda: box.put(3, Slot.TARGET, 2, ("y", 0.5), 8))
    value, took = _timed_take(box, 3, Slot.TARGET, 2, PATIENT)
    sender.join()
    assert value == ("y", 0.5)
    assert took < 2.0


def test_take_is_removed_once() -> None:
    """A taken message is gone: a second take of it waits until its deadline."""
    box = _box(1000, entry_overhead=0)
    box.put(1, Slot.GRAD, 0, "g", 4)
    assert box.take(1, Slot.GRAD, 0, time.monotonic() + PATIENT) == "g"
    with pytest.raises(DeadlineExceeded):
        box.take(1, Slot.GRAD, 0, time.monotonic() + SOON)


def test_deadline_raises_promptly_naming_the_wait() -> None:
    """With nothing delivered, take raises DeadlineExceeded at its deadline, not later."""
    box = _box(1000, entry_overhead=0)
    value, took = _timed_take(box, 4, Slot.GRAD, 7, 0.1)
    assert isinstance(value, DeadlineExceeded)
    assert "run 4" in str(value)
    assert "grad" in str(value)
    assert "micro-batch 7" in str(value)
    assert 0.09 <= took < 0.5


def test_past_deadline_raises_at_once() -> None:
    """A deadline already in the past raises without waiting."""
    box = _box(1000, entry_overhead=0)
    value, took = _timed_take(box, 1, Slot.INPUT, 0, -1.0)
    assert isinstance(value, DeadlineExceeded)
    assert took < 0.1


def test_fail_wakes_a_waiting_take_with_that_error() -> None:
    """Failing a run wakes its waiting take with exactly the recorded error."""
    box = _box(1000, entry_overhead=0)
    error = StageUnavailable("stage 2 at 127.0.0.1:1 died")
    failer = _later(lambda: box.fail(5, error))
    value, took = _timed_take(box, 5, Slot.INPUT, 0, PATIENT)
    failer.join()
    assert value is error
    assert took < 2.0


def test_fail_does_not_touch_other_runs() -> None:
    """A failure of one run leaves other runs' messages deliverable."""
    box = _box(1000, entry_overhead=0)
    box.put(6, Slot.INPUT, 0, "ok", 1)
    box.fail(5, StageUnavailable("gone"))
    assert box.take(6, Slot.INPUT, 0, time.monotonic() + PATIENT) == "ok"
    assert box.failure(6) is None


def test_first_failure_wins() -> None:
    """Only the first failure of a run is recorded and raised."""
    box = _box(1000, entry_overhead=0)
    first, second = StageUnavailable("first"), StageUnavailable("second")
    box.fail(1, first)
    box.fail(1, second)
    assert box.failure(1) is first
    with pytest.raises(StageUnavailable, match="first"):
        box.take(1, Slot.INPUT, 0, time.monotonic() + PATIENT)


def test_abort_fails_the_run_with_step_aborted() -> None:
    """abort wakes the run's waits with StepAborted carrying the reason."""
    box = _box(1000, entry_overhead=0)
    box.abort(9, "client gave up")
    with pytest.raises(StepAborted, match="client gave up"):
        box.take(9, Slot.GRAD, 0, time.monotonic() + PATIENT)


def test_messages_of_closed_runs_are_dropped() -> None:
    """close_through frees held messages of closed runs and drops their late arrivals."""
    box = _box(1000, entry_overhead=0)
    box.put(2, Slot.INPUT, 0, "held", 10)
    box.put(4, Slot.INPUT, 0, "kept", 10)
    box.close_through(3)
    box.put(3, Slot.INPUT, 1, "late", 10)
    assert box.usage() == (10, 1)  # only run 4's message is held
    for run, mb in ((2, 0), (3, 1)):
        with pytest.raises(StepAborted, match=f"run {run} was not started here"):
            box.take(run, Slot.INPUT, mb, time.monotonic() + SOON)
    assert box.take(4, Slot.INPUT, 0, time.monotonic() + PATIENT) == "kept"


def test_close_through_forgets_failures_of_closed_runs() -> None:
    """Failures of closed runs are discarded; later runs keep theirs."""
    box = _box(1000, entry_overhead=0)
    box.fail(1, StageUnavailable("old"))
    box.fail(2, StageUnavailable("new"))
    box.close_through(1)
    assert box.failure(1) is None
    assert box.failure(2) is not None


def test_close_through_never_reopens_runs() -> None:
    """Closing through an older run keeps newer closed runs closed."""
    box = _box(1000, entry_overhead=0)
    box.close_through(5)
    box.close_through(2)
    box.put(4, Slot.INPUT, 0, "late", 1)
    assert box.usage() == (0, 0)  # dropped, not held
    box.expect(4, NO_SECRET)  # a closed run is not started again
    with pytest.raises(StepAborted):
        box.take(4, Slot.INPUT, 0, time.monotonic() + SOON)


def test_byte_limit_raises_too_large_with_the_values() -> None:
    """A put that would pass the byte limit raises TooLarge naming held, extra and limit."""
    box = _box(100, entry_overhead=0)
    box.put(1, Slot.INPUT, 0, "a", 60)
    box.put(1, Slot.INPUT, 1, "b", 40)
    with pytest.raises(TooLarge) as info:
        box.put(1, Slot.INPUT, 2, "c", 1)
    assert all(
        v in str(info.value) for v in ("100 bytes in 2 messages", "1 more", "limit of 100 bytes")
    )


def test_bytes_return_to_zero_after_takes() -> None:
    """Taking every message frees its bytes: a full-limit message fits again."""
    box = _box(100, entry_overhead=0)
    box.put(1, Slot.INPUT, 0, "a", 60)
    box.put(1, Slot.GRAD, 0, "b", 40)
    deadline = time.monotonic() + PATIENT
    box.take(1, Slot.INPUT, 0, deadline)
    box.take(1, Slot.GRAD, 0, deadline)
    box.put(2, Slot.INPUT, 0, "full", 100)
    assert box.take(2, Slot.INPUT, 0, deadline) == "full"


def test_bytes_return_to_zero_after_close_through() -> None:
    """Closing runs frees the bytes of their untaken messages."""
    box = _box(100, entry_overhead=0)
    box.put(1, Slot.INPUT, 0, "a", 60)
    box.put(2, Slot.INPUT, 0, "b", 40)
    box.close_through(2)
    box.put(3, Slot.INPUT, 0, "full", 100)
    assert box.take(3, Slot.INPUT, 0, time.monotonic() + PATIENT) == "full"


def test_duplicate_delivery_does_not_leak_bytes() -> None:
    """A re-delivered message replaces the first without leaking its bytes."""
    box = _box(100, entry_overhead=0)
    box.put(1, Slot.INPUT, 0, "first", 40)
    box.put(1, Slot.INPUT, 0, "again", 40)
    assert box.take(1, Slot.INPUT, 0, time.monotonic() + PATIENT) == "again"
    box.close_through(1)
    box.put(2, Slot.INPUT, 0, "full", 100)  # the mailbox is empty: this must fit


def test_concurrent_puts_and_takes_lose_nothing() -> None:
    """Many producers and consumers on separate threads exchange every message once."""
    box = _box(10_000, entry_overhead=0)
    n = 200
    got: list[int] = []
    lock = threading.Lock()

    def consume(mbs: range) -> None:
        for i in mbs:
            value = box.take(1, Slot.INPUT, i, time.monotonic() + PATIENT)
            with lock:
                got.append(value)

    def produce(mbs: range) -> None:
        for i in mbs:
            box.put(1, Slot.INPUT, i, i, 1)

    threads = [
        threading.Thread(target=work, args=(range(k, n, 4),))
        for k in range(4)
        for work in (consume, produce)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENT * 2)
    assert sorted(got) == list(range(n))
    box.put(2, Slot.INPUT, 0, "full", 10_000)  # every byte was released


def test_every_message_counts_its_overhead_even_when_empty() -> None:
    """Zero-byte tensors are not free: each message reserves a fixed overhead, and the
    number of messages is capped."""
    box = _box(1000, entry_overhead=100)
    for i in range(10):
        box.put(1, Slot.INPUT, i, "empty", 0)
    with pytest.raises(TooLarge, match="10 messages"):
        box.put(1, Slot.INPUT, 10, "empty", 0)
    few = _box(10**6, max_entries=3, entry_overhead=0)
    for i in range(3):
        few.put(1, Slot.INPUT, i, "x", 1)
    with pytest.raises(TooLarge, match="3 messages"):
        few.reserve(1)


def test_reservations_stop_concurrent_streams_from_overcommitting() -> None:
    """Room is reserved before a message is received: two streams cannot both count on the
    same free bytes, and released room is free again."""
    box = _box(100, entry_overhead=0)
    first = box.reserve(60)
    with pytest.raises(TooLarge):
        box.reserve(60)  # the first stream's bytes are not there yet, but their room is
    box.release(first)
    box.release(first)  # idempotent
    second = box.reserve(60)
    box.put(1, Slot.INPUT, 0, "x", 60, second)
    assert box.take(1, Slot.INPUT, 0, time.monotonic() + PATIENT) == "x"
    box.put(2, Slot.INPUT, 0, "full", 100)


SECRET, OTHER = b"s" * 16, b"o" * 16


def test_a_message_without_the_runs_secret_is_never_taken() -> None:
    """Messages held before their run starts are kept apart by secret: a stranger's copy
    neither replaces nor stands in for the real one, and is dropped (counted) once the run
    starts; a wrong secret arriving later is dropped at once; the take gets the real one."""
    box = Mailbox(1000, entry_overhead=0)
    assert box.put(20, Slot.INPUT, 0, "real", 10, secret=SECRET)
    assert box.put(20, Slot.INPUT, 0, "stranger", 10, secret=OTHER)  # held: run unknown
    assert box.put(20, Slot.GRAD, 0, "stranger", 10, secret=NO_SECRET)
    assert box.usage() == (30, 3)
    assert box.expect(20, SECRET) == 2
    assert box.usage() == (10, 1)
    assert not box.put(20, Slot.GRAD, 1, "late stranger", 10, secret=OTHER)
    assert box.refused == 3
    assert box.usage() == (10, 1)
    assert box.take(20, Slot.INPUT, 0, time.monotonic() + PATIENT) == "real"
    with pytest.raises(DeadlineExceeded):
        box.take(20, Slot.GRAD, 0, time.monotonic() + SOON)


def test_a_strangers_copies_replaced_while_held_are_all_counted() -> None:
    """A stranger's message that replaced its own earlier copy while held (same run, slot,
    micro-batch and secret) counts as two refused when the run starts, not one; copies
    with the run's secret are not counted."""
    box = Mailbox(1000, entry_overhead=0)
    assert box.put(23, Slot.INPUT, 0, "empty", 0, secret=NO_SECRET)
    assert box.put(23, Slot.INPUT, 0, "poison", 10, secret=NO_SECRET)  # replaces "empty"
    assert box.put(23, Slot.INPUT, 0, "poison again", 10, secret=NO_SECRET)
    assert box.put(23, Slot.GRAD, 0, "real", 5, secret=SECRET)
    assert box.put(23, Slot.GRAD, 0, "real, re-sent", 5, secret=SECRET)
    assert box.usage() == (15, 2)
    assert box.expect(23, SECRET) == 3
    assert box.refused == 3
    assert box.usage() == (5, 1)
    assert box.take(23, Slot.GRAD, 0, time.monotonic() + PATIENT) == "real, re-sent"


def test_a_waiting_take_wakes_only_for_its_secret() -> None:
    """A take waiting for its message ignores a stranger's copy and wakes on the real one."""
    box = Mailbox(1000, entry_overhead=0)
    box.expect(21, SECRET)

    def deliver() -> None:
        box.put(21, Slot.INPUT, 0, "stranger", 1, secret=OTHER)
        box.put(21, Slot.INPUT, 0, "real", 1, secret=SECRET)

    sender = _later(deliver)
    value, _ = _timed_take(box, 21, Slot.INPUT, 0, PATIENT)
    sender.join()
    assert value == "real"
    assert box.usage() == (0, 0)


def test_a_run_not_started_is_never_taken_from() -> None:
    """A take of a run that was never started fails at once, whatever is held for it."""
    box = Mailbox(1000, entry_overhead=0)
    box.put(22, Slot.INPUT, 0, "x", 1, secret=NO_SECRET)
    with pytest.raises(StepAborted, match="run 22 was not started here"):
        box.take(22, Slot.INPUT, 0, time.monotonic() + PATIENT)


def test_only_the_newest_runs_secrets_are_kept() -> None:
    """Runs that are never closed (inference) keep no more than ``KNOWN_RUNS`` secrets:
    the oldest is forgotten and its takes fail."""
    box = Mailbox(1000, entry_overhead=0)
    for run in range(100, 100 + KNOWN_RUNS + 1):
        box.expect(run, SECRET)
    with pytest.raises(StepAborted):
        box.take(100, Slot.INPUT, 0, time.monotonic() + PATIENT)
    box.put(101, Slot.INPUT, 0, "x", 1, secret=SECRET)
    assert box.take(101, Slot.INPUT, 0, time.monotonic() + PATIENT) == "x"


GENERATION = 1 << 40  # the first run id of client generation 1


def test_early_data_far_past_the_newest_run_is_dropped_and_counted() -> None:
    """Data for runs far past the newest run started here (a stranger's guesses: issue 18's
    review filled the mailbox for good with 65,546 of them), for a run passed without being
    started, or of an older generation is dropped at once and counted; the next run's is
    held and taken."""
    told: list[int] = []
    box = Mailbox(1 << 20, on_refused=told.append)
    box.expect(GENERATION + 9, SECRET)
    flood = MAX_ENTRIES + 10
    for n in range(flood):
        run = GENERATION + 10**9 + n // 4096
        assert not box.put(run, Slot.INPUT, n % 4096, "x", 0, secret=OTHER)
    assert not box.put(GENERATION + 5, Slot.INPUT, 0, "passed", 0, secret=OTHER)
    assert not box.put(9, Slot.INPUT, 0, "older client", 0, secret=OTHER)
    assert box.usage() == (0, 0)
    assert box.refused == sum(told) == flood + 2
    assert box.put(GENERATION + 10, Slot.INPUT, 0, "real", 10, secret=SECRET)
    box.expect(GENERATION + 10, SECRET)
    assert box.take(GENERATION + 10, Slot.INPUT, 0, time.monotonic() + PATIENT) == "real"
    assert box.usage() == (0, 0)


def test_early_data_in_the_window_is_freed_once_its_run_is_passed() -> None:
    """Early data is held for the ``EARLY_RUNS`` runs past the newest one; data for a run
    the stage then passes without starting it is freed (counted), not kept until a close
    that never comes."""
    box = Mailbox(1 << 20, entry_overhead=0)
    box.expect(GENERATION + 1, SECRET)
    for run in range(GENERATION + 2, GENERATION + 2 + EARLY_RUNS):
        assert box.put(run, Slot.INPUT, 0, "x", 1, secret=OTHER)
    assert not box.put(GENERATION + 2 + EARLY_RUNS, Slot.INPUT, 0, "x", 1, secret=OTHER)
    assert box.usage() == (EARLY_RUNS, EARLY_RUNS)
    box.expect(GENERATION + 5, SECRET)  # runs 2..4 passed; 5 started: its stranger dropped
    assert box.usage() == (EARLY_RUNS - 4, EARLY_RUNS - 4)
    assert box.refused == 1 + 4
    box.close_through(GENERATION + 20)
    assert box.usage() == (0, 0)


def test_a_flood_for_a_generation_not_run_yet_never_keeps_out_the_jobs_data() -> None:
    """Before any run of its generation (a stage that just joined) early data has no window:
    a stranger's flood fills only the early caps, the job's next run's data displaces it,
    and the data of the started run has the rest of the mailbox."""
    box = Mailbox(1 << 30, entry_overhead=0)
    for n in range(EARLY_ENTRIES + 1000):
        run = GENERATION + 10**6 + n % (2 * EARLY_HELD_RUNS)
        with contextlib.suppress(TooLarge):  # the caps full of its own run's or nearer
            box.put(run, Slot.INPUT, n // (2 * EARLY_HELD_RUNS), "x", 1, secret=OTHER)
    assert box.usage()[1] <= EARLY_ENTRIES
    real = GENERATION + 7
    assert box.put(real, Slot.INPUT, 0, "real", 1, secret=SECRET)
    assert box.put(real, Slot.TARGET, 0, "target", 1, secret=SECRET)
    box.expect(real, SECRET)
    assert box.usage() == (2, 2)  # the rest was of runs past the window: dropped
    for mb in range(1, MAX_ENTRIES - 2):  # the run's own data: the whole mailbox
        assert box.put(real, Slot.GRAD, mb, "g", 1, secret=SECRET)
    assert box.take(real, Slot.INPUT, 0, time.monotonic() + PATIENT) == "real"
    assert box.take(real, Slot.TARGET, 0, time.monotonic() + PATIENT) == "target"


def test_early_bytes_are_capped_and_a_nearer_run_displaces_a_further_one() -> None:
    """Early data holds at most a quarter of the bytes (or one message when alone); a
    message of a nearer run displaces a further run's, one of the furthest run is refused
    with TooLarge (its room given back)."""
    box = Mailbox(4000, entry_overhead=0)
    assert box.put(GENERATION + 90, Slot.INPUT, 0, "far", 900, secret=OTHER)
    with pytest.raises(TooLarge, match="early data of run"):
        box.put(GENERATION + 95, Slot.INPUT, 0, "further", 500, secret=OTHER)
    assert box.usage() == (900, 1)
    assert box.put(GENERATION + 1, Slot.INPUT, 0, "real", 500, secret=SECRET)
    assert box.usage() == (500, 1)
    assert box.refused == 2  # "further", refused, and "far", displaced
    box.expect(GENERATION + 1, SECRET)
    assert box.take(GENERATION + 1, Slot.INPUT, 0, time.monotonic() + PATIENT) == "real"


def test_a_runs_own_early_data_is_never_displaced_by_its_later_data() -> None:
    """The early caps full of one run's data (its inputs came before its RunStep): the
    next message of that run is refused with TooLarge naming the caps -- its sender fails
    the run at once -- and none of the run's held messages is lost; once the run starts,
    its data is no longer early and the rest comes in."""
    box = Mailbox(4000, entry_overhead=0)  # early caps: 1000 bytes
    run = GENERATION + 1
    for mb in range(4):
        assert box.put(run, Slot.INPUT, mb, f"x{mb}", 250, secret=SECRET)
    with pytest.raises(TooLarge, match=r"early data of run .* caps \(1000 bytes"):
        box.put(run, Slot.INPUT, 4, "x4", 250, secret=SECRET)
    assert box.usage() == (1000, 4) and box.refused == 1
    box.expect(run, SECRET)
    assert box.put(run, Slot.INPUT, 4, "x4", 250, secret=SECRET)
    for mb in range(5):
        assert box.take(run, Slot.INPUT, mb, time.monotonic() + PATIENT) == f"x{mb}"


def test_a_stranger_who_fills_the_early_caps_first_gives_way_to_the_runs_data() -> None:
    """A stranger's messages for the next run, sent before any of the run's (run ids are
    predictable), give way to the run's own, oldest first: they cannot fail the run."""
    box = Mailbox(4000, entry_overhead=0)  # early caps: 1000 bytes
    run = GENERATION + 1
    for mb in range(10):
        assert box.put(run, Slot.INPUT, mb, "junk", 100, secret=OTHER)
    for mb in range(4):
        assert box.put(run, Slot.INPUT, mb, f"x{mb}", 250, secret=SECRET)
    assert box.usage() == (1000, 4) and box.refused == 10
    box.expect(run, SECRET)
    for mb in range(4):
        assert box.take(run, Slot.INPUT, mb, time.monotonic() + PATIENT) == f"x{mb}"


def test_a_take_waiting_when_its_run_is_closed_ends_at_once() -> None:
    """A take still waiting when its run is closed (a reduction thread of a failed run)
    ends with StepAborted at once, not at its deadline."""
    box = _box(1000, entry_overhead=0)
    closer = _later(lambda: box.close_through(3))
    value, took = _timed_take(box, 3, Slot.REDUCE, 0, PATIENT)
    closer.join()
    assert isinstance(value, StepAborted) and "run 3 is over" in str(value), value
    assert took < 2.0
