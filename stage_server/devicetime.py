"""Layer timing on an emulated or a real device: the emulated slow device (``Slowdown``), the
fastest-run model of a slowed CPU stage's op times (``FastestTimes``), and CUDA events on
a GPU, read once per step instead of once per layer.

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

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from elasticpipe.errors import InvalidRequest

__all__ = ["EventClock", "FastestTimes", "Lap", "Slowdown", "event_clock"]

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


class Slowdown:
    """Emulates a device ``factor`` times slower: a layer whose compute takes t seconds takes
    ``factor * t`` on the emulated device, in all.

    The time reported for a layer is ``factor * t``, what the emulated device would take.
    ``t`` comes from ``clock``: on CPU stages the thread's CPU time, so that stages sharing
    one host (tests, benchmarks, the demo) do not take each other's load for their own
    slowness; on CUDA, with ``events``, the time between two CUDA events around the layer,
    read later (a ``Lap``: no synchronize per layer), else wall time after a synchronize.

    **A device time that does not depend on the host's load.** An op (one micro-batch
    through the slice) takes its layers' ``factor * t`` in all: at its end it waits for
    what that device time leaves of the wall time since the op began (``begin``; without
    it, since its first slowed layer began). Sleeping between layers would also evict the
    caches of the next layer, and on a shared CPU host that made an emulated 2x straggler
    measure 2.5-3x. So an op of a device 4x slower than a core takes 4 t whether its
    compute ran alone on a core (t of wall time, 3 t owed) or shared one with another
    stage (2 t of wall time, 2 t owed), and the rest of the op -- the host's Python
    (seeding, stashing) and the tensor work outside the layers (the gradients' sums) --
    runs within the device's time, as an accelerator's host issues the next kernels while
    the device computes. Several emulated devices on a few cores then run at the speed
    the planner is told, as long as each op's work fits beside the others' (on a host
    with too little CPU for it, an op takes its wall time, more than ``factor * t``). At
    ``factor`` 1 nothing is owed: a stage not slowed down never waits. A factor ``set``
    while an op runs applies from the next op on.

    With ``fastest`` (``--timer fastest``) ``t`` is the fastest of the op's recent runs, not
    this run's own (``devicetime.FastestTimes``): CPU time itself grows with the host's load.
    """

    def __init__(
        self,
        factor: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
        events: EventClock | None = None,
        fastest: FastestTimes | None = None,
        pays: bool = True,
    ):
        self.set(factor)
        self.clock = clock
        self.events = events
        self.fastest = fastest
        self.pays = pays
        self._device_s = 0.0  # the op's device time so far (its slowed layers')
        self._began: float | None = None  # the op's start (wall time), while it is slowed
        self._op_factor: float | None = None  # the factor at the op's ``begin``
        self._laps: list[Lap] = []  # events' laps of a slowed-down op, paid in ``pay``

    def unpaid(self) -> Slowdown:
        """The same emulated device (its factor, clocks and ``fastest`` table), reporting
        the same times, whose ops wait for nothing they owe: for the profile, where no one
        waits on the emulated device. Its waits cost the profile 4x its compute at
        ``--slowdown 4``, and each timed run then started on caches and a clock cooled by
        a sleep: a GPT's blocks profiled 15-20% slower than they trained."""
        return Slowdown(self.factor, self.clock, self.events, self.fastest, pays=False)

    def set(self, factor: float) -> None:
        """Changes the factor (>= 1) while the stage runs."""
        if not factor >= 1.0 or not math.isfinite(factor):
            raise InvalidRequest(f"slowdown factor must be a finite number >= 1 (got {factor})")
        self.factor = float(factor)

    def timed(
        self,
        fn: Callable[[], Any],
        sync: Callable[[], None],
        op: Hashable | None = None,
        outside: Callable[[], float] | None = None,
    ) -> tuple[Any, float | Lap]:
        """Runs ``fn`` and returns (result, emulated seconds); the extra time is owed.
        With CUDA events the seconds are a ``Lap``, read once its events completed. ``op``
        names the op for a ``fastest`` model (``LayerSlice.op``); ``outside()``, once
        ``fn`` returned, the seconds of host work within it that are no device's (on the
        host clock)."""
        if self.events is not None:
            result, lap = self.events.time(fn, self.factor)
            if lap.factor > 1.0:
                self._laps.append(lap)
            return result, lap
        factor = self.factor if self._op_factor is None else self._op_factor
        if factor > 1.0 and self._began is None:  # (the clock read only when slowed)
            self._began = time.perf_counter()
        start = self.clock()
        result = fn()
        sync()
        compute = self.clock() - start - (outside() if outside is not None else 0.0)
        if self.fastest is not None and op is not None:
            compute = self.fastest.time(op, compute)
        if factor > 1.0:
            self._device_s += factor * compute
        return result, factor * compute

    def begin(self) -> None:
        """Starts an op (on a CPU stage, its host work from now on runs within its
        device time); forgets what an op that failed before its ``pay`` left."""
        self._device_s, self._laps, self._op_factor = 0.0, [], self.factor
        slowed = self.factor > 1.0 and self.events is None  # (CUDA: laps of device time)
        self._began = time.perf_counter() if slowed else None

    def pay(self) -> None:
        """Waits for what the op's device time leaves of the wall time since it began."""
        device_s, began, laps = self._device_s, self._began, self._laps
        self._device_s, self._began, self._laps, self._op_factor = 0.0, None, [], None
        if not self.pays:
            return
        owed = device_s - (time.perf_counter() - began) if began is not None else 0.0
        owed += sum((lap.factor - 1.0) * lap.raw() for lap in laps)  # waits: slowed only
        if owed > 0:
            time.sleep(owed)
