"""Pipeline efficiency: how close a step came to the fastest its own ops allowed.

The ideal step time is the critical path of the schedule with free communication: every
stage runs its ops of ``elasticpipe.training.schedule`` in order, each taking the time it was
measured to take, starting as soon as its stage is free and its inputs exist:

* F(s, m) after F(s-1, m)  (the activation from the previous stage)
* B(s, m) after B(s+1, m)  (the gradient from the next stage) and after F(s, m)

Efficiency is that ideal divided by the measured step time; what is missing to 1 is
bubbles the durations themselves do not force (waiting for the network, for the client,
for a scheduler) plus overheads between ops.

Worked example, 1F1B, 2 stages, 2 micro-batches, every F 1 s and every B 2 s
(``[start, end]`` in seconds)::

    stage 0: F0 [0,1]  F1 [1,2]  B0 [4,6]  B1 [7,9]
    stage 1: F0 [1,2]  B0 [2,4]  F1 [4,5]  B1 [5,7]

B(0,0) waits for B(1,0) (ends at 4), B(0,1) for B(1,1) (ends at 7): the ideal is 9 s,
which is (m + S - 1) * (f + b). With equal op times that formula holds for GPipe and
1F1B alike; unequal times make one stage the bottleneck and the walk finds the path.
"""

from __future__ import annotations

from collections.abc import Sequence

from elasticpipe.errors import InvalidRequest
from elasticpipe.training.schedule import SPLIT_BACKWARD, Op, OpKind, stage_ops
from elasticpipe.v1 import stage_pb2


def ideal_step_time(
    schedule: str,
    forward_s: Sequence[Sequence[float]],
    backward_s: Sequence[Sequence[float]],
    weight_s: Sequence[Sequence[float]] | None = None,
) -> float:
    """The critical path of one training step with free communication.

    Args:
        schedule: "gpipe", "1f1b" or "zb-h1".
        forward_s: ``forward_s[s][m]``: seconds the forward of micro-batch m took on
            stage s (the last stage's including the loss).
        backward_s: the same for the backwards (with "zb-h1": the input gradients, B).
        weight_s: with "zb-h1", the same for the weight gradients (W); else None.

    Returns:
        Seconds from the first op's start to the last op's end.

    Raises:
        InvalidRequest: no stages, or stages that disagree on the micro-batch count, or
            a negative duration.
    """
    stages = len(forward_s)
    if stages < 1 or len(backward_s) != stages:
        raise InvalidRequest(
            f"need the op durations of every stage (forward: {stages} stages, "
            f"backward: {len(backward_s)})"
        )
    m = len(forward_s[0])
    for s in range(stages):
        if len(forward_s[s]) != m or len(backward_s[s]) != m:
            raise InvalidRequest(
                f"stage {s} reports {len(forward_s[s])} forwards and {len(backward_s[s])} "
                f"backwards; stage 0 reports {m} micro-batches"
            )
        if min((*forward_s[s], *backward_s[s]), default=0.0) < 0:
            raise InvalidRequest(f"stage {s} reports a negative op duration")
    if m == 0:
        raise InvalidRequest("no micro-batch durations reported")
    if (schedule in SPLIT_BACKWARD) != (weight_s is not None) or (
        weight_s is not None
        and (len(weight_s) != stages or any(len(w) != m or min(w) < 0 for w in weight_s))
    ):
        raise InvalidRequest(
            f"schedule {schedule!r} needs weight-gradient durations exactly when it splits "
            "the backward, one per micro-batch and stage"
        )
    ops = [stage_ops(schedule, stages, s, m) for s in range(stages)]
    return critical_path(ops, forward_s, backward_s, weight_s)


def critical_path(
    ops: Sequence[Sequence[Op]],
    forward_s: Sequence[Sequence[float]],
    backward_s: Sequence[Sequence[float]],
    weight_s: Sequence[Sequence[float]] | None = None,
) -> float:
    """The makespan of running ``ops[s]`` in order on each stage s, every op as soon as
    its stage is free and its input exists, taking ``forward_s[s][m]`` (``backward_s``,
    ``weight_s``: a W op needs nothing from another stage).

    Raises:
        InvalidRequest: op lists that deadlock (an op waits for one that never runs).
    """
    stages = len(ops)
    done: dict[tuple[OpKind, int, int], float] = {}  # (kind, stage, micro-batch) -> end
    free = [0.0] * stages
    next_op = [0] * stages
    remaining = sum(len(o) for o in ops)
    while remaining:
        progressed = False
        for s in range(stages):
            # Runs this stage's ops for as long as their inputs are ready.
            while next_op[s] < len(ops[s]):
                op = ops[s][next_op[s]]
                i = op.micro_batch
                if op.kind is OpKind.FORWARD:
                    dep = (OpKind.FORWARD, s - 1, i) if s > 0 else None
                    took = forward_s[s][i]
                elif op.kind is OpKind.WEIGHT:
                    dep = None
                    took = weight_s[s][i] if weight_s is not None else 0.0
                else:
                    dep = (OpKind.BACKWARD, s + 1, i) if s < stages - 1 else None
                    took = backward_s[s][i]
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] if dep is not None else 0.0)
                free[s] = done[(op.kind, s, i)] = start + took
                next_op[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [str(ops[s][next_op[s]]) for s in range(stages) if next_op[s] < len(ops[s])]
            raise InvalidRequest(f"the op lists deadlock: stages wait at {stuck}")
    return max(free, default=0.0)


def efficiency(ideal_s: float, measured_s: float) -> float:
    """``ideal_s / measured_s``, in [0, 1] (0 when nothing was measured).

    The measured time can only fall short of the ideal through clock granularity: such
    a ratio is capped at 1.
    """
    if measured_s <= 0 or ideal_s <= 0:
        return 0.0
    return min(1.0, ideal_s / measured_s)


def step_efficiency(schedule: str, reports: Sequence[stage_pb2.StepReport]) -> tuple[float, float]:
    """The ideal step time and the efficiency of one step, from its stages' reports.

    The measured step time is the longest stage's run (``wall_s``): stage 0's run spans
    the step's first op to its last, waiting for the client's inputs included.

    Returns:
        (ideal seconds, efficiency); (0, 0) when the reports lack op durations (an
        inference pass, or stages of an older version).
    """
    try:
        ideal = ideal_step_time(
            schedule,
            [list(r.forward_s) for r in reports],
            [list(r.backward_s) for r in reports],
            [list(r.weight_s) for r in reports] if schedule in SPLIT_BACKWARD else None,
        )
    except InvalidRequest:
        return 0.0, 0.0
    return ideal, efficiency(ideal, max((r.wall_s for r in reports), default=0.0))
