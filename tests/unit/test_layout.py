"""Tests of the layout: replicas of one epoch, their shares, and the reduction groups."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest
from elasticpipe.layout import Layout
from elasticpipe.partition import Partition, Placement, StageRef


def _replica(boundaries: tuple[int, ...], names: str, epoch: int = 3) -> Partition:
    stages = tuple(StageRef(f"st-{n}", f"h:{n}") for n in names)
    return Partition(epoch=epoch, job_id="j1", boundaries=boundaries, stages=stages)


EXAMPLE = Layout((_replica((0, 2, 5), "ab"), _replica((0, 1, 3, 5), "cde")), (5, 3))


def test_groups_are_the_runs_of_layers_with_the_same_holders() -> None:
    """Boundaries (0, 2, 5) and (0, 1, 3, 5) give the groups [0,1), [1,2), [2,3), [3,5)."""
    groups = EXAMPLE.validate(num_layers=5, micro_batches=8).groups()
    assert [(g.lo, g.hi) for g in groups] == [(0, 1), (1, 2), (2, 3), (3, 5)]
    assert [tuple(h.stage_id[-1] for h in g.holders) for g in groups] == [
        ("a", "c"),
        ("a", "d"),
        ("b", "d"),
        ("b", "e"),
    ]
    assert [(g.lo, g.hi) for g in EXAMPLE.groups_of("st-b")] == [(2, 3), (3, 5)]


def test_shares_are_contiguous_ranges_in_replica_order() -> None:
    """Shares 5:3 of M = 8: replica 0 runs micro-batches 0-4, replica 1 runs 5-7."""
    assert EXAMPLE.share_of(0) == range(0, 5) and EXAMPLE.share_of(1) == range(5, 8)
    assert EXAMPLE.micro_batches == 8
    assert EXAMPLE.replica_of_stage("st-d") == 1 and EXAMPLE.replica_of_stage("st-x") is None


def test_one_replica_is_its_partition_with_one_holder_per_group() -> None:
    """``Layout.single``: every stage its own group, holding its own range."""
    partition = _replica((0, 2, 3, 7), "abc")
    layout = Layout.single(partition, micro_batches=4).validate(7, 4)
    assert [(g.lo, g.hi, len(g.holders)) for g in layout.groups()] == [
        (0, 2, 1),
        (2, 3, 1),
        (3, 7, 1),
    ]


def test_the_json_form_round_trips() -> None:
    """What the store keeps parses back to the same layout."""
    assert Layout.from_json(EXAMPLE.to_json()) == EXAMPLE


def test_the_wire_form_round_trips_and_reads_as_replica_0_where_replicas_are_unknown() -> None:
    """The coordinator's Partition message with every replica: replica 0's fields on top
    (what an older client reads), the replicas and shares below; one replica is just its
    partition, running every micro-batch."""
    message = EXAMPLE.to_proto()
    assert Layout.from_proto(message, 8) == EXAMPLE
    assert Partition.from_proto(message) == EXAMPLE.replicas[0]
    assert EXAMPLE.addresses == ("h:a", "h:b", "h:c", "h:d", "h:e")
    one = EXAMPLE.replicas[1]
    assert not Layout.single(one, 8).to_proto().replicas
    assert Layout.from_proto(one.to_proto(), 8) == Layout.single(one, 8)
    with pytest.raises(InvalidRequest, match="add up to 8, not the 6"):
        Layout.from_proto(message, 6)


@pytest.mark.parametrize(
    ("layout", "error"),
    [
        (Layout((), ()), "at least one replica"),
        (
            Layout((_replica((0, 5), "a"), _replica((0, 5), "b", epoch=4)), (1, 1)),
            "replica 1 is of epoch 4",
        ),
        (Layout((_replica((0, 5), "a"), _replica((0, 4), "b")), (1, 1)), "replica 1: bound"),
        (Layout((_replica((0, 2, 5), "ab"), _replica((0, 5), "b")), (1, 1)), "'st-b' serves"),
        (Layout((_replica((0, 5), "a"), _replica((0, 5), "b")), (4,)), r"shares \[4\] must"),
        (Layout((_replica((0, 5), "a"), _replica((0, 5), "b")), (4, -1)), "must be 2 counts"),
        (Layout((_replica((0, 5), "a"), _replica((0, 5), "b")), (4, 3)), "up to 7, not the 8"),
    ],
)
def test_a_bad_layout_is_refused_naming_what_is_wrong(layout: Layout, error: str) -> None:
    """Mixed epochs, a bad replica, a stage in two replicas or wrong shares: each named."""
    with pytest.raises(InvalidRequest, match=error):
        layout.validate(num_layers=5, micro_batches=8)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12), st.data())
def test_groups_tile_the_layers_and_have_constant_holders(layers: int, data: st.DataObject) -> None:
    """For random replicas, the groups tile [0, L), every layer of a group has the group's
    holders, neighbouring groups differ, and there are at most sum(S_r - 1) + 1."""
    replicas = []
    for r in range(data.draw(st.integers(1, 4))):
        inner = (
            sorted(data.draw(st.sets(st.integers(1, layers - 1), max_size=4))) if layers > 1 else []
        )
        cuts = (0, *inner, layers)
        replicas.append(_replica(cuts, "".join(chr(97 + 5 * r + i) for i in range(len(cuts) - 1))))
    layout = Layout(tuple(replicas), (1,) * len(replicas)).validate(layers)
    groups = layout.groups()
    assert groups[0].lo == 0 and groups[-1].hi == layers
    assert all(a.hi == b.lo and a.holders != b.holders for a, b in itertools.pairwise(groups))
    assert all(layout.holders(layer_) == g.holders for g in groups for layer_ in g.layers)
    assert len(groups) <= sum(p.num_stages - 1 for p in replicas) + 1


def test_a_stages_placement_carries_its_replica_and_groups_over_the_wire() -> None:
    """st-d (replica 1, layers 1-2) reduces groups 1 ([1,2)) and 2 ([2,3)) with a and b;
    its placement says so and survives the wire; one replica's placement has no groups."""
    placement = EXAMPLE.assignment("st-d")
    assert (placement.replica, placement.num_replicas, placement.lo, placement.hi) == (1, 2, 1, 3)
    assert [(g.index, g.lo, g.hi) for g in placement.groups] == [(1, 1, 2), (2, 2, 3)]
    assert [h.stage_id for h in placement.groups[0].holders] == ["st-a", "st-d"]
    assert Placement.from_proto(placement.to_proto()) == placement
    single = Layout.single(_replica((0, 2, 5), "ab"), 4).assignment("st-b")
    assert single.num_replicas == 1 and single.groups == ()
    with pytest.raises(InvalidRequest, match="'st-x' serves no replica"):
        EXAMPLE.assignment("st-x")


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"replica": 2}, "replica 2 of 2"),
        ({"num_replicas": 0}, "replica 1 of 1, 2 groups"),
    ],
)
def test_a_bad_replica_placement_is_refused_by_name(change: dict[str, int], error: str) -> None:
    """A replica past the count, or groups without replicas: InvalidRequest naming them."""
    wire = EXAMPLE.assignment("st-d").to_proto()
    for field, value in change.items():
        setattr(wire, field, value)
    with pytest.raises(InvalidRequest, match=error):
        Placement.from_proto(wire)


@pytest.mark.parametrize(
    ("groups", "error"),
    [
        ([(1, 2)], r"groups \[\(1, 2\)\] do not tile layers \[1, 3\)"),
        ([(1, 2), (2, 3), (3, 4)], r"3 groups for layers \[1, 3\)"),
        ([], r"groups \[\] do not tile"),
    ],
)
def test_groups_that_leave_a_layer_out_are_refused(
    groups: list[tuple[int, int]], error: str
) -> None:
    """st-d holds layers 1-2: its groups must tile them (a layer left out would never get
    its reduced gradient), each naming st-d as replica 1's holder."""
    wire = EXAMPLE.assignment("st-d").to_proto()
    template = wire.groups[0]
    del wire.groups[:]
    for lo, hi in groups:
        g = wire.groups.add()
        g.CopyFrom(template)
        g.layer_lo, g.layer_hi = lo, hi
    with pytest.raises(InvalidRequest, match=error):
        Placement.from_proto(wire)


def test_a_group_naming_another_holder_is_refused() -> None:
    """A group whose replica-1 holder is not st-d itself is refused, naming the stage."""
    wire = EXAMPLE.assignment("st-d").to_proto()
    wire.groups[0].holders[1].address = "h:elsewhere"
    with pytest.raises(InvalidRequest, match="replica 1's stage 'h:d'"):
        Placement.from_proto(wire)
