"""Tests of the admin CLI's partition parser."""

from __future__ import annotations

import pytest

from elasticpipe.cli.admin import parse_ranges
from elasticpipe.errors import InvalidRequest


@pytest.mark.parametrize(
    ("text", "boundaries"),
    [
        ("0:6,6:12,12:18", [0, 6, 12, 18]),
        ("0:1", [0, 1]),
        ("0:1,1:2,2:3,3:4", [0, 1, 2, 3, 4]),
        ("2:5,5:9", [2, 5, 9]),
    ],
)
def test_parse_ranges_returns_boundaries(text: str, boundaries: list[int]) -> None:
    """Contiguous LO:HI ranges turn into their S + 1 boundaries."""
    assert parse_ranges(text) == boundaries


@pytest.mark.parametrize(
    ("text", "bad_part"),
    [
        ("0:6,7:12", "'7:12'"),  # gap
        ("0:6,5:12", "'5:12'"),  # overlap
        ("0:6,6:6", "'6:6'"),  # empty
        ("0:6,6:3", "'6:3'"),  # backwards
        ("0:0", "'0:0'"),
        ("a:b", "'a:b'"),
        ("0-6", "'0-6'"),
        ("0:6:12", "'0:6:12'"),
        ("0:6,", "''"),
        ("", "''"),
        ("0:6,,6:12", "''"),
        ("0:6,6:x", "'6:x'"),
        ("1.5:3", "'1.5:3'"),
    ],
    ids=[
        "gap",
        "overlap",
        "empty",
        "backwards",
        "empty-first",
        "letters",
        "dash",
        "three-fields",
        "trailing-comma",
        "nothing",
        "double-comma",
        "bad-hi",
        "float",
    ],
)
def test_parse_ranges_rejects_naming_the_bad_part(text: str, bad_part: str) -> None:
    """Gaps, overlaps, empty ranges and junk raise InvalidRequest naming the bad part."""
    with pytest.raises(InvalidRequest) as info:
        parse_ranges(text)
    assert bad_part in str(info.value)


def test_parse_ranges_rejects_negative_layers() -> None:
    """A range starting below layer 0 is malformed and raises InvalidRequest naming it."""
    with pytest.raises(InvalidRequest, match="'-2:3'"):
        parse_ranges("-2:3,3:6")


def test_status_columns_widen_for_long_names_and_addresses() -> None:
    """A StatefulSet's pod names and DNS addresses stay in their columns."""
    from elasticpipe.cli.admin import format_status
    from elasticpipe.client.admin import Status, from_proto
    from elasticpipe.v1 import coordinator_pb2

    long_name = "elasticpipe-stage-0spare"
    long_address = "elasticpipe-stage-0.elasticpipe-stage.default.svc.cluster.local:7200"
    status = coordinator_pb2.StatusResponse(num_layers=4)
    status.partition.boundaries.extend([0, 2, 4])
    for i, (name, address) in enumerate([(long_name, long_address), ("s1", "10.0.0.2:7200")]):
        status.stages.add(name=name, address=address, state="chain", index=i, layer_hi=2 * i + 2)
    table = format_status(from_proto(Status, status)).splitlines()
    header = next(line for line in table if line.startswith("name"))
    rows = [line for line in table if line.startswith((long_name, "s1 "))]
    assert len(rows) == 2
    for row in rows:  # every row's state column starts where the header's does
        assert row[header.index("state") :].startswith("chain")
        assert row[header.index("address") - 1] == " "


def test_status_lists_live_stages_first_with_ids_and_the_gone_ones_apart() -> None:
    """The chain in chain order, then spares, each with its id; a spare's unmeasured speed
    is "-", not 0.000; the job's step is shown once (live rows carry no per-stage step,
    which heartbeats report at different moments); dead and left incarnations follow in
    their own section, with the step each had committed when last heard from."""
    from elasticpipe.cli.admin import format_status
    from elasticpipe.client.admin import Status, from_proto
    from elasticpipe.v1 import coordinator_pb2

    status = coordinator_pb2.StatusResponse(num_layers=4, committed_step=7)
    status.partition.boundaries.extend([0, 2, 4])
    rows = [  # registration order, as the coordinator sends them
        ("old-b", "st-dead0001", "dead", -1, 0.0, 3),
        ("spare", "st-spare001", "spare", -1, 0.0, 0),
        ("b", "st-chain002", "chain", 1, 1.5, 6),
        ("a", "st-chain001", "chain", 0, 1.0, 7),
        ("gone", "st-left0001", "left", -1, 0.0, 5),
    ]
    for name, sid, state, index, speed, step in rows:
        status.stages.add(
            name=name, stage_id=sid, state=state, index=index, speed=speed, committed_step=step
        )
    lines = format_status(from_proto(Status, status)).splitlines()
    assert "step: 7" in lines[0]
    order = [line.split()[0] for line in lines if line.split()[:1] and "st-" in line]
    assert order == ["a", "b", "spare", "old-b", "gone"]
    gone_at = next(i for i, line in enumerate(lines) if line.startswith("gone"))
    assert all(line.startswith(("old-b", "gone")) for line in lines[gone_at + 2 :])
    table = {line.split()[0]: line.split() for line in lines[:gone_at] if "st-" in line}
    assert table["a"][1] == "st-chain001" and table["spare"][1] == "st-spare001"
    assert table["spare"][4] == "-"  # speed (no address, no device in this status)
    assert table["b"][4] == "1.500"
    assert not any("6" in cell or "7" in cell for row in table.values() for cell in row[5:])
    dead = next(line.split() for line in lines[gone_at:] if line.startswith("old-b"))
    assert dead[1:4] == ["st-dead0001", "dead", "0"] and dead[4] == "3"
