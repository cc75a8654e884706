"""Tests of the one Partition type: ownership, placements, moves, validation, wire forms."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest
from elasticpipe.partition import Move, Partition, Placement, StageRef, check_boundaries

pytestmark = pytest.mark.timeout(60)

A, B, C = StageRef("a", "h:1"), StageRef("b", "h:2"), StageRef("c", "h:3")
P = Partition(epoch=4, job_id="j", boundaries=(0, 2, 5, 7), stages=(A, B, C))


def test_owner_of_and_layers_of_follow_the_boundaries() -> None:
    """Stage s owns [b_s, b_{s+1}); owner_of agrees for every layer."""
    assert [P.owner_of(i).stage_id for i in range(7)] == list("aabbbcc")
    assert list(P.layers_of(1)) == [2, 3, 4]
    with pytest.raises(InvalidRequest, match="layer 7 is outside the model"):
        P.owner_of(7)


def test_assignment_names_neighbours_chain_and_snapshot_peer() -> None:
    """A stage's placement has its range, neighbours, the chain, and where its snapshot
    copy goes (the next stage, wrapping around)."""
    b = P.assignment("b")
    assert (b.index, b.lo, b.hi, b.prev, b.next) == (1, 2, 5, "h:1", "h:3")
    assert b.snapshot_peer == "h:3" and P.assignment("c").snapshot_peer == "h:1"
    outsider = P.assignment("z")
    assert not outsider.in_chain and outsider.epoch == 4
    assert Placement.from_proto(b.to_proto()) == b


def test_moves_to_lists_each_layer_changing_owner() -> None:
    """The worked example of the module docstring."""
    new = P.evolve(epoch=5, boundaries=(0, 3, 4, 7))
    assert P.moves_to(new) == [Move(2, "b", "a"), Move(4, "b", "c")]
    assert P.moves_to(P) == []


@pytest.mark.parametrize(
    ("partition", "match"),
    [
        (P.evolve(stages=(A, A, C)), "stage 'a' appears twice"),
        (P.evolve(boundaries=(0, 2, 2, 7)), "leave stage 1 without layers"),
        (P.evolve(boundaries=(0, 2, 7)), "give 2 ranges for 3 stages"),
        (P.evolve(boundaries=(1, 2, 5, 7)), "must run from 0 to"),
        (P.evolve(stages=()), "has no stages"),
    ],
    ids=["repeated-stage", "empty-stage", "too-few-ranges", "not-from-zero", "no-stages"],
)
def test_validate_refuses_a_partition_that_loses_or_repeats(
    partition: Partition, match: str
) -> None:
    """Every way a partition could lose a layer or give a stage two ranges is refused,
    naming the values."""
    with pytest.raises(InvalidRequest, match=match):
        partition.validate()


def test_validate_checks_the_layer_count() -> None:
    """A partition of another model size is refused."""
    with pytest.raises(InvalidRequest, match="from 0 to 9"):
        P.validate(num_layers=9)
    assert P.validate(num_layers=7) is P


def test_wire_and_json_forms_round_trip() -> None:
    """to_proto/from_proto and to_json/from_json give back the same partition."""
    q = P.evolve(restored_step=3, restore_epoch=4, predicted_step_s=0.5)
    assert Partition.from_proto(q.to_proto()) == q
    assert Partition.from_json(q.to_json()) == q


def test_check_boundaries_names_the_bad_values() -> None:
    """check_boundaries accepts 0 < ... < L and names what is wrong otherwise."""
    check_boundaries([0, 1, 3], 3, 2)
    with pytest.raises(InvalidRequest, match=r"\[0, 3, 3\]"):
        check_boundaries([0, 3, 3], 3, 2)


@st.composite
def partitions(draw: st.DrawFn) -> tuple[Partition, Partition]:
    layers = draw(st.integers(2, 30))
    stages = tuple(StageRef(f"s{i}", f"h:{i}") for i in range(draw(st.integers(1, 6))))

    def cut(refs: tuple[StageRef, ...]) -> tuple[int, ...]:
        inner = draw(
            st.lists(
                st.integers(1, layers - 1),
                min_size=len(refs) - 1,
                max_size=len(refs) - 1,
                unique=True,
            )
        )
        return (0, *sorted(inner), layers)

    if len(stages) > layers:
        stages = stages[:layers]
    old = Partition(1, "j", cut(stages), stages)
    other = tuple(draw(st.permutations(stages)))
    return old, Partition(2, "j", cut(other), other)


@given(partitions())
def test_moves_are_exactly_the_layers_whose_owner_changes(
    pair: tuple[Partition, Partition],
) -> None:
    """For any two valid partitions, applying moves_to to the old owners gives the new."""
    old, new = pair
    owners = {i: old.owner_of(i).stage_id for i in range(old.num_layers)}
    for move in old.moves_to(new):
        assert owners[move.layer] == move.source
        owners[move.layer] = move.target
    assert owners == {i: new.owner_of(i).stage_id for i in range(new.num_layers)}


@pytest.mark.parametrize("n_stages", [1, 2, 5])
def test_assignments_equal_each_stages_own_assignment(n_stages: int) -> None:
    """The chain built once and copied gives every stage exactly its own wire form."""
    stages = tuple(StageRef(f"id{i}", f"10.0.0.{i}:5000") for i in range(n_stages))
    boundaries = tuple(range(0, 3 * n_stages + 1, 3))
    p = Partition(epoch=7, job_id="j", boundaries=boundaries, stages=stages)
    names = [f"s{i}" for i in range(n_stages)]
    wire = p.assignments(names)
    assert list(wire) == [s.stage_id for s in stages]
    for ref in stages:
        assert wire[ref.stage_id] == p.assignment(ref.stage_id, names).to_proto()
        assert Placement.from_proto(wire[ref.stage_id]) == p.assignment(ref.stage_id, names)


def test_an_unknown_step_time_stays_unknown_on_the_wire_and_in_the_store() -> None:
    """predicted_step_s None (not profiled) round-trips as None, is unset on the wire, and
    a stored 0.0 (how "unknown" was written before) reads back as None."""
    assert P.predicted_step_s is None
    assert not P.to_proto().HasField("predicted_step_s")
    assert Partition.from_proto(P.to_proto()).predicted_step_s is None
    assert Partition.from_json(P.to_json()).predicted_step_s is None
    assert Partition.from_json({**P.to_json(), "predicted_step_s": 0.0}).predicted_step_s is None
    timed = P.evolve(predicted_step_s=0.125)
    assert Partition.from_proto(timed.to_proto()).predicted_step_s == 0.125
