"""CPU lists (``elasticpipe stage --cpus``) and how a ``LocalCluster`` spreads its stages
over the CPUs it may use."""

from __future__ import annotations

import pytest

from elasticpipe.stage_server.cpus import format_cpus, parse_cpus, share, spread, stage_cpus


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0", {0}), ("0-3", {0, 1, 2, 3}), ("0,2,4-5", {0, 2, 4, 5}), (" 1 , 3-3", {1, 3})],
)
def test_lists_read_as_taskset_writes_them_and_back(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus
    assert parse_cpus(format_cpus(cpus)) == cpus


@pytest.mark.timeout(10)
def test_runs_are_written_as_ranges() -> None:
    assert format_cpus({5, 0, 1, 2, 7, 8}) == "0-2,5,7-8"


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("x", "'x'"),
        ("1-x", "'1-x'"),
        ("3-1", "'3-1'"),
        ("-1", "'-1'"),
        ("", "''"),
        ("1-", "'1-'"),
        ("+1", "'+1'"),
        ("0-9999999999", "'0-9999999999'"),
    ],
)
def test_a_bad_list_is_refused_naming_the_bad_item(text: str, named: str) -> None:
    with pytest.raises(ValueError, match="CPU") as caught:
        parse_cpus(text)
    assert named in str(caught.value)


@pytest.mark.timeout(10)
def test_stages_take_the_cpus_in_turn_and_neighbours_never_share_one() -> None:
    """One CPU a stage: stage k the k-th, around again; with two stages a core, stage 0 and
    1 the first two CPUs, and a list shorter than a stage's share gives it all of them."""
    cpus = [2, 3]
    assert [spread(k, 1, cpus) for k in range(4)] == [{2}, {3}, {2}, {3}]
    assert [spread(k, 2, [0, 1, 2, 3]) for k in range(3)] == [{0, 1}, {2, 3}, {0, 1}]
    assert spread(1, 4, cpus) == {2, 3}
    with pytest.raises(ValueError, match="no CPU"):
        spread(0, 1, [])


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("stages", "per_stage", "cpus", "each"),
    [
        (2, 1, 2, 1),  # a core each
        (4, 1, 2, 1),  # two stages a core
        (3, 1, 2, None),  # one core would hold two, the other one: left to the kernel
        (5, 1, 2, None),
        (4, 1, 16, 4),  # an equal part of a larger host: room beside each compute thread
        (3, 1, 16, 5),  # (one CPU left over)
        (2, 4, 4, 4),  # at least the torch threads (both stages on all four CPUs)...
        (2, 3, 4, None),  # ...which do not spread evenly here
        (3, 2, 2, 2),  # every stage on both CPUs
        (1, 8, 2, None),  # more threads than CPUs
    ],
)
def test_stages_share_the_cpus_evenly_or_are_left_unbound(
    stages: int, per_stage: int, cpus: int, each: int | None
) -> None:
    assert share(stages, per_stage, cpus) == each


@pytest.mark.timeout(10)
def test_a_stage_gets_its_spread_share_or_none() -> None:
    assert [stage_cpus(k, 4, 1, [0, 1]) for k in range(4)] == [{0}, {1}, {0}, {1}]
    assert stage_cpus(1, 2, 1, list(range(8))) == {4, 5, 6, 7}
    assert stage_cpus(0, 3, 1, [0, 1]) is None  # uneven: unbound
    assert stage_cpus(0, 2, 1, []) is None  # nothing to bind to
