"""A registration under a name a live incarnation holds: what the coordinator does with each
outcome of its probe of the holder -- refuse (NameInUse), let the newcomer wait (NotReady),
or take it for the holder's restart -- at the holder's own address and elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.coordinator import Coordinator
from elasticpipe.coordinator.membership import Member, Probe
from elasticpipe.coordinator.store import SqliteStore
from elasticpipe.errors import NameInUse, NotReady

HOLDER = "10.0.0.1:7202"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    """A coordinator (no loops started) on a fresh store."""
    store = SqliteStore(str(tmp_path / "c.db"))
    yield Coordinator(store)
    store.close()


def probing(coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch, probe: Probe) -> list[str]:
    """Makes the coordinator's probe of a holder find ``probe``; returns the probed ids."""
    probed: list[str] = []

    def fake(_self: Coordinator, holder: Member) -> Probe:
        probed.append(holder.row.stage_id)
        return probe

    monkeypatch.setattr(Coordinator, "_probe", fake)
    return probed


@pytest.mark.parametrize("newcomer", [HOLDER, "10.0.0.1:7204"])
def test_a_holder_that_answers_as_itself_refuses_the_newcomer_at_any_address(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch, newcomer: str
) -> None:
    """A second process under the name, even one advertising the holder's own address, is
    refused with the holder's id, address and last heartbeat; the holder stays alive."""
    sid = coordinator.register("host-2", HOLDER, "cpu")
    probed = probing(coordinator, monkeypatch, Probe.ITSELF)
    with pytest.raises(NameInUse) as refused:
        coordinator.register("host-2", newcomer, "cpu")
    assert probed == [sid]
    for named in ("'host-2'", sid, HOLDER, "last heartbeat", "was refused"):
        assert named in str(refused.value), refused.value
    (only,) = coordinator.members.members()
    assert only.row.stage_id == sid and coordinator.members.alive(only)


def test_a_holder_that_heartbeats_but_times_out_makes_the_newcomer_wait(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow holder is neither displaced nor declared in use for good: the newcomer gets
    NotReady (it retries), naming the holder, and the holder stays the one incarnation."""
    sid = coordinator.register("host-2", HOLDER, "cpu")
    probing(coordinator, monkeypatch, Probe.TIMED_OUT)
    with pytest.raises(NotReady) as waiting:
        coordinator.register("host-2", "10.0.0.1:7204", "cpu")
    assert not isinstance(waiting.value, NameInUse)
    for named in (sid, HOLDER, "last heartbeat", "did not answer"):
        assert named in str(waiting.value), waiting.value
    (only,) = coordinator.members.members()
    assert only.row.stage_id == sid and coordinator.members.alive(only)


@pytest.mark.parametrize(
    ("probe", "newcomer"),
    [
        (Probe.OTHER, HOLDER),  # a restart on the holder's port answers as nobody yet
        (Probe.UNREACHABLE, HOLDER),
        (Probe.UNREACHABLE, "10.0.0.1:7204"),  # a restart elsewhere after a crash
        (Probe.ERROR, "10.0.0.1:7204"),  # something else answers at the old address
        (Probe.OTHER, "10.0.0.1:7204"),
    ],
)
def test_a_holder_that_is_gone_is_replaced_by_the_restart_at_once(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch, probe: Probe, newcomer: str
) -> None:
    """Refused, unreachable, answered by another incarnation or with an error: the holder
    is gone, so the registration is the next incarnation and the old one is dead."""
    old = coordinator.register("host-2", HOLDER, "cpu")
    probing(coordinator, monkeypatch, probe)
    new = coordinator.register("host-2", newcomer, "cpu")
    by_id = {m.row.stage_id: m for m in coordinator.members.members()}
    assert not coordinator.members.alive(by_id[old]) and coordinator.members.alive(by_id[new])
    assert by_id[new].row.incarnation == by_id[old].row.incarnation + 1


def test_a_name_nobody_holds_is_registered_without_a_probe(
    coordinator: Coordinator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first registration of a name, or one after its holder left, probes nothing."""
    probed = probing(coordinator, monkeypatch, Probe.ITSELF)
    sid = coordinator.register("host-2", HOLDER, "cpu")
    coordinator.members.mark_left(sid)
    coordinator.register("host-2", HOLDER, "cpu")
    assert probed == []
