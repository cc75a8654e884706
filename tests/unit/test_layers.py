"""A stage's layer slice: recomputation is exact (dropout and batch-norm included), a
layer's scheduler travels with it, and an emulated device's times (each run's, or the
fastest of the recent runs)."""

from __future__ import annotations

import time

import pytest
import torch

from elasticpipe.stage_server import devicetime
from elasticpipe.stage_server.devicetime import FastestTimes, Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.slicestate import LayerTiming
from elasticpipe.training.job import JobConfig

NORMED = "tests.support.custom_models:normed"  # Linear, BatchNorm1d, ReLU, Dropout, Linear
ALLOW = ("tests.support.custom_models",)


def _slice(**options: object) -> LayerSlice:
    job = JobConfig(model=NORMED, optimizer="sgd", optimizer_kwargs={"lr": 0.1}, **options)  # type: ignore[arg-type]
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ALLOW)
    layers.build(0, 5)
    return layers


def _train(layers: LayerSlice, steps: int = 3) -> tuple[dict[str, torch.Tensor], int]:
    torch.manual_seed(7)
    peak = 0
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(6, 8, generator=g)
        stashes = [layers.forward(x[k::2], train=True, micro_batch=k) for k in range(2)]
        peak = max(peak, sum(s.nbytes() for _, s in stashes if s is not None))
        for y, stash in reversed(stashes):
            assert stash is not None
            layers.backward(stash, torch.ones_like(y))
        layers.step()
    state = {f"{i}.{k}": v for i, m in layers.layers.items() for k, v in m.state_dict().items()}
    return state, peak


@pytest.mark.timeout(30)
@pytest.mark.parametrize("options", [{"recompute_all": True}, {"recompute": (1, 3)}])
def test_recompute_gives_exactly_the_same_weights(options: dict[str, object]) -> None:
    """Same dropout masks, batch-norm statistics updated once: bit-identical weights and
    buffers, fewer bytes stashed."""
    plain, plain_peak = _train(_slice())
    again, peak = _train(_slice(**options))
    assert plain.keys() == again.keys()
    for key, value in plain.items():
        assert torch.equal(again[key], value), key
    assert peak < plain_peak


@pytest.mark.timeout(30)
def test_a_moved_layer_carries_its_scheduler() -> None:
    """export_layer then load_layer elsewhere: the learning rate goes on where it was."""
    options = {"scheduler": "StepLR", "scheduler_kwargs": {"step_size": 2, "gamma": 0.5}}
    source = _slice(**options)
    _train(source, steps=3)
    state = source.export_layer(0, include_optimizer=True)
    assert isinstance(state["scheduler"], str)  # JSON text, never pickle
    target = _slice(**options)
    built = target.load_layer(0, state)
    assert built.scheduler is not None and built.optimizer is not None
    assert built.optimizer.param_groups[0]["lr"] == pytest.approx(0.05)
    built.scheduler.step()
    assert built.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)
    assert built.scheduler.last_epoch == 4


MASKED = "tests.support.custom_models:masked"  # layers pass (hidden, mask) or a dict


def _train_masked(as_dict: bool, **options: object) -> tuple[dict[str, torch.Tensor], int]:
    job = JobConfig(
        model=MASKED,
        model_kwargs={"as_dict": as_dict, "clamp": not as_dict},
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.1},
        **options,  # type: ignore[arg-type]
    )
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ALLOW)
    # [clamp (integers only, tuples only),] embedding, 2 x (attention, MLP), head
    layers.build(0, 6 if as_dict else 7)
    torch.manual_seed(7)
    peak = 0
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 13, (4, 5), generator=g)
        mask = torch.rand(4, 5, generator=g) > 0.3
        x = {"ids": ids, "mask": mask} if as_dict else (ids, mask)
        y, stash = layers.forward(x, train=True, micro_batch=0)  # type: ignore[arg-type]
        assert stash is not None and isinstance(y, torch.Tensor)
        peak = max(peak, stash.nbytes())
        layers.backward(stash, torch.ones_like(y))
        layers.step()
    state = {f"{i}.{k}": v for i, m in layers.layers.items() for k, v in m.state_dict().items()}
    return state, peak


@pytest.mark.timeout(30)
@pytest.mark.parametrize("as_dict", [False, True])
@pytest.mark.parametrize("options", [{"recompute_all": True}, {"recompute": (0, 2, 3)}])
def test_recompute_of_layers_passing_several_tensors_is_exact(
    as_dict: bool, options: dict[str, object]
) -> None:
    """Layers taking and returning (hidden, mask) tuples or dicts, an integers-only one
    among them: recomputing keeps only each layer's inputs, and the weights come out
    bit-identical with fewer bytes stashed."""
    plain, plain_peak = _train_masked(as_dict)
    again, peak = _train_masked(as_dict, **options)
    assert plain.keys() == again.keys()
    for key, value in plain.items():
        assert torch.equal(again[key], value), key
    assert peak < plain_peak


def test_an_emulated_device_takes_factor_times_the_compute_however_loaded_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slowdown 4 on a layer whose compute takes 10 ms of CPU time: the op owes what brings
    it to 40 ms in all, whether the compute took 10 ms of wall time (alone on its core)
    or 25 ms (sharing it); factor 1 owes nothing."""
    slept: list[float] = []
    monkeypatch.setattr(devicetime.time, "sleep", slept.append)  # what pay() waits
    for factor, wall_s, want in ((4.0, 0.010, 0.040), (4.0, 0.025, 0.040), (1.0, 0.010, None)):
        cpu = iter([0.0, 0.010])  # the thread's CPU time around the compute
        slow = Slowdown(factor, clock=lambda cpu=cpu: next(cpu))  # type: ignore[misc]
        began = time.perf_counter()
        _, reported = slow.timed(lambda wall_s=wall_s: _busy(wall_s), lambda: None)  # type: ignore[misc]
        took = time.perf_counter() - began
        slept.clear()
        slow.pay()
        assert reported == pytest.approx(factor * 0.010)
        if want is None:
            assert slept == []
        else:  # (a host so loaded that the compute took longer owes nothing)
            total = took + sum(slept)
            assert total == pytest.approx(max(want, took), abs=0.002), (wall_s, took, slept)


def test_the_hosts_work_between_layers_runs_within_the_device_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Slowdown 4 on two layers of 10 ms of compute each (a fake CPU clock) with the
    host's own work between them: 30 ms of it runs within the op's 80 ms of device time
    (as an accelerator's host issues kernels while the device computes), 100 ms of it
    makes the op take that long and owe nothing. An op that failed before paying leaves
    nothing to the next (``begin``), and a factor set during an op applies from the next."""
    slept: list[float] = []
    monkeypatch.setattr(devicetime.time, "sleep", slept.append)
    for host_s in (0.030, 0.100):
        cpu = iter([0.0, 0.010, 1.0, 1.010])
        slow = Slowdown(4.0, clock=lambda cpu=cpu: next(cpu))  # type: ignore[misc]
        slow.begin()
        began = time.perf_counter()
        slow.timed(lambda: None, lambda: None)
        _busy(host_s)
        slow.timed(lambda: None, lambda: None)
        took = time.perf_counter() - began
        slept.clear()
        slow.pay()
        if took >= 0.080:
            assert slept == [], (host_s, took, slept)
        else:
            assert took + sum(slept) == pytest.approx(0.080, abs=0.003), (host_s, took, slept)
    cpu = iter([0.0, 0.010, 1.0, 1.010])
    slow = Slowdown(4.0, clock=lambda: next(cpu))
    slow.timed(lambda: None, lambda: None)  # an op that raised after its first layer
    slow.begin()
    slow.timed(lambda: None, lambda: None)
    slept.clear()
    slow.pay()
    assert len(slept) == 1 and slept[0] == pytest.approx(0.040, abs=0.003)
    cpu = iter([0.0, 0.010, 1.0, 1.010, 2.0, 2.010])
    slow = Slowdown(4.0, clock=lambda: next(cpu))
    slow.begin()
    slow.timed(lambda: None, lambda: None)
    slow.set(1.0)  # while the op runs
    _, reported = slow.timed(lambda: None, lambda: None)
    slept.clear()
    slow.pay()
    assert reported == pytest.approx(0.040)
    assert len(slept) == 1 and slept[0] == pytest.approx(0.080, abs=0.003)
    slow.begin()
    _, reported = slow.timed(lambda: None, lambda: None)
    slept.clear()
    slow.pay()
    assert reported == pytest.approx(0.010) and slept == []  # the next op: factor 1


def test_the_profiles_emulated_device_reports_its_time_and_waits_for_none_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``Slowdown.unpaid`` (the profile's): the same factor, clock and ``fastest`` table,
    the same reported time, and no wait; the stage's own device still waits. Compute of
    5 ms, then 4 ms, by a fake clock: the profile reports 4 x 5 ms and sleeps nothing; the
    stage's next run of the same op reports 4 x 4 ms (the fastest of both: one table) and
    waits those 16 ms, less the wall time its run took."""
    slept: list[float] = []
    monkeypatch.setattr(devicetime.time, "sleep", slept.append)
    ticks = iter([0.0, 0.005, 1.0, 1.004])
    table = FastestTimes()
    stage = Slowdown(4.0, clock=lambda: next(ticks), fastest=table)
    profile = stage.unpaid()
    assert (profile.factor, profile.clock, profile.fastest) == (4.0, stage.clock, table)
    _, reported = profile.timed(lambda: None, lambda: None, op="op")
    profile.pay()
    assert reported == pytest.approx(0.020) and slept == []
    _, again = stage.timed(lambda: None, lambda: None, op="op")
    stage.pay()
    assert again == pytest.approx(0.016)  # one table: the fastest of both runs
    assert len(slept) == 1 and slept[0] == pytest.approx(0.016, abs=0.002)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_an_op_counts_as_the_fastest_of_its_recent_runs() -> None:
    """``--timer fastest``: an op counts as the fastest of its last ``window`` runs (a
    loaded host only ever adds time), and a run falls out of the window as newer ones come;
    each op (here the key) has its own runs; a full table forgets the least recent op."""
    fastest = FastestTimes(window=3, max_ops=2)
    assert [fastest.time("a", t) for t in (0.030, 0.010, 0.020, 0.050)] == [
        0.030,
        0.010,
        0.010,
        0.010,
    ]
    assert fastest.time("a", 0.040) == 0.020  # 0.010 fell out of the window
    assert fastest.time("b", 0.045) == 0.045  # another op: its own runs
    assert fastest.time("a", 0.001) == 0.001
    fastest.time("c", 0.007)  # a third op: the table (max 2) forgets b, run least recently
    assert fastest.time("a", 0.060) == 0.001
    assert fastest.time("b", 0.090) == 0.090
    with pytest.raises(ValueError, match="window must be >= 1"):
        FastestTimes(window=0)


def test_a_slowed_slice_does_not_count_the_hosts_load_with_the_fastest_timer() -> None:
    """A slowed slice with the fastest-run model: a layer whose compute is made slower (a
    busy loop inside it: the host's load) reports the same seconds as before; an input of
    another shape is an op of its own, whose slow run counts."""
    job = JobConfig(model=NORMED, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    layers = LayerSlice(
        job, torch.device("cpu"), Slowdown(2.0, time.thread_time, None, FastestTimes()), ALLOW
    )
    layers.build(0, 5)

    def first_forward(rows: int) -> float:
        layers.timings = {i: LayerTiming() for i in layers.indices}
        y, stash = layers.forward(torch.randn(rows, 8), train=True, micro_batch=0)
        assert stash is not None
        layers.backward(stash, torch.ones_like(y))
        return layers.timings[0].forward_s

    for _ in range(5):
        before = first_forward(6)
    layer = layers.layers[0]
    slow = layer.forward
    # (an instance attribute the layer's op name no longer sees: ``LayerSlice`` named it)
    layer.forward = lambda x: (_cpu_busy(0.02), slow(x))[1]  # type: ignore[method-assign]
    assert [first_forward(6) for _ in range(3)] == [before] * 3  # 20 ms more: not counted
    assert first_forward(4) > 2 * 0.02  # a new shape: its one run is slow, and counts


def _cpu_busy(seconds: float) -> None:
    """Spends ``seconds`` of this thread's CPU time (what a CPU stage's layers are timed
    in), however long the host keeps it waiting."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Named(FastestTimes):
    """Keeps the name of every op timed, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[object] = []

    def time(self, op: object, measured: float) -> float:  # type: ignore[override]
        self.names.append(op)
        return super().time(op, measured)


@pytest.mark.parametrize("split", [False, True], ids=["1f1b", "zb-h1"])
def test_each_kind_of_layer_op_has_a_name_of_its_own(split: bool) -> None:
    """An MLP of three alike Linear layers on the first stage: the first one's input is data
    (no gradient), so its forward and its whole backward are other ops than the two others'
    (which share theirs); a backward (whole, or ZB-H1's input and weight gradients, W the
    same op for all three: weights only) is another op than the forward, and inference
    (eval mode, no autograd) another than a training forward."""
    job = JobConfig(model="mlp", model_kwargs={"sizes": [16, 16, 16, 16]}, optimizer="sgd")
    fastest = _Named()
    layers = LayerSlice(
        job, torch.device("cpu"), Slowdown(2.0, time.thread_time, None, fastest), ()
    )
    layers.build(0, 5)
    y, stash = layers.forward(torch.randn(4, 16), True, False, micro_batch=0, split=split)
    assert stash is not None
    forwards, fastest.names = fastest.names, []
    layers.backward(stash, torch.ones_like(y), split=split)
    if split:
        layers.backward_weights(stash)
    backwards, fastest.names = fastest.names, []
    layers.forward(torch.randn(4, 16), train=False)
    inference = fastest.names
    # forwards: Linear 0, ReLU, Linear 2, ReLU, Linear 4 (the layers of the slice, in order)
    assert forwards[2] == forwards[4] != forwards[0] and forwards[1] == forwards[3]
    linear = {forwards[0], forwards[2]}
    assert not linear & set(backwards) and not linear & set(inference)
    kinds = [name[2] for name in backwards]  # type: ignore[index]
    if split:  # B of Linear 4, ReLU 3, Linear 2, ReLU 1 (Linear 0 has no input to B), then W
        assert kinds == ["input grads", "backward"] * 2 + ["weight grads"] * 3
        assert backwards[0] == backwards[2] and backwards[4] == backwards[5] == backwards[6]
    else:  # Linear 4, ReLU 3, Linear 2, ReLU 1, Linear 0
        assert kinds == ["backward"] * 5
        assert backwards[0] == backwards[2] != backwards[4] and backwards[1] == backwards[3]
    assert len(inference) == 5 and inference[0] == inference[2] == inference[4]  # (no grads)


def test_alike_layers_are_one_op_for_the_fastest_timer() -> None:
    """A GPT's blocks compute alike (``alike_key``): on the same input they are one op,
    whose runs count together, as the profile measures one block for all; the embedding,
    another kind of op, another input form or another job are ops of their own."""
    model = {"vocab_size": 32, "d_model": 16, "n_heads": 2, "n_layers": 3, "max_seq_len": 8}
    job = JobConfig(model="gpt", model_kwargs=model, optimizer="sgd", optimizer_kwargs={"lr": 0.1})
    fastest = Slowdown(2.0, time.thread_time, None, FastestTimes())
    layers = LayerSlice(job, torch.device("cpu"), fastest, ())
    layers.build(0, 4)
    x = torch.randn(2, 8, 16)
    block = layers.op(1, "forward", [x])
    assert block is not None
    assert layers.op(2, "forward", [x]) == block == layers.op(3, "forward", [x])
    assert layers.op(0, "forward", [x]) != block
    assert layers.op(1, "backward", [x]) != block
    assert layers.op(1, "forward", [x[:1]]) != block
    other_job = JobConfig(**{**vars(job), "job_id": "other"})
    other = LayerSlice(other_job, torch.device("cpu"), fastest, ())
    other.build(1, 2)
    assert other.op(1, "forward", [x]) != block
    assert LayerSlice(job, torch.device("cpu"), Slowdown(), ()).op(1, "forward", [x]) is None
