"""A slice's gradients in a training run: the canonical tree sum of its micro-batches'
gradients, the same bits in any order of backward, whole or split (ZB-H1's B then W)."""

from __future__ import annotations

import pytest
import torch

from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.training.gradsum import tree_sum
from elasticpipe.training.job import JobConfig

M = 8


def _slice() -> LayerSlice:
    job = JobConfig(model="mlp", model_kwargs={"sizes": [16, 64, 64, 4]}, micro_batches=M)
    layers = LayerSlice(job, torch.device("cpu"), Slowdown())
    layers.build(0, 5)  # Linear, ReLU, Linear, ReLU, Linear
    return layers


def _inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return [torch.randn(3, 16, generator=g) * 10.0 ** (k % 4 - 2) for k in range(M)]


def _grads(layers: LayerSlice) -> list[torch.Tensor]:
    return [p.grad for i in layers.indices for p in layers.layers[i].parameters()]  # type: ignore[misc]


def _run(layers: LayerSlice, order: list[int], split: bool = False) -> list[torch.Tensor]:
    """One run: every micro-batch forward, then their backwards in ``order``."""
    layers.begin_grads(M)
    xs = _inputs()
    outs = [layers.forward(xs[k], train=True, micro_batch=k, split=split) for k in range(M)]
    for k in order:
        y, stash = outs[k]
        assert stash is not None
        layers.backward(stash, torch.ones_like(y), micro_batch=k, split=split)
        if split:
            layers.backward_weights(stash, micro_batch=k)
    layers.finish_backward()
    return _grads(layers)


def _each_micro_batch(layers: LayerSlice) -> list[list[torch.Tensor]]:
    """Each micro-batch's own gradients (outside a run, one backward at a time)."""
    xs, each = _inputs(), []
    for k in range(M):
        y, stash = layers.forward(xs[k], train=True, micro_batch=k)
        assert stash is not None
        layers.backward(stash, torch.ones_like(y), micro_batch=k)
        each.append([g.clone() for g in _grads(layers)])
        layers.zero_grad()
    return each


@pytest.mark.timeout(30)
def test_a_runs_gradients_are_the_tree_sum_of_its_micro_batches() -> None:
    """torch.equal to ``tree_sum`` of the micro-batches' own gradients; not the left fold
    that accumulating into ``.grad`` gives (so the test tells the two apart)."""
    each = _each_micro_batch(_slice())
    got = _run(_slice(), list(range(M)))
    tree = [tree_sum([e[j] for e in each], torch.add) for j in range(len(got))]
    assert all(torch.equal(a, b) for a, b in zip(got, tree, strict=True))
    left = [each[0][j].clone() for j in range(len(got))]
    for e in each[1:]:
        left = [a + b for a, b in zip(left, e, strict=True)]
    assert not all(torch.equal(a, b) for a, b in zip(got, left, strict=True))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("split", [False, True])
def test_any_order_of_backward_gives_the_same_bits(split: bool) -> None:
    """Backwards in order, in reverse and shuffled, whole or split into B and W: equal."""
    want = _run(_slice(), list(range(M)))
    for order in ([*reversed(range(M))], [3, 0, 7, 5, 1, 6, 2, 4]):
        got = _run(_slice(), order, split=split)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), order


@pytest.mark.timeout(30)
def test_a_micro_batch_missing_or_taken_twice_is_an_error_naming_it() -> None:
    """A run whose micro-batch 5 never ran its backward cannot finish; one run twice is
    refused."""
    layers = _slice()
    with pytest.raises(ValueError, match=r"incomplete: \[5\] missing"):
        _run(layers, [k for k in range(M) if k != 5])
    layers.begin_grads(M)
    y, stash = layers.forward(_inputs()[0], train=True, micro_batch=0)
    assert stash is not None
    layers.backward(stash, torch.ones_like(y), micro_batch=0)
    with pytest.raises(ValueError, match="0 overlaps"):
        layers.took_grads(0)


@pytest.mark.timeout(30)
def test_a_share_hands_over_its_partials_and_takes_the_reduced_sum() -> None:
    """A slice running micro-batches 3-7 of 8 hands over one partial per tree node its
    share covers (3 and [4,8)); gradients installed for a layer it does not hold, or of
    another count than its parameters, are refused by name."""
    layers = _slice()
    layers.begin_grads(M, range(3, 8))
    xs = _inputs()
    for k in range(3, 8):
        y, stash = layers.forward(xs[k], train=True, micro_batch=k)
        assert stash is not None
        layers.backward(stash, torch.ones_like(y), micro_batch=k)
    partials = layers.take_partials()
    assert sorted(partials) == [0, 2, 4]  # the Linear layers (the ReLUs hold nothing)
    assert [str(node) for node, _ in partials[0]] == ["3", "[4,8)"]
    with pytest.raises(ValueError, match="no training run is begun"):
        layers.take_partials()
    with pytest.raises(ValueError, match=r"layer 9 is not held here \(layers \[0, 1, 2, 3, 4\]\)"):
        layers.install_grads({9: []})
    with pytest.raises(ValueError, match="layer 0 has 2 parameters, 1 gradients came"):
        layers.install_grads({0: [None]})


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits (``torch.equal`` takes -0.0 for 0.0)."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _zb_slice(model: str, n: int) -> LayerSlice:
    job = JobConfig(model=f"tests.support.zb_models:{model}", micro_batches=6)
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ("tests.support.zb_models",))
    layers.build(0, n)
    return layers


def _zb_run(model: str, n: int, interleaved: bool) -> dict[str, torch.Tensor]:
    layers = _zb_slice(model, n)
    layers.begin_grads(6)
    outs = []
    for k in range(6):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(k))
        outs.append(layers.forward(x, True, True, micro_batch=k, step=1, split=interleaved))

    def b(k: int) -> None:
        y, stash = outs[k]
        assert stash is not None
        g = torch.ones_like(y) if isinstance(y, torch.Tensor) else torch.ones_like(y[0])
        layers.backward(stash, g, micro_batch=k, split=interleaved)

    if interleaved:  # a middle stage's ZB-H1: B0 B1 W0 B2 W1 ... B5 W4 W5
        b(0)
        for k in range(1, 6):
            b(k)
            layers.backward_weights(outs[k - 1][1], micro_batch=k - 1)  # type: ignore[arg-type]
        layers.backward_weights(outs[5][1], micro_batch=5)  # type: ignore[arg-type]
    else:
        for k in range(6):
            b(k)
    layers.finish_backward()
    return {
        f"{i}.{name}": p.grad
        for i, m in layers.layers.items()
        for name, p in m.named_parameters()
        if p.grad is not None
    }


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("model", "n"), [("odd", 11), ("checkpointed", 4)])
def test_zb_h1s_interleaved_b_and_w_sum_as_whole_backwards_do(model: str, n: int) -> None:
    """ZB-H1's order on a middle stage (a micro-batch's B before the last one's W) gives a
    run the bits of whole backwards, on awkward layers and a reentrantly checkpointed one
    (found by a second reader: that layer's B wrote gradients the next W took as its own)."""
    whole = _zb_run(model, n, interleaved=False)
    split = _zb_run(model, n, interleaved=True)
    assert whole.keys() == split.keys() and whole
    for key in whole:
        assert torch.equal(_bits(whole[key]), _bits(split[key])), key


@pytest.mark.timeout(30)
@pytest.mark.parametrize("split", [False, True], ids=["whole", "zb-h1"])
def test_the_last_backward_tells_each_layer_done_and_its_partials_can_go_first(
    split: bool,
) -> None:
    """The run's last backward with ``done``: every layer is told, highest first (whole:
    as the backward passes it; ZB-H1: at the end of W). The upper layers' partials taken
    at once (a group reducing while the backward goes on) and the rest taken after are the
    same bits as a run that takes them all at the end."""
    want = _slice()
    want.begin_grads(M, range(3, 8))
    plain = _slice()
    plain.begin_grads(M, range(3, 8))
    xs = _inputs()
    told: list[int] = []
    early: dict[int, list] = {}

    def done(i: int) -> None:
        told.append(i)
        if i == 2:  # layers 2-4 are whole: their partials go now
            early.update(plain.take_partials([2, 3, 4]))

    for layers, hook in ((want, None), (plain, done)):
        for k in range(3, 8):
            y, stash = layers.forward(xs[k], train=True, micro_batch=k, split=split)
            assert stash is not None
            last = hook if k == 7 else None
            if split:
                layers.backward(stash, torch.ones_like(y), micro_batch=k, split=True)
                layers.backward_weights(stash, micro_batch=k, done=last)
            else:
                layers.backward(stash, torch.ones_like(y), micro_batch=k, done=last)
    assert told == [4, 3, 2, 1, 0]
    late = plain.take_partials()
    assert sorted(early) == [2, 3, 4] and sorted(late) == [0, 2, 4] and late[2] == []
    got = {**late, **{i: p for i, p in early.items() if p}}
    expected = want.take_partials()
    assert sorted(got) == sorted(expected)
    for i, nodes in expected.items():
        assert [n for n, _ in got[i]] == [n for n, _ in nodes]
        for (_, a), (_, b) in zip(got[i], nodes, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), i
