"""Where a stage's incoming activations, gradients and targets wait for the op that needs them.

Messages may arrive before the ``RunStep`` they belong to (the previous stage can be
faster than the client's call), so the mailbox is keyed by run id and accepts any run that
is not known to be over. A run's waiting op wakes on its message, on the run's failure, or
at its deadline -- never later.

Memory is bounded: room for a message is *reserved* (its bytes plus a fixed per-entry
overhead, so that even empty tensors count) before anything is allocated for it, and the
number of entries is capped; concurrent streams cannot overcommit.
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


ENTRY_OVERHEAD = 512  # bytes counted per message beyond its tensor (objects, keys)
MAX_ENTRIES = 65_536


class Reservation:
    """Room set aside for one message (``Mailbox.reserve``); used once by ``put``."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.open = True


class Mailbox:
    """Thread-safe store of per-run messages, with bounded memory and failure wake-ups."""

    def __init__(
        self, max_bytes: int, max_entries: int = MAX_ENTRIES, entry_overhead: int = ENTRY_OVERHEAD
    ):
        self._max_bytes = max_bytes
        self._max_entries = max_entries
        self._overhead = entry_overhead
        self._bytes = 0  # stored and reserved
        self._entries = 0  # stored and reserved
        self._cond = threading.Condition()
        self._items: dict[int, dict[tuple[Slot, int], tuple[Any, int]]] = {}
        self._closed_below = 0  # runs below this id are over: their late messages are dropped
        self._failures: dict[int, ElasticPipeError] = {}

    def reserve(self, nbytes: int) -> Reservation:
        """Sets room aside for a message of ``nbytes`` before it is received.

        Raises:
            TooLarge: the bytes (with the per-entry overhead) or the entries would pass
                their limit.
        """
        need = nbytes + self._overhead
        with self._cond:
            if self._bytes + need > self._max_bytes or self._entries >= self._max_entries:
                raise TooLarge(
                    f"mailbox full: {self._bytes} bytes in {self._entries} messages waiting; "
                    f"{need} more would pass the limit of {self._max_bytes} bytes "
                    f"or {self._max_entries} messages"
                )
            self._bytes += need
            self._entries += 1
            return Reservation(need)

    def release(self, reservation: Reservation) -> None:
        """Gives back room reserved for a message that never came (idempotent)."""
        with self._cond:
            if reservation.open:
                reservation.open = False
                self._bytes -= reservation.nbytes
                self._entries -= 1

    def put(
        self,
        run: int,
        slot: Slot,
        micro_batch: int,
        value: Any,
        nbytes: int,
        reservation: Reservation | None = None,
    ) -> None:
        """Delivers a message into room reserved for it (reserved now if not given);
        drops it if its run is already over.

        Raises:
            TooLarge: no reservation was given and no room is left.
        """
        held = reservation or self.reserve(nbytes)
        with self._cond:
            if not held.open:
                raise TooLarge(f"message of run {run} delivered twice into one reservation")
            if run < self._closed_below:
                self._give_back(held)
                return
            box = self._items.setdefault(run, {})
            replaced = box.pop((slot, micro_batch), None)
            if replaced is not None:  # a re-sent message replaces the first copy
                self._bytes -= replaced[1]
                self._entries -= 1
            held.open = False
            box[(slot, micro_batch)] = (value, held.nbytes)
            self._cond.notify_all()

    def _give_back(self, held: Reservation) -> None:
        if held.open:
            held.open = False
            self._bytes -= held.nbytes
            self._entries -= 1

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
                    self._entries -= 1
                    return value
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(
                        f"run {run}: no {slot.value} for micro-batch {micro_batch} arrived "
                        "before the deadline"
                    )
                self._cond.wait(remaining)

    def fail(self, run: int, error: ElasticPipeError) -> None:
        """Wakes every wait of ``run`` with ``error`` (first failure wins)."""
        with self._cond:
            self._failures.setdefault(run, error)
            self._cond.notify_all()

    def failure(self, run: int) -> ElasticPipeError | None:
        """The failure recorded for ``run``, if any."""
        with self._cond:
            return self._failures.get(run)

    def usage(self) -> tuple[int, int]:
        """Bytes and entries held or reserved now."""
        with self._cond:
            return self._bytes, self._entries

    def close_through(self, run: int) -> None:
        """Marks every run up to and including ``run`` as over and frees its messages."""
        with self._cond:
            self._closed_below = max(self._closed_below, run + 1)
            for old in [r for r in self._items if r < self._closed_below]:
                entries = self._items.pop(old).values()
                self._bytes -= sum(n for _, n in entries)
                self._entries -= len(entries)
            for old in [r for r in self._failures if r < self._closed_below]:
                del self._failures[old]
            self._cond.notify_all()

    def abort(self, run: int, reason: str) -> None:
        """Fails ``run`` with StepAborted."""
        self.fail(run, StepAborted(f"run {run} aborted: {reason}"))
