"""ZB-H1's split backward: B then W give a whole backward's gradients, bit for bit, and
nothing of the input's path runs twice."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from elasticpipe import models
from elasticpipe.stage_server.weightgrad import Split, split_backward


def _block() -> nn.Module:
    gpt = models.build(
        "gpt", seed=0, vocab_size=17, d_model=32, n_heads=4, n_layers=1, max_seq_len=8
    )
    return gpt[1]  # a transformer block: attention and MLP behind layer norms


class _Twice(nn.Module):
    """One weight used twice on the input's path."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) @ self.w


class _Loose(nn.Module):
    """One output that depends on a weight but not on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.lin(x), self.bias * 3


def _outs(y: torch.Tensor | tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [y] if isinstance(y, torch.Tensor) else list(y)


def _grads(
    layer: nn.Module, x: torch.Tensor, seed: int, run: Callable[..., torch.Tensor | None]
) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    layer.zero_grad(set_to_none=True)
    xx = x.detach().requires_grad_(True)
    outs = _outs(layer(xx))
    g = torch.Generator().manual_seed(seed)
    gs = [torch.randn(o.shape, generator=g) for o in outs]
    dx = run(outs, gs, xx, [p for p in layer.parameters() if p.requires_grad])
    return dx, [p.grad for p in layer.parameters()]


def _whole(outs, gs, xx, params) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    torch.autograd.backward(outs, gs)
    return xx.grad


def _split(outs, gs, xx, params) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    (dx,), halves = split_backward(outs, gs, [xx], params)
    assert all(p.grad is None for p in params), "B computed a weight gradient"
    halves.weights()
    return dx


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("make", "shape", "fallback"),
    [
        (_block, (2, 8, 32), False),
        (lambda: nn.Linear(6, 6), (5, 6), False),
        (_Twice, (5, 6), True),
        (_Loose, (5, 6), True),
    ],
    ids=["transformer block", "linear", "weight used twice", "output without the input"],
)
def test_b_then_w_equals_a_whole_backward_bit_for_bit(
    make: Callable[[], nn.Module], shape: tuple[int, ...], fallback: bool
) -> None:
    """The input's and every weight's gradient equal a whole backward's exactly, over two
    micro-batches accumulated; shared weights and input-free outputs take the fallback."""
    torch.manual_seed(0)
    layer = make()
    xs = [torch.randn(shape), torch.randn(shape)]
    want_dx, want = [], []
    for i, x in enumerate(xs):
        dx, grads = _grads(layer, x, i, _whole)
        want_dx.append(dx)
        want.append([g.clone() if g is not None else None for g in grads])
    for i, x in enumerate(xs):
        dx, grads = _grads(layer, x, i, _split)
        assert torch.equal(dx, want_dx[i])
        for got, expected in zip(grads, want[i], strict=True):
            assert (got is None) == (expected is None)
            if got is not None:
                assert torch.equal(got, expected)
    xx = xs[0].detach().requires_grad_(True)
    outs = _outs(layer(xx))
    _, halves = split_backward(
        outs, [torch.ones_like(o) for o in outs], [xx], list(layer.parameters())
    )
    assert (halves.fallback is not None) == fallback


def test_the_input_path_runs_once_and_w_runs_each_exit_for_its_weights() -> None:
    """Counting node executions in a transformer block: every node on the input's path runs
    in B only; W runs the exits again and the nodes between them and the weights."""
    layer = _block()
    xx = torch.randn(2, 8, 32).requires_grad_(True)
    y = layer(xx)
    runs: dict[object, int] = {}
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        node.register_prehook(lambda gs, node=node: runs.__setitem__(node, runs.get(node, 0) + 1))
        stack += [n for n, _ in node.next_functions]
    _, halves = split_backward([y], [torch.ones_like(y)], [xx], list(layer.parameters()))
    after_b = dict(runs)
    assert halves.fallback is None and len(halves.exits) >= 6  # 4 linear, 2 layer norms
    exits = {edges[0].node for edges, _, _ in halves.exits}
    halves.weights()
    again = {n for n in after_b if runs[n] > after_b[n]}
    assert again == exits  # only the exits run twice
    assert all(runs[n] <= 2 for n in runs)
    assert all(p.grad is not None for p in layer.parameters())


@pytest.mark.numerics
def test_under_autocast_the_split_is_exact() -> None:
    """bf16 autocast puts a cast between each weight and its matmul: still exact."""
    torch.manual_seed(1)
    layer = _block()
    x = torch.randn(2, 8, 32)

    def under(run: Callable[..., torch.Tensor | None]) -> tuple[torch.Tensor | None, list]:
        layer.zero_grad(set_to_none=True)
        xx = x.detach().requires_grad_(True)
        with torch.autocast("cpu", torch.bfloat16):
            y = layer(xx)
        dx = run([y], [torch.ones_like(y)], xx, list(layer.parameters()))
        return dx, [p.grad.clone() for p in layer.parameters()]

    want_dx, want = under(_whole)
    got_dx, got = under(_split)
    assert torch.equal(got_dx, want_dx)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _Hooked(nn.Module):
    """A tensor hook (not idempotent) on a linear layer's output: an exit's output."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h.register_hook(lambda g: g * 2)
        return torch.relu(h)


class _Reentrant(nn.Module):
    """Reentrant checkpointing inside the layer (refuses autograd.grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.lin, x, use_reentrant=True)


@pytest.mark.numerics
@pytest.mark.parametrize("make", [_Hooked, _Reentrant], ids=["tensor hook", "reentrant"])
def test_hooks_and_reentrant_checkpoints_keep_the_split_exact(
    make: Callable[[], nn.Module],
) -> None:
    """A hook on an exit's output runs once, as in a whole backward; a reentrantly
    checkpointed layer backpropagates whole in B (found by a second reader: the hook ran
    twice, the checkpoint raised)."""
    torch.manual_seed(2)
    layer = make()
    x = torch.randn(5, 6)
    want_dx, want = _grads(layer, x, 0, _whole)
    want = [g.clone() for g in want if g is not None]
    got_dx, got = _grads(layer, x, 0, _split_any)
    assert torch.equal(got_dx, want_dx)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def _split_any(outs, gs, xx, params) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    (dx,), halves = split_backward(outs, gs, [xx], params)
    halves.weights()
    return dx


def test_an_empty_split_does_nothing() -> None:
    """A Split with nothing left (W already ran) is a no-op."""
    Split().weights()
