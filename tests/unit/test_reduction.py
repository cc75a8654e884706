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
from elasticpipe.stage_server.reduction import GroupReduction, Piece, Send, chunk_bounds, cut
from elasticpipe.training.gradsum import Node, TreeSum, covering, tree_sum


def _add(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x + y for x, y in zip(a, b, strict=True)]


def _leaves(total: int, sizes: list[int], seed: int) -> list[list[torch.Tensor]]:
    """Per micro-batch, one flat gradient per parameter, magnitudes over 12 decades."""
    g = torch.Generator().manual_seed(seed)
    return [
        [
            torch.randn(n, generator=g) * 10.0 ** torch.randint(-6, 7, (1,), generator=g)
            for n in sizes
        ]
        for _ in range(total)
    ]


def _reduce(
    leaves: list[list[torch.Tensor]], shares: list[range], rng: random.Random
) -> list[list[torch.Tensor]]:
    """Every holder sums its share, then the pieces go round in a random order."""
    total = len(leaves)
    like = [torch.zeros_like(t) for t in leaves[0]]
    holders = [GroupReduction(7, r, shares, total, like) for r in range(len(shares))]
    queue: list[Send] = []
    for r, share in enumerate(shares):
        partials: list[tuple[Node, list[torch.Tensor]]] = []
        if share:
            acc = TreeSum(total, _add, share.start, share.stop)
            for k in share:
                acc.add(k, [t.clone() for t in leaves[k]])
            partials = acc.partials()
        queue += holders[r].start(partials)
    while queue:
        send = queue.pop(rng.randrange(len(queue)))
        queue += holders[send.to].receive(send.piece)
    assert all(h.done for h in holders)
    return [h.result() for h in holders]


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
    want = tree_sum([[t.clone() for t in leaf] for leaf in leaves], _add)
    for got in _reduce(leaves, shares, random.Random(seed)):
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("cuts", [[0, 4, 8], [0, 5, 8], [0, 1, 8], [0, 1, 3, 8]])
def test_the_split_changes_no_bit(cuts: list[int]) -> None:
    """Shares 4:4, 5:3, 1:7 and 1:2:5 of 8 micro-batches: the same bits as one replica."""
    leaves = _leaves(8, [5, 3, 11], seed=3)
    one = _reduce(leaves, [range(8)], random.Random(0))[0]
    for got in _reduce(leaves, _shares(cuts), random.Random(1)):
        assert all(torch.equal(a, b) for a, b in zip(got, one, strict=True))


def _pair() -> tuple[GroupReduction, list[range]]:
    shares = [range(0, 5), range(5, 8)]
    return GroupReduction(2, 0, shares, 8, [torch.zeros(4), torch.zeros(2)]), shares


@pytest.mark.parametrize(
    ("piece", "error"),
    [
        (Piece(3, 0, 1, Node(5, 6), (torch.zeros(3),)), "is of group 3"),
        (Piece(2, 0, 0, Node(5, 6), (torch.zeros(3),)), "no other holder is in replica 0"),
        (Piece(2, 0, 4, Node(5, 6), (torch.zeros(3),)), "no other holder is in replica 4"),
        (Piece(2, 2, 1, Node(5, 6), (torch.zeros(3),)), "there are 2 chunks"),
        (Piece(2, 1, 1, Node(5, 6), (torch.zeros(1), torch.zeros(2))), "reduces chunk 0"),
        (Piece(2, 0, 1, Node(4, 5), (torch.zeros(3),)), "node 4 is not of the sender's share"),
        (Piece(2, 0, 1, Node(5, 6), (torch.zeros(4),)), r"tensors \[\(4, 'torch.float32'\)\]"),
        (Piece(2, 0, 1, Node(5, 6), (torch.zeros(3, dtype=torch.float64),)), "float64"),
        (Piece(2, 0, 1, Node(5, 6), (torch.zeros(1, 3),)), "expected flat"),
        (Piece(2, 0, 1, None, (torch.zeros(3),)), "not its reducer's"),
    ],
)
def test_a_bad_piece_is_refused_naming_what_is_wrong(piece: Piece, error: str) -> None:
    """Another group, a sender that is this holder or no holder, a chunk out of range or
    not this holder's, a node outside the sender's share, other sizes, dtypes or shapes,
    a reduced chunk not from its reducer: each an InvalidRequest that says so."""
    holder, _ = _pair()
    with pytest.raises(InvalidRequest, match=error):
        holder.receive(piece)


def test_a_piece_twice_and_a_wrong_start_are_refused() -> None:
    """The same node twice, a start with nodes its share does not cover, a second start and
    a result before every chunk is reduced: each refused by name."""
    holder, shares = _pair()
    piece = Piece(2, 0, 1, Node(5, 6), (torch.zeros(3),))
    holder.receive(piece)
    with pytest.raises(InvalidRequest, match="overlaps"):
        holder.receive(piece)
    with pytest.raises(InvalidRequest, match=r"chunks \[0, 1\] not reduced yet"):
        holder.result()
    with pytest.raises(InvalidRequest, match=r"holds nodes \['4'\], its share covers"):
        holder.start([(Node(4, 5), [torch.zeros(4), torch.zeros(2)])])
    with pytest.raises(InvalidRequest, match="started already"):
        holder.start([])
    assert [str(n) for n in covering(shares[0].start, shares[0].stop, 8)] == ["[0,4)", "4"]
