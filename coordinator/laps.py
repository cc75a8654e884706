"""Wall time per phase of a long coordinator operation (job setup), for its log line."""

from __future__ import annotations

import time


class Laps:
    """Seconds spent in each named phase since the previous ``lap`` (or since creation)."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.seconds: dict[str, float] = {}

    def lap(self, name: str) -> None:
        """Ends the phase ``name`` now (adding to it if it ran before)."""
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 4)
        self._last = now
