"""ZB-H1 on a stage's layers: split backward (B then W) gives the whole backward's gradients
on awkward layers (frozen, shared inside a layer, unused, int ids, batch norm, outputs without
the input), counts what it holds, and times B + W (tests by a second reader)."""

from __future__ import annotations

import pytest
import torch

from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.training.job import JobConfig

ALLOW = ("tests.support.zb_models",)


def _slice(model: str, n: int, **options: object) -> LayerSlice:
    job = JobConfig(
        model=f"tests.support.zb_models:{model}",
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.1},
        **options,  # type: ignore[arg-type]
    )
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ALLOW)
    layers.build(0, n)
    return layers


def _grads(
    model: str, n: int, split: bool, input_grad: bool, **options: object
) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    layers = _slice(model, n, **options)
    inputs = []
    stashes = []
    for k in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        y, stash = layers.forward(x, True, input_grad, micro_batch=k, step=0, split=split)
        assert stash is not None
        stashes.append((y, stash))
    order = [0, 1, 2]
    for k in order:
        y, stash = stashes[k]
        g = torch.ones_like(y) if isinstance(y, torch.Tensor) else torch.ones_like(y[0])
        gi = layers.backward(stash, g, micro_batch=k, split=split)
        inputs.append(gi)
    if split:
        for k in order:
            layers.backward_weights(stashes[k][1], micro_batch=k)
    grads = {
        f"{i}.{name}": p.grad.clone() if p.grad is not None else torch.zeros(0)
        for i, m in layers.layers.items()
        for name, p in m.named_parameters()
    }
    return grads, inputs


@pytest.mark.numerics
@pytest.mark.timeout(30)
@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize("options", [{}, {"recompute_all": True}])
@pytest.mark.parametrize(("model", "n"), [("odd", 11), ("independent_only", 3)])
def test_split_backward_gives_the_whole_backwards_gradients(
    model: str, n: int, input_grad: bool, options: dict[str, object]
) -> None:
    """Three micro-batches: every weight's and input's gradient equals a whole backward's
    bit for bit, on the first stage (no input gradient) and a middle one, with and without
    recomputation."""
    whole, whole_in = _grads(model, n, False, input_grad, **options)
    split, split_in = _grads(model, n, True, input_grad, **options)
    assert whole.keys() == split.keys()
    for key in whole:
        assert torch.equal(whole[key], split[key]), key
    for a, b in zip(whole_in, split_in, strict=True):
        if a is None:
            assert b is None
        else:
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("options", [{}, {"recompute_all": True}])
def test_stash_bytes_count_what_b_leaves_for_w(options: dict[str, object]) -> None:
    """Between B and W the stash still holds the gradients kept for W (with recompute, the
    recomputed graphs too): ``Stash.nbytes`` (peak_stashed_bytes) counts them (found by a
    second reader: they were missed)."""
    layers = _slice("odd", 11, **options)
    x = torch.randn(64, 8)
    y, stash = layers.forward(x, True, input_grad=True, micro_batch=0, step=0, split=True)
    assert stash is not None
    layers.backward(stash, torch.ones_like(y), micro_batch=0, split=True)
    held = {}
    for w in stash.weights:
        for t in [*w.grads, *w.split.tensors()]:
            held[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert held
    assert stash.nbytes() >= sum(held.values()), (stash.nbytes(), sum(held.values()))
    if options:  # the recomputed graphs' saved tensors are counted too
        assert stash.nbytes() > sum(held.values())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize("recompute", [False, True])
def test_split_backward_with_event_laps_settles(input_grad: bool, recompute: bool) -> None:
    """CUDA-event Laps (stand-in events): B's lap plus W's (and a recompute's) settle into
    each layer's backward time; a slowed clock pays for B and W."""
    from elasticpipe.stage_server.devicetime import EventClock
    from tests.support.fake_cuda import FakeEvent

    job = JobConfig(
        model="tests.support.zb_models:odd",
        optimizer="sgd",
        optimizer_kwargs={"lr": 0.1},
        recompute_all=recompute,
    )
    slow = Slowdown(2.0, events=EventClock(make_event=FakeEvent))
    layers = LayerSlice(job, torch.device("cpu"), slow, ALLOW)
    layers.build(0, 11)
    y, stash = layers.forward(torch.randn(4, 8), True, input_grad, micro_batch=0, split=True)
    assert stash is not None
    layers.backward(stash, torch.ones_like(y), micro_batch=0, split=True)
    layers.backward_weights(stash, micro_batch=0)
    layers.settle_timings()
    for i, m in layers.layers.items():
        if any(p.requires_grad for p in m.parameters()):
            assert layers.timings[i].backward_s > 0, i
