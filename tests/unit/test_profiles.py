"""Who profiles a new job: the first CPU stage of each host, for the host's CPU stages; a
GPU stage for itself (``coordinator.profiles``)."""

from __future__ import annotations

import pytest

from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.profiles import sharing
from elasticpipe.coordinator.store import StageRow

pytestmark = pytest.mark.timeout(30)


def _member(stage_id: str, address: str, device: str) -> Member:
    return Member(StageRow(stage_id, stage_id, address, device, 0.0))


def test_the_first_cpu_stage_of_a_host_profiles_for_the_others_and_gpus_for_themselves() -> None:
    chosen = [
        _member("a", "10.0.0.1:7201", "cpu"),
        _member("b", "10.0.0.1:7202", "cpu"),  # a's host and device: shares a's
        _member("c", "10.0.0.1:7203", "cuda:0"),  # another device there: its own
        _member("d", "10.0.0.1:7204", "cuda:0"),  # cuda:0 in another process: its own
        _member("e", "10.0.0.2:7201", "cpu"),  # another host: its own
        _member("f", "[fd00::1]:7201", "cpu"),
        _member("g", "[fd00::1]:7202", "cpu"),
    ]
    assert sharing(chosen) == {
        "a": "a",
        "b": "a",
        "c": "c",
        "d": "d",
        "e": "e",
        "f": "f",
        "g": "f",
    }
