"""Layer timing on an emulated or a real device: the fastest-run model of a slowed CPU
stage's op times (``FastestTimes``), and CUDA events on a GPU, read once per step instead
of once per layer.

**The fastest-run model** (``--timer fastest``, CPU stages): a layer op (what the layer
computes, the direction, the shapes and dtypes of its input or, for a backward, of its
output's gradients, and the modes: ``LayerSlice.op``) counts as the fastest of its last
``WINDOW`` runs, not as what this run measured. Several stages emulating slow devices on
a few shared cores (benches) otherwise see their thread CPU time grow with each other's
load (caches, memory bandwidth): the speeds a job's profile measured (one stage of a host
at a time, then each layer's fastest of five runs, ``profiling``) came out 10-25% faster
than the same stages ran when training together, and the planner's predictions missed by
that much before any overhead of the system's own. (Such a stage's profile now times a
quick layer up to ``WINDOW`` times, without waiting out the emulated time:
``Stage.profile``.) What delays a run only ever adds time, so
the fastest recent run is the op's time on an unloaded host: an emulated op then takes
the same time alone or beside others, as an accelerator's would, provided its work (its
compute and the stage's own work around it) fits in it (a ``Slowdown`` op never takes
less than its wall time). A window, not a time
frozen once: the first runs of a process are slow ones (cold caches, first allocations),
and a stage that shares its host's profile (``coordinator.profiles``) runs an op first in
training: until one of its runs came on a quiet host, such a stage counts slower than the
profile.
The loss and the optimizer step are not emulated (as with ``--timer cpu``).

CUDA events:

A layer's compute is bracketed by two events (``enable_timing``) recorded on the stage
device's current stream; nothing waits for them when they are recorded. The elapsed time
is read later (``Lap.seconds``), when ``LayerSlice.settle_timings`` folds a step's
measurements in: one wait for the device per step, instead of a ``torch.cuda.synchronize``
around every layer, which would stall the host until the GPU drained its queue and so
remove any overlap between the host's launches and the device's work.

Worked example: layer 3's forward on micro-batch 0 records S3 and T3 around its kernels,
layer 4's S4 and T4; the host goes on to launch the next op at once. At the end of the
step ``settle_timings`` waits for T4 (the last event) and reads ``S3.elapsed_time(T3)``
and ``S4.elapsed_time(T4)`` (milliseconds) as the layers' seconds, times the emulated
slowdown factor that was in force when they were recorded.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["EventClock", "FastestTimes", "Lap", "event_clock"]

TIMERS = ("auto", "cpu", "wall", "fastest")
WINDOW = 32  # runs of an op whose fastest is its time (--timer fastest)
MAX_OPS = 4096  # distinct ops remembered; beyond, the least recently run is forgotten


class FastestTimes:
    """Each op's time as the fastest of its last ``window`` runs (the module docstring).
    An op is a hashable key: the job, what the layer computes, the direction, and the
    shapes and dtypes of what it ran on (``LayerSlice.op`` builds it)."""

    def __init__(self, window: int = WINDOW, max_ops: int = MAX_OPS):
        if window < 1:
            raise ValueError(f"window must be >= 1 (got {window})")
        self.window, self.max_ops = window, max_ops
        self._lock = threading.Lock()
        self._ops: OrderedDict[Hashable, deque[float]] = OrderedDict()  # least recent first

    def time(self, op: Hashable, measured: float) -> float:
        """The seconds ``op`` counts as, once ``measured`` is one of its runs."""
        with self._lock:
            runs = self._ops.get(op)
            if runs is None:
                if len(self._ops) >= self.max_ops:
                    self._ops.popitem(last=False)
                runs = self._ops[op] = deque(maxlen=self.window)
            else:
                self._ops.move_to_end(op)
            runs.append(measured)
            return min(runs)


@dataclass
class Lap:
    """GPU time between pairs of CUDA events, read once they completed; times ``factor``
    (the stage's emulated slowdown, fixed when recorded)."""

    pairs: list[tuple[Any, Any]]
    factor: float = 1.0

    def raw(self) -> float:
        """Seconds of device time, waiting for the last event if needed."""
        if self.pairs:
            self.pairs[-1][1].synchronize()
        ms: float = sum(start.elapsed_time(end) for start, end in self.pairs)
        return ms / 1000.0

    def seconds(self) -> float:
        """The emulated seconds: ``factor`` times the device time."""
        return self.factor * self.raw()

    def __add__(self, other: Lap | float) -> Lap:
        if isinstance(other, Lap):
            # A slowdown changed between the two (a recompute and its backward): the
            # emulation is approximate across a change, so the newer factor times both.
            return Lap([*self.pairs, *other.pairs], other.factor)
        if other == 0.0:
            return self
        raise TypeError("a Lap adds to another Lap or 0.0")

    __radd__ = __add__


class EventClock:
    """Brackets GPU work with CUDA events (``enable_timing``) on ``device``'s current
    stream (not the current device's: a stage on ``cuda:1`` may run with device 0 current).

    Args:
        device: the stage's device; None: the current device (and any stand-in events).
        make_event: makes one event (tests pass a stand-in).
    """

    def __init__(
        self, device: torch.device | None = None, make_event: Callable[[], Any] | None = None
    ):
        self.device = device
        self._make = make_event or _timing_event

    def time(self, fn: Callable[[], Any], factor: float) -> tuple[Any, Lap]:
        """Runs ``fn``; returns its result and the (not yet completed) lap around it."""
        stream = torch.cuda.current_stream(self.device) if self.device is not None else None
        start, end = self._make(), self._make()
        start.record(stream)
        result = fn()
        end.record(stream)
        return result, Lap([(start, end)], factor)


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]  # torch stub


def event_clock(timer: str, device: torch.device) -> EventClock | None:
    """CUDA-event timing for the ``auto`` timer on a CUDA device; None elsewhere (``wall``
    keeps host clocks around a synchronize, ``cpu`` the thread's CPU time, as before)."""
    return EventClock(device) if timer == "auto" and device.type == "cuda" else None
