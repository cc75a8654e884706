"""``Pipeline``'s ``replicas`` and ``stages``, and the coordinator's check of the setup
request they become (``client.replicas.ask``, ``coordinator.replicas.Shape``)."""

from __future__ import annotations

import pytest

from elasticpipe.client.replicas import Asked, ask
from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import PlanError
from elasticpipe.coordinator.replicas import Shape, pinned_order
from elasticpipe.coordinator.store import StageRow
from elasticpipe.errors import InvalidRequest
from elasticpipe.layout import Layout
from elasticpipe.partition import Partition, StageRef


@pytest.mark.parametrize(
    ("replicas", "stages", "asked"),
    [
        (None, None, Asked(0)),
        (None, 4, Asked(4)),
        (1, 4, Asked(4)),
        (2, 3, Asked(6, (3, 3))),
        (None, (2, 3), Asked(5, (2, 3))),
        (2, [2, 3], Asked(5, (2, 3))),
        (None, (4,), Asked(4)),
        ("auto", None, Asked(0, (), True)),
        ("auto", 6, Asked(6, (), True)),
    ],
)
def test_the_arguments_become_the_request_fields(
    replicas: int | str | None, stages: int | tuple[int, ...] | None, asked: Asked
) -> None:
    assert ask(replicas, stages) == asked


@pytest.mark.parametrize(
    ("replicas", "stages", "error"),
    [
        (0, 3, "replicas must be an int >= 1"),
        (True, 3, "replicas must be an int >= 1"),
        (None, 0, "stages must be an int >= 1"),
        (None, (), r"gives 0 replica lengths"),
        ("auto", (2, 3), "stages \\(with replicas='auto'\\) must be an int"),
    ],
)
def test_bad_arguments_are_refused_by_name(replicas: object, stages: object, error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        ask(replicas, stages)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("sizes", "auto", "num_stages", "error"),
    [
        ((2, 3), True, 0, "do not also give replica_stages"),
        ((2, 0), False, 0, "counts >= 1"),
        ((2, 3), False, 4, "num_stages 4 is not the sum"),
    ],
)
def test_the_coordinator_refuses_a_bad_request_by_name(
    sizes: tuple[int, ...], auto: bool, num_stages: int, error: str
) -> None:
    with pytest.raises(InvalidRequest, match=error):
        Shape.parse(sizes, auto, num_stages)


def test_a_shape_waits_for_its_stages_and_resumes_only_its_own_layout() -> None:
    shape = Shape.parse((2, 3), False, 0)
    assert shape.replicated and shape.stages_needed(0) == 5
    assert not Shape.parse((), False, 4).replicated and Shape().stages_needed(4) == 4

    def chain(*ids: str) -> Partition:
        return Partition(1, "j", tuple(range(len(ids) + 1)), tuple(StageRef(i, i) for i in ids))

    running = Layout((chain("a", "b"), chain("c", "d", "e")), (4, 4))
    assert shape.matches(running)
    assert not Shape.parse((3, 2), False, 0).matches(running)
    assert not shape.matches(None)  # a job of one pipeline
    assert Shape().matches(running) and Shape(auto=True).matches(None)


def _member(name: str, pin: str = "") -> Member:
    member = Member(StageRow(f"id-{name}", name, f"h:{name}", "cpu", 0.0))
    member.replica_pin = pin
    return member


def test_pinned_stages_serve_their_replica_and_the_rest_fill_in_order() -> None:
    """Pins a (2 stages) and b (1): sorted names take replicas 0 and 1; s1 and s3, unpinned,
    fill the places left in registration order."""
    chosen = [
        _member("s0", "b"),
        _member("s1"),
        _member("s2", "a"),
        _member("s3"),
        _member("s4", "a"),
    ]
    ordered = [m.row.name for m in pinned_order(chosen, (3, 2))]
    assert ordered == ["s2", "s4", "s1", "s0", "s3"]
    assert [m.row.name for m in pinned_order(chosen[1:4:2], (1, 1))] == ["s1", "s3"]


@pytest.mark.parametrize(
    ("pins", "sizes", "error"),
    [
        (["a", "b", "c"], (1, 1), r"pinned to 3 replicas \['a', 'b', 'c'\], the job has 2"),
        (["a", "a", ""], (1, 2), r"2 stages are pinned to replica 'a' .*which has 1"),
    ],
)
def test_pins_that_do_not_fit_are_refused_by_name(
    pins: list[str], sizes: tuple[int, ...], error: str
) -> None:
    chosen = [_member(f"s{i}", pin) for i, pin in enumerate(pins)]
    with pytest.raises(PlanError, match=error):
        pinned_order(chosen, sizes)
