"""The policy's moves waiting for confirmation (``Rebalancer._confirmed``).

A move the policy decides on is held back until the measurements of a later committed step
call for it again. "Again" means the same target, or a move the same way (no coordinate
the other way, one at least both ways): figures read in the middle of a step (a
heartbeat's, which a stage sends as soon as its compute moved by a quarter) see part of a
change of speed, so their target falls short of the step's end's (a straggler's shares
7:5, then 9:3), and requiring one target twice cost its re-split a step. So a proposal
from a step's first figures may be confirmed by the same step's last: a slowdown that
lasts most of one step (most of a layer's last 9 measurements) can re-split or move; the
gain threshold, the payback and the cool-down still apply. A proposal belongs to one job
and epoch: another's, or one from a step after the stages' (a rollback), counts as none.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace
from typing import NamedTuple

from elasticpipe.coordinator.planning.policy import Decision

__all__ = ["Pending", "confirm", "confirmed", "same_way", "toward"]


class Pending(NamedTuple):
    """A proposed move of one kind, waiting for a later step's measurements."""

    key: Hashable  # its target: boundaries and chain, shares, ...
    # the stages' committed step when it was proposed (its figures: that step's, or later)
    step: int
    stamp: tuple[str, int]  # the job and epoch it was proposed in
    toward: tuple[int, ...] | None  # per coordinate, the way it moves (None: by key only)


def toward(current: Sequence[int], target: Sequence[int]) -> tuple[int, ...] | None:
    """Per coordinate, the sign of the move from ``current`` to ``target`` (-1, 0 or 1);
    None when they do not compare (different lengths)."""
    if len(current) != len(target):
        return None
    return tuple((t > c) - (t < c) for c, t in zip(current, target, strict=True))


def same_way(a: tuple[int, ...] | None, b: tuple[int, ...] | None) -> bool:
    """Whether two moves (``toward``'s signs) go the same way: no coordinate the opposite
    way, and at least one moved by both (a partial reading moves fewer coordinates)."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(x * y >= 0 for x, y in zip(a, b, strict=True)) and any(
        x * y > 0 for x, y in zip(a, b, strict=True)
    )


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
    alike = pending is not None and (pending.key == key or same_way(pending.toward, way))
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
