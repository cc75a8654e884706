"""The host/device data path without a GPU: the pinned pool's reuse rules, which path and
clock a device gets, that a CPU stage pins and copies nothing, and the deferred
CUDA-event timing folded into a slice's timings (with stand-in events)."""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import pytest
import torch

from elasticpipe.errors import DeadlineExceeded, InvalidRequest, StageUnavailable
from elasticpipe.observe.metrics import StageMetrics, StageView
from elasticpipe.stage_server import devicepath, devicetime
from elasticpipe.stage_server import stage as stage_module
from elasticpipe.stage_server.devicepath import (
    PinnedPool,
    PlainPath,
    Sender,
    for_device,
    losses_to_floats,
    memory_stats,
    sq_norm,
)
from elasticpipe.stage_server.devicetime import EventClock, Lap, Slowdown, event_clock
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.stage import Stage, StageConfig
from elasticpipe.training.job import JobConfig
from tests.support.fake_cuda import FakeEvent, Flag

CPU = torch.device("cpu")


def _pool(**kw: Any) -> tuple[PinnedPool, list[tuple[tuple[int, ...], torch.dtype]]]:
    made: list[tuple[tuple[int, ...], torch.dtype]] = []

    def allocate(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        made.append((shape, dtype))
        return torch.empty(shape, dtype=dtype)

    return PinnedPool(allocate, **kw), made


@pytest.mark.timeout(10)
def test_pool_reuses_a_buffer_only_after_its_copy_completed() -> None:
    """A released buffer comes back only once its event reports done; until then the pool
    allocates a new one."""
    pool, made = _pool()
    a = pool.acquire((2, 3), torch.float32)
    copy = Flag(done=False)
    pool.release(a, copy)
    b = pool.acquire((2, 3), torch.float32)
    assert b is not a and len(made) == 2  # a's copy still pending
    copy.done = True
    assert pool.acquire((2, 3), torch.float32) is a
    pool.release(b, None)  # no pending copy
    assert pool.acquire((2, 3), torch.float32) is b
    assert pool.allocated == 2


@pytest.mark.timeout(10)
def test_pool_is_keyed_by_shape_and_dtype_and_bounded() -> None:
    """Another shape or dtype never gets a buffer of the wrong kind; at most ``per_key``
    buffers and ``max_bytes`` stay free."""
    pool, made = _pool(per_key=2, max_bytes=3 * 24)
    a = pool.acquire((2, 3), torch.float32)
    pool.release(a, None)
    assert pool.acquire((3, 2), torch.float32) is not a
    assert pool.acquire((2, 3), torch.float64) is not a
    assert pool.acquire((2, 3), torch.float32) is a
    bufs = [torch.empty(2, 3) for _ in range(3)]
    for buf in bufs:
        pool.release(buf, None)
    assert pool.free_bytes() == 2 * 24  # the third is dropped (per_key)
    pool.release(torch.empty(6, dtype=torch.float32), None)
    assert pool.free_bytes() == 3 * 24
    pool.release(torch.empty(1, 6, dtype=torch.float32), None)  # over max_bytes: dropped
    assert pool.free_bytes() == 3 * 24
    assert len(made) == 3


@pytest.mark.timeout(10)
def test_a_cpu_device_gets_the_plain_path_and_host_clocks() -> None:
    """CPU: ``PlainPath`` and no CUDA events; CUDA: events only for the ``auto`` timer."""
    assert isinstance(for_device(CPU), PlainPath)
    assert event_clock("auto", CPU) is None
    assert event_clock("cpu", CPU) is None
    cuda = torch.device("cuda", 0)  # naming a device needs no GPU
    clock = event_clock("auto", cuda)
    assert isinstance(clock, EventClock) and clock.device == cuda
    assert event_clock("wall", cuda) is None
    assert event_clock("cpu", cuda) is None
    assert event_clock("fastest", CPU) is None
    with pytest.raises(ValueError, match="needs a CUDA device, not cpu"):
        devicepath.CudaPath(CPU)


@pytest.mark.timeout(10)
def test_the_fastest_timer_emulates_a_device_on_cpu_stages_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--timer fastest``: a CPU stage times its ops in thread CPU time, each the fastest
    of its recent runs (``FastestTimes``); a CUDA stage refuses it by name (its events
    already time the device alone); an unknown timer is refused naming the choices."""
    assert stage_module._clock("fastest", CPU) is time.thread_time
    with pytest.raises(InvalidRequest, match="timer 'fastest' emulates a device on a CPU"):
        stage_module._clock("fastest", torch.device("cuda", 0))
    with pytest.raises(InvalidRequest, match=r"unknown timer 'gpu'.*fastest"):
        stage_module._clock("gpu", CPU)
    fastest = stage_module.Stage(StageConfig("a", timer="fastest", slowdown=4.0))
    assert fastest.slowdown.fastest is not None
    assert stage_module.Stage(StageConfig("b")).slowdown.fastest is None
    # its profile times a quick layer as often as training keeps its runs, not five
    # times, and reports the emulated device's time without waiting it out
    slept: list[float] = []
    monkeypatch.setattr(devicetime.time, "sleep", slept.append)
    job = JobConfig(model="mlp", model_kwargs={"sizes": [8, 8]}, optimizer="sgd", loss="mse")
    timings = fastest.profile(job, torch.randn(4, 8), 5)
    assert [t.samples for t in timings] == [devicetime.WINDOW] * len(timings)
    assert slept == [] and all(t.forward_s > 0 for t in timings)
    assert fastest.slowdown.pays  # (the stage's own device waits: test_layers.py)


@pytest.mark.timeout(10)
def test_the_cpu_path_pins_and_copies_nothing() -> None:
    """On a CPU stage the same tensors go through unchanged (no staging copy, no pinning)
    and a send reaches its sink at once."""
    path = PlainPath(CPU)
    x = torch.randn(4, 5)
    assert path.to_device(x) is x
    pair = (x, torch.ones(4, dtype=torch.int64))
    moved = path.to_device(pair)
    assert isinstance(moved, tuple) and all(a is b for a, b in zip(moved, pair, strict=True))
    assert path.to_host(x) is x
    assert not x.is_pinned()
    sent: list[object] = []

    class Sink:
        def put(self, msg: object, answer_here: bool = False) -> None:
            sent.append((msg, answer_here))

    path.send(Sink(), x, lambda v: ("msg", v))
    assert sent == [(("msg", x), True)]  # the executor's thread reads the answer
    path.drain(time.monotonic())
    path.finish()
    path.abandon()


@pytest.mark.timeout(30)
def test_a_cpu_stage_keeps_host_timing_and_the_plain_path() -> None:
    """A stage on ``--device cpu`` times layers by thread CPU time, with no events and no
    device memory figures, exactly as before."""
    stage = Stage(StageConfig(name="cpu-stage"))
    try:
        assert isinstance(stage.path, PlainPath)
        assert stage.slowdown.events is None
        assert stage.slowdown.clock is time.thread_time
        assert stage._metrics_view().device_memory is None
    finally:
        stage.close()
    assert memory_stats(CPU) is None


@pytest.mark.timeout(10)
def test_laps_add_and_scale_by_the_slowdown() -> None:
    """A lap's seconds are the events' elapsed time times the factor it was recorded with;
    recompute and backward laps add; 0.0 adds as nothing."""
    clock = EventClock(make_event=FakeEvent)
    _, lap = clock.time(lambda: time.sleep(0.01), factor=2.0)
    _, more = clock.time(lambda: time.sleep(0.01), factor=2.0)
    assert 0.02 <= lap.seconds() < 0.2
    assert lap + 0.0 is lap and 0.0 + lap is lap
    both = lap + more
    assert both.raw() == pytest.approx(lap.raw() + more.raw())
    changed = lap + Lap(more.pairs, 3.0)  # SetSlowdown between a recompute and its backward
    assert changed.factor == 3.0 and changed.raw() == pytest.approx(lap.raw() + more.raw())


NORMED = "tests.support.custom_models:normed"
ALLOW = ("tests.support.custom_models",)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("recompute", [False, True])
def test_event_timings_are_deferred_until_settled(recompute: bool) -> None:
    """With an event clock the slice folds its layer times in only at ``settle_timings``
    (one wait a step), forward and backward (recompute included), as host timing would."""
    job = JobConfig(
        model=NORMED, optimizer="sgd", optimizer_kwargs={"lr": 0.1}, recompute_all=recompute
    )
    layers = LayerSlice(job, CPU, Slowdown(events=EventClock(make_event=FakeEvent)), ALLOW)
    layers.build(0, 5)
    y, stash = layers.forward(torch.randn(4, 8), train=True, micro_batch=0)
    assert stash is not None
    layers.backward(stash, torch.ones_like(y))
    assert all(t.samples == 0 and t.backward_s == 0.0 for t in layers.timings.values())
    FakeEvent.synced = 0
    layers.settle_timings()
    assert FakeEvent.synced > 0
    for i, t in layers.timings.items():
        assert t.samples == 1 and t.forward_s > 0, i
        assert t.output_bytes > 0
    assert any(t.backward_s > 0 for t in layers.timings.values())
    layers.settle_timings()  # nothing left: no change
    assert all(t.samples == 1 for t in layers.timings.values())


@pytest.mark.timeout(30)
def test_a_slowed_event_clock_pays_what_it_owes() -> None:
    """Factor 3 with events: the op sleeps about twice its measured time, and reports 3x
    (the host's time since ``begin`` does not count: the device's is the lap's)."""
    slow = Slowdown(3.0, events=EventClock(make_event=FakeEvent))
    slow.begin()
    time.sleep(0.03)  # the host's own work before the layer: not taken off the wait
    _, lap = slow.timed(lambda: time.sleep(0.02), lambda: None)
    assert isinstance(lap, Lap)
    start = time.perf_counter()
    slow.pay()
    paid = time.perf_counter() - start
    assert paid == pytest.approx(2 * lap.raw(), rel=0.5)
    assert lap.seconds() == pytest.approx(3 * lap.raw())


@pytest.mark.timeout(10)
def test_sq_norm_on_the_cpu_is_the_old_sum() -> None:
    """Per layer, per tensor, in float64, summed in the same order: bit-identical."""
    g = torch.Generator().manual_seed(0)
    groups = [[torch.randn(7, 3, generator=g), torch.randn(5, generator=g)], [], [torch.randn(9)]]
    old = 0.0
    for group in groups:
        per = 0.0
        for t in group:
            per += float(torch.linalg.vector_norm(t, dtype=torch.float64) ** 2)
        old += per
    assert sq_norm(groups) == old
    assert sq_norm([]) == 0.0
    assert math.isinf(sq_norm([[torch.tensor([math.inf])]]))


@pytest.mark.timeout(10)
def test_losses_to_floats_reads_each_scalar() -> None:
    """Scalar tensors in, the same floats out, in order."""
    assert losses_to_floats([torch.tensor(1.5), torch.tensor([2.25])]) == [1.5, 2.25]
    assert losses_to_floats([]) == []


@pytest.mark.timeout(10)
def test_device_memory_is_exported_for_cuda_stages_only() -> None:
    """With device figures the stage exports allocated and peak bytes; a CPU stage none."""
    from prometheus_client import generate_latest

    base = dict(
        epoch=1,
        layer_lo=0,
        layer_hi=2,
        committed_step=1,
        mailbox_bytes=0,
        mailbox_entries=0,
        stashed_bytes=0,
        stashed_micro_batches=0,
        slowdown=1.0,
    )
    cuda = generate_latest(StageMetrics(lambda: StageView(**base, device_memory=(10, 20))).registry)
    assert b"elasticpipe_stage_device_allocated_bytes 10.0" in cuda
    assert b"elasticpipe_stage_device_peak_bytes 20.0" in cuda
    cpu = generate_latest(StageMetrics(lambda: StageView(**base)).registry)
    assert b"device_allocated_bytes" not in cpu


class Gate:
    """A copy that completes when the test says so (``synchronize`` blocks until then)."""

    def __init__(self, fail: bool = False) -> None:
        self.opened = threading.Event()
        self.fail = fail

    def synchronize(self) -> None:
        self.opened.wait(10)
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")


class Collect:
    def __init__(self) -> None:
        self.got: list[object] = []

    def put(self, msg: object, answer_here: bool = False) -> None:
        self.got.append(msg)


@pytest.mark.timeout(20)
def test_the_sender_hands_on_in_order_and_only_after_each_copy() -> None:
    """Nothing reaches the sink before its copy completed, and messages keep their order
    even when a later copy completes first."""
    sender, sink = Sender("cuda:0"), Collect()
    first, second = Gate(), Gate()
    sender.submit(first, sink, "m0")
    sender.submit(second, sink, "m1")
    second.opened.set()
    time.sleep(0.05)
    assert sink.got == []  # m0's copy is still running: m1 waits behind it
    first.opened.set()
    sender.drain(time.monotonic() + 5)
    assert sink.got == ["m0", "m1"]
    only_wait = Gate()
    only_wait.opened.set()
    sender.submit(only_wait, None, None)  # a host copy with nothing to send
    sender.drain(time.monotonic() + 5)
    sender.close()


@pytest.mark.timeout(20)
def test_the_sender_drain_names_a_deadline_and_a_failed_copy() -> None:
    """A copy still running at the deadline and a failing copy are errors that say so;
    after the failure is reported the sender goes on."""
    sender, sink = Sender("cuda:1"), Collect()
    slow = Gate()
    sender.submit(slow, sink, "late")
    with pytest.raises(DeadlineExceeded, match="1 device-to-host copies on cuda:1 still pending"):
        sender.drain(time.monotonic() + 0.05)
    slow.opened.set()
    sender.drain(time.monotonic() + 5)
    broken = Gate(fail=True)
    broken.opened.set()
    sender.submit(broken, sink, "lost")
    with pytest.raises(StageUnavailable, match=r"copy on cuda:1 failed: .*illegal memory access"):
        sender.drain(time.monotonic() + 5)
    assert sink.got == ["late"]
    fine = Gate()
    fine.opened.set()
    sender.submit(fine, sink, "next")
    sender.drain(time.monotonic() + 5)
    assert sink.got == ["late", "next"]
    sender.close()
