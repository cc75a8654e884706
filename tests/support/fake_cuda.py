"""Stand-ins for CUDA events on the host clock, for the device-path tests run without a GPU."""

from __future__ import annotations

import math
import time


class Flag:
    """A stand-in for a CUDA event: ``query()`` is True once ``done`` is set."""

    def __init__(self, done: bool = False):
        self.done = done

    def query(self) -> bool:
        return self.done


class FakeEvent:
    """A timing event on the host clock: what ``torch.cuda.Event`` does, on the CPU."""

    synced = 0

    def __init__(self) -> None:
        self.at = math.nan

    def record(self, stream: object = None) -> None:
        assert stream is None  # no device given: the current stream
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        FakeEvent.synced += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: FakeEvent) -> float:
        return (end.at - self.at) * 1000.0
