"""Shares: how many of a step's M micro-batches each replica runs, so that the slowest
replica finishes as early as it can.

Replica ``r`` takes ``T_r(m)`` seconds for a share of ``m`` micro-batches (the planner's
prediction for its partition; nondecreasing in ``m``, ``T_r(0) = 0``). The step waits for
the slowest replica, so the best shares minimise ``max_r T_r(m_r)`` with ``sum m_r = M``.
Water-filling gives them exactly: hand out the micro-batches one at a time, each to the
replica that would finish it soonest (smallest ``T_r(m_r + 1)``). Worked example, M = 8,
two replicas with ``T_0(m) = 1 + m`` and ``T_1(m) = 2 + 2m`` (half as fast)::

    micro-batch        1  2  3  4  5  6  7  8
    T_0(m_0 + 1)       2  3  4  5  5  6  7  7
    T_1(m_1 + 1)       4  4  4  4  6  6  6  8
    goes to            0  0  0  1  0  0  1  0    -> shares (6, 2): T_0 = 7 s, T_1 = 6 s

The step takes 7 s; (5, 3) would take 8 s (T_1 = 8), and so would (7, 1) (T_0 = 8). Ties
go to the lower replica, so the shares are deterministic. Re-splitting moves no state,
which is why the policy tries it before moving layers.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Sequence

from elasticpipe.coordinator.planning.cost import Plan, predict_step_time
from elasticpipe.errors import InvalidRequest

__all__ = ["assign_shares", "pipeline_slots", "planned_step_times", "plus_slots", "slowest"]

StepTime = Callable[[int], float]  # seconds of a replica's step for a share of m >= 1


def assign_shares(
    step_times: Sequence[StepTime], micro_batches: int, at_least: int = 0
) -> tuple[int, ...]:
    """The shares minimising the slowest replica's step time (exact for nondecreasing
    ``step_times``; ties go to the lower replica).

    Args:
        step_times: per replica, its predicted seconds for a share of ``m >= 1``.
        micro_batches: the step's global micro-batch count ``M``.
        at_least: every replica's smallest share (1: every replica runs; the water-filling
            then hands out the rest, and stays exact under that floor).

    Raises:
        InvalidRequest: no replica, ``micro_batches < 1``, or too few micro-batches for
            the floor (naming the values).
    """
    if not step_times or micro_batches < max(1, at_least * len(step_times)):
        raise InvalidRequest(
            f"cannot share {micro_batches} micro-batches among {len(step_times)} replicas "
            f"(need at least one of each, and {at_least} per replica)"
        )
    shares = [at_least] * len(step_times)
    heap = [(t(at_least + 1), r) for r, t in enumerate(step_times)]
    heapq.heapify(heap)
    for _ in range(micro_batches - at_least * len(step_times)):
        _, r = heapq.heappop(heap)
        shares[r] += 1
        heapq.heappush(heap, (step_times[r](shares[r] + 1), r))
    return tuple(shares)


def slowest(step_times: Sequence[StepTime], shares: Sequence[int]) -> float:
    """The step's predicted seconds under ``shares``: its slowest replica's (a replica with
    no share takes none)."""
    return max((t(m) for t, m in zip(step_times, shares, strict=True) if m), default=0.0)


def planned_step_times(plans: Sequence[Plan], schedule: str, slot_s: float = 0.0) -> list[StepTime]:
    """Each replica's ``T_r(m)``: the planner's prediction for its partition (``plans[r]``)
    running ``m`` micro-batches under ``schedule``, plus ``slot_s`` per slot of its
    pipeline (``m + S - 1`` of them: what a chain measured beyond the model per slot, hop
    latencies and per-op overheads; ``Cluster.slot_overhead``)."""
    times: list[StepTime] = [
        functools.partial(predict_step_time, p, schedule=schedule) for p in plans
    ]
    if not slot_s:
        return times
    return [
        functools.partial(plus_slots, t, slot_s, len(p.boundaries) - 1)
        for t, p in zip(times, plans, strict=True)
    ]


def plus_slots(predicted: StepTime, per_slot: float, stages: int, share: int) -> float:
    """``predicted(share)`` plus ``per_slot`` for each of a chain of ``stages``' slots at
    that share (``pipeline_slots``)."""
    return predicted(share) + per_slot * pipeline_slots(stages, share)


def pipeline_slots(stages: int, share: int) -> int:
    """The slots of a pipeline of ``stages`` running ``share`` micro-batches: ``share +
    stages - 1`` (a hop's latency, a per-op overhead, is paid once per slot)."""
    return share + stages - 1
