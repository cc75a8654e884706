"""Where a stage's incoming activations, gradients and targets wait for the op that needs them.

Messages may arrive before the ``RunStep`` they belong to (the previous stage can be
faster than the client's call), so the mailbox is keyed by run id and accepts any run that
is not known to be over. A run's waiting op wakes on its message, on the run's failure, or
at its deadline -- never later.

Memory is bounded: room for a message is *reserved* (its bytes plus a fixed per-entry
overhead, so that even empty tensors count) before anything is allocated for it, and the
number of entries is capped; concurrent streams cannot overcommit.

Only the run's own data is ever taken. Every message carries its run's secret (random, one
per run, chosen by the client and told to the stage in ``RunStep``: see ``expect``); a
message held before its run is known is kept apart from any other copy for the same slot,
so a stranger's message can neither stand in for nor replace the real one. When the run
becomes known, held messages with another secret are dropped, and so is every later one;
a take matches only the run's secret. Every message dropped for its secret is counted
(``refused``), a copy that a later one with the same secret replaced while held too.
Whoever does not hold the job cannot guess a secret (128 bits), so on a plaintext cluster
too its messages only ever take up room, which the bounds above limit.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from enum import Enum
from typing import Any

from elasticpipe.errors import DeadlineExceeded, ElasticPipeError, StepAborted, TooLarge
from elasticpipe.logs import get_logger

log = get_logger(__name__)


class Slot(Enum):
    """Which kind of message a micro-batch waits for."""

    INPUT = "input"
    GRAD = "grad"
    TARGET = "target"


ENTRY_OVERHEAD = 512  # bytes counted per message beyond its tensor (objects, keys)
MAX_ENTRIES = 65_536
KNOWN_RUNS = 16  # the newest runs started here whose secrets are kept
REFUSED_LOG_INTERVAL_S = 10.0  # at most one ``data_refused`` line this often
NO_SECRET = b""  # what a message without a secret carries (no run accepts it: see RunStep)

Key = tuple[Slot, int, bytes]  # slot, micro-batch, the secret the message carried


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
        # run -> key -> (value, bytes, copies: how many messages it stands for, with those
        # it replaced, so that all of them are counted if its secret is refused)
        self._items: dict[int, dict[Key, tuple[Any, int, int]]] = {}
        self._secrets: dict[int, bytes] = {}  # of the runs started here (``expect``)
        self._closed_below = 0  # runs below this id are over: their late messages are dropped
        self._failures: dict[int, ElasticPipeError] = {}
        self.refused = 0  # messages dropped for a wrong secret, in all
        self._refused_logged = (-math.inf, 0)  # (when, ``refused`` then)

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
        secret: bytes = NO_SECRET,
    ) -> bool:
        """Delivers a message into room reserved for it (reserved now if not given); drops
        it if its run is already over, or is known here under another secret.

        Returns:
            False if the message was dropped for its secret (counted in ``refused``).

        Raises:
            TooLarge: no reservation was given and no room is left.
        """
        held = reservation or self.reserve(nbytes)
        with self._cond:
            if not held.open:
                raise TooLarge(f"message of run {run} delivered twice into one reservation")
            if run < self._closed_below:
                self._give_back(held)
                return True
            known = self._secrets.get(run)
            if known is not None and not hmac.compare_digest(secret, known):
                self._give_back(held)
                self._refuse(run, 1)
                return False
            box = self._items.setdefault(run, {})
            key = (slot, micro_batch, secret)
            replaced = box.pop(key, None)
            copies = 1
            if replaced is not None:  # a re-sent message replaces the first copy
                self._bytes -= replaced[1]
                self._entries -= 1
                copies += replaced[2]
            held.open = False
            box[key] = (value, held.nbytes, copies)
            self._cond.notify_all()
            return True

    def expect(self, run: int, secret: bytes) -> int:
        """Starts ``run`` here with the secret its client chose: held messages of the run
        with another secret are dropped, and so is every later one. The secrets of runs
        closed (``close_through``), or older than the newest ``KNOWN_RUNS``, are forgotten:
        their takes fail (a stage runs one run at a time, in order).

        Returns:
            How many messages held for the run were dropped (a copy replaced while held,
            by one with the same secret, counts too).
        """
        with self._cond:
            if run < self._closed_below:
                return 0  # over already: its takes fail, its messages are dropped
            self._secrets[run] = secret
            while len(self._secrets) > KNOWN_RUNS:  # inference runs are never closed
                del self._secrets[min(self._secrets)]
            box = self._items.get(run, {})
            wrong = [k for k in box if not hmac.compare_digest(k[2], secret)]
            dropped = 0
            for key in wrong:
                _, nbytes, copies = box.pop(key)
                self._bytes -= nbytes
                self._entries -= 1
                dropped += copies
            if dropped:
                self._refuse(run, dropped)
            return dropped

    def _refuse(self, run: int, n: int) -> None:
        """Counts ``n`` messages of ``run`` dropped for their secret; logs at most every
        ``REFUSED_LOG_INTERVAL_S`` (a flood must not flood the log too)."""
        self.refused += n
        now = time.monotonic()
        when, before = self._refused_logged
        if now - when >= REFUSED_LOG_INTERVAL_S:
            self._refused_logged = (now, self.refused)
            log.warning(
                "data_refused",
                run=run,
                dropped=self.refused - before,
                why="the message did not carry its run's secret (not from the job's holder)",
            )

    def _give_back(self, held: Reservation) -> None:
        if held.open:
            held.open = False
            self._bytes -= held.nbytes
            self._entries -= 1

    def take(self, run: int, slot: Slot, micro_batch: int, deadline: float) -> Any:
        """Waits for and removes a message of ``run`` (started here: ``expect``) that
        carries the run's secret.

        Raises:
            StepAborted / the run's failure: the run failed while waiting, or was never
                started here, or is over.
            DeadlineExceeded: nothing arrived by ``deadline`` (a ``time.monotonic`` value).
        """
        with self._cond:
            secret = self._secrets.get(run)
            if secret is None:
                raise StepAborted(f"run {run} was not started here (or is over)")
            key = (slot, micro_batch, secret)
            while True:
                failure = self._failures.get(run)
                if failure is not None:
                    raise failure
                box = self._items.get(run, {})
                if key in box:
                    value, nbytes, _ = box.pop(key)
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
                self._bytes -= sum(n for _, n, _ in entries)
                self._entries -= len(entries)
            for old in [r for r in self._failures if r < self._closed_below]:
                del self._failures[old]
            for old in [r for r in self._secrets if r < self._closed_below]:
                del self._secrets[old]
            self._cond.notify_all()

    def abort(self, run: int, reason: str) -> None:
        """Fails ``run`` with StepAborted."""
        self.fail(run, StepAborted(f"run {run} aborted: {reason}"))
