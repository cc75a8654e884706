"""A stage's data path between host and device: pinned staging, a copy stream, event timing.

On a CPU stage nothing here changes what happens: ``for_device`` returns ``PlainPath``,
which moves values with ``Tensor.to`` exactly as before, pins nothing and sends at once.

On a CUDA stage (``CudaPath``) activations and gradients cross the host/device boundary
on a dedicated copy stream, so that copies overlap the compute stream's work:

* host -> device (``to_device``): the received CPU tensor is copied into a pinned buffer
  from ``PinnedPool`` (a host memcpy), then copied to the device with ``non_blocking=True``
  on the copy stream. The compute stream waits for that copy (``wait_event``) before any
  kernel reads the result, and the device tensor is ``record_stream``-ed on the compute
  stream so that the caching allocator does not hand its memory out while compute may
  still read it. The pinned buffer goes back to the pool with the copy's event: it is
  reused only once that event has completed.
* device -> host (``send``): the copy stream first waits for the compute stream
  (``wait_stream``: the output must be finished), copies into a pinned buffer with
  ``non_blocking=True`` and records an event; the device tensor is ``record_stream``-ed on
  the copy stream (it may be freed by the caller before the copy ran). A sender thread
  waits for each event in order and only then hands the message to the link, so the
  compute thread never blocks on a copy and the link never reads a buffer before its bytes
  arrived. The buffers of a run go back to the pool only after ``finish`` (every link has
  flushed: the bytes have left); a failed run drops them.
* layer timing (``devicetime.EventClock``): a layer's compute is bracketed by two CUDA
  events instead of host clocks around ``torch.cuda.synchronize``, read once per step.
* reductions read back once: the losses of a step and the gradients' squared norm are
  summed on the device and read with one synchronisation (``losses_to_floats``,
  ``sq_norm``).

Worked example, stage 1 of 3 on a GPU, one micro-batch: the mailbox holds a CPU tensor x;
``to_device`` copies it into pinned buffer B (host), enqueues B -> x' on the copy stream,
records event E1, makes the compute stream wait for E1 and returns x'. The layers run on
the compute stream (events S, T around each layer). ``send`` makes the copy stream wait
for the compute stream, enqueues y -> pinned C, records E2, and queues (E2, message(C)) to
the sender thread, which waits for E2 and puts the message on the link. At the run's end
``drain`` waits for the sender, the executor flushes the links, ``finish`` returns C to the
pool; ``settle_timings`` waits for the last T and folds every layer's time in.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from elasticpipe.errors import DeadlineExceeded, StageUnavailable
from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value

__all__ = [
    "CudaPath",
    "DevicePath",
    "PinnedPool",
    "PlainPath",
    "Sender",
    "Sink",
    "for_device",
    "losses_to_floats",
    "memory_stats",
    "sq_norm",
]

POOL_BUFFERS_PER_KEY = 4  # free pinned buffers kept per (shape, dtype)
POOL_MAX_BYTES = 1 << 30  # free pinned bytes kept in all


class Ready(Protocol):
    """What a buffer waits on before reuse: a ``torch.cuda.Event`` (or a test's stand-in)."""

    def query(self) -> bool: ...


Key = tuple[tuple[int, ...], torch.dtype]


@dataclass
class _Free:
    buffer: torch.Tensor
    ready: Ready | None


@dataclass
class PinnedPool:
    """Reusable pinned host buffers keyed by (shape, dtype).

    ``acquire`` hands out a free buffer whose last copy has completed (its event's
    ``query()`` is True), else allocates a new one; ``release`` returns a buffer with the
    event of the copy that last used it. At most ``per_key`` free buffers are kept per key
    and ``max_bytes`` in all; the rest are dropped (freed by the caching host allocator).
    """

    allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    per_key: int = POOL_BUFFERS_PER_KEY
    max_bytes: int = POOL_MAX_BYTES
    _free: dict[Key, list[_Free]] = field(default_factory=dict)
    _bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    allocated: int = 0  # buffers allocated so far (tests, metrics)

    def acquire(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A pinned buffer of ``shape`` and ``dtype`` that no pending copy still uses."""
        key: Key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key, [])
            for n, entry in enumerate(free):
                if entry.ready is None or entry.ready.query():
                    del free[n]
                    self._bytes -= _nbytes(entry.buffer)
                    return entry.buffer
            self.allocated += 1
        return self.allocate(key[0], dtype)

    def release(self, buffer: torch.Tensor, ready: Ready | None) -> None:
        """Returns ``buffer``; it is reused only once ``ready`` (its last copy) completed."""
        key: Key = (tuple(buffer.shape), buffer.dtype)
        size = _nbytes(buffer)
        with self._lock:
            free = self._free.setdefault(key, [])
            if len(free) < self.per_key and self._bytes + size <= self.max_bytes:
                free.append(_Free(buffer, ready))
                self._bytes += size

    def free_bytes(self) -> int:
        """Bytes held by free buffers."""
        with self._lock:
            return self._bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


class Sink(Protocol):
    """Where ``send`` delivers: a ``Link`` (its ``put``; ``answer_here``: the calling thread
    reads the answer itself, ``Link.collect``)."""

    def put(self, msg: Any, answer_here: bool = False) -> None: ...


class DevicePath(Protocol):
    """How a stage moves values between host and its device (see the module docstring)."""

    def to_device(self, value: Value) -> Value: ...

    def to_host(self, value: Value) -> Value: ...

    def send(self, sink: Sink, value: Value, make: Callable[[Value], Any]) -> None: ...

    def drain(self, deadline: float) -> None: ...

    def finish(self) -> None: ...

    def abandon(self) -> None: ...

    def close(self) -> None: ...


class PlainPath:
    """The path of a CPU stage (and the fallback anywhere): ``Tensor.to``, sends at once."""

    def __init__(self, device: torch.device):
        self.device = device

    def to_device(self, value: Value) -> Value:
        """``value`` on the device (``structure.to_device``: no copy for a CPU tensor)."""
        return structure.to_device(value, self.device)

    def to_host(self, value: Value) -> Value:
        """``value`` on the CPU."""
        return structure.to_device(value, torch.device("cpu"))

    def send(self, sink: Sink, value: Value, make: Callable[[Value], Any]) -> None:
        """Puts ``make(value)`` on ``sink`` now, its answer left to this thread (the
        executor's: it collects the answers as it goes, and flushes at the run's end)."""
        sink.put(make(value), answer_here=True)

    def drain(self, deadline: float) -> None:
        """Nothing is ever pending."""

    def finish(self) -> None:
        """Nothing to give back."""

    def abandon(self) -> None:
        """Nothing to drop."""

    def close(self) -> None:
        """Nothing runs."""


class CudaPath:
    """Pinned buffers and non-blocking copies on a dedicated stream (a CUDA stage)."""

    def __init__(self, device: torch.device, pool: PinnedPool | None = None):
        if device.type != "cuda":
            raise ValueError(f"CudaPath needs a CUDA device, not {device}")
        self.device = device
        self.pool = pool or PinnedPool(_pinned)
        self.copy_stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch stub
        self._in_use: list[tuple[torch.Tensor, Ready]] = []  # this run's D2H buffers
        self.sender = Sender(str(device))

    def _compute(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def to_device(self, value: Value) -> Value:
        """``value`` on the device; the compute stream waits for the copy (non-blocking)."""
        compute = self._compute()
        return structure.apply(value, lambda t: self._upload(t, compute))

    def _upload(self, t: torch.Tensor, compute: torch.cuda.Stream) -> torch.Tensor:
        if t.device.type != "cpu":
            return t.to(self.device)
        # Already pinned (decoded into pinned memory): copied from where it is; torch's
        # caching host allocator keeps its block until the copy completed.
        staging = t if t.is_pinned() else self.pool.acquire(t.shape, t.dtype)
        if staging is not t:
            staging.copy_(t)
        with torch.cuda.stream(self.copy_stream):
            out = staging.to(self.device, non_blocking=True)
            done = self.copy_stream.record_event()
        compute.wait_event(done)  # no kernel of the compute stream reads ``out`` earlier
        out.record_stream(compute)  # allocated on the copy stream, used on compute
        if staging is not t:
            self.pool.release(staging, done)  # reused only once the copy completed
        return out

    def _download(self, t: torch.Tensor, pooled: bool) -> tuple[torch.Tensor, bool]:
        if t.device.type == "cpu":
            return t, False
        t = t.detach()
        if pooled:
            host = self.pool.acquire(t.shape, t.dtype)
        else:  # handed out for good (inference outputs): not the pool's
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(self.copy_stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.copy_stream)  # the caller may drop ``t`` before the copy ran
        return host, pooled

    def _stage_out(self, value: Value, pooled: bool) -> tuple[Value, torch.cuda.Event]:
        self.copy_stream.wait_stream(self._compute())  # the value must be computed first
        held: list[torch.Tensor] = []

        def one(t: torch.Tensor) -> torch.Tensor:
            host, pool = self._download(t, pooled)
            if pool:
                held.append(host)
            return host

        out = structure.apply(value, one)
        done = self.copy_stream.record_event()
        self._in_use.extend((h, done) for h in held)
        return out, done

    def to_host(self, value: Value) -> Value:
        """``value`` in pinned host memory; it may still be arriving until ``drain``."""
        out, done = self._stage_out(value, pooled=False)
        self.sender.submit(done, None, None)  # ``drain`` waits for it
        return out

    def send(self, sink: Sink, value: Value, make: Callable[[Value], Any]) -> None:
        """Copies ``value`` to the host on the copy stream; ``make(host)`` goes to ``sink``
        once the copy completed, without blocking the caller."""
        out, done = self._stage_out(value, pooled=True)
        self.sender.submit(done, sink, make(out))

    def drain(self, deadline: float) -> None:
        """Waits until every copy of this run completed and its message went to its link
        (``Sender.drain``)."""
        self.sender.drain(deadline)

    def finish(self) -> None:
        """The run's sends have left (links flushed): their buffers go back to the pool."""
        for host, done in self._in_use:
            self.pool.release(host, done)
        self._in_use.clear()

    def abandon(self) -> None:
        """A failed run: a link may still read its buffers, so none is reused; a copy error
        of that run does not fail the next one."""
        self._in_use.clear()
        self.sender.forget_error()

    def close(self) -> None:
        """Stops the sender thread (the stage is closing)."""
        self.sender.close()


class Waitable(Protocol):
    """A copy's completion: a ``torch.cuda.Event`` (or a test's stand-in)."""

    def synchronize(self) -> None: ...


class Sender:
    """Hands messages to their sinks in submission order, each once its copy completed,
    from its own thread (so the compute thread never waits for a copy).

    Args:
        where: named in errors (the device).
    """

    def __init__(self, where: str):
        self.where = where
        self._queue: queue.Queue[tuple[Waitable, Sink | None, Any] | None] = queue.Queue()
        self._pending = 0
        self._error: BaseException | None = None
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="d2h-sender", daemon=True)
        self._thread.start()

    def submit(self, done: Waitable, sink: Sink | None, msg: Any) -> None:
        """Puts ``msg`` on ``sink`` once ``done`` completed (None: only waits for it)."""
        with self._idle:
            self._pending += 1
        self._queue.put((done, sink, msg))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            done, sink, msg = item
            try:
                done.synchronize()
                if sink is not None:
                    sink.put(msg)
            except BaseException as exc:  # a CUDA error: kept, raised by ``drain``
                with self._idle:
                    self._error = self._error or exc
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def drain(self, deadline: float) -> None:
        """Waits until everything submitted was handed on.

        Raises:
            DeadlineExceeded: copies still pending at ``deadline`` (``time.monotonic()``).
            StageUnavailable: a copy failed (a CUDA error), named.
        """
        with self._idle:
            ok = self._idle.wait_for(
                lambda: self._pending == 0, max(0.0, deadline - time.monotonic())
            )
            error, self._error = self._error, None
        if error is not None:
            raise StageUnavailable(f"a device-to-host copy on {self.where} failed: {error!r}")
        if not ok:
            raise DeadlineExceeded(
                f"{self._pending} device-to-host copies on {self.where} still pending at the "
                "deadline"
            )

    def forget_error(self) -> None:
        """Drops a failed copy's error (its run was abandoned)."""
        with self._idle:
            self._error = None

    def close(self) -> None:
        """Stops the thread once what was submitted is handed on."""
        self._queue.put(None)
        self._thread.join(timeout=5)


def for_device(device: torch.device) -> DevicePath:
    """The data path for a stage on ``device``: ``CudaPath`` on CUDA, else ``PlainPath``."""
    if device.type == "cuda":
        return CudaPath(device)
    return PlainPath(device)


# ---- reductions and memory ----------------------------------------------------------------


def sq_norm(groups: list[list[torch.Tensor]]) -> float:
    """Sum over ``groups`` (a stage's layers) of the sum of the squared 2-norms of their
    tensors (the gradients), in float64; inf or nan kept.

    On the CPU, one float per tensor, summed as before; on a device the sums stay there, in
    the same order, and one ``item()`` reads the total: one synchronisation instead of one
    a tensor.
    """
    first = next((g for group in groups for g in group), None)
    if first is None or first.device.type == "cpu":
        cpu: float = sum(_cpu_sq_norm(group) for group in groups)  # as before: same rounding
        return cpu
    total = torch.zeros((), dtype=torch.float64, device=first.device)
    for group in groups:
        acc = torch.zeros((), dtype=torch.float64, device=first.device)
        for g in group:
            acc = acc + torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
        total = total + acc
    return float(total.item())


def _cpu_sq_norm(group: list[torch.Tensor]) -> float:
    total = 0.0
    for g in group:
        total += float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2)
    return total


def losses_to_floats(losses: list[torch.Tensor]) -> list[float]:
    """Scalar loss tensors as floats: one synchronisation for all of them on a device."""
    if not losses:
        return []
    if losses[0].device.type == "cpu":
        return [float(t) for t in losses]
    values: list[float] = torch.stack([t.reshape(()) for t in losses]).tolist()
    return values


def memory_stats(device: torch.device) -> tuple[int, int] | None:
    """(allocated, peak allocated) bytes of the caching allocator on a CUDA device; None
    elsewhere (a CPU stage's memory is the process's)."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
