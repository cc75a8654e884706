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

__all__ = ["LayoutPlan", "PerStep", "plan_fixed", "plan_layouts", "reduce_seconds"]


@dataclass(frozen=True)
class LayoutPlan:
    """One candidate layout with its predicted times.

    Attributes:
        replicas: per replica, its hosts (indices into the given speeds) in chain order.
        plans: per replica, its partition and stage times (``Plan``).
        shares: micro-batches per replica.
        step_s: the predicted step: the slowest replica's, plus ``reduce_s`` and
            ``per_step_s``.
        reduce_s: the predicted reduction of the gradients among the replicas.
        per_step_s: the step's part outside the pipelines (``PerStep``).
    """

    replicas: tuple[tuple[int, ...], ...]
    plans: tuple[Plan, ...]
    shares: tuple[int, ...]
    step_s: float
    reduce_s: float
    per_step_s: float = 0.0


@dataclass(frozen=True)
class PerStep:
    """What a step costs once, outside its pipelines: ``fixed_s`` (the RunStep fan-out, the
    commit's round trip, the client's loop: learned, ``Cluster.per_step``), plus the optimizer
    steps, which every stage runs at once between its runs (after its reply to the commit;
    its next run waits for it, ``stage_server.deferral``): the busiest stage's
    parameter bytes (``param_bytes`` per layer) at ``optimizer_rate`` bytes/s. Without a
    rate, optimizer steps count as free."""

    fixed_s: float = 0.0
    param_bytes: Numbers | None = None
    optimizer_rate: float | None = None

    def seconds(self, boundaries: Sequence[Sequence[int]]) -> float:
        """The per-step seconds of a layout whose replicas are cut at ``boundaries``."""
        return self.fixed_s + self.optimizer_seconds(boundaries)

    def optimizer_seconds(self, boundaries: Sequence[Sequence[int]]) -> float:
        """Its optimizer steps alone: the busiest stage's bytes at the rate (0 without)."""
        if not self.optimizer_rate or self.param_bytes is None:
            return 0.0
        busiest = max(
            math.fsum(self.param_bytes[lo:hi])
            for bounds in boundaries
            for lo, hi in itertools.pairwise(bounds)
        )
        return busiest / self.optimizer_rate


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
    slot_s: float = 0.0,
    per_step: PerStep = PerStep(),
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
        slot_s: seconds added per slot of each replica's pipeline (``planned_step_times``).
        per_step: what each layout's step costs outside its pipelines (``PerStep``).

    Raises:
        PlanError: no replica count fits the memory caps, or bad inputs (named).
    """
    speeds = [float(s) for s in host_speeds]
    if not speeds or any(not s > 0 for s in speeds):
        raise PlanError(f"host_speeds must be > 0, at least one (got {speeds})")
    if (param_bytes is None) != (reduce_bandwidth is None):
        raise PlanError("param_bytes and reduce_bandwidth go together (the reduction's time)")
    if reduce_bandwidth is not None and not reduce_bandwidth > 0:
        raise PlanError(f"reduce_bandwidth must be > 0 bytes/s (got {reduce_bandwidth})")
    top = min(len(speeds), micro_batches, max_replicas or len(speeds))
    found: list[LayoutPlan] = []
    errors: list[str] = []
    for count in range(1, top + 1):
        try:
            found.append(
                _plan(
                    _deal(speeds, count),
                    layer_costs,
                    speeds,
                    micro_batches,
                    schedule,
                    param_bytes,
                    reduce_bandwidth,
                    layer_memory,
                    host_memory,
                    slot_s=slot_s,
                    per_step=per_step,
                )
            )
        except PlanError as exc:
            errors.append(f"{count} replicas: {exc}")
    if not found:
        raise PlanError("no layout fits: " + "; ".join(errors))
    return sorted(found, key=lambda p: (p.step_s, len(p.replicas)))


def plan_fixed(
    layer_costs: Numbers,
    host_speeds: Numbers,
    micro_batches: int,
    sizes: Sequence[int],
    schedule: str = "1f1b",
    param_bytes: Numbers | None = None,
    reduce_bandwidth: float | None = None,
    layer_memory: Numbers | None = None,
    host_memory: Numbers | None = None,
    slot_s: float = 0.0,
    per_step: PerStep = PerStep(),
) -> LayoutPlan:
    """The layout of replicas of the given lengths: the hosts taken in the order given,
    ``sizes[0]`` of them for replica 0, the next ``sizes[1]`` for replica 1, and so on;
    each replica ordered and partitioned by ``order_hosts``, every replica given at least
    one micro-batch. Arguments as ``plan_layouts``'s.

    Raises:
        PlanError: sizes that do not add up to the hosts, more replicas than micro-batches,
            or a replica that fits no partition (named).
    """
    speeds = [float(s) for s in host_speeds]
    if not sizes or any(n < 1 for n in sizes) or sum(sizes) != len(speeds):
        raise PlanError(
            f"replica lengths {list(sizes)} must be >= 1 each and add up to the "
            f"{len(speeds)} stages"
        )
    if len(sizes) > micro_batches:
        raise PlanError(
            f"{len(sizes)} replicas need at least as many micro-batches (got {micro_batches}): "
            "every replica runs at least one"
        )
    starts = list(itertools.accumulate(sizes, initial=0))
    groups = [list(range(a, b)) for a, b in itertools.pairwise(starts)]
    args = (schedule, param_bytes, reduce_bandwidth, layer_memory, host_memory)
    return _plan(
        groups,
        layer_costs,
        speeds,
        micro_batches,
        *args,
        at_least=1,
        slot_s=slot_s,
        per_step=per_step,
    )


def _plan(
    groups: list[list[int]],
    layer_costs: Numbers,
    speeds: list[float],
    micro_batches: int,
    schedule: str,
    param_bytes: Numbers | None,
    reduce_bandwidth: float | None,
    layer_memory: Numbers | None,
    host_memory: Numbers | None,
    at_least: int = 0,
    slot_s: float = 0.0,
    per_step: PerStep = PerStep(),
) -> LayoutPlan:
    """One layout of the hosts dealt into ``groups``: each ordered and partitioned, the
    shares water-filled, the reduction and the per-step part added (``PlanError`` naming
    the replica that fits no partition)."""
    ordered, plans = [], []
    for r, hosts in enumerate(groups):
        caps = [host_memory[h] for h in hosts] if host_memory is not None else None
        try:
            order, best = order_hosts(
                layer_costs,
                [speeds[h] for h in hosts],
                layer_memory=layer_memory if caps is not None else None,
                stage_memory=caps,
            )
        except PlanError as exc:
            raise PlanError(f"replica {r}: {exc}") from exc
        ordered.append(tuple(hosts[i] for i in order))
        plans.append(best)
    times = planned_step_times(plans, schedule, slot_s)
    shares = assign_shares(times, micro_batches, at_least)
    running = [p.boundaries for p, share in zip(plans, shares, strict=True) if share]
    reduce_s = (
        reduce_seconds(running, param_bytes, reduce_bandwidth)
        if param_bytes is not None and reduce_bandwidth is not None
        else 0.0
    )
    once = per_step.seconds(running)  # (a replica with no share is dropped: ``lay_out``)
    step_s = slowest(times, shares) + reduce_s + once
    return LayoutPlan(tuple(ordered), tuple(plans), shares, step_s, reduce_s, once)


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
