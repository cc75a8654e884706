"""CPU seconds and page faults of other processes, as the benches count them (Linux /proc)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elasticpipe.local.cluster import LocalCluster

__all__ = ["process_cpu_s", "process_faults", "stage_pids"]


def stage_pids(cluster: LocalCluster) -> list[int]:
    """The process ids of a local cluster's stages (its coordinators left out)."""
    return [proc.pid for name, proc in cluster.procs.items() if name.startswith("stage-")]


def process_cpu_s(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far, all its threads: the scheduler's
    nanosecond count (``/proc/PID/task/*/schedstat``; ``/proc/PID/stat`` counts 10 ms
    ticks, too coarse for a few steps)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def process_faults(pid: int) -> tuple[int, float]:
    """(minor page faults, kernel CPU seconds) of process ``pid`` so far, all its threads
    (``/proc/PID/stat``): a first touch of memory is a minor fault, and its zeroing and
    mapping are kernel time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # (after the command's closing parenthesis: minflt is field 10 of proc(5), stime 15)
    return int(fields[7]), int(fields[12]) / os.sysconf("SC_CLK_TCK")
