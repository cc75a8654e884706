"""The leader election on a real etcd member: one leader, terms that grow, standbys that
take over when it resigns or its lease lapses, and a deposed leader that cannot write."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.coordinator.store import Election, EtcdStore, NotLeader
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
    first, second = Election(_store(url), "a:7100"), Election(_store(url), "b:7100")
    term_a = first.campaign(timeout_s=10)
    assert term_a > 0 and first.leader() is not None
    assert first.leader().address == "a:7100"  # type: ignore[union-attr]
    won: list[int] = []
    waiter = threading.Thread(target=lambda: won.append(second.campaign(timeout_s=20)))
    waiter.start()
    time.sleep(1.0)
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
    new_store._call(
        lambda ch: rpc_pb2_grpc.LeaseStub(ch).LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease))
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


def test_a_leader_that_cannot_renew_steps_down_before_its_lease_lapses(
    tmp_path: Path,
) -> None:
    """etcd gone: the leader's renewals fail, and it sets ``lost`` within ttl - margin of
    its last renewal, before etcd could hand its key to anyone else."""
    member = start_etcd(tmp_path / "etcd")
    store = EtcdStore([member.endpoint], f"/lost-{uuid.uuid4().hex[:8]}")
    election = Election(store, "a:7100", ttl_s=3, margin_s=1.0)
    store.fence_with(election)
    election.campaign(timeout_s=10)
    member.stop()
    killed = time.monotonic()
    assert election.lost.wait(timeout=10)
    assert time.monotonic() - killed < election.ttl_s, "it stepped down after its lease lapsed"
    assert election.term == 0
    with pytest.raises(NotLeader):
        store.put("job", {"after": "lost"})
