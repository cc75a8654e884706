"""Wall-clock timing of a call, as the benches take it: the median of repeats."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["median_seconds"]


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``repeats`` calls of ``fn`` (``perf_counter``; the median, because a
    shared host's noise only ever adds)."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
