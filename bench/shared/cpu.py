"""CPU seconds of other processes, as the benches count them (Linux /proc)."""

from __future__ import annotations

import contextlib
from pathlib import Path

__all__ = ["process_cpu_s"]


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far, all its threads: the scheduler's
    nanosecond count (``/proc/PID/task/*/schedstat``; ``/proc/PID/stat`` counts 10 ms
    ticks, too coarse for a few steps)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9
