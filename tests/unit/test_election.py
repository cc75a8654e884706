"""The leader election on a real etcd member: one leader, terms that grow, standbys that
take over when it resigns or its lease lapses, and a deposed leader that cannot write."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.coordinator.store import Election, EtcdStore, Leader, NotLeader
from elasticpipe.etcdpb import rpc_pb2, rpc_pb2_grpc
from tests.support.etcd import EtcdMember, start_etcd

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdMember]:
    member = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield member
    member.stop()


@pytest.fixture
def url(etcd: EtcdMember) -> str:
    return f"etcd://{etcd.endpoint}/election-{uuid.uuid4().hex[:8]}"


def _store(url: str) -> EtcdStore:
    return EtcdStore.from_url(url)


def test_one_candidate_leads_and_a_second_waits_until_it_resigns(url: str) -> None:
    """The first campaign wins at once; the second blocks, then wins with a higher term
    once the first resigns, and the store names it as leader."""
    first = Election(_store(url), "a:7100")
    second = Election(_store(url), "b:7100", ttl_s=2, margin_s=0.5)
    term_a = first.campaign(timeout_s=10)
    assert term_a > 0 and first.leader() is not None
    assert first.leader().address == "a:7100"  # type: ignore[union-attr]
    won: list[int] = []
    waiter = threading.Thread(target=lambda: won.append(second.campaign(timeout_s=20)))
    waiter.start()
    time.sleep(3.0)  # longer than the standby's own 2 s lease: it must keep it alive
    assert not won, "a standby led while the leader still held its key"
    first.resign()
    waiter.join(timeout=20)
    assert won and won[0] > term_a
    assert second.leader() is not None and second.leader().address == "b:7100"  # type: ignore[union-attr]
    second.resign()


def test_a_campaign_that_cannot_win_in_time_says_so(url: str) -> None:
    first, second = Election(_store(url), "a:7100"), Election(_store(url), "b:7100")
    first.campaign(timeout_s=10)
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="b:7100"):
        second.campaign(timeout_s=1.0)
    assert time.monotonic() - started < 5
    first.resign()
    second.resign()


def test_a_fenced_leader_writes_and_a_deposed_one_cannot(url: str) -> None:
    """Writes carry the leader's term: once another leads (here: the key deleted behind
    the old leader's back, as when its lease lapsed), the old leader's write raises
    NotLeader and changes nothing, although it has not noticed yet."""
    old_store, new_store = _store(url), _store(url)
    old = Election(old_store, "a:7100", ttl_s=30)
    old_store.fence_with(old)
    old.campaign(timeout_s=10)
    old_store.put("job", {"by": "a"})
    assert new_store.get("job") == {"by": "a"}
    # Depose it: revoke its lease from the outside (what etcd does when it lapses).
    lease = old._lease
    new_store.call(
        lambda ch, timeout: rpc_pb2_grpc.LeaseStub(ch).LeaseRevoke(
            rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=timeout
        )
    )
    new = Election(new_store, "b:7100")
    new_store.fence_with(new)
    new.campaign(timeout_s=10)
    assert old.term != 0, "the old leader has not noticed yet: the fence alone must hold"
    with pytest.raises(NotLeader, match="a:7100"):
        old_store.put("job", {"by": "a again"})
    with pytest.raises(NotLeader):
        old_store.delete("job")
    assert new_store.get("job") == {"by": "a"}, "a deposed leader's write changed the store"
    new_store.put("job", {"by": "b"})
    assert new_store.get("job") == {"by": "b"}
    new.resign()
    old._stop.set()


@pytest.mark.parametrize("silent_member", [False, True])
def test_a_leader_that_cannot_renew_steps_down_before_its_lease_lapses(
    tmp_path: Path, silent_member: bool
) -> None:
    """etcd gone (refusing connections, or, with ``silent_member``, one member that accepts
    and never answers, so that every renewal waits out its timeout): the leader sets
    ``lost`` within ttl - margin of sending its last accepted renewal, before etcd could
    let its lease expire and hand the key to anyone else; its writes are refused after."""
    member = start_etcd(tmp_path / "etcd")
    endpoints = [member.endpoint]
    silent = None
    if silent_member:
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)  # never accepted: a member that does not answer
        endpoints.append(f"127.0.0.1:{silent.getsockname()[1]}")
    store = EtcdStore(endpoints, f"/lost-{uuid.uuid4().hex[:8]}")
    election = Election(store, "a:7100", ttl_s=3, margin_s=1.0)
    store.fence_with(election)
    election.campaign(timeout_s=10)
    member.stop()
    assert election.lost.wait(timeout=10)
    lost_at = time.monotonic()
    last_renewal_sent = election._lease_from
    assert lost_at - last_renewal_sent < election.ttl_s - election.margin_s + 0.5, (
        "it stepped down too close to (or after) its lease's expiry"
    )
    assert election.term == 0
    with pytest.raises(NotLeader):
        store.put("job", {"after": "lost"})
    store.close()
    if silent is not None:
        silent.close()


def test_a_campaign_txn_sent_again_after_it_applied_still_wins(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create applied but its reply was lost, and ``call`` sent it again: the second try
    finds the key under this candidate's own lease, which is a win, not a wait on itself."""
    store = _store(url)
    real = store.txn

    def twice(request: rpc_pb2.TxnRequest) -> rpc_pb2.TxnResponse:
        real(request)
        return real(request)

    monkeypatch.setattr(store, "txn", twice)
    election = Election(store, "a:7100")
    term = election.campaign(timeout_s=5)
    assert term > 0 and election.leader() == Leader("a:7100", term)
    election.resign()


def test_resign_ends_a_campaign_waiting_in_another_thread(url: str) -> None:
    """A standby told to resign stops standing by (NotLeader) and never leads after."""
    first, second = Election(_store(url), "a:7100"), Election(_store(url), "b:7100")
    first.campaign(timeout_s=10)
    outcome: list[BaseException] = []

    def stand_by() -> None:
        try:
            second.campaign(timeout_s=20)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=stand_by)
    waiter.start()
    time.sleep(0.5)
    second.resign()
    waiter.join(timeout=10)
    assert not waiter.is_alive()
    assert outcome and isinstance(outcome[0], NotLeader), outcome
    first.resign()
    time.sleep(0.5)
    assert second.term == 0 and second.leader() is None


def test_a_store_fenced_with_a_candidate_that_does_not_lead_writes_nothing(url: str) -> None:
    store = _store(url)
    election = Election(store, "a:7100")
    store.fence_with(election)
    with pytest.raises(NotLeader, match="a:7100"):
        store.put("job", {"by": "a"})
    assert _store(url).get("job") is None


def test_a_leadership_lost_and_won_again_has_a_new_term(url: str) -> None:
    """A leader whose lease etcd dropped steps down; its next win is a new key under a
    higher term, so that whatever was left of the first leadership (its commands are
    stamped, its writes fenced, with the first term) stays fenced out."""
    store = _store(url)
    election = Election(store, "a:7100", ttl_s=3, margin_s=1.0)
    first = election.campaign(timeout_s=10)
    lease = election._lease
    store.call(
        lambda ch, timeout: rpc_pb2_grpc.LeaseStub(ch).LeaseRevoke(
            rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=timeout
        )
    )
    assert election.lost.wait(timeout=10)
    assert election.term == 0
    second = election.campaign(timeout_s=10)
    assert second > first
    assert election._lease != lease
    old = store.fenced(_Leadership(election.address, election.key, first))
    with pytest.raises(NotLeader, match=f"term {first}"):
        old.put("job", {"by": "the first leadership"})
    assert store.get("job") is None
    election.close()


class _Leadership:
    def __init__(self, address: str, key: bytes, term: int):
        self.address, self.key, self.term = address, key, term
