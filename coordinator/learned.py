"""Figures the coordinator learns from jobs and predicts new layouts with, kept across jobs
and in the store: a restarted coordinator, or a standby that takes over, predicts with what
this one learned.

``Cluster`` keeps two, each the latest figure of each of the last ``JOBS`` jobs, and
predicts with their median (a figure of the hosts, like the reduction's rate):

* per pipeline slot, what a job's chains measured beyond the planner's model (hop
  latencies, per-op overheads; ``replica_options.note_overheads``);
* per step, what its stages waited between runs beyond the optimizer steps (the RunStep
  fan-out, the commit's round trip, the client's loop).
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import OrderedDict
from typing import Any

from elasticpipe.coordinator.store import Store

JOBS = 16  # jobs whose figure is kept
STORE_CHANGE = 0.05  # a job's figure is stored again when it moved by more than this
STORE_FLOOR_S = 1e-4  # ... and by more than this (a figure near 0 flickers)


class Learned:
    """One learned figure, per job: the latest of each of the last ``JOBS`` jobs, under
    ``key`` in the store (as ``[[job, seconds], ...]``, oldest first)."""

    def __init__(self, store: Store, key: str):
        self.store, self.key = store, key
        self._figures = loaded(store.get(key))
        self._stored = dict(self._figures)  # what the store holds (``store``)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()  # one ``store`` at a time

    def note(self, job_id: str, figure: float) -> None:
        """Keeps ``job_id``'s latest figure (in memory: ``store`` stores them)."""
        with self._lock:
            self._figures.pop(job_id, None)
            self._figures[job_id] = figure
            while len(self._figures) > JOBS:
                self._figures.popitem(last=False)

    def figures(self) -> dict[str, float]:
        """Each kept job's figure, oldest first."""
        with self._lock:
            return dict(self._figures)

    def median(self) -> float:
        """The median of the kept figures (0.0: none yet)."""
        figures = list(self.figures().values())
        return statistics.median(figures) if figures else 0.0

    def store_changed(self) -> bool:
        """Stores the figures when they differ from the stored ones: a job new or gone, or
        a figure moved by more than ``STORE_CHANGE`` (and ``STORE_FLOOR_S``) since it was
        stored (never on a heartbeat's path: the coordinator's ``learned`` loop calls
        this). Returns whether it wrote.

        Raises:
            ElasticPipeError: the store refused (this coordinator no longer leads, say); the
                stored figures stay as they were, and a later call tries again.
        """
        with self._write_lock:
            now, stored = self.figures(), self._stored
            if list(now) == list(stored) and all(  # (the same jobs, oldest first)
                abs(figure - stored[job]) <= max(STORE_CHANGE * stored[job], STORE_FLOOR_S)
                for job, figure in now.items()
            ):
                return False
            self.store.put(self.key, [[job, figure] for job, figure in now.items()])
            self._stored = now
            return True


def loaded(raw: Any) -> OrderedDict[str, float]:
    """The stored figures (``[[job, seconds], ...]``), oldest first; none of what is
    malformed (a store written by hand, or by an older coordinator): it is learned again."""
    kept: OrderedDict[str, float] = OrderedDict()
    for item in raw if isinstance(raw, list) else []:
        if (
            isinstance(item, list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], int | float)
            and not isinstance(item[1], bool)
            and math.isfinite(item[1])
            and item[1] >= 0
        ):
            kept[item[0]] = float(item[1])
    while len(kept) > JOBS:
        kept.popitem(last=False)
    return kept
