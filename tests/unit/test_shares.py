"""Tests of share assignment: water-filling against brute force, ties, the planner's times."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.coordinator.planning.cost import Plan
from elasticpipe.coordinator.planning.shares import assign_shares, planned_step_times, slowest
from elasticpipe.errors import InvalidRequest


def _compositions(total: int, parts: int) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` counts >= 0."""
    return [
        tuple(b - a for a, b in zip((0, *cuts), (*cuts, total), strict=False))
        for cuts in itertools.combinations_with_replacement(range(total + 1), parts - 1)
    ]


def test_the_worked_example_gives_six_and_two() -> None:
    """T_0(m) = 1 + m and T_1(m) = 2 + 2m with M = 8: shares (6, 2), the step 7 s."""
    times = [lambda m: 1.0 + m, lambda m: 2.0 + 2 * m]
    shares = assign_shares(times, 8)
    assert shares == (6, 2) and slowest(times, shares) == 7.0


def test_equal_replicas_split_evenly_and_ties_go_to_the_lower_replica() -> None:
    """Three equal replicas and M = 7: (3, 2, 2)."""
    assert assign_shares([float] * 3, 7) == (3, 2, 2)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.data())
def test_water_filling_is_as_good_as_brute_force(total: int, data: st.DataObject) -> None:
    """For random nondecreasing step times, no split of the micro-batches has a faster
    slowest replica than the one assigned."""
    replicas = data.draw(st.integers(1, 4))
    tables = []
    for _ in range(replicas):
        steps = data.draw(st.lists(st.floats(0.0, 5.0), min_size=total, max_size=total))
        tables.append(list(itertools.accumulate([data.draw(st.floats(0.01, 5.0)), *steps])))
    times = [lambda m, t=t: t[m - 1] for t in tables]
    shares = assign_shares(times, total)
    assert sum(shares) == total and all(m >= 0 for m in shares)
    best = min(slowest(times, c) for c in _compositions(total, replicas))
    assert slowest(times, shares) == best


def test_a_slow_replica_gets_a_smaller_share_of_the_planned_steps() -> None:
    """From the planner's prediction: a replica whose stages are 3x slower gets fewer
    micro-batches, and the shares minimise the predicted step."""
    fast = Plan((0, 2, 4), (1.0, 1.0), (0.0,), 1.0)
    slow = Plan((0, 2, 4), (3.0, 3.0), (0.0,), 3.0)
    times = planned_step_times([fast, slow], "1f1b")
    shares = assign_shares(times, 8)
    assert shares[0] > shares[1]
    assert slowest(times, shares) == min(slowest(times, c) for c in _compositions(8, 2))


@pytest.mark.parametrize(("replicas", "total"), [(0, 4), (2, 0)])
def test_nothing_to_share_is_refused_naming_the_counts(replicas: int, total: int) -> None:
    """No replica, or no micro-batch: an InvalidRequest with both counts."""
    with pytest.raises(
        InvalidRequest, match=f"cannot share {total} micro-batches among {replicas}"
    ):
        assign_shares([float] * replicas, total)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 9), st.data())
def test_a_floor_of_one_is_as_good_as_brute_force_over_splits_that_keep_it(
    total: int, data: st.DataObject
) -> None:
    """With ``at_least=1`` (every replica runs), no split giving each replica at least one
    micro-batch has a faster slowest replica than the one assigned."""
    replicas = data.draw(st.integers(1, min(4, total)))
    tables = []
    for _ in range(replicas):
        steps = data.draw(st.lists(st.floats(0.0, 5.0), min_size=total, max_size=total))
        tables.append(list(itertools.accumulate([data.draw(st.floats(0.01, 5.0)), *steps])))
    times = [lambda m, t=t: t[m - 1] for t in tables]
    shares = assign_shares(times, total, at_least=1)
    assert sum(shares) == total and min(shares) >= 1
    best = min(slowest(times, c) for c in _compositions(total, replicas) if min(c) >= 1)
    assert slowest(times, shares) == best


def test_a_floor_the_micro_batches_cannot_meet_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="3 micro-batches among 4 replicas"):
        assign_shares([float] * 4, 3, at_least=1)
