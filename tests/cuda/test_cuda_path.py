"""The CUDA data path on a GPU: pinned staging and copy-stream ordering give the right bytes,
CUDA-event timing is sane and needs no synchronize per layer, reductions sync once."""

from __future__ import annotations

import time

import pytest
import torch

from elasticpipe.stage_server.devicepath import (
    CudaPath,
    for_device,
    losses_to_floats,
    memory_stats,
    sq_norm,
)
from elasticpipe.stage_server.devicetime import EventClock, Lap, Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.training.job import JobConfig

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda", 0)
BIG = (4096, 4096)  # 64 MiB of float32: copies long enough to race if ordering were wrong


class Sink:
    """Collects what a link would send, with the host bytes it held when put."""

    def __init__(self) -> None:
        self.got: list[tuple[str, torch.Tensor]] = []

    def put(self, msg: tuple[str, torch.Tensor]) -> None:
        name, tensor = msg
        self.got.append((name, tensor.clone()))  # the bytes as the link would read them


def _busy(x: torch.Tensor, rounds: int = 20) -> torch.Tensor:
    """A long chain of kernels on the current stream (so copies would overtake it)."""
    for _ in range(rounds):
        x = torch.tanh(x @ x.T / x.shape[0])
    return x


@pytest.mark.timeout(60)
def test_to_device_is_right_without_a_sync_and_reuses_pinned_buffers() -> None:
    """Many host->device copies of one shape back to back: each arrives intact (a pinned
    buffer is never overwritten before its copy finished), on the device, and the pool
    reuses buffers once their copies completed."""
    assert isinstance(for_device(CUDA), CudaPath)
    path = CudaPath(CUDA)
    sources = [torch.full(BIG, float(k)) for k in range(8)]
    outs = [path.to_device(s) for s in sources]
    for k, out in enumerate(outs):
        assert isinstance(out, torch.Tensor) and out.device.type == "cuda"
        assert torch.equal(out.cpu(), sources[k]), k
    torch.cuda.synchronize()
    before = path.pool.allocated
    again = path.to_device(sources[0])
    assert path.pool.allocated == before  # a completed buffer was reused
    assert torch.equal(again.cpu(), sources[0])  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_a_pinned_input_is_copied_from_where_it_is() -> None:
    """A tensor already in pinned memory takes no staging buffer and arrives intact, even
    when the caller drops it at once."""
    path = CudaPath(CUDA)
    source = torch.full(BIG, 3.0).pin_memory()
    out = path.to_device(source)
    del source
    torch.empty(BIG).pin_memory().fill_(float("nan"))  # would land on the freed block
    assert path.pool.allocated == 0
    assert isinstance(out, torch.Tensor) and bool((out == 3.0).all())


@pytest.mark.timeout(60)
def test_mixed_values_keep_their_dtypes_and_structure() -> None:
    """A dict with a float and an int64 tensor comes back the same on the device."""
    path = for_device(CUDA)
    value = {"h": torch.randn(3, 5), "ids": torch.arange(6).reshape(3, 2)}
    out = path.to_device(value)
    assert isinstance(out, dict) and list(out) == ["h", "ids"]
    for key, sent in value.items():
        assert out[key].device.type == "cuda" and out[key].dtype == sent.dtype
        assert torch.equal(out[key].cpu(), sent)


@pytest.mark.timeout(60)
def test_send_waits_for_compute_and_survives_the_source_being_freed() -> None:
    """An output still being computed is copied only once done (``wait_stream``), reaches
    the sink only once copied, and its memory is not reused while the copy runs
    (``record_stream``) even though the caller drops it at once."""
    path = CudaPath(CUDA)
    sink = Sink()
    expected = []
    for k in range(4):
        x = torch.full(BIG, 0.001 * (k + 1), device=CUDA)
        y = _busy(x)
        expected.append(y.detach().cpu())  # a reference computed in order (syncs; fine here)
        y = _busy(x)  # the same value again, still in flight when sent
        path.send(sink, y, lambda v, k=k: (f"m{k}", v))
        del y, x
        torch.empty(BIG, device=CUDA).fill_(float("nan"))  # would land on y's memory
    path.drain(time.monotonic() + 30)
    assert [name for name, _ in sink.got] == ["m0", "m1", "m2", "m3"]  # in order
    for (_, got), want in zip(sink.got, expected, strict=True):
        torch.testing.assert_close(got, want)
    held = path.pool.free_bytes()
    path.finish()
    assert path.pool.free_bytes() > held  # the run's buffers went back


@pytest.mark.timeout(60)
def test_to_host_gives_pinned_bytes_after_drain() -> None:
    """An inference output copied to the host is pinned and right once drained."""
    path = for_device(CUDA)
    y = _busy(torch.full((512, 512), 0.01, device=CUDA))
    host = path.to_host(y)
    path.drain(time.monotonic() + 30)
    assert isinstance(host, torch.Tensor) and host.is_pinned()
    torch.testing.assert_close(host, y.cpu())


@pytest.mark.timeout(60)
def test_event_timing_matches_synchronized_host_timing() -> None:
    """A lap around a long kernel chain measures what a synchronize-bracketed host clock
    does (within a factor of two), and a slice times its layers without any synchronize."""
    x = torch.full((2048, 2048), 0.001, device=CUDA)
    _busy(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    _busy(x)
    torch.cuda.synchronize()
    host = time.perf_counter() - start
    _, lap = EventClock(CUDA).time(lambda: _busy(x), factor=1.0)
    assert isinstance(lap, Lap)
    assert host / 2 < lap.seconds() < host * 2, (host, lap.seconds())

    job = JobConfig(model="mlp", model_kwargs={"sizes": [256, 512, 512, 8]}, optimizer="sgd")
    layers = LayerSlice(job, CUDA, Slowdown(events=EventClock(CUDA)))
    layers.build(0, 5)
    real = torch.cuda.synchronize

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch.cuda.synchronize on the hot path")

    torch.cuda.synchronize = forbidden  # type: ignore[assignment]
    try:
        y, stash = layers.forward(torch.randn(64, 256, device=CUDA), train=True)
        assert stash is not None
        layers.backward(stash, torch.ones_like(y))  # type: ignore[arg-type]
    finally:
        torch.cuda.synchronize = real
    layers.settle_timings()
    for i, t in layers.timings.items():
        assert t.samples == 1 and 0 < t.forward_s < 1.0, i
        assert 0 <= t.backward_s < 1.0, i


@pytest.mark.timeout(60)
def test_reductions_on_the_device_match_the_cpu() -> None:
    """The grad sq-norm summed on the GPU and read once equals the CPU's; losses too."""
    g = torch.Generator().manual_seed(0)
    groups = [[torch.randn(300, 7, generator=g), torch.randn(50, generator=g)], [torch.randn(9)]]
    on_gpu = [[t.to(CUDA) for t in group] for group in groups]
    assert sq_norm(on_gpu) == pytest.approx(sq_norm(groups), rel=1e-12)
    losses = [torch.tensor(0.25), torch.tensor(1.5)]
    assert losses_to_floats([t.to(CUDA) for t in losses]) == [0.25, 1.5]


@pytest.mark.timeout(60)
def test_memory_stats_follow_the_allocator() -> None:
    """Allocated bytes grow with a tensor; the peak is at least the current figure."""
    before = memory_stats(CUDA)
    assert before is not None
    t = torch.empty(64 << 20, dtype=torch.uint8, device=CUDA)
    after = memory_stats(CUDA)
    assert after is not None
    assert after[0] >= before[0] + (64 << 20) and after[1] >= after[0]
    del t
