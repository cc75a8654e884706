"""The policy's confirmation of a move (``coordinator.proposals``): a later step's
measurements must call for it again, the same target or a move the same way, in the same
job and epoch."""

from __future__ import annotations

import pytest

from elasticpipe.coordinator.planning.policy import Decision
from elasticpipe.coordinator.proposals import Pending, confirm, confirmed, same_way, toward

pytestmark = pytest.mark.timeout(30)

JOB = ("j", 3)  # (job id, epoch)


def test_the_way_a_move_goes_is_the_sign_of_each_coordinate() -> None:
    assert toward((6, 6), (9, 3)) == (1, -1)
    assert toward((0, 4, 8), (0, 3, 8)) == (0, -1, 0)
    assert toward((0, 4), (0, 2, 4)) is None  # (another stage count: no way to compare)


def test_a_move_is_confirmed_by_a_later_steps_call_for_it() -> None:
    """The same target at a later step confirms; at the same step it waits."""
    pending: dict[str, Pending] = {}
    assert not confirm(pending, "move", "A", 5, JOB)
    assert not confirm(pending, "move", "A", 5, JOB)  # (the same step's figures again)
    assert confirm(pending, "move", "A", 6, JOB)


def test_a_larger_move_the_same_way_confirms_and_an_opposite_one_starts_over() -> None:
    """Mid-step figures see part of a change of speed: shares 6:6 -> 7:5 proposed at step
    3, then 9:3 at step 4 confirms (the same way); 5:7 would have started over."""
    pending: dict[str, Pending] = {}
    assert not confirm(pending, "shares", (7, 5), 3, JOB, toward((6, 6), (7, 5)))
    assert confirm(pending, "shares", (9, 3), 4, JOB, toward((6, 6), (9, 3)))
    pending.clear()
    assert not confirm(pending, "shares", (7, 5), 3, JOB, toward((6, 6), (7, 5)))
    assert not confirm(pending, "shares", (5, 7), 4, JOB, toward((6, 6), (5, 7)))
    assert pending["shares"] == Pending((5, 7), 4, JOB, (-1, 1))  # (the new one pends)
    assert not confirm(pending, "shares", (5, 7), 4, JOB, (-1, 1))
    assert confirm(pending, "shares", (5, 7), 5, JOB, (-1, 1))


def test_without_a_way_only_the_same_target_confirms() -> None:
    """A new replica of spare X is not confirmed by a proposal of spare Y."""
    pending: dict[str, Pending] = {}
    assert not confirm(pending, "replica", "X", 3, JOB)
    assert not confirm(pending, "replica", "Y", 4, JOB)
    assert confirm(pending, "replica", "Y", 5, JOB)


def test_another_jobs_or_epochs_or_a_later_steps_proposal_counts_as_none() -> None:
    """A proposal left by a job that ended, from an epoch since changed, or from a step
    after the stages' (a rollback) neither confirms a move nor holds one back."""
    for stale in (Pending("A", 500, ("old", 9), None), Pending("A", 2, ("j", 2), None)):
        pending = {"move": stale}
        assert not confirm(pending, "move", "A", 3, JOB)
        assert pending["move"] == Pending("A", 3, JOB, None)
        assert confirm(pending, "move", "A", 4, JOB)
    pending = {"move": Pending("A", 500, JOB, None)}
    assert not confirm(pending, "move", "A", 4, JOB)  # (rolled back to step 4)
    assert confirm(pending, "move", "A", 5, JOB)


def test_a_held_decision_says_the_step_it_waits_for() -> None:
    pending: dict[str, Pending] = {}
    move = Decision(True, "gain 40% > 10%", 0.4, 2.0, 1.2, 0, 0.1, "move")
    held = confirmed(pending, "move", move, "A", 7, JOB)
    assert not held.move and held.outcome == "unconfirmed"
    assert held.reason.endswith("waiting to confirm at step 8"), held.reason
    assert confirmed(pending, "move", move, "A", 8, JOB) is move


def test_a_partial_reading_moves_fewer_coordinates_the_same_way() -> None:
    """Three replicas from (4, 4, 4): a mid-step reading (5, 4, 3) and the step's end
    (5, 5, 2) go the same way; so do a chain's cuts (0, 1, 0, 0) and (0, 1, -1, 0). A
    coordinate the other way, or none moved by both, is another way."""
    assert same_way(toward((4, 4, 4), (5, 4, 3)), toward((4, 4, 4), (5, 5, 2)))
    assert same_way((0, 1, 0, 0), (0, 1, -1, 0))
    assert not same_way((1, 0, -1), (-1, 1, 0))  # (the first replica both ways)
    assert not same_way((1, 0, -1), (0, 1, 0))  # (nothing moved by both)
    assert not same_way((1, -1), None) and not same_way((1, -1), (1, -1, 0))
    pending: dict[str, Pending] = {}
    assert not confirm(pending, "shares", (5, 4, 3), 3, JOB, toward((4, 4, 4), (5, 4, 3)))
    assert confirm(pending, "shares", (5, 5, 2), 4, JOB, toward((4, 4, 4), (5, 5, 2)))
