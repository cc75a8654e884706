"""Tests of a group's reduction among its holders: every holder ends with the same bits,
the one-process tree sum's, for any shares, sizes and order of delivery; bad pieces are
refused naming what is wrong."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest
from elasticpipe.stage_server.reduction import (
    GroupReduction,
    Piece,
    Send,
    chunk_bounds,
    cut,
    flatten,
    unflatten,
)
from elasticpipe.training.gradsum import Node, TreeSum, covering, tree_sum

Leaf = list[torch.Tensor | None]  # one micro-batch's gradients, None: none reached


def _add(a: Leaf, b: Leaf) -> Leaf:
    """``.grad``'s rule: a gradient plus none is that gradient."""
    return [x if y is None else y if x is None else x + y for x, y in zip(a, b, strict=True)]


def _params(sizes: list[int]) -> list[list[torch.Tensor]]:
    """One layer of trainable parameters of ``sizes`` elements."""
    return [[torch.zeros(n, requires_grad=True) for n in sizes]]


def _leaves(total: int, sizes: list[int], seed: int) -> list[Leaf]:
    """Per micro-batch, one flat gradient per parameter (magnitudes over 12 decades, now
    and then -0.0), or none at all for the last parameter in every third micro-batch and
    for a parameter of 3 elements always."""
    g = torch.Generator().manual_seed(seed)
    leaves: list[Leaf] = []
    for k in range(total):
        leaf: Leaf = []
        for j, n in enumerate(sizes):
            t = torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 7, (1,), generator=g)
            t[0] = -0.0 if k % 2 else t[0]
            leaf.append(None if n == 3 or (j == len(sizes) - 1 and k % 3 == 0) else t)
        leaves.append(leaf)
    return leaves


def _reduce(
    leaves: list[Leaf], sizes: list[int], shares: list[range], rng: random.Random
) -> list[Leaf]:
    """Every holder sums its share, then the pieces go round in a random order; each
    holder's result as ``.grad`` would hold it."""
    total, params = len(leaves), _params(sizes)
    like = flatten([[None] * len(sizes)], params)[0]
    holders = [GroupReduction(7, r, shares, total, like) for r in range(len(shares))]
    queue: list[Send] = []
    for r, share in enumerate(shares):
        partials = []
        if share:
            acc = TreeSum(total, _add, share.start, share.stop)
            for k in share:
                acc.add(k, [t.clone() if t is not None else None for t in leaves[k]])
            partials = [(node, flatten([sums], params)) for node, sums in acc.partials()]
        queue += holders[r].start(partials)
    while queue:
        send = queue.pop(rng.randrange(len(queue)))
        queue += holders[send.to].receive(send.piece)
    assert all(h.done for h in holders)
    return [unflatten(h.result(), params)[0] for h in holders]


def _same(a: Leaf, b: Leaf) -> bool:
    """Bit for bit (-0.0 is not 0.0), None where None."""
    return all(
        (x is None and y is None)
        or (
            x is not None
            and y is not None
            and torch.equal(x.view(torch.int32), y.view(torch.int32))
        )
        for x, y in zip(a, b, strict=True)
    )


def _shares(cuts: list[int]) -> list[range]:
    return [range(a, b) for a, b in itertools.pairwise(cuts)]


def test_chunks_cover_the_elements_and_cut_meets_each_parameter_it_spans() -> None:
    """10 elements in 3 chunks: [0,3) [3,6) [6,10); elements 2-7 of parameters of 4 and 6
    elements are the last two of the first and the first four of the second."""
    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    a, b = torch.arange(4.0), torch.arange(4.0, 10.0)
    assert [t.tolist() for t in cut([a, b], 2, 8)] == [[2.0, 3.0], [4.0, 5.0, 6.0, 7.0]]
    assert cut([a, b], 4, 4) == []


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 12), st.integers(0, 2**31 - 1), st.data())
def test_every_holder_gets_the_one_process_sum_for_any_shares(
    total: int, seed: int, data: st.DataObject
) -> None:
    """Random replicas (some with no share), parameter sizes and delivery order: every
    holder's result is ``torch.equal`` to the tree sum of all micro-batches in one place."""
    replicas = data.draw(st.integers(1, 4))
    inner = sorted(
        data.draw(st.lists(st.integers(0, total), min_size=replicas - 1, max_size=replicas - 1))
    )
    shares = _shares([0, *inner, total])
    sizes = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=4))
    leaves = _leaves(total, sizes, seed)
    want = tree_sum([[t.clone() if t is not None else None for t in leaf] for leaf in leaves], _add)
    for got in _reduce(leaves, sizes, shares, random.Random(seed)):
        assert _same(got, want)


@pytest.mark.parametrize("cuts", [[0, 4, 8], [0, 5, 8], [0, 1, 8], [0, 1, 3, 8]])
def test_the_split_changes_no_bit(cuts: list[int]) -> None:
    """Shares 4:4, 5:3, 1:7 and 1:2:5 of 8 micro-batches: the same bits as one replica,
    and a parameter without a gradient keeps none."""
    sizes = [5, 3, 11]
    leaves = _leaves(8, sizes, seed=3)
    one = _reduce(leaves, sizes, [range(8)], random.Random(0))[0]
    assert one[1] is None and one[0] is not None  # the parameter no micro-batch reached
    for got in _reduce(leaves, sizes, _shares(cuts), random.Random(1)):
        assert _same(got, one)


def _pair() -> tuple[GroupReduction, list[range]]:
    shares = [range(0, 5), range(5, 8)]
    return GroupReduction(2, 0, shares, 8, [torch.zeros(4), torch.zeros(2)]), shares


@pytest.mark.parametrize(
    ("piece", "error"),
    [
        (Piece(3, 0, 1, Node(5, 6), (torch.zeros(3),), (True,)), "is of group 3"),
        (Piece(2, 0, 0, Node(5, 6), (torch.zeros(3),), (True,)), "no other holder is in replica 0"),
        (Piece(2, 0, 4, Node(5, 6), (torch.zeros(3),), (True,)), "no other holder is in replica 4"),
        (Piece(2, 2, 1, Node(5, 6), (torch.zeros(3),), (True,)), "there are 2 chunks"),
        (
            Piece(2, 1, 1, Node(5, 6), (torch.zeros(1), torch.zeros(2)), (True, True)),
            "reduces chunk 0",
        ),
        (Piece(2, 0, 1, Node(4, 5), (torch.zeros(3),), (True,)), "node 4 is not of the sender's"),
        (Piece(2, 0, 1, Node(5, 6), (torch.zeros(4),), (True,)), r"tensors \[\(4, 'torch.float32'"),
        (Piece(2, 0, 1, Node(5, 6), (torch.zeros(3, dtype=torch.float64),), (True,)), "float64"),
        (Piece(2, 0, 1, Node(5, 6), (torch.zeros(1, 3),), (True,)), "expected 1 flags and flat"),
        (Piece(2, 0, 1, Node(5, 6), (torch.zeros(3),), (True, False)), "has 2 flags"),
        (Piece(2, 0, 1, None, (torch.zeros(3),), (True,)), "not its reducer's"),
    ],
)
def test_a_bad_piece_is_refused_naming_what_is_wrong(piece: Piece, error: str) -> None:
    """Another group, a sender that is this holder or no holder, a chunk out of range or
    not this holder's, a node outside the sender's share, other sizes, dtypes, shapes or
    flag counts, a reduced chunk not from its reducer: each an InvalidRequest that says so."""
    holder, _ = _pair()
    with pytest.raises(InvalidRequest, match=error):
        holder.receive(piece)


def test_a_piece_twice_and_a_wrong_start_are_refused() -> None:
    """The same node twice, a start with nodes its share does not cover, a second start and
    a result before every chunk is reduced: each refused by name."""
    holder, shares = _pair()
    piece = Piece(2, 0, 1, Node(5, 6), (torch.zeros(3),), (True,))
    holder.receive(piece)
    with pytest.raises(InvalidRequest, match="overlaps"):
        holder.receive(piece)
    with pytest.raises(InvalidRequest, match=r"chunks \[0, 1\] not reduced yet"):
        holder.result()
    with pytest.raises(InvalidRequest, match=r"holds nodes \['4'\], its share covers"):
        holder.start([(Node(4, 5), ([torch.zeros(4), torch.zeros(2)], [True, True]))])
    with pytest.raises(InvalidRequest, match="started already"):
        holder.start([])
    assert [str(n) for n in covering(shares[0].start, shares[0].stop, 8)] == ["[0,4)", "4"]
