"""Tests of membership: stable ids per name, heartbeats, liveness, drained, persistence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.coordinator.membership import Membership
from elasticpipe.coordinator.store import Store


class FakeClock:
    """A monotonic clock the test advances by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(str(tmp_path / "c.db"))
    yield s
    s.close()


@pytest.fixture
def members(store: Store, clock: FakeClock) -> Membership:
    return Membership(store, dead_after_s=5.0, clock=clock)


def test_register_same_name_twice_keeps_the_id(members: Membership) -> None:
    """A stage re-registering under its name keeps its id and gets its new address."""
    first = members.register("host-a", "10.0.0.1:7000", "cuda")
    again = members.register("host-a", "10.0.0.1:7555", "cpu")
    assert again == first
    assert len(members.members()) == 1
    member = members.by_id(first)
    assert member is not None
    assert (member.row.address, member.row.device) == ("10.0.0.1:7555", "cpu")


def test_different_names_get_different_ids(members: Membership) -> None:
    """Two hosts get two distinct ids, listed in registration order."""
    a = members.register("host-a", "a:1", "cpu")
    b = members.register("host-b", "b:1", "cpu")
    assert a != b
    assert [m.row.stage_id for m in members.members()] == [a, b]


def test_heartbeat_of_unknown_id_is_false(members: Membership) -> None:
    """A heartbeat from an id the coordinator does not know returns False."""
    assert members.heartbeat("st-nobody", 1, {}, 0, 1.0) is False


def test_heartbeat_records_what_the_stage_said(members: Membership, clock: FakeClock) -> None:
    """A known stage's heartbeat stores its epoch, step, slowdown and timings."""
    sid = members.register("host-a", "a:1", "cpu")
    clock.now += 1.0
    assert members.heartbeat(sid, 4, {0: (0.1, 0.2, 64, 8)}, 17, 2.5) is True
    member = members.by_id(sid)
    assert member is not None
    assert (member.epoch, member.committed_step, member.slowdown) == (4, 17, 2.5)
    assert member.timings == {0: (0.1, 0.2, 64, 8)}
    assert member.last_seen == clock.now


def test_liveness_follows_the_clock(members: Membership, clock: FakeClock) -> None:
    """A stage is alive until dead_after_s passes without a heartbeat, and again after one."""
    sid = members.register("host-a", "a:1", "cpu")
    member = members.by_id(sid)
    assert member is not None
    assert members.alive(member)
    clock.now += 4.9
    assert members.alive(member)
    clock.now += 0.1
    assert not members.alive(member)
    members.heartbeat(sid, 0, {}, 0, 1.0)
    assert members.alive(member)


def test_reloaded_stages_are_not_alive_until_heard(store: Store, clock: FakeClock) -> None:
    """After a coordinator restart, stages keep their ids but count as dead until a heartbeat."""
    sid = Membership(store, clock=clock).register("host-a", "a:1", "cpu")
    restarted = Membership(store, clock=clock)
    member = restarted.by_id(sid)
    assert member is not None
    assert not restarted.alive(member)
    assert restarted.heartbeat(sid, 0, {}, 0, 1.0) is True
    assert restarted.alive(member)
    assert restarted.register("host-a", "a:2", "cpu") == sid


def test_drained_persists_across_restart(store: Store, clock: FakeClock) -> None:
    """A drained stage stays drained after a restart and after re-registering."""
    first = Membership(store, clock=clock)
    sid = first.register("host-a", "a:1", "cpu")
    first.set_drained(sid, True)
    restarted = Membership(store, clock=clock)
    member = restarted.by_id(sid)
    assert member is not None
    assert member.row.drained
    restarted.register("host-a", "a:1", "cpu")
    assert restarted.by_id(sid).row.drained  # type: ignore[union-attr]
    restarted.set_drained(sid, False)
    assert not Membership(store, clock=clock).by_id(sid).row.drained  # type: ignore[union-attr]


@pytest.mark.parametrize("key", ["st", "host-a", "10.0.0.1:7000"])
def test_find_by_id_name_or_address(members: Membership, key: str) -> None:
    """find locates a stage by its id, its name or its address."""
    sid = members.register("host-a", "10.0.0.1:7000", "cpu")
    found = members.find(sid if key == "st" else key)
    assert found is not None
    assert found.row.stage_id == sid
    assert members.find("nobody") is None
