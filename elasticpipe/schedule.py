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
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from elasticpipe.errors import InvalidRequest


class OpKind(Enum):
    """What an op does with its micro-batch."""

    FORWARD = "F"
    BACKWARD = "B"


@dataclass(frozen=True)
class Op:
    """One op of a stage's schedule."""

    kind: OpKind
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.micro_batch}"


SCHEDULES = ("gpipe", "1f1b")


def stage_ops(schedule: str, num_stages: int, stage: int, micro_batches: int) -> list[Op]:
    """The ops stage ``stage`` of ``num_stages`` runs for one training step.

    Args:
        schedule: "gpipe" or "1f1b".
        num_stages: S >= 1.
        stage: 0 <= stage < S.
        micro_batches: m >= 1.

    Returns:
        2m ops: every micro-batch's forward once and backward once, each backward after
        its forward.

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
    return ops + bwd[micro_batches - warmup :]


def forward_ops(micro_batches: int) -> list[Op]:
    """The ops of an inference pass: forwards only."""
    return [Op(OpKind.FORWARD, i) for i in range(micro_batches)]


def peak_in_flight(ops: list[Op]) -> int:
    """Most micro-batches forwarded but not yet backwarded at any point of ``ops``."""
    alive = peak = 0
    for op in ops:
        alive += 1 if op.kind is OpKind.FORWARD else -1
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
