"""Tests of layout planning: the replica count, the hosts of each replica, the shares and
the reduction's time, on numbers alone."""

from __future__ import annotations

import pytest

from elasticpipe.coordinator.planning.cost import PlanError
from elasticpipe.coordinator.planning.layouts import plan_fixed, plan_layouts, reduce_seconds


def test_the_worked_example_ranks_four_single_host_replicas_first() -> None:
    """4 equal hosts, 4 layers of cost 1, M = 8, free reduction: R = 4 predicts 8, R = 2
    predicts 10, R = 1 predicts 11 (the module's example)."""
    found = plan_layouts([1.0] * 4, [1.0] * 4, micro_batches=8)
    by_count = {len(p.replicas): p for p in found}
    assert next(len(p.replicas) for p in found) == 4
    assert by_count[4].step_s == pytest.approx(8.0) and by_count[4].shares == (2, 2, 2, 2)
    assert by_count[2].step_s == pytest.approx(10.0)
    assert by_count[1].step_s == pytest.approx(11.0)
    assert sorted(h for hosts in by_count[2].replicas for h in hosts) == [0, 1, 2, 3]


def test_memory_caps_rule_out_replicas_too_short_to_hold_the_model() -> None:
    """Hosts that hold 2 of the 4 layers each: no single-host replica; 2 replicas of 2."""
    found = plan_layouts([1.0] * 4, [1.0] * 4, 8, layer_memory=[10.0] * 4, host_memory=[25.0] * 4)
    assert min(len(h) for p in found for h in p.replicas) >= 2
    assert len(found[0].replicas) == 2 and found[0].step_s == pytest.approx(10.0)


def test_a_slow_reduction_favours_one_pipeline() -> None:
    """Gradients of 1 GB per layer over 1 GB/s: reducing costs more than the bubble saves."""
    found = plan_layouts([1.0] * 4, [1.0] * 4, 8, param_bytes=[1e9] * 4, reduce_bandwidth=1e9)
    assert len(found[0].replicas) == 1 and found[0].reduce_s == 0.0
    two = next(p for p in found if len(p.replicas) == 2)
    assert two.reduce_s == pytest.approx(2.0)  # each holder: 2 layers x 2(2-1)/2 x 1 GB


def test_a_slow_host_gets_a_smaller_share() -> None:
    """Two single-host replicas, one host 3x slower: the shares lean to the fast one."""
    found = plan_layouts([1.0] * 2, [3.0, 1.0], 8, max_replicas=2)
    two = next(p for p in found if len(p.replicas) == 2)
    fast = two.replicas.index((0,))
    assert two.shares[fast] > two.shares[1 - fast]


def test_reduce_seconds_sums_each_holders_groups() -> None:
    """Boundaries (0, 2, 5) and (0, 1, 3, 5), 1 byte per layer, 1 B/s: holder b of replica
    0 holds groups [2,3) and [3,5): 3 bytes x 2(2-1)/2 = 3 s, the busiest."""
    assert reduce_seconds([(0, 2, 5), (0, 1, 3, 5)], [1.0] * 5, 1.0) == pytest.approx(3.0)
    assert reduce_seconds([(0, 5)], [1.0] * 5, 1.0) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"host_speeds": [1.0, 0.0]}, "host_speeds must be > 0"),
        ({"param_bytes": [1.0] * 4}, "go together"),
        ({"param_bytes": [1.0] * 4, "reduce_bandwidth": 0.0, "max_replicas": 2}, "must be > 0"),
        ({"layer_memory": [10.0] * 4, "host_memory": [5.0] * 4}, "no layout fits: 1 replicas"),
    ],
)
def test_bad_inputs_and_no_fit_are_refused_by_name(kwargs: dict[str, object], error: str) -> None:
    """Zero speeds, half the reduction's inputs, a zero bandwidth, caps nothing fits."""
    args: dict[str, object] = {
        "layer_costs": [1.0] * 4,
        "host_speeds": [1.0] * 4,
        "micro_batches": 8,
    }
    args.update(kwargs)
    with pytest.raises(PlanError, match=error):
        plan_layouts(**args)  # type: ignore[arg-type]


def test_fixed_lengths_take_the_hosts_in_order_and_give_every_replica_a_share() -> None:
    """Replicas of (2, 3) over 5 hosts: hosts 0-1 form replica 0, 2-4 replica 1; a replica
    three times slower still runs at least one micro-batch."""
    plan = plan_fixed([1.0] * 6, [1.0, 1.0, 1.0, 1.0, 1.0], 8, (2, 3))
    assert sorted(plan.replicas[0]) == [0, 1] and sorted(plan.replicas[1]) == [2, 3, 4]
    assert [p.boundaries[-1] for p in plan.plans] == [6, 6]
    assert sum(plan.shares) == 8 and plan.shares[1] >= plan.shares[0]  # the longer is faster
    slow = plan_fixed([1.0] * 2, [1.0, 1.0 / 30], 4, (1, 1))
    assert slow.shares == (3, 1)


@pytest.mark.parametrize(
    ("sizes", "hosts", "micro_batches", "error"),
    [
        ((2, 2), 5, 8, r"replica lengths \[2, 2\] must be >= 1 each and add up to the 5"),
        ((2, 0), 2, 8, "must be >= 1"),
        ((1, 1, 1), 3, 2, "3 replicas need at least as many micro-batches"),
    ],
)
def test_bad_fixed_lengths_are_refused_by_name(
    sizes: tuple[int, ...], hosts: int, micro_batches: int, error: str
) -> None:
    with pytest.raises(PlanError, match=error):
        plan_fixed([1.0] * 4, [1.0] * hosts, micro_batches, sizes)


def test_a_replica_that_fits_no_partition_is_named() -> None:
    with pytest.raises(PlanError, match="replica 1"):
        plan_fixed(
            [1.0] * 4, [1.0] * 3, 4, (1, 2), layer_memory=[10.0] * 4, host_memory=[45.0, 15.0, 15.0]
        )


def test_an_overhead_per_slot_counts_in_every_replicas_step_and_shifts_the_shares() -> None:
    """``slot_s``: seconds per slot of each replica's pipeline (``m + S - 1`` slots). The
    worked example at 0.5 s a slot: R = 4 (2 slots each) 8 + 1, R = 2 (5) 10 + 2.5, R = 1
    (11) 11 + 5.5. Replicas of (2, 3) over 6 layers of cost 1, M = 8: 3 (m + 1) against
    2 (m + 2) split (3, 5) in 14; a second a slot, 4 (m + 1) against 3 (m + 2), (4, 4) in
    20: the longer chain pays more slots per micro-batch."""
    found = plan_layouts([1.0] * 4, [1.0] * 4, micro_batches=8, slot_s=0.5)
    by_count = {len(p.replicas): p.step_s for p in found}
    assert (by_count[4], by_count[2], by_count[1]) == pytest.approx((9.0, 12.5, 16.5))
    assert len(found[0].replicas) == 4
    free = plan_fixed([1.0] * 6, [1.0] * 5, 8, (2, 3))
    slow = plan_fixed([1.0] * 6, [1.0] * 5, 8, (2, 3), slot_s=1.0)
    assert (free.shares, free.step_s) == ((3, 5), pytest.approx(14.0))
    assert (slow.shares, slow.step_s) == ((4, 4), pytest.approx(20.0))
