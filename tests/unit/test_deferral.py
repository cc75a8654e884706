"""Tests of the stage's lock that carries out deferred effects before any holder's work."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from elasticpipe.stage_server.deferral import Deferral
from elasticpipe.stage_server.protocol import Do, Effect

pytestmark = pytest.mark.timeout(30)

STEP = [Effect(Do.APPLY_STEP, run=1, step=1), Effect(Do.CLOSE_RUNS, run=1)]


class Recorder:
    """A ``carry_out`` that records what it carried out, and can be held back or fail."""

    def __init__(self) -> None:
        self.done: list[Effect] = []
        self.release = threading.Event()
        self.release.set()
        self.carried = threading.Event()
        self.fail = False
        self.lock: Deferral | None = None

    def __call__(self, effects: list[Effect]) -> None:
        assert self.release.wait(10)
        if self.lock is not None:
            with self.lock:  # reentrant: nothing left to settle
                pass
        if self.fail:
            raise RuntimeError("injected: the effects failed")
        self.done.extend(effects)
        self.carried.set()


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
def lock(recorder: Recorder) -> Iterator[Deferral]:
    deferral = Deferral(recorder, "test")
    recorder.lock = deferral
    yield deferral
    deferral.close()


def test_the_applier_carries_deferred_effects_out_without_any_other_holder(
    lock: Deferral, recorder: Recorder
) -> None:
    """Deferred effects run on the applier thread once the deferring holder leaves."""
    with lock:
        lock.defer(STEP)
        assert recorder.done == []  # not while the deferring holder holds the lock
    assert recorder.carried.wait(10)
    assert recorder.done == STEP


def test_the_next_holder_finds_the_effects_carried_out_before_its_work(
    lock: Deferral, recorder: Recorder
) -> None:
    """Whoever takes the lock after a deferral sees the effects done, in order, once."""
    recorder.release.clear()  # the applier is held inside carry_out, or not yet in it
    with lock:
        lock.defer(STEP)
    seen: list[list[Effect]] = []

    def holder() -> None:
        with lock:
            seen.append(list(recorder.done))

    thread = threading.Thread(target=holder)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive()  # it waits for the effects, whichever thread runs them
    recorder.release.set()
    thread.join(10)
    assert seen == [STEP]
    assert recorder.done == STEP


def test_a_wait_settles_what_was_deferred_while_the_lock_was_free(
    lock: Deferral, recorder: Recorder
) -> None:
    """A waiter woken after another thread deferred finds the effects carried out."""
    lock.close()  # no applier: only the woken waiter can carry them out
    woke: list[list[Effect]] = []
    waiting = threading.Event()

    def waiter() -> None:
        with lock:
            waiting.set()
            lock.wait_for(lambda: bool(recorder.done), 10)
            woke.append(list(recorder.done))

    thread = threading.Thread(target=waiter)
    thread.start()
    assert waiting.wait(10)
    with lock:
        lock.defer(STEP)
        lock.notify_all()
    thread.join(15)
    assert woke == [STEP]


def test_failed_effects_fail_neither_the_holder_that_ran_them_nor_the_applier(
    lock: Deferral, recorder: Recorder
) -> None:
    """Effects that raise are logged and dropped, never rerun; the holder goes on, and the
    applier carries out the next deferral."""
    recorder.fail = True
    with lock:
        lock.defer(STEP)
    with lock:  # ran them itself, or found the applier had
        held = True
    assert held and recorder.done == []
    recorder.fail = False
    with lock:
        lock.defer(STEP[1:])
    assert recorder.carried.wait(10)
    assert recorder.done == STEP[1:]
