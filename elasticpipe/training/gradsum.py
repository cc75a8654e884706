"""The canonical sum of a step's micro-batch gradients: one fixed binary tree over the M
micro-batches, so that the sum has the same bits however the micro-batches are split among
replicas and in whatever order their backward passes end.

Float addition is not associative: ``((g0 + g1) + g2) + g3`` and ``(g0 + g1) + (g2 + g3)``
can differ in their last bits. It is commutative, though (``a + b == b + a`` bit for bit),
so fixing *which* sums are formed fixes the result, whatever order they are formed in.

The tree ``T(lo, hi)`` over micro-batches ``[lo, hi)`` is a leaf when ``hi - lo == 1``,
else ``T(lo, mid) + T(mid, hi)`` with ``mid = lo + p``, ``p`` the largest power of two below
``hi - lo``. Worked example, M = 6::

                    [0,6)
                  /       \\
             [0,4)         [4,6)
            /     \\        /   \\
        [0,2)     [2,4)   4     5
        /  \\      /  \\
       0    1    2    3

    sum = ((g0 + g1) + (g2 + g3)) + (g4 + g5)

A replica that runs micro-batches ``[1, 5)`` covers the whole nodes ``1``, ``[2,4)`` and ``4``
(``covering(1, 5, 6)``; at most about ``2 log2 M`` of them). ``TreeSum`` sums each of them as
its micro-batches' gradients arrive, keeping one partial per pending node (at most about
``log2 M + 1`` when they arrive in order), and the reducer feeds every replica's node
partials into a ``TreeSum`` over ``[0, M)`` to get the root. For M <= 3 the tree is the
left fold ``(g0 + g1) + g2``, which is what accumulating into ``.grad`` computes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Node", "TreeSum", "covering", "peak_partials", "tree_sum"]

T = TypeVar("T")


@dataclass(frozen=True, order=True)
class Node:
    """The tree node summing micro-batches ``[lo, hi)``."""

    lo: int
    hi: int

    def __str__(self) -> str:
        return str(self.lo) if self.hi - self.lo == 1 else f"[{self.lo},{self.hi})"


def _split(lo: int, hi: int) -> int:
    """Where ``T(lo, hi)`` splits: ``lo`` plus the largest power of two below ``hi - lo``."""
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


@functools.lru_cache(maxsize=64)
def _parents(total: int) -> dict[Node, tuple[Node, Node, bool]]:
    """Every non-root node of the tree over ``total`` micro-batches: its parent, its sibling,
    and whether it is the left child."""
    found: dict[Node, tuple[Node, Node, bool]] = {}
    todo = [Node(0, total)]
    while todo:
        node = todo.pop()
        if node.hi - node.lo < 2:
            continue
        mid = _split(node.lo, node.hi)
        left, right = Node(node.lo, mid), Node(mid, node.hi)
        found[left] = (node, right, True)
        found[right] = (node, left, False)
        todo += [left, right]
    return found


def _check_total(total: int) -> None:
    if total < 1:
        raise ValueError(f"a step needs at least one micro-batch (got {total})")


def covering(lo: int, hi: int, total: int) -> list[Node]:
    """The maximal nodes of the tree over ``total`` micro-batches inside ``[lo, hi)``, in
    micro-batch order: what a replica running ``[lo, hi)`` sends the reducers.

    Raises:
        ValueError: ``[lo, hi)`` is empty or not inside ``[0, total)``.
    """
    _check_total(total)
    if not 0 <= lo < hi <= total:
        raise ValueError(f"micro-batches [{lo}, {hi}) are not a range inside [0, {total})")
    nodes: list[Node] = []
    todo = [Node(0, total)]
    while todo:
        node = todo.pop()
        if lo <= node.lo and node.hi <= hi:
            nodes.append(node)
        elif node.lo < hi and lo < node.hi:  # overlaps: its children decide
            mid = _split(node.lo, node.hi)
            todo += [Node(mid, node.hi), Node(node.lo, mid)]  # left popped first
    return nodes


class TreeSum(Generic[T]):
    """Sums the micro-batches ``[lo, hi)`` of a step of ``total`` in the canonical tree,
    whatever order their values (or whole nodes' partials) are added in.

    ``plus(left, right)`` adds two partials; it may reuse ``left``'s memory (``Tensor.add_``
    does), since a partial is added exactly once. Example::

        acc = TreeSum(total=6, lo=1, hi=5, plus=torch.Tensor.add_)
        for k in (4, 1, 3, 2):      # any order
            acc.add(k, grad_of(k))
        acc.partials()              # [(1, g1), ([2,4), g2 + g3), (4, g4)]
    """

    def __init__(
        self, total: int, plus: Callable[[T, T], T], lo: int = 0, hi: int | None = None
    ) -> None:
        hi = total if hi is None else hi
        self._final = covering(lo, hi, total)  # checks total, lo and hi
        self._total, self._lo, self._hi, self._plus = total, lo, hi, plus
        self._parents = _parents(total)
        self._pending: dict[Node, T] = {}

    def add(self, micro_batch: int, value: T) -> None:
        """Adds micro-batch ``micro_batch``'s value.

        Raises:
            ValueError: it is outside this sum's range, or was added already.
        """
        self.add_node(Node(micro_batch, micro_batch + 1), value)

    def add_node(self, node: Node, value: T) -> None:
        """Adds the partial sum of a whole tree node (another replica's, say), merging it
        with its sibling whenever both are here.

        Raises:
            ValueError: ``node`` is no node of the tree, lies outside this sum's range, or
                overlaps what was added already.
        """
        if node != Node(0, self._total) and node not in self._parents:
            raise ValueError(f"{node} is no node of the tree over {self._total} micro-batches")
        if not (self._lo <= node.lo and node.hi <= self._hi):
            raise ValueError(f"{node} lies outside micro-batches [{self._lo}, {self._hi})")
        if any(p.lo < node.hi and node.lo < p.hi for p in self._pending):
            raise ValueError(f"{node} overlaps micro-batches already added")
        while node not in self._final:
            parent, sibling, is_left = self._parents[node]
            if sibling not in self._pending:
                break
            other = self._pending.pop(sibling)
            value = self._plus(value, other) if is_left else self._plus(other, value)
            node = parent
        self._pending[node] = value

    @property
    def pending(self) -> int:
        """How many partial sums are held now."""
        return len(self._pending)

    @property
    def complete(self) -> bool:
        """Whether every micro-batch of the range was added."""
        return all(n in self._pending for n in self._final)

    def partials(self) -> list[tuple[Node, T]]:
        """The covering nodes' sums, in micro-batch order.

        Raises:
            ValueError: a micro-batch of the range is missing (naming those missing).
        """
        if not self.complete:
            have = {k for n in self._pending for k in range(n.lo, n.hi)}
            missing = [k for k in range(self._lo, self._hi) if k not in have]
            raise ValueError(
                f"micro-batches [{self._lo}, {self._hi}) incomplete: {missing} missing"
            )
        return [(n, self._pending[n]) for n in self._final]

    def result(self) -> T:
        """The sum of the whole range, for a range that is one node (``[0, total)`` is).

        Raises:
            ValueError: the range is not complete, or is several nodes (``partials``).
        """
        parts = self.partials()
        if len(parts) != 1:
            raise ValueError(
                f"micro-batches [{self._lo}, {self._hi}) are {len(parts)} nodes, not one: "
                "fold their partials on the reducer"
            )
        return parts[0][1]


def tree_sum(values: Iterable[T], plus: Callable[[T, T], T]) -> T:
    """The canonical sum of ``values`` (micro-batches ``0, 1, ...`` in order).

    Raises:
        ValueError: ``values`` is empty.
    """
    items = list(values)
    _check_total(len(items))
    acc: TreeSum[T] = TreeSum(len(items), plus)
    for k, v in enumerate(items):
        acc.add(k, v)
    return acc.result()


def peak_partials(total: int) -> int:
    """The most partial sums held at once when ``total`` micro-batches arrive in order (as
    every schedule runs their backwards): what a step's gradients cost in memory, in
    copies of the layers' gradients, besides the one being computed (a fresh ``.grad``).
    At most about ``log2(total)``: 1 for M <= 3, 2 for M = 4, 3 for M = 8.

    Raises:
        ValueError: ``total < 1``.
    """
    acc: TreeSum[None] = TreeSum(total, lambda a, b: None)
    peak = 0
    for k in range(total):
        peak = max(peak, acc.pending)
        acc.add(k, None)
    return max(peak, acc.pending)
