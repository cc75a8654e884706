"""Tests of membership: incarnations, heartbeats, liveness, death, drained, persistence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.coordinator.membership import (
    SPEED_WINDOW,
    Heard,
    Membership,
    Probe,
    holder_alive,
)
from elasticpipe.coordinator.store import SqliteStore, Store
from elasticpipe.v1 import stage_pb2


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
    s = SqliteStore(str(tmp_path / "c.db"))
    yield s
    s.close()


@pytest.fixture
def members(store: Store, clock: FakeClock) -> Membership:
    return Membership(store, dead_after_s=5.0, clock=clock)


def test_registering_a_name_again_is_a_new_incarnation(members: Membership) -> None:
    """A stage re-registering under its name gets a new id; the old incarnation is dead."""
    first, older = members.register("host-a", "10.0.0.1:7000", "cuda")
    again, replaced = members.register("host-a", "10.0.0.1:7555", "cpu")
    assert again != first and older == []
    assert [m.row.stage_id for m in replaced] == [first]
    old, new = members.by_id(first), members.by_id(again)
    assert old is not None and new is not None
    assert old.row.dead and not members.alive(old)
    assert (new.row.address, new.row.device, new.row.incarnation) == ("10.0.0.1:7555", "cpu", 2)
    assert members.find("host-a") is new


def test_different_names_get_different_ids(members: Membership) -> None:
    """Two hosts get two distinct ids, listed in registration order."""
    a, _ = members.register("host-a", "a:1", "cpu")
    b, _ = members.register("host-b", "b:1", "cpu")
    assert a != b
    assert [m.row.stage_id for m in members.members()] == [a, b]


def test_heartbeat_of_unknown_or_dead_id(members: Membership) -> None:
    """A heartbeat from an unknown id says so; from a dead incarnation it says dead."""
    assert members.heartbeat("st-nobody", 1, {}, 0, 1.0) is Heard.UNKNOWN
    sid, _ = members.register("host-a", "a:1", "cpu")
    assert members.declare_dead(sid, "test")
    assert not members.declare_dead(sid, "again")
    assert members.heartbeat(sid, 1, {}, 0, 1.0) is Heard.DEAD


def test_heartbeat_records_what_the_stage_said(members: Membership, clock: FakeClock) -> None:
    """A known stage's heartbeat stores its epoch, step, slowdown, timings and snapshots."""
    sid, _ = members.register("host-a", "a:1", "cpu")
    clock.now += 1.0
    held = [stage_pb2.SnapshotHolding(job_id="j", step=10, layers=[0, 1])]
    assert members.heartbeat(sid, 4, {0: (0.1, 0.2, 64, 8)}, 17, 2.5, None, held) is Heard.OK
    member = members.by_id(sid)
    assert member is not None
    assert (member.epoch, member.committed_step, member.slowdown) == (4, 17, 2.5)
    assert member.timings == {0: (0.1, 0.2, 64, 8)}
    assert member.snapshots == held
    assert member.last_seen == clock.now


def test_liveness_follows_the_clock(members: Membership, clock: FakeClock) -> None:
    """A stage is alive until dead_after_s passes without a heartbeat, and again after one
    (silence alone does not declare it dead: that is the coordinator's decision)."""
    sid, _ = members.register("host-a", "a:1", "cpu")
    member = members.by_id(sid)
    assert member is not None
    assert members.alive(member)
    clock.now += 4.9
    assert members.alive(member)
    clock.now += 0.1
    assert not members.alive(member) and members.silent(member)
    members.heartbeat(sid, 0, {}, 0, 1.0)
    assert members.alive(member)


def test_reloaded_stages_get_a_grace_period(store: Store, clock: FakeClock) -> None:
    """After a coordinator restart, known live incarnations keep their ids and count as
    alive for one dead_after period, so their next heartbeat finds them; dead ones stay dead."""
    first = Membership(store, clock=clock)
    sid, _ = first.register("host-a", "a:1", "cpu")
    gone, _ = first.register("host-b", "b:1", "cpu")
    first.declare_dead(gone, "test")
    clock.now += 100.0
    restarted = Membership(store, clock=clock)
    member, dead = restarted.by_id(sid), restarted.by_id(gone)
    assert member is not None and dead is not None
    assert restarted.alive(member) and not restarted.alive(dead)
    assert restarted.heartbeat(sid, 0, {}, 0, 1.0) is Heard.OK


def test_drained_persists_across_restart_and_incarnations(store: Store, clock: FakeClock) -> None:
    """A drained stage stays drained after a restart and in its next incarnation."""
    first = Membership(store, clock=clock)
    sid, _ = first.register("host-a", "a:1", "cpu")
    first.set_drained(sid, True)
    restarted = Membership(store, clock=clock)
    member = restarted.by_id(sid)
    assert member is not None and member.row.drained
    again, _ = restarted.register("host-a", "a:1", "cpu")
    assert restarted.by_id(again).row.drained  # type: ignore[union-attr]
    restarted.set_drained(again, False)
    assert not Membership(store, clock=clock).by_id(again).row.drained  # type: ignore[union-attr]


def test_a_stage_leaving_on_its_own_does_not_drain_its_successor(
    members: Membership,
) -> None:
    """SIGTERM drains a stage so it can exit; its restart (a rolling update) rejoins."""
    sid, _ = members.register("host-a", "a:1", "cpu")
    members.mark_leaving(sid)
    members.set_drained(sid, True)
    again, older = members.register("host-a", "a:1", "cpu")
    assert [m.row.stage_id for m in older] == [sid]
    assert not members.by_id(again).row.drained  # type: ignore[union-attr]


def test_leaving_is_remembered_across_a_coordinator_restart(store: Store, clock: FakeClock) -> None:
    """The successor of a stage that left on its own rejoins even after a restart."""
    first = Membership(store, clock=clock)
    sid, _ = first.register("host-a", "a:1", "cpu")
    first.mark_leaving(sid)
    first.set_drained(sid, True)
    restarted = Membership(store, clock=clock)
    again, _ = restarted.register("host-a", "a:1", "cpu")
    assert not restarted.by_id(again).row.drained  # type: ignore[union-attr]


def test_an_operators_drain_survives_the_stage_leaving_and_dying(members: Membership) -> None:
    """Drained by an operator, then SIGTERM'd (or killed and declared dead): the next
    incarnation is still drained."""
    sid, _ = members.register("host-a", "a:1", "cpu")
    members.set_drained(sid, True)
    members.mark_leaving(sid)  # its own shutdown does not turn the drain into a leave
    members.declare_dead(sid, "killed")
    again, older = members.register("host-a", "a:1", "cpu")
    assert older == []  # already dead
    assert members.by_id(again).row.drained  # type: ignore[union-attr]


def test_forget_removes_an_incarnation(store: Store, clock: FakeClock) -> None:
    """A forgotten incarnation is gone from membership, also after a restart."""
    members = Membership(store, clock=clock)
    sid, _ = members.register("host-a", "a:1", "cpu")
    members.forget(sid)
    assert members.by_id(sid) is None and members.members() == []
    assert Membership(store, clock=clock).members() == []


@pytest.mark.parametrize("key", ["st", "host-a", "10.0.0.1:7000"])
def test_find_by_id_name_or_address(members: Membership, key: str) -> None:
    """find locates a stage by its id, its name or its address."""
    sid, _ = members.register("host-a", "10.0.0.1:7000", "cpu")
    found = members.find(sid if key == "st" else key)
    assert found is not None
    assert found.row.stage_id == sid
    assert members.find("nobody") is None


def test_the_holder_of_a_name_is_its_live_incarnation_at_any_address(
    members: Membership, clock: FakeClock
) -> None:
    """A registration meets the name's live incarnation as its holder, from another address
    and from the holder's own (an advertised address can be shared: only the probe tells a
    restart there from a second process); there is none once it is silent, dead or left."""
    sid, _ = members.register("host-a", "10.0.0.1:7000", "cpu")
    holder = members.holder("host-a")
    assert holder is not None and holder.row.stage_id == sid
    assert members.heard_ago(holder) == 0.0 and members.dead_after_s == 5.0
    assert members.holder("host-b") is None
    clock.now += 5.0
    assert members.heard_ago(holder) == 5.0
    assert members.holder("host-a") is None  # silent: a restart elsewhere
    members.heartbeat(sid, 0, {}, 0, 1.0)
    members.mark_left(sid)
    assert members.holder("host-a") is None  # shutting down on purpose
    other, _ = members.register("host-c", "10.0.0.3:7000", "cpu")
    members.declare_dead(other, "test")
    assert members.holder("host-c") is None


@pytest.mark.parametrize(
    ("heard_ago", "probe", "alive"),
    [
        (0.5, Probe.ITSELF, True),  # it answered as itself: a second process is refused
        (0.5, Probe.TIMED_OUT, True),  # slow but heartbeating: not displaced
        (0.5, Probe.OTHER, False),  # another incarnation, or none, on its port: a restart
        (0.5, Probe.UNREACHABLE, False),  # connection refused: it died
        (0.5, Probe.ERROR, False),  # something else answers there (UNIMPLEMENTED, ...)
        (5.0, Probe.ITSELF, False),  # its heartbeat is stale: missed, whatever answers
        (5.0, Probe.TIMED_OUT, False),
        (float("inf"), Probe.ITSELF, False),  # never heard from
    ],
)
def test_a_holder_is_alive_only_while_it_heartbeats_and_answers_as_itself_or_times_out(
    heard_ago: float, probe: Probe, alive: bool
) -> None:
    """The rule a registration under a held name follows (dead_after 5 s)."""
    assert holder_alive(heard_ago, 5.0, probe) is alive


def test_an_incarnation_that_left_is_left_not_dead_also_after_a_restart(
    store: Store, clock: FakeClock
) -> None:
    """A stage whose shutdown finished is "left" (and kept out of partitions), a killed one
    "dead"; the difference survives a coordinator restart, and the successor of the one
    that left is not drained."""
    first = Membership(store, clock=clock)
    gone, _ = first.register("host-a", "a:1", "cpu")
    killed, _ = first.register("host-b", "b:1", "cpu")
    spare, _ = first.register("host-c", "c:1", "cpu")
    first.mark_leaving(gone)
    first.mark_left(gone)
    first.declare_dead(killed, "missed its heartbeats")
    states = {m.row.name: first.state(m, in_chain=False) for m in first.members()}
    assert states == {"host-a": "left", "host-b": "dead", "host-c": "spare"}
    restarted = Membership(store, clock=clock)
    assert [restarted.state(m, in_chain=False) for m in restarted.members()][:2] == [
        "left",
        "dead",
    ]
    assert restarted.by_id(gone).row.drained  # type: ignore[union-attr]
    again, _ = restarted.register("host-a", "a:1", "cpu")
    assert not restarted.by_id(again).row.drained  # type: ignore[union-attr]
    assert restarted.state(restarted.by_id(spare), in_chain=True) == "chain"  # type: ignore[arg-type]


def test_the_speed_spread_counts_one_estimate_per_heartbeat(members: Membership) -> None:
    """``admin plan``'s spread: (max - min) / median of the live speeds of the last
    ``SPEED_WINDOW`` heartbeats, one per heartbeat however often the planner asks, and
    forgotten when the stage's layers change."""
    sid, _ = members.register("host-a", "a:1", "cpu")
    member = members.by_id(sid)
    assert member is not None and member.speed_spread() == 0.0
    for speed in (1.0, 1.2, 0.8):
        members.heartbeat(sid, 1, {}, 0, 1.0)
        member.observe_speed(speed)
        member.observe_speed(5.0)  # asked again before the next heartbeat: not counted
    assert member.speed_spread() == pytest.approx((1.2 - 0.8) / 1.0)
    for _ in range(SPEED_WINDOW):
        members.heartbeat(sid, 1, {}, 0, 1.0)
        member.observe_speed(2.0)
    assert member.speed_spread() == 0.0  # the old estimates left the window
    member.observe_speed(3.0)  # no new heartbeat: not counted
    assert member.speed_spread() == 0.0
    members.heartbeat(sid, 1, {}, 0, 1.0)
    member.observe_speed(3.0)
    assert member.speed_spread() == pytest.approx(0.5)
    member.remeasure()
    assert member.speed_spread() == 0.0 and member.timings == {}
