"""Pipeline schedules: the ordered forward/backward ops each stage runs in one step.

Each stage runs its own list in order, waiting for the input an op needs (an activation
from the previous stage, a gradient from the next); sends never block. Both schedules are
deadlock-free because every stage runs backward ops in micro-batch order.

GPipe, 3 stages, 4 micro-batches (F = forward, B = backward; one column per clock)::

    stage 0: F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
    stage 1:    F0 F1 F2 F3 .  .  B0 B1 B2 B3
    stage 2:       F0 F1 F2 F3 B0 B1 B2 B3

1F1B (PipeDream-flush), same shape: stage s runs ``min(S - s - 1, m)`` warm-up forwards,
then alternates one forward and one backward, then drains the remaining backwards, so at
most ``min(S - s, m)`` micro-batches of activations are alive on stage s instead of m::

    stage 0: F0 F1 F2 .  B0 F3 B1 .  B2 .  B3
    stage 1:    F0 F1 .  B0 F2 B1 F3 B2 B3
    stage 2:       F0 B0 F1 B1 F2 B2 F3 B3

ZB-H1 (zero bubble, "Zero Bubble Pipeline Parallelism", Qi et al., ICLR 2024) splits each
backward in two: B computes only the gradient of the stage's input, which the previous
stage waits for, and W the gradients of the stage's weights, which nobody waits for. The
order is 1F1B's with B in place of the backward; stage s runs each W ``s`` backwards
after its B, so the chain's B ops reach the first stage sooner and the W ops fill what was the
drain's bubble. With F, B and W of equal length the bubble is a third of 1F1B's (one
unit per extra stage instead of three), and the activations alive on a stage (forwarded,
weight gradients not yet computed) are at most ``min(S, m)``: 1F1B's peak, now on every
stage. Same shape, F = B = W::

    stage 0: F0 F1 F2 .  .  B0 W0 F3 B1 W1 B2 W2 B3 W3
    stage 1:    F0 F1 .  B0 F2 B1 W0 F3 B2 W1 B3 W2 W3
    stage 2:       F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from elasticpipe.errors import InvalidRequest


class OpKind(Enum):
    """What an op does with its micro-batch."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward; in ZB-H1, the input gradient only
    WEIGHT = "W"  # ZB-H1: the weight gradients of a micro-batch whose B ran


@dataclass(frozen=True)
class Op:
    """One op of a stage's schedule."""

    kind: OpKind
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.micro_batch}"


SCHEDULES = ("gpipe", "1f1b", "zb-h1")
SPLIT_BACKWARD = frozenset({"zb-h1"})  # schedules whose backward is B then W


def stage_ops(schedule: str, num_stages: int, stage: int, micro_batches: int) -> list[Op]:
    """The ops stage ``stage`` of ``num_stages`` runs for one training step.

    Args:
        schedule: "gpipe", "1f1b" or "zb-h1".
        num_stages: S >= 1.
        stage: 0 <= stage < S.
        micro_batches: m >= 1.

    Returns:
        2m ops: every micro-batch's forward once and backward once, each backward after
        its forward; 3m with "zb-h1": every micro-batch's F, B and W in that order.

    Raises:
        InvalidRequest: an unknown schedule or out-of-range argument.
    """
    if schedule not in SCHEDULES:
        raise InvalidRequest(f"unknown schedule {schedule!r} (choose from {list(SCHEDULES)})")
    if num_stages < 1 or not 0 <= stage < num_stages or micro_batches < 1:
        raise InvalidRequest(
            f"bad schedule shape (stages: {num_stages}, stage: {stage}, "
            f"micro-batches: {micro_batches})"
        )
    fwd = [Op(OpKind.FORWARD, i) for i in range(micro_batches)]
    bwd = [Op(OpKind.BACKWARD, i) for i in range(micro_batches)]
    if schedule == "gpipe":
        return fwd + bwd
    warmup = min(num_stages - stage - 1, micro_batches)
    ops = fwd[:warmup]
    for i in range(micro_batches - warmup):
        ops += [fwd[warmup + i], bwd[i]]
    ops += bwd[micro_batches - warmup :]
    if schedule == "zb-h1":
        return _defer_weights(ops, lag=stage)
    return ops


def _defer_weights(ops: list[Op], lag: int) -> list[Op]:
    """Puts each backward's W ``lag`` backwards after its B (the rest at the end)."""
    out: list[Op] = []
    pending: list[int] = []
    for op in ops:
        out.append(op)
        if op.kind is OpKind.BACKWARD:
            pending.append(op.micro_batch)
            if len(pending) > lag:
                out.append(Op(OpKind.WEIGHT, pending.pop(0)))
    return out + [Op(OpKind.WEIGHT, i) for i in pending]


def forward_ops(micro_batches: int) -> list[Op]:
    """The ops of an inference pass: forwards only."""
    return [Op(OpKind.FORWARD, i) for i in range(micro_batches)]


def peak_in_flight(ops: list[Op]) -> int:
    """Most micro-batches forwarded but not yet fully backwarded (B, and W where the
    schedule splits the backward) at any point of ``ops``."""
    split = any(op.kind is OpKind.WEIGHT for op in ops)
    done = OpKind.WEIGHT if split else OpKind.BACKWARD
    alive = peak = 0
    for op in ops:
        if op.kind is OpKind.FORWARD:
            alive += 1
        elif op.kind is done:
            alive -= 1
        peak = max(peak, alive)
    return peak


def split_sizes(batch: int, micro_batches: int) -> list[int]:
    """Sizes of the micro-batches a mini-batch of ``batch`` samples splits into.

    Uneven batches give sizes that differ by at most one; fewer samples than micro-batches
    give one micro-batch per sample (no empty micro-batches).

    Raises:
        InvalidRequest: an empty batch or micro_batches < 1.
    """
    if batch < 1:
        raise InvalidRequest(f"mini-batch must hold at least one sample (got {batch})")
    if micro_batches < 1:
        raise InvalidRequest(f"micro_batches must be >= 1 (got {micro_batches})")
    m = min(batch, micro_batches)
    base, extra = divmod(batch, m)
    return [base + (1 if i < extra else 0) for i in range(m)]
