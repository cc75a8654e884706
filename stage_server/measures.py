"""What a stage measures of its own runs for the planner, reported in its heartbeats: how
long its pipeline takes (``EpochTime``), how long it waits between runs (``EpochMedian``),
and how fast its reductions and optimizer steps go (``Rate``).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

__all__ = ["EpochMedian", "EpochTime", "Rate"]

EWMA = 0.5  # the weight of a run's newest figure
WINDOW = 8  # the runs ``EpochMedian`` takes the median of


class EpochTime:
    """How long this stage's pipeline (its replica's, or the job's one chain) takes per
    training run, in this epoch (``Stage.pipeline_time``): an EWMA of seconds from a run's
    start to the stage's last op (before any reduction). The coordinator takes a chain's
    slowest stage as its measured time, and weighs what the planner's prediction misses
    (link latency, overheads) when it splits the shares and predicts new layouts. A new
    epoch (new shares, moved layers) starts afresh, and its first run is left out (it pays
    for what a change leaves cold: connections, caches, a retried run's wait)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch, self._runs, self._seconds = -1, 0, 0.0

    def note(self, epoch: int, seconds: float) -> None:
        """Counts one run of ``epoch`` that took ``seconds`` to its last op."""
        with self._lock:
            if epoch != self._epoch:
                self._epoch, self._runs, self._seconds = epoch, 0, 0.0
            self._runs += 1
            if self._runs == 2:
                self._seconds = seconds
            elif self._runs > 2:
                self._seconds += EWMA * (seconds - self._seconds)

    def at(self, epoch: int) -> float:
        """The time measured in ``epoch`` (0.0: none yet)."""
        with self._lock:
            return self._seconds if epoch == self._epoch else 0.0


class Rate:
    """How fast this stage does something per byte, in bytes per second: an EWMA over its
    runs. ``Stage.reduce_rate``: its gradient reductions, each run's bytes (what the planner
    counts a holder sends: ``2 (R - 1) / R`` of the gradient bytes of each group it holds,
    ``layouts.reduce_seconds``) over the time from its first group's reduction start to its
    last one's end; without a link bandwidth from the operator, the coordinator plans
    replicas' reductions at its stages' median rate. ``Stage.optimizer_rate``: its
    optimizer steps, its layers' parameter bytes over the step's time. A new epoch's first
    run is left out (it opens connections, may wait for a peer still committing the epoch,
    and an optimizer's first step makes its state); the rate carries over epochs and jobs,
    as a figure of the hosts and their network."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch, self._rate = -1, 0.0

    def note(self, epoch: int, rate: float | None) -> None:
        """Counts one run of ``epoch`` that went at ``rate`` (None: it measured nothing)."""
        with self._lock:
            if epoch != self._epoch:
                self._epoch = epoch
            elif rate is not None:
                old = self._rate
                self._rate = rate if not old else old + EWMA * (rate - old)

    def value(self) -> float:
        """The rate measured so far (0.0: none yet)."""
        with self._lock:
            return self._rate


class EpochMedian:
    """A time this stage measures per training run in this epoch, as the median of its
    last ``WINDOW`` runs: robust to the odd long one. ``Stage.between_runs``: from a run's
    end (its report) to the next run's start, the step's part outside the pipelines (the
    commit and optimizer steps, the RunStep fan-out, the client's loop, where an
    evaluation or a checkpoint now and then takes long). A new epoch starts afresh, and
    its first run is left out."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._epoch, self._first = -1, True
        self._seconds: deque[float] = deque(maxlen=WINDOW)

    def note(self, epoch: int, seconds: float) -> None:
        """Counts one run of ``epoch`` that took ``seconds``."""
        with self._lock:
            if epoch != self._epoch:
                self._epoch, self._first = epoch, True
                self._seconds.clear()
            if self._first:
                self._first = False
            else:
                self._seconds.append(seconds)

    def at(self, epoch: int) -> float:
        """The median measured in ``epoch`` (0.0: none yet)."""
        with self._lock:
            if epoch != self._epoch or not self._seconds:
                return 0.0
            return statistics.median(self._seconds)
