"""Where a stage's incoming activations, gradients and targets wait for the op that needs them.

Messages may arrive before the ``RunStep`` they belong to (the previous stage can be
faster than the client's call), so the mailbox is keyed by run id and holds *early* data --
for a run not started here yet -- within a window: the client starts one run at a time and
sends a run's data only once it starts that run, so early data is for the next run, or a
few past it when attempts failed before reaching this stage (their aborts move the window
too). Past the newest run started or closed here, of its client generation, only
``EARLY_RUNS`` runs are held; data for a run further ahead, one already passed, or an older
generation is dropped and counted. A generation the mailbox has not run yet (a new client;
a stage that just joined, or rolled back) has no window: its data is held, within the early
caps. A run's waiting op wakes on its message, on the run's failure, or at its deadline --
never later.

Memory is bounded: room for a message is *reserved* (its bytes plus a fixed per-entry
overhead, so that even empty tensors count) before anything is allocated for it, and the
number of entries is capped; concurrent streams cannot overcommit. Early data has caps of
its own inside those (``EARLY_ENTRIES`` messages, ``EARLY_HELD_RUNS`` runs, a quarter of the
bytes -- or one message, however large, when nothing else is held early): when they are
reached the newest arrival displaces the early data of the runs further ahead than its
own, furthest first, oldest first, then its own run's oldest while that came under another
secret (so a flood that came first gives way to the run's data), and never a message that
came under its own secret (it would be lost unseen, and the run would wait for it until its
deadline): when nothing may give way, the arrival is refused with ``TooLarge``, so that
its sender fails at once. So data for runs that never come can neither stay for good nor
keep out the job's own: the runs started here have the rest of the room, and the next
run's early data displaces a stranger's. (A stranger's flood that comes *after* a run's
first data can still displace it, unseen, as before: the run then waits for its deadline.)

Only the run's own data is ever taken. Every message carries its run's secret (random, one
per run, chosen by the client and told to the stage in ``RunStep``: see ``expect``); a
message held before its run is known is kept apart from any other copy for the same slot,
so a stranger's message can neither stand in for nor replace the real one. When the run
becomes known, held messages with another secret are dropped, and so is every later one;
a take matches only the run's secret. Whoever does not hold the job cannot guess a secret
(128 bits), so on a plaintext cluster too its messages only ever take up room, within
the early caps above, until their run is started, passed or closed here, or displaced.
"""

from __future__ import annotations

import hmac
import math
import threading
import time
from collections.abc import Callable
from enum import Enum
from typing import Any

from elasticpipe.errors import DeadlineExceeded, ElasticPipeError, StepAborted, TooLarge
from elasticpipe.logs import get_logger
from elasticpipe.security import bounds

log = get_logger(__name__)


class Slot(Enum):
    """Which kind of message a micro-batch waits for."""

    INPUT = "input"
    GRAD = "grad"
    TARGET = "target"
    REDUCE = "reduce"  # a reduction piece: its key names (group, sender, node), not a micro-batch


ENTRY_OVERHEAD = 512  # bytes counted per message beyond its tensor (objects, keys)
MAX_ENTRIES = 65_536
KNOWN_RUNS = 16  # the newest runs started here whose secrets are kept
EARLY_RUNS = 8  # runs past the newest started or closed here whose data may come first
EARLY_ENTRIES = 16_384  # early messages held (a run's inputs and targets: 2 x 4096 at most)
EARLY_HELD_RUNS = 64  # runs with early messages held
EARLY_SHARE = 4  # early data holds at most 1/EARLY_SHARE of the byte limit
REFUSED_LOG_INTERVAL_S = 10.0  # at most one ``data_refused`` line this often
NO_SECRET = b""  # what a message without a secret carries (no run accepts it: see RunStep)

Key = tuple[Slot, int, bytes]  # slot, micro-batch, the secret the message carried

WRONG_SECRET = "the message did not carry its run's secret (not from the job's holder)"


class Reservation:
    """Room set aside for one message (``Mailbox.reserve``); used once by ``put``."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.open = True


class Mailbox:
    """Thread-safe store of per-run messages, with bounded memory and failure wake-ups."""

    def __init__(
        self,
        max_bytes: int,
        max_entries: int = MAX_ENTRIES,
        entry_overhead: int = ENTRY_OVERHEAD,
        on_refused: Callable[[int], None] | None = None,
    ):
        self._max_bytes = max_bytes
        self._early_max = (max_bytes // EARLY_SHARE, min(EARLY_ENTRIES, max_entries))
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
        self._newest = 0  # the newest run started or closed here: early data's window
        self._early: set[int] = set()  # runs whose held messages are early (not started)
        self._early_held = [0, 0]  # bytes and entries of those
        self._on_refused = on_refused  # told how many messages each drop refused
        self.refused = 0  # messages dropped (a wrong secret, outside the window), in all
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
        it if its run is already over, or is known here under another secret, or is early
        and outside the window (see the module docstring).

        Returns:
            False if the message was dropped for its secret, or as early data outside the
            window (counted in ``refused``).

        Raises:
            TooLarge: no reservation was given and no room is left; or the message is early
                and nothing held early may give way to it (``_room_early``; the room
                reserved is given back, the message counted in ``refused``).
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
            key = (slot, micro_batch, secret)
            if known is None:
                why = self._outside_window(run)
                if why is not None:
                    self._give_back(held)
                    self._refuse(run, 1, why)
                    return False
                if not self._room_early(run, key, held.nbytes):
                    self._give_back(held)
                    self._refuse(run, 1, "early data with the early caps full")
                    raise TooLarge(self._early_full(run))
            replaced = self._items.get(run, {}).pop(key, None)
            copies = 1
            if replaced is not None:  # a re-sent message replaces the first copy
                self._forget(run, replaced[1])
                copies += replaced[2]  # and stands for it: a stranger's copies all count
            box = self._items.setdefault(run, {})
            held.open = False
            box[key] = (value, held.nbytes, copies)
            if known is None:
                self._early.add(run)
                self._early_held[0] += held.nbytes
                self._early_held[1] += 1
            self._cond.notify_all()
            return True

    def _outside_window(self, run: int) -> str | None:
        """Why early data of ``run`` may not be held (None: it may)."""
        newest = self._newest
        if not newest or bounds.generation(run) > bounds.generation(newest):
            return None  # a generation not run here yet: no window, the early caps hold
        if bounds.generation(run) < bounds.generation(newest):
            return f"early data of an older client generation than run {newest}'s"
        if run <= newest:
            return f"data of a run never started here, which run {newest} passed"
        if run > newest + EARLY_RUNS:
            return f"early data more than {EARLY_RUNS} runs past run {newest}"
        return None

    def _room_early(self, run: int, key: Key, nbytes: int) -> bool:
        """Makes room in the early caps for a message of ``run``, displacing the early data
        of the runs furthest ahead (oldest first), never a nearer run's, and of its own run
        only while the oldest held came under another secret (a stranger's, if this one
        is the run's: a flood that came first gives way); False if no room can be made so."""
        max_bytes, max_entries = self._early_max
        box = self._items.get(run, {})
        again = box.get(key)  # a re-sent message frees its first copy
        while True:
            held_bytes, held_entries = self._early_held
            if again is not None:
                held_bytes, held_entries = held_bytes - again[1], held_entries - 1
            new_run = run not in self._early
            if (
                held_bytes + nbytes <= max_bytes
                and held_entries < max_entries
                and not (new_run and len(self._early) >= EARLY_HELD_RUNS)
            ):
                return True
            if not self._early or held_entries == 0:
                return True  # one message, however large, when nothing else is held early
            furthest = max(self._early)
            if furthest < run:
                return False
            victims = self._items[furthest]
            oldest = next(iter(victims))
            if furthest == run and hmac.compare_digest(oldest[2], key[2]):
                # Never its own sender's data (the same secret): that message would be lost
                # unseen, and the run would wait for it until its deadline.
                return False
            _, displaced, copies = victims.pop(oldest)
            self._forget(furthest, displaced)
            why = "of a nearer run" if furthest > run else "of its run under another secret"
            self._refuse(furthest, copies, f"early data displaced by data {why}")

    def _early_full(self, run: int) -> str:
        """Why an early message of ``run`` is refused: the early caps are full."""
        max_bytes, max_entries = self._early_max
        return (
            f"early data of run {run} (arrived before its RunStep) refused: the data held "
            f"early fills its caps ({max_bytes} bytes, 1/{EARLY_SHARE} of the mailbox's; "
            f"{max_entries} messages; {EARLY_HELD_RUNS} runs), and none of it may give way"
        )

    def _forget(self, run: int, nbytes: int) -> None:
        """Gives back a held message's room (in the early caps too, if early); drops the
        run's box once empty."""
        self._bytes -= nbytes
        self._entries -= 1
        if run in self._early:
            self._early_held[0] -= nbytes
            self._early_held[1] -= 1
        if not self._items.get(run, True):
            del self._items[run]
            self._early.discard(run)

    def _drop_run(self, run: int) -> int:
        """Frees every message held for ``run``; how many there were (with the copies they
        replaced)."""
        box = self._items.pop(run, {})
        nbytes = sum(n for _, n, _ in box.values())
        self._bytes -= nbytes
        self._entries -= len(box)
        if run in self._early:
            self._early.discard(run)
            self._early_held[0] -= nbytes
            self._early_held[1] -= len(box)
        return sum(c for _, _, c in box.values())

    def _advance(self, run: int) -> None:
        """``run`` was started or closed here: the window moves past it, and early data
        now outside it is dropped."""
        self._newest = max(self._newest, run)
        for old in [r for r in self._early if self._outside_window(r) is not None]:
            if n := self._drop_run(old):
                self._refuse(old, n, "early data outside the window once a newer run came")

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
            if run in self._early:  # its messages are the run's now, not early data
                self._early.discard(run)
                self._early_held[0] -= sum(n for _, n, _ in box.values())
                self._early_held[1] -= len(box)
            wrong = [k for k in box if not hmac.compare_digest(k[2], secret)]
            dropped = 0
            for key in wrong:
                _, nbytes, copies = box.pop(key)
                self._forget(run, nbytes)
                dropped += copies
            if dropped:
                self._refuse(run, dropped)
            before = self.refused
            self._advance(run)
            return dropped + self.refused - before

    def _refuse(self, run: int, n: int, why: str = WRONG_SECRET) -> None:
        """Counts ``n`` messages of ``run`` dropped (``why``), tells ``on_refused``; logs at
        most every ``REFUSED_LOG_INTERVAL_S`` (a flood must not flood the log too)."""
        self.refused += n
        if self._on_refused is not None:
            self._on_refused(n)
        now = time.monotonic()
        when, before = self._refused_logged
        if now - when >= REFUSED_LOG_INTERVAL_S:
            self._refused_logged = (now, self.refused)
            log.warning(
                "data_refused",
                run=run,
                dropped=self.refused - before,
                why=why,
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
                if run < self._closed_below:  # closed while this waited: nothing will come
                    raise StepAborted(f"run {run} is over")
                box = self._items.get(run, {})
                if key in box:
                    value, nbytes, _ = box.pop(key)
                    self._forget(run, nbytes)
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
                self._drop_run(old)
            self._advance(run)
            for old in [r for r in self._failures if r < self._closed_below]:
                del self._failures[old]
            for old in [r for r in self._secrets if r < self._closed_below]:
                del self._secrets[old]
            self._cond.notify_all()

    def abort(self, run: int, reason: str) -> None:
        """Fails ``run`` with StepAborted."""
        self.fail(run, StepAborted(f"run {run} aborted: {reason}"))
