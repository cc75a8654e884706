"""Warnings and waits that recur while a job rides out an outage, logged once and then
at most every few seconds with how often or how long (a line per retry would drown the log).

They log as ``elasticpipe.client.pipeline``, the logger applications filter a ``Pipeline``'s
events on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from elasticpipe.logs import get_logger

__all__ = ["Repeats", "Waiting"]

log = get_logger("elasticpipe.client.pipeline")


class Repeats:
    """Logs a warning the first time, then the same warning (same event and fields) at
    most once every ``every`` seconds with how often it recurred: a job waiting out an
    outage says so without a line per retry."""

    def __init__(self, every: float = 10.0):
        self._every = every
        self._last: dict[str, tuple[str, float, int]] = {}  # event: (what, logged at, count)

    def warn(self, event: str, error: str, **fields: Any) -> int:
        """Logs ``event`` unless it just did; returns how often in a row it happened."""
        what, now = f"{error}|{sorted(fields.items())!r}", time.monotonic()
        last = self._last.get(event)
        if last is not None and last[0] == what:
            count = last[2] + 1
            if now - last[1] < self._every:
                self._last[event] = (what, last[1], count)
                return count
            log.warning(event, error=error, repeated=count, **fields)
            self._last[event] = (what, now, count)
            return count
        log.warning(event, error=error, **fields)
        self._last[event] = (what, now, 1)
        return 1


class Waiting:
    """Logs a wait at info once, when it begins, then at most every ``every`` seconds
    with how long it has lasted: a client waiting out another's lease says so without a
    line per retry."""

    def __init__(
        self, event: str, every: float = 10.0, clock: Callable[[], float] = time.monotonic
    ):
        self._event, self._every, self._clock = event, every, clock
        self._began: float | None = None
        self._logged = 0.0

    def still(self, **fields: Any) -> bool:
        """The wait goes on: logs it if it just began or ``every`` seconds passed since
        the last line; returns whether it logged."""
        now = self._clock()
        if self._began is None:
            self._began = self._logged = now
            log.info(self._event, **fields)
            return True
        if now - self._logged < self._every:
            return False
        self._logged = now
        log.info(self._event, waited_s=round(now - self._began, 1), **fields)
        return True
