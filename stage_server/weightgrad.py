"""One layer's backward in two halves (ZB-H1's B and W): its input's gradients now, its
weights' gradients later, each computed once.

B runs ``torch.autograd.grad`` from the layer's outputs to its inputs, keeping the graph.
The autograd engine then runs only the nodes on a path to the inputs (the *input
closure*) and, of each, only the outputs that lead there: no weight gradient is computed.
Some of those nodes also feed a weight (a linear layer's matmul feeds its weight and its
input): the *exits*. While B runs, a hook on each exit keeps the gradient it received.

W starts one backward at each exit, with the gradient kept for it, into the weights that
exit reaches: the engine runs the exit again for those outputs only, then what lies
between it and its weights (a transpose, an autocast copy), and accumulates the gradients
exactly as a whole backward would (the same nodes, the same incoming gradients: the same
numbers, tests/integration/test_transparency.py). Nothing of the input closure runs twice.

Where that is not exact -- a weight reached from two exits (used twice in the layer), or
an output that does not depend on the input but on weights -- W is instead the whole
backward from the layer's outputs into its weights (the part of the input closure
between the outputs and the weights then runs a second time; the gradients are still
the same). ``Split.fallback`` says which was taken. A layer that checkpoints reentrantly
(``torch.utils.checkpoint(use_reentrant=True)``, which refuses ``autograd.grad``) runs its
whole backward in B and leaves W nothing.

The gradients kept for W may share memory with the gradients B returns and with the
outputs' gradients it was given: neither may change in place before W. A tensor that
``retain_grad``s inside the layer at an exit's output gets its gradient written twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge

Node = Any  # torch.autograd.graph.Node: the C++ nodes have no common Python base to name
REENTRANT_CHECKPOINT = "CheckpointFunctionBackward"  # torch.utils.checkpoint, use_reentrant


@dataclass
class Split:
    """What W needs of one layer: a backward per exit, or (``fallback``) the whole one."""

    exits: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = field(
        default_factory=list
    )  # (edges into the exit, the gradients B left there, the weights it reaches)
    # (outputs, their gradients, the weights; None: every leaf, a layer whose input needs none)
    fallback: (
        tuple[list[torch.Tensor], list[torch.Tensor], Sequence[torch.Tensor] | None] | None
    ) = None

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for W (beyond the graph's own saved tensors)."""
        held = [g for _, grads, _ in self.exits for g in grads]
        if self.fallback is not None:
            held += [*self.fallback[0], *self.fallback[1]]
        return held

    def weights(self) -> None:
        """W: accumulates the weight gradients into ``.grad`` and frees the graph (once:
        what ran is forgotten first, so nothing is ever added twice)."""
        exits, self.exits = self.exits, []
        fallback, self.fallback = self.fallback, None
        if fallback is not None:
            outs, grads, params = fallback
            torch.autograd.backward(outs, grads, inputs=params)
        for edges, grads, params in exits:
            # The kept gradient already went through the tensor hooks on the exit's outputs
            # (``register_hook``): the engine would run them again on it, so the exit is
            # handed exactly the kept gradient, whatever those hooks make of it.
            node, kept = edges[0].node, {e.output_nr: g for e, g in zip(edges, grads, strict=True)}
            pin = node.register_prehook(
                lambda gs, kept=kept: tuple(kept.get(i) for i in range(len(gs)))
            )
            try:
                torch.autograd.backward(edges, grads, inputs=params)
            finally:
                pin.remove()


def split_backward(
    outs: list[torch.Tensor],
    grads: list[torch.Tensor],
    xs: list[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor | None, ...], Split]:
    """B: the gradients of ``xs`` (None where unused), and what W needs for ``params``.

    Args:
        outs: the layer's outputs that get a gradient; ``grads`` theirs.
        xs: the layer's inputs that need a gradient (leaves requiring grad).
        params: the layer's trainable parameters.
    """
    roots = [o.grad_fn for o in outs]
    inputs = {_leaf_node(x) for x in xs}
    weights = {_leaf_node(p): p for p in params}
    to_input, to_weights, order = _reach(roots, inputs, weights)
    if any(type(node).__name__ == REENTRANT_CHECKPOINT for node in order):
        # Reentrant checkpointing refuses autograd.grad and ``inputs=``: the whole
        # backward now, nothing left for W.
        torch.autograd.backward(outs, grads)
        return tuple(x.grad for x in xs), Split()
    exits: dict[Node, frozenset[Node]] = {}
    for node in order:
        if not to_input[node] or node in inputs:
            continue
        reached = frozenset[Node]().union(
            *(to_weights[n] for n, _ in node.next_functions if n is not None and not to_input[n])
        )
        if reached:
            exits[node] = reached
    shared = sum(len(r) for r in exits.values()) != len(frozenset[Node]().union(*exits.values()))
    loose = any(r is not None and not to_input[r] and to_weights[r] for r in roots)
    if shared or loose:
        dxs = torch.autograd.grad(outs, xs, grads, retain_graph=True, allow_unused=True)
        return dxs, Split(fallback=(outs, grads, list(params)))
    kept: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [
        node.register_prehook(lambda gs, node=node: kept.__setitem__(node, tuple(gs)))
        for node in exits
    ]
    try:
        dxs = torch.autograd.grad(outs, xs, grads, retain_graph=True, allow_unused=True)
    finally:
        for hook in hooks:
            hook.remove()
    split = Split()
    for node, reached in exits.items():
        got = kept.get(node, ())
        edges = [GradientEdge(node, i) for i, g in enumerate(got) if g is not None]
        if edges:  # no gradient reached the exit: neither would a whole backward's
            split.exits.append(
                (edges, [g for g in got if g is not None], [weights[n] for n in reached])
            )
    return dxs, split


def _leaf_node(t: torch.Tensor) -> Node:
    """The node a tensor's gradient enters the graph at (its AccumulateGrad for a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _reach(
    roots: list[Node], inputs: set[Node], weights: dict[Node, torch.Tensor]
) -> tuple[dict[Node, bool], dict[Node, frozenset[Node]], list[Node]]:
    """For every node below ``roots``: whether it leads to an input, which weights it
    leads to; and the nodes with each one after everything below it."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack = [(r, False) for r in roots if r is not None]
    while stack:
        node, below_done = stack.pop()
        if below_done:
            order.append(node)
        elif node not in seen:
            seen.add(node)
            stack.append((node, True))
            stack += [(n, False) for n, _ in node.next_functions if n is not None]
    to_input: dict[Node, bool] = {}
    to_weights: dict[Node, frozenset[Node]] = {}
    none: frozenset[Node] = frozenset()
    for node in order:
        below = [n for n, _ in node.next_functions if n is not None]
        to_input[node] = node in inputs or any(to_input[n] for n in below)
        mine = frozenset([node]) if node in weights else none
        to_weights[node] = mine.union(*(to_weights[n] for n in below))
    return to_input, to_weights, order
