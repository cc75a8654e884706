"""A stage's layers linked into one autograd pass (``LayerSlice.forward`` without ``split``):
the same bits as the layers run one by one, each layer timed, and a failing layer named."""

from __future__ import annotations

import pytest
import torch

from elasticpipe.errors import ModelError, StepAborted, UserCodeError
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.training.job import JobConfig

ALLOW = ("tests.support.zb_models",)


def _slice(model: str, n: int) -> LayerSlice:
    job = JobConfig(model=f"tests.support.zb_models:{model}", optimizer="sgd")
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ALLOW)
    layers.build(0, n)
    return layers


def _run(model: str, n: int, linked: bool, input_grad: bool) -> tuple[list, list, list[int]]:
    """Three micro-batches' gradients summed in a run (the last backward taking each
    layer's as it is done, as for a reduction), each one's input gradient, and the layers
    told done in order; ``split=True`` forwards run the layers one by one (backward
    without splitting)."""
    layers = _slice(model, n)
    layers.begin_grads(3)
    inputs = []
    told: list[int] = []
    for k in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        y, stash = layers.forward(x, True, input_grad, micro_batch=k, step=2, split=not linked)
        assert stash is not None
        assert any(stash.linked) == linked
        g = torch.ones_like(y) if isinstance(y, torch.Tensor) else torch.ones_like(y[0])
        done = told.append if k == 2 else None
        inputs.append(layers.backward(stash, g, micro_batch=k, done=done))
    layers.finish_backward()
    grads = [p.grad for i in layers.indices for p in layers.layers[i].parameters()]
    return grads, inputs, told


@pytest.mark.numerics
@pytest.mark.timeout(30)
@pytest.mark.parametrize("input_grad", [False, True])
@pytest.mark.parametrize(
    ("model", "n"),
    [
        ("odd", 11),
        ("unreached", 7),
        ("independent_only", 3),
        ("gradless_between", 3),
        ("clamped", 3),
    ],
)
def test_linked_layers_give_the_bits_of_layers_run_one_by_one(
    model: str, n: int, input_grad: bool
) -> None:
    """Awkward layers (frozen, reused, unused, int ids between layers, batch norm, dropout,
    an output that does not depend on the input, a float between layers without a
    gradient, an input clamped in place without autograd): every gradient, the missing
    ones included, the input gradients and the order the layers are told done are equal
    (gradients bit for bit: same kernels, same order; only where autograd's pass stops
    differs)."""
    linked, linked_in, linked_told = _run(model, n, True, input_grad)
    alone, alone_in, alone_told = _run(model, n, False, input_grad)
    assert linked_told == alone_told == list(reversed(range(n)))
    assert len(linked) == len(alone)
    for a, b in zip(linked, alone, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    for a, b in zip(linked_in, alone_in, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.timeout(30)
def test_linked_layers_are_each_timed() -> None:
    """An MLP's seven layers in one pass: each gets a backward time of its own."""
    job = JobConfig(model="mlp", model_kwargs={"sizes": [256] * 5}, optimizer="sgd")
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ())
    layers.build(0, 7)
    y, stash = layers.forward(torch.randn(64, 256), True, True, micro_batch=0)
    assert stash is not None and stash.linked == [False] + [True] * 6
    layers.backward(stash, torch.ones_like(y), micro_batch=0)
    assert all(layers.timings[i].backward_s > 0 for i in range(7)), layers.timings


@pytest.mark.timeout(30)
def test_a_failing_backward_in_linked_layers_names_its_layer() -> None:
    """Where the third of four linked layers raises in backward, the error names layer 2,
    not the slice's top, and nothing is observed of the failed pass."""
    layers = _slice("refuses", 4)
    y, stash = layers.forward(torch.randn(64, 8), True, False, micro_batch=0)
    assert stash is not None and stash.linked == [False, True, True, True]
    with pytest.raises(UserCodeError, match=r"backward of layer 2 \(RefusesBackward\)"):
        layers.backward(stash, torch.ones_like(y), micro_batch=0)
    assert layers.timings[3].backward_s == 0.0


@pytest.mark.timeout(30)
def test_a_layer_changing_its_linked_input_in_place_is_named() -> None:
    """Autograd allows it on a linked input, but the hook timing the layer would sit
    inside the change: refused with the layer named, as an unlinked input refuses it."""
    layers = _slice("in_place", 3)
    with pytest.raises(UserCodeError, match=r"forward of layer 1 \(AddBias\).*in place"):
        layers.forward(torch.randn(4, 8), True, True, micro_batch=0)


@pytest.mark.timeout(30)
def test_layers_under_autocast_are_not_linked() -> None:
    """Autocast caches its casts of leaves only, so linking would change a bf16 layer's
    bits: a bf16 job runs its layers one by one."""
    job = JobConfig(model="mlp", model_kwargs={"sizes": [16] * 4}, precision="bf16")
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ())
    layers.build(0, 5)
    _, stash = layers.forward(torch.randn(4, 16), True, True, micro_batch=0)
    assert stash is not None and not any(stash.linked)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("error", [ValueError("no such node"), StepAborted("aborted")])
def test_what_the_hooks_own_work_raises_is_not_the_users(error: Exception) -> None:
    """The run's last backward takes each layer's gradients in a hook (a reduction may
    start there): what that raises comes out as it is, as one by one, not as the user's
    error naming a layer."""
    layers = _slice("unreached", 7)
    layers.begin_grads(1)
    y, stash = layers.forward(torch.randn(4, 8), True, True, micro_batch=0)
    assert stash is not None and all(stash.linked[1:])

    def done(i: int) -> None:
        if i == 3:  # taken in the hook on layer 3's input
            raise error

    g = torch.ones_like(y) if isinstance(y, torch.Tensor) else torch.ones_like(y[0])
    with pytest.raises(type(error), match=str(error)) as raised:
        layers.backward(stash, g, micro_batch=0, done=done)
    assert type(raised.value) is type(error)  # (UserCodeError is a ValueError too)


@pytest.mark.timeout(30)
def test_a_gradient_arriving_after_its_layer_was_taken_is_refused() -> None:
    """A layer whose graph has a node made on another thread: autograd runs that node
    after the layer below began, so its gradient would come after the layer was taken
    into the sums (with a reduction waiting: ``done``). Refused, naming the layer; the
    same run without ``done`` (gradients taken at the end) is exact."""
    layers = _slice("threaded", 3)
    layers.begin_grads(1)
    y, stash = layers.forward(torch.randn(4, 8), True, True, micro_batch=0)
    assert stash is not None and all(stash.linked[1:])
    with pytest.raises(ModelError, match="layer 1 after the layer below"):
        layers.backward(stash, torch.ones_like(y), micro_batch=0, done=lambda i: None)
    grads = []
    for split in (False, True):
        layers = _slice("threaded", 3)
        layers.begin_grads(1)
        y, stash = layers.forward(torch.ones(4, 8), True, True, micro_batch=0, split=split)
        assert stash is not None
        layers.backward(stash, torch.ones_like(y), micro_batch=0)
        layers.finish_backward()
        grads.append([p.grad for i in layers.indices for p in layers.layers[i].parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def _alone(model: str, n: int, k: int) -> list[torch.Tensor | None]:
    """Micro-batch ``k``'s gradients alone: one backward outside a run (they stay in
    ``.grad``), as ``_deferred`` runs it."""
    layers = _slice(model, n)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
    y, stash = layers.forward(x, True, True, micro_batch=k, step=2)
    assert stash is not None
    layers.backward(stash, torch.ones_like(y), micro_batch=k)
    return [p.grad for i in layers.indices for p in layers.layers[i].parameters()]


def _equal(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.numerics
@pytest.mark.timeout(30)
@pytest.mark.parametrize("take_each", [False, True])
def test_deferred_takes_give_the_bits_of_takes_in_the_backward(take_each: bool) -> None:
    """``defer_takes`` (the executor: a backward's gradients join the sums after its input
    gradients were sent): each whole-slice ``took_grads`` leaves them in ``.grad`` until
    ``take_owed``. Taken after each backward, or only by the next backward and the run's
    end (the guards), what a backward leaves in ``.grad`` is its micro-batch's gradients
    alone (not added to the last one's), the sums of 4 micro-batches have the bits of a run
    that takes inside the backward, and a micro-batch taken twice is still refused."""
    n, runs = 11, 4
    taken = _slice("odd", n)
    taken.begin_grads(runs)
    layers = _slice("odd", n)
    layers.begin_grads(runs)
    layers.defer_takes = True
    for k in range(runs):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        for run in (taken, layers):
            y, stash = run.forward(x, True, True, micro_batch=k, step=2)
            assert stash is not None
            run.backward(stash, torch.ones_like(y), micro_batch=k)
        left = [p.grad for i in layers.indices for p in layers.layers[i].parameters()]
        assert _equal(left, _alone("odd", n, k)), k
        if take_each:
            layers.take_owed()
            assert all(
                p.grad is None for i in layers.indices for p in layers.layers[i].parameters()
            )
    layers.took_grads(1)  # (deferred: refused when taken)
    with pytest.raises(ValueError, match="overlaps"):
        layers.take_owed()
    taken.finish_backward()
    layers.finish_backward()
    expected = [p.grad for i in taken.indices for p in taken.layers[i].parameters()]
    assert _equal([p.grad for i in layers.indices for p in layers.layers[i].parameters()], expected)
