"""Layouts: how many replicas, which hosts form each, how each partitions the layers and
what share of the micro-batches each runs, for the shortest predicted step.

For each replica count R from 1 up, the hosts are dealt into R replicas of about equal
total speed (fastest first, each to the replica with the least speed so far), each replica
is ordered and partitioned by ``order_hosts`` (under the memory caps), the shares are
water-filled (``shares.assign_shares``) on the planner's step predictions, and the
gradients' reduction is added. Worked example, 4 equal hosts, 4 layers of cost 1,
M = 8, 1F1B, a free reduction::

    R = 1: one chain of 4, share 8:  (8 - 1) x 1 + 4 = 11
    R = 2: two chains of 2, 4 each:  (4 - 1) x 2 + 4 = 10
    R = 4: four single hosts, 2 each: (2 - 1) x 4 + 4 = 8   <- the best without memory caps

With memory caps that keep a host from holding the whole model R = 4 is infeasible, and a
slow reduction (``reduce_bandwidth``) favours fewer replicas: it costs each holder
``2 (R - 1) / R`` of the gradient bytes of every group it holds (reduce-scatter, then
all-gather), after the step's last backward (counted as not overlapped).

Greedy, not exhaustive: the hosts are dealt once per R. A search can come later.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from elasticpipe.coordinator.planning.cost import Numbers, Plan, PlanError
from elasticpipe.coordinator.planning.hosts import order_hosts
from elasticpipe.coordinator.planning.shares import (
    assign_shares,
    planned_step_times,
    slowest,
)

__all__ = ["LayoutPlan", "plan_layouts", "reduce_seconds"]


@dataclass(frozen=True)
class LayoutPlan:
    """One candidate layout with its predicted times.

    Attributes:
        replicas: per replica, its hosts (indices into the given speeds) in chain order.
        plans: per replica, its partition and stage times (``Plan``).
        shares: micro-batches per replica.
        step_s: the predicted step: the slowest replica's, plus ``reduce_s``.
        reduce_s: the predicted reduction of the gradients among the replicas.
    """

    replicas: tuple[tuple[int, ...], ...]
    plans: tuple[Plan, ...]
    shares: tuple[int, ...]
    step_s: float
    reduce_s: float


def reduce_seconds(
    boundaries: Sequence[Sequence[int]], param_bytes: Numbers, bandwidth: float
) -> float:
    """The reduction's predicted seconds: the busiest holder's bytes over ``bandwidth``.

    A group is a run of layers held by the same stage in every replica (``Layout.groups``);
    its holders each send ``2 (R - 1) / R`` of its gradient bytes. A holder's groups go one
    after another.

    Raises:
        PlanError: a bandwidth that is not > 0.
    """
    replicas = len(boundaries)
    if replicas < 2:
        return 0.0
    if not bandwidth > 0:
        raise PlanError(f"reduce_bandwidth must be > 0 bytes/s (got {bandwidth})")
    cuts = sorted({b for bounds in boundaries for b in bounds})
    load: dict[tuple[int, int], float] = {}  # (replica, stage): bytes it sends
    for lo, hi in itertools.pairwise(cuts):
        sent = 2 * (replicas - 1) / replicas * math.fsum(param_bytes[lo:hi])
        for r, bounds in enumerate(boundaries):
            stage = max(s for s in range(len(bounds) - 1) if bounds[s] <= lo)
            load[(r, stage)] = load.get((r, stage), 0.0) + sent
    return max(load.values()) / bandwidth


def plan_layouts(
    layer_costs: Numbers,
    host_speeds: Numbers,
    micro_batches: int,
    schedule: str = "1f1b",
    param_bytes: Numbers | None = None,
    reduce_bandwidth: float | None = None,
    layer_memory: Numbers | None = None,
    host_memory: Numbers | None = None,
    max_replicas: int | None = None,
) -> list[LayoutPlan]:
    """Every feasible replica count's best layout found, the shortest predicted step first.

    Args:
        layer_costs, layer_memory: as for ``plan``.
        host_speeds: ``H`` relative speeds of the hosts to lay out.
        micro_batches: the step's global micro-batch count ``M``.
        schedule: the pipeline schedule (``predict_step_time``'s).
        param_bytes: ``L`` gradient bytes per layer, for the reduction's time; with
            ``reduce_bandwidth`` (bytes/s). Without them the reduction counts as free.
        host_memory: ``H`` bytes each host offers (as ``order_hosts``'s ``stage_memory``).
        max_replicas: at most this many replicas (default: as many as hosts, and no more
            than ``micro_batches``).

    Raises:
        PlanError: no replica count fits the memory caps, or bad inputs (named).
    """
    speeds = [float(s) for s in host_speeds]
    if not speeds or any(not s > 0 for s in speeds):
        raise PlanError(f"host_speeds must be > 0, at least one (got {speeds})")
    if (param_bytes is None) != (reduce_bandwidth is None):
        raise PlanError("param_bytes and reduce_bandwidth go together (the reduction's time)")
    top = min(len(speeds), micro_batches, max_replicas or len(speeds))
    found: list[LayoutPlan] = []
    errors: list[str] = []
    for count in range(1, top + 1):
        groups = _deal(speeds, count)
        try:
            ordered, plans = [], []
            for hosts in groups:
                caps = [host_memory[h] for h in hosts] if host_memory is not None else None
                order, best = order_hosts(
                    layer_costs,
                    [speeds[h] for h in hosts],
                    layer_memory=layer_memory if caps is not None else None,
                    stage_memory=caps,
                )
                ordered.append(tuple(hosts[i] for i in order))
                plans.append(best)
        except PlanError as exc:
            errors.append(f"{count} replicas: {exc}")
            continue
        times = planned_step_times(plans, schedule)
        shares = assign_shares(times, micro_batches)
        reduce_s = (
            reduce_seconds([p.boundaries for p in plans], param_bytes, reduce_bandwidth)
            if param_bytes is not None and reduce_bandwidth is not None
            else 0.0
        )
        found.append(
            LayoutPlan(
                tuple(ordered), tuple(plans), shares, slowest(times, shares) + reduce_s, reduce_s
            )
        )
    if not found:
        raise PlanError("no layout fits: " + "; ".join(errors))
    return sorted(found, key=lambda p: (p.step_s, len(p.replicas)))


def _deal(speeds: list[float], count: int) -> list[list[int]]:
    """The hosts dealt into ``count`` replicas of about equal total speed: fastest first,
    each to the replica with the least speed so far (ties: the lower replica)."""
    replicas: list[list[int]] = [[] for _ in range(count)]
    totals = [0.0] * count
    for host in sorted(range(len(speeds)), key=lambda h: (-speeds[h], h)):
        r = min(range(count), key=lambda i: (totals[i], i))
        replicas[r].append(host)
        totals[r] += speeds[host]
    return replicas
