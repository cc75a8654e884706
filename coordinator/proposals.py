"""The policy's moves waiting for confirmation (``Rebalancer._confirmed``).

A move the policy decides on is held back until the measurements of a later committed step
call for it again: one step's figures, a neighbour's burst, do not move layers. "Again"
means the same target, or a move the same way: figures read in the middle of a step (a
heartbeat's) see part of a change of speed, so their target falls short of the next
step's (a straggler's shares 7:5, then 9:3), and requiring one target twice cost its
re-split a step. A proposal belongs to one job and epoch: another's, or one from a step
after the stages' (a rollback), counts as none.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import NamedTuple

from elasticpipe.coordinator.planning.policy import Decision

__all__ = ["Pending", "confirm", "confirmed", "toward"]


class Pending(NamedTuple):
    """A proposed move of one kind, waiting for a later step's measurements."""

    key: Hashable  # its target: boundaries and chain, shares, ...
    step: int  # the committed step whose measurements proposed it
    stamp: tuple[str, int]  # the job and epoch it was proposed in
    toward: tuple[int, ...] | None  # per coordinate, the way it moves (None: by key only)


def toward(current: Sequence[int], target: Sequence[int]) -> tuple[int, ...] | None:
    """Per coordinate, the sign of the move from ``current`` to ``target`` (-1, 0 or 1);
    None when they do not compare (different lengths)."""
    if len(current) != len(target):
        return None
    return tuple((t > c) - (t < c) for c, t in zip(current, target, strict=True))


def confirm(
    proposals: dict[str, Pending],
    kind: str,
    key: Hashable,
    step: int,
    stamp: tuple[str, int],
    way: tuple[int, ...] | None = None,
) -> bool:
    """Whether a move of ``kind`` to ``key``, called for by the measurements of committed
    ``step`` in ``stamp``'s job and epoch (moving ``way``: ``toward``), is confirmed: a
    proposal of this kind from this job and epoch and an earlier step called for the same
    target or a move the same way. Otherwise this move becomes the pending one (a move
    alike, from the same step, keeps the pending one's step)."""
    pending = proposals.get(kind)
    if pending is not None and (pending.stamp != stamp or step < pending.step):
        pending = None  # another job's or epoch's, or a step rolled back since
    alike = pending is not None and (
        pending.key == key or (way is not None and pending.toward == way)
    )
    if pending is not None and alike and step > pending.step:
        return True
    if not alike:
        proposals[kind] = Pending(key, step, stamp, way)
    return False


def confirmed(
    proposals: dict[str, Pending],
    kind: str,
    decision: Decision,
    key: Hashable,
    step: int,
    stamp: tuple[str, int],
    way: tuple[int, ...] | None = None,
) -> Decision:
    """``decision`` (a move) if ``confirm`` confirms it; else the same held back, saying
    the step whose measurements it waits for."""
    if confirm(proposals, kind, key, step, stamp, way):
        return decision
    waits_for = proposals[kind].step + 1
    return replace(
        decision,
        move=False,
        outcome="unconfirmed",
        reason=f"{decision.reason}; waiting to confirm at step {waits_for}",
    )
