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
    from elasticpipe.v1 import coordinator_pb2

    long_name = "elasticpipe-stage-0spare"
    long_address = "elasticpipe-stage-0.elasticpipe-stage.default.svc.cluster.local:7200"
    status = coordinator_pb2.StatusResponse(num_layers=4)
    status.partition.boundaries.extend([0, 2, 4])
    for i, (name, address) in enumerate([(long_name, long_address), ("s1", "10.0.0.2:7200")]):
        status.stages.add(name=name, address=address, state="chain", index=i, layer_hi=2 * i + 2)
    table = format_status(status).splitlines()
    header = next(line for line in table if line.startswith("name"))
    rows = [line for line in table if line.startswith((long_name, "s1 "))]
    assert len(rows) == 2
    for row in rows:  # every row's state column starts where the header's does
        assert row[header.index("state") :].startswith("chain")
        assert row[header.index("address") - 1] == " "
