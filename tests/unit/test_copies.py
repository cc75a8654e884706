"""Tests of snapshot-copy accounting: which steps are safe, which recoverable."""

from __future__ import annotations

import pytest

from elasticpipe.coordinator.copies import copies_by_step, missing_layers, newest_step
from elasticpipe.v1 import stage_pb2

pytestmark = pytest.mark.timeout(20)


def held(step: int, layers: list[int], job: str = "j") -> stage_pb2.SnapshotHolding:
    return stage_pb2.SnapshotHolding(job_id=job, step=step, layers=layers)


# The docstring's example: a owns layers 0-1, b owns 2-3, each copies to the other.
HOLDINGS = {
    "a": [held(10, [0, 1]), held(10, [2, 3]), held(20, [0, 1]), held(30, [0, 1], job="old")],
    "b": [held(10, [2, 3]), held(10, [0, 1]), held(20, [2, 3])],
}


def test_a_step_is_safe_only_with_two_live_copies_of_every_layer() -> None:
    """Step 10 has two holders per layer, step 20 only one: 10 is the safe step."""
    found = copies_by_step(HOLDINGS, "j")
    assert newest_step(found, 4, {"a", "b"}, need=2) == 10
    assert newest_step(found, 4, {"a", "b"}, need=1) == 20


def test_after_a_death_the_newest_recoverable_step_is_chosen() -> None:
    """With b dead, only step 10 still has every layer (from a's copy of b's snapshot)."""
    found = copies_by_step(HOLDINGS, "j")
    assert newest_step(found, 4, {"a"}) == 10
    assert missing_layers(found, 20, 4, {"a"}) == [2, 3]
    assert newest_step(found, 4, set()) is None


def test_other_jobs_and_later_steps_are_ignored() -> None:
    """Holdings of another job never count; at_most bounds the step."""
    found = copies_by_step(HOLDINGS, "j")
    assert 30 not in found
    assert newest_step(found, 4, {"a", "b"}, at_most=15) == 10
