"""Where a stage's incoming activations, gradients and targets wait for the op that needs them.

Messages may arrive before the ``RunStep`` they belong to (the previous stage can be
faster than the client's call), so the mailbox is keyed by run id and accepts any run that
is not known to be over. A run's waiting op wakes on its message, on the run's failure, or
at its deadline -- never later.
"""

from __future__ import annotations

import threading
import time
from enum import Enum
from typing import Any

from elasticpipe.errors import DeadlineExceeded, ElasticPipeError, StepAborted, TooLarge


class Slot(Enum):
    """Which kind of message a micro-batch waits for."""

    INPUT = "input"
    GRAD = "grad"
    TARGET = "target"


class Mailbox:
    """Thread-safe store of per-run messages, with bounded memory and failure wake-ups."""

    def __init__(self, max_bytes: int):
        self._max_bytes = max_bytes
        self._bytes = 0
        self._cond = threading.Condition()
        self._items: dict[int, dict[tuple[Slot, int], tuple[Any, int]]] = {}
        self._closed_below = 0  # runs below this id are over: their late messages are dropped
        self._failures: dict[int, ElasticPipeError] = {}

    def put(self, run: int, slot: Slot, micro_batch: int, value: Any, nbytes: int) -> None:
        """Delivers a message; drops it silently if its run is already over.

        Raises:
            TooLarge: the mailbox would hold more than its byte limit.
        """
        with self._cond:
            if run < self._closed_below:
                return
            if self._bytes + nbytes > self._max_bytes:
                raise TooLarge(
                    f"mailbox full: {self._bytes} bytes waiting, {nbytes} more would pass "
                    f"the limit of {self._max_bytes}"
                )
            box = self._items.setdefault(run, {})
            replaced = box.get((slot, micro_batch))
            if replaced is not None:  # a re-sent message replaces the first copy
                self._bytes -= replaced[1]
            box[(slot, micro_batch)] = (value, nbytes)
            self._bytes += nbytes
            self._cond.notify_all()

    def take(self, run: int, slot: Slot, micro_batch: int, deadline: float) -> Any:
        """Waits for and removes a message.

        Raises:
            StepAborted / the run's failure: the run failed while waiting.
            DeadlineExceeded: nothing arrived by ``deadline`` (a ``time.monotonic`` value).
        """
        key = (slot, micro_batch)
        with self._cond:
            while True:
                failure = self._failures.get(run)
                if failure is not None:
                    raise failure
                box = self._items.get(run, {})
                if key in box:
                    value, nbytes = box.pop(key)
                    self._bytes -= nbytes
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(
                        f"run {run}: no {slot.value} for micro-batch {micro_batch} arrived "
                        "before the deadline"
                    )
                self._cond.wait(remaining)

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more would fit under the byte limit (checked before allocating)."""
        with self._cond:
            return self._bytes + nbytes <= self._max_bytes

    def fail(self, run: int, error: ElasticPipeError) -> None:
        """Wakes every wait of ``run`` with ``error`` (first failure wins)."""
        with self._cond:
            self._failures.setdefault(run, error)
            self._cond.notify_all()

    def failure(self, run: int) -> ElasticPipeError | None:
        """The failure recorded for ``run``, if any."""
        with self._cond:
            return self._failures.get(run)

    def close_through(self, run: int) -> None:
        """Marks every run up to and including ``run`` as over and frees its messages."""
        with self._cond:
            self._closed_below = max(self._closed_below, run + 1)
            for old in [r for r in self._items if r < self._closed_below]:
                self._bytes -= sum(n for _, n in self._items.pop(old).values())
            for old in [r for r in self._failures if r < self._closed_below]:
                del self._failures[old]
            self._cond.notify_all()

    def abort(self, run: int, reason: str) -> None:
        """Fails ``run`` with StepAborted."""
        self.fail(run, StepAborted(f"run {run} aborted: {reason}"))
