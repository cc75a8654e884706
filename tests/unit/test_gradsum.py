"""Tests of the canonical gradient sum: the tree's shape, the nodes a range covers, and the
same bits for any split into ranges and any order of arrival."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.training.gradsum import Node, TreeSum, covering, peak_partials, tree_sum


def _add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a + b


def _leaves(total: int, seed: int) -> list[torch.Tensor]:
    """Values whose sums depend on the order: magnitudes spread over 12 decades."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.randint(-6, 7, (total, 1), generator=g).float()
    return [row for row in torch.randn(total, 33, generator=g) * scale]


def _split_sum(leaves: list[torch.Tensor], cuts: list[int], rng: random.Random) -> torch.Tensor:
    """Each range of ``cuts`` summed as its own replica would (leaves in a random order),
    then its node partials folded by a reducer (in another random order)."""
    total = len(leaves)
    partials: list[tuple[Node, torch.Tensor]] = []
    for lo, hi in itertools.pairwise(cuts):
        acc = TreeSum(total, _add, lo, hi)
        for k in rng.sample(range(lo, hi), hi - lo):
            acc.add(k, leaves[k].clone())
        partials += acc.partials()
    reducer = TreeSum(total, _add)
    for node, value in rng.sample(partials, len(partials)):
        reducer.add_node(node, value)
    return reducer.result()


def test_the_tree_splits_at_the_largest_power_of_two_below_the_size() -> None:
    """M = 6 sums ((g0 + g1) + (g2 + g3)) + (g4 + g5); M = 3 is the left fold."""
    assert tree_sum(["0", "1", "2", "3", "4", "5"], lambda a, b: f"({a}+{b})") == (
        "(((0+1)+(2+3))+(4+5))"
    )
    assert tree_sum(["0", "1", "2"], lambda a, b: f"({a}+{b})") == "((0+1)+2)"
    assert tree_sum(["0"], lambda a, b: f"({a}+{b})") == "0"


def test_the_tree_is_not_the_left_fold_and_the_difference_shows_in_float32() -> None:
    """With 1e8, 1, -1e8, 1 in float32 the left fold gives 1 and the tree gives 0: the order
    is part of the result, which is why one order is fixed for every split."""
    values = [torch.tensor(v, dtype=torch.float32) for v in (1e8, 1.0, -1e8, 1.0)]
    left = ((values[0] + values[1]) + values[2]) + values[3]
    assert left.item() == 1.0
    assert tree_sum(values, _add).item() == 0.0


@pytest.mark.parametrize(
    ("lo", "hi", "total", "nodes"),
    [
        (0, 6, 6, ["[0,6)"]),
        (1, 5, 6, ["1", "[2,4)", "4"]),
        (0, 5, 8, ["[0,4)", "4"]),
        (3, 8, 8, ["3", "[4,8)"]),
        (5, 6, 6, ["5"]),
        (1, 15, 16, ["1", "[2,4)", "[4,8)", "[8,12)", "[12,14)", "14"]),
    ],
)
def test_a_range_covers_the_maximal_tree_nodes_inside_it(
    lo: int, hi: int, total: int, nodes: list[str]
) -> None:
    """``covering`` names the whole subtrees inside a replica's range, in order."""
    assert [str(n) for n in covering(lo, hi, total)] == nodes


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.data())
def test_covering_nodes_tile_the_range_and_are_few(total: int, data: st.DataObject) -> None:
    """The nodes are contiguous, exactly fill [lo, hi), and number at most 2 log2 M + 1."""
    lo = data.draw(st.integers(0, total - 1))
    hi = data.draw(st.integers(lo + 1, total))
    nodes = covering(lo, hi, total)
    assert nodes[0].lo == lo and nodes[-1].hi == hi
    assert all(a.hi == b.lo for a, b in itertools.pairwise(nodes))
    assert len(nodes) <= 2 * max(total - 1, 1).bit_length() + 1


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31 - 1), st.data())
def test_any_split_and_any_order_give_the_same_bits(
    total: int, seed: int, data: st.DataObject
) -> None:
    """Replicas summing contiguous ranges in any order, folded on a reducer in any order,
    give ``torch.equal`` the one-process tree sum."""
    leaves = _leaves(total, seed)
    inner = data.draw(st.sets(st.integers(1, total - 1), max_size=6)) if total > 1 else set()
    cuts = [0, *sorted(inner), total]
    got = _split_sum(leaves, cuts, random.Random(seed))
    assert torch.equal(got, tree_sum([x.clone() for x in leaves], _add))


def test_in_place_addition_gives_the_same_bits_as_new_tensors() -> None:
    """``Tensor.add_`` may serve as ``plus`` (a partial is added once): same bits."""
    leaves = _leaves(13, seed=7)
    in_place = tree_sum([x.clone() for x in leaves], torch.Tensor.add_)
    assert torch.equal(in_place, tree_sum(leaves, _add))


@pytest.mark.parametrize(
    ("total", "peak"), [(1, 1), (2, 1), (3, 1), (4, 2), (7, 2), (8, 3), (15, 3), (64, 6)]
)
def test_partials_held_at_once_stay_logarithmic_in_order(total: int, peak: int) -> None:
    """Micro-batches arriving in order (as every schedule runs them) hold at most about
    log2(M) partials at once: what the memory planner adds for the gradients."""
    assert peak_partials(total) == peak


def test_bad_ranges_and_repeated_micro_batches_are_refused_by_name() -> None:
    """A range outside the step, a micro-batch added twice, one outside the range, a node
    that is not in the tree and an incomplete range each raise naming the values."""
    with pytest.raises(ValueError, match=r"\[3, 9\) are not a range inside \[0, 8\)"):
        covering(3, 9, 8)
    with pytest.raises(ValueError, match="at least one micro-batch"):
        tree_sum([], _add)
    acc = TreeSum(8, _add, 2, 6)
    acc.add(3, torch.ones(1))
    with pytest.raises(ValueError, match="3 overlaps"):
        acc.add(3, torch.ones(1))
    with pytest.raises(ValueError, match=r"6 lies outside micro-batches \[2, 6\)"):
        acc.add(6, torch.ones(1))
    with pytest.raises(ValueError, match=r"\[1,3\) is no node"):
        acc.add_node(Node(1, 3), torch.ones(1))
    with pytest.raises(ValueError, match=r"\[2, 6\) incomplete: \[2, 4, 5\] missing"):
        acc.partials()
    whole = TreeSum(8, _add, 1, 8)
    for k in range(1, 8):
        whole.add(k, torch.ones(1))
    with pytest.raises(ValueError, match="are 3 nodes, not one"):
        whole.result()
