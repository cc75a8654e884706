"""Tests of the durable stores: what survives a reopen, incarnations, the commit point.

Every test runs on both stores: SQLite in a file, and etcd (one real member on loopback,
each test under its own key prefix).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from elasticpipe.coordinator.store import (
    EpochRow,
    EtcdStore,
    SqliteStore,
    StageRow,
    Store,
    open_store,
)
from elasticpipe.coordinator.store import etcd as etcd_store
from elasticpipe.coordinator.store.etcd import EtcdTLS
from elasticpipe.errors import CommitOutcomeUnknown, ElasticPipeError, InvalidRequest, Unavailable
from elasticpipe.etcdpb import rpc_pb2, rpc_pb2_grpc
from elasticpipe.etcdpb import rpc_pb2 as pb
from elasticpipe.partition import Partition, StageRef
from elasticpipe.security import tls
from tests.support.etcd import EtcdMember, start_etcd, start_etcd_cluster

pytestmark = pytest.mark.timeout(20)

A = StageRow("st-a", "host-a", "10.0.0.1:7000", "cuda", 100.0)
B = StageRow("st-b", "host-b", "10.0.0.2:7000", "cpu", 200.0, drained=True)
PARTITION = Partition(
    epoch=3,
    job_id="job1",
    boundaries=(0, 4, 9),
    stages=(StageRef("st-a", "10.0.0.1:7000"), StageRef("st-b", "10.0.0.2:7000")),
    predicted_step_s=0.25,
    restored_step=2,
    restore_epoch=3,
)
EPOCHS = [
    EpochRow(1, 10.0, "initial", (0, 5, 9), ("st-a", "st-b"), kind="start", job_id="job1"),
    EpochRow(
        2,
        20.0,
        "rebalance",
        (0, 4, 9),
        ("st-a", "st-b"),
        layers_moved=1,
        bytes_moved=4096,
        pause_s=0.5,
        extra={"gain": 0.2},
        job_id="job1",
        stage_names=("host-a", "host-b"),
    ),
]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdMember]:
    member = start_etcd(tmp_path_factory.mktemp("etcd"))
    yield member
    member.stop()


@pytest.fixture(params=["sqlite", "etcd"])
def path(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store's URL: a fresh SQLite file, or a fresh prefix in the real etcd."""
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'coordinator.db'}"
    member: EtcdMember = request.getfixturevalue("etcd")
    return f"etcd://{member.endpoint}/test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(path: str) -> Iterator[Store]:
    s = open_store(path)
    s.url = path  # type: ignore[attr-defined]
    yield s
    s.close()


def _reopen(store: Store) -> Store:
    store.close()
    reopened = open_store(store.url)  # type: ignore[attr-defined]
    reopened.url = store.url  # type: ignore[attr-defined]
    return reopened


def test_everything_survives_a_reopen(path: str) -> None:
    """Stages, key-values, the partition, epoch history and max_epoch survive a restart."""
    first = open_store(path)
    first.add_stage(A)
    first.add_stage(B)
    first.put("job", {"model": "mlp", "kwargs": {"sizes": [1, 2]}})
    first.put_partition(PARTITION)
    for row in EPOCHS:
        first.add_epoch(row)
    first.close()

    second = open_store(path)
    try:
        assert second.stages() == [A, B]
        assert second.get("job") == {"model": "mlp", "kwargs": {"sizes": [1, 2]}}
        assert second.partition() == PARTITION
        assert second.epochs() == EPOCHS
        assert second.max_epoch() == 3
    finally:
        second.close()


def test_incarnations_of_a_name_are_kept_apart(store: Store) -> None:
    """Two incarnations of one name are two rows; max_incarnation counts them."""
    store.add_stage(A)
    store.add_stage(StageRow("st-a2", "host-a", "10.0.0.9:7001", "cpu", 999.0, incarnation=2))
    store = _reopen(store)
    assert [s.stage_id for s in store.stages()] == ["st-a", "st-a2"]
    assert store.max_incarnation("host-a") == 2
    assert store.max_incarnation("nobody") == 0


def test_a_taken_stage_id_or_incarnation_is_refused_by_name(store: Store) -> None:
    """Both stores refuse, with the same ValueError naming it, a stage id that exists
    (whatever else the row says) and a name's incarnation number that another id holds;
    the same row again (a retried write) changes nothing; nothing else is written."""
    store.add_stage(A)
    store.add_stage(A)
    with pytest.raises(ValueError, match=r"stage id 'st-a' exists"):
        store.add_stage(replace(A, name="host-z", incarnation=5))
    with pytest.raises(ValueError, match=r"stage id 'st-a' exists"):
        store.add_stage(replace(A, address="elsewhere:1"))
    with pytest.raises(ValueError, match=r"stage 'host-a' incarnation 1 exists"):
        store.add_stage(replace(A, stage_id="st-other"))
    store = _reopen(store)
    assert [(s.stage_id, s.name, s.incarnation) for s in store.stages()] == [("st-a", "host-a", 1)]
    assert store.max_incarnation("host-z") == 0


def test_the_latest_incarnation_is_per_exact_name(store: Store) -> None:
    """Names that extend one another ('h', 'h/1', 'h1') keep their own numbers, and the
    latest is the highest (10 after 9: numbers, not text)."""
    for name, numbers in (("h", (1, 2, 9, 10)), ("h/1", (1, 11)), ("h1", (12,))):
        for n in numbers:
            store.add_stage(replace(A, stage_id=f"{name}-{n}", name=name, incarnation=n))
    store = _reopen(store)
    assert [store.max_incarnation(n) for n in ("h", "h/1", "h1", "h/", "")] == [10, 11, 12, 0, 0]


def test_an_epoch_row_without_a_time_is_stamped_when_written(store: Store) -> None:
    """``at=0`` means "now" on both stores: the row read back carries the write's time."""
    before = time.time()
    store.add_epoch(replace(EPOCHS[0], at=0.0))
    (row,) = _reopen(store).epochs()
    assert before <= row.at <= time.time()


def test_flags_survive_a_reopen_and_forgotten_stages_vanish(store: Store) -> None:
    """drained and dead are durable both ways; a forgotten stage is no longer listed."""
    store.add_stage(A)
    store.add_stage(B)
    store.set_stage("st-a", drained=True, dead=True)
    store.set_stage("st-b", drained=False)
    store = _reopen(store)
    assert [(s.stage_id, s.drained, s.dead) for s in store.stages()] == [
        ("st-a", True, True),
        ("st-b", False, False),
    ]
    store.set_stage("st-a", forgotten=True)
    assert [s.stage_id for s in store.stages()] == ["st-b"]
    with pytest.raises(ValueError, match="unknown stage flag 'alive'"):
        store.set_stage("st-b", alive=True)


def test_stages_are_listed_in_registration_order(store: Store) -> None:
    """stages() orders by registration time, whatever the insertion order."""
    store.add_stage(B)
    store.add_stage(A)
    assert [s.stage_id for s in store.stages()] == ["st-a", "st-b"]


def test_put_overwrites_delete_removes_and_missing_is_none(store: Store) -> None:
    """put replaces the value of a key; delete removes it; an unknown key reads as None."""
    store.put("k", [1, 2])
    store.put("k", {"x": None})
    assert store.get("k") == {"x": None}
    store.delete("k")
    assert store.get("k") is None


def test_empty_store_has_no_partition_and_epoch_zero(store: Store) -> None:
    """A fresh store has no stages, no partition, no history and max_epoch 0."""
    assert (store.stages(), store.partition(), store.epochs(), store.max_epoch()) == (
        [],
        None,
        [],
        0,
    )


def test_max_epoch_covers_history_partition_and_attempts(store: Store) -> None:
    """max_epoch is the highest of the history, the current partition and any epoch ever
    reserved, so reserve_epoch never hands out a number twice."""
    store.add_epoch(EpochRow(7, 1.0, "x", (0, 1)))
    store.put_partition(PARTITION)  # epoch 3
    assert store.max_epoch() == 7
    store.put_partition(PARTITION.evolve(epoch=9))
    assert store.max_epoch() == 9
    assert store.reserve_epoch() == 10
    assert store.reserve_epoch() == 11


def test_commit_change_writes_partition_and_record_together(store: Store) -> None:
    """The commit point stores the new partition and marks the change committed."""
    store.put("epoch_change", {"epoch": 3, "phase": "preparing"})
    store.commit_change(PARTITION, {"epoch": 3, "phase": "preparing"})
    store = _reopen(store)
    assert store.partition() == PARTITION
    assert store.get("epoch_change") == {"epoch": 3, "phase": "committed"}


def test_client_generations_increase(store: Store) -> None:
    """next_client hands out ever larger generations, across a reopen."""
    first, second = store.next_client(), store.next_client()
    store = _reopen(store)
    assert first < second < store.next_client()


def test_epochs_of_one_job_most_recent_oldest_first(store: Store) -> None:
    """epochs(limit) keeps the newest records, oldest first; job_id filters them."""
    for epoch in range(1, 6):
        store.add_epoch(EpochRow(epoch, float(epoch), f"e{epoch}", (0, 1), job_id=f"j{epoch % 2}"))
    assert [r.epoch for r in store.epochs(limit=3)] == [3, 4, 5]
    assert [r.epoch for r in store.epochs(job_id="j1")] == [1, 3, 5]


def test_a_loop_pause_lands_only_on_a_change_of_its_job_and_survives_a_reopen(
    store: Store,
) -> None:
    """set_loop_pause writes into the change's row of that job; another job's epoch, an
    abandoned attempt and an unknown epoch are left alone (False)."""
    store.add_epoch(EpochRow(1, 1.0, "start", (0, 2), job_id="j", kind="start"))
    store.add_epoch(EpochRow(2, 2.0, "move", (0, 1, 2), job_id="j", pause_s=0.05))
    store.add_epoch(EpochRow(3, 3.0, "gave up", (0, 1, 2), job_id="j", kind="abandoned"))
    store.add_epoch(EpochRow(4, 4.0, "move", (0, 1, 2), job_id="other"))
    assert store.set_loop_pause("j", 2, 0.08)
    assert not store.set_loop_pause("j", 3, 0.5)
    assert not store.set_loop_pause("j", 4, 0.5)
    assert not store.set_loop_pause("j", 9, 0.5)
    assert not store.set_loop_pause("j", 2, 0.08)  # sent again: already recorded
    # The change's row is written again after its commit reached every stage: the client's
    # report, which may come first, is kept.
    store.add_epoch(EpochRow(2, 2.5, "move", (0, 1, 2), job_id="j", pause_s=0.05))
    reopened = _reopen(store)
    try:
        assert [(r.epoch, r.pause_s, r.loop_pause_s) for r in reopened.epochs()] == [
            (1, 0.0, 0.0),
            (2, 0.05, 0.08),
            (3, 0.0, 0.0),
            (4, 0.0, 0.0),
        ]
    finally:
        reopened.close()


def test_memory_store_works_without_a_file() -> None:
    """The default ':memory:' store keeps values for its lifetime."""
    store = SqliteStore()
    try:
        store.add_stage(A)
        assert store.stages() == [A]
    finally:
        store.close()


def test_store_urls_pick_the_backend_and_bad_ones_name_the_bad_part(tmp_path: Path) -> None:
    """sqlite:PATH and a bare path are SQLite; etcd:// lists members and a prefix."""
    for url in (f"sqlite:{tmp_path / 'a.db'}", str(tmp_path / "b.db")):
        opened = open_store(url)
        assert isinstance(opened, SqliteStore)
        opened.close()
    etcd = open_store("etcd://10.0.0.1:2379,10.0.0.2:2379/jobs/a")
    assert isinstance(etcd, EtcdStore)
    assert etcd.endpoints == ["10.0.0.1:2379", "10.0.0.2:2379"]
    assert etcd.prefix == "/jobs/a"
    etcd.close()
    default = open_store("etcd://h:2379")
    assert isinstance(default, EtcdStore) and default.prefix == "/elasticpipe"
    default.close()
    for bad, named in (("etcd://", "names no"), ("etcd://h:x", "'h:x'"), ("etcd://h:0", "'h:0'")):
        with pytest.raises(InvalidRequest, match=named):
            open_store(bad)


def test_etcd_store_goes_on_when_the_first_member_listed_is_down(etcd: EtcdMember) -> None:
    """A member that does not answer is skipped: the next one listed serves the call."""
    url = f"etcd://127.0.0.1:1,{etcd.endpoint}/test-{uuid.uuid4().hex[:8]}"
    store = open_store(url)
    try:
        store.put("job", {"a": 1})
        assert store.get("job") == {"a": 1}
    finally:
        store.close()


def test_an_etcd_store_with_no_member_answering_says_which_members_it_tried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every member down: passes over the members until RETRY_FOR_S has gone by (an etcd
    leader election is that kind of short outage), then a clear Unavailable naming them,
    not a raw gRPC error."""
    monkeypatch.setattr(etcd_store, "RETRY_FOR_S", 1.0)
    store = open_store("etcd://127.0.0.1:1,127.0.0.1:2")
    try:
        started = time.monotonic()
        with pytest.raises(Unavailable, match=r"127\.0\.0\.1:1,127\.0\.0\.1:2.*within 1 s"):
            store.get("job")
        assert 0.5 <= time.monotonic() - started < 5.0  # it retried, and it gave up
    finally:
        store.close()


def _etcd_store(etcd: EtcdMember) -> EtcdStore:
    store = open_store(f"etcd://{etcd.endpoint}/test-{uuid.uuid4().hex[:8]}")
    assert isinstance(store, EtcdStore)
    return store


def _lose_txn_replies(store: EtcdStore, monkeypatch: pytest.MonkeyPatch, apply: bool) -> None:
    """Every Txn from now on gets no reply: etcd applies it first if ``apply``, else not,
    and the store sees UNAVAILABLE from every member (as in a partition that began while
    the request was in flight)."""

    def txn(request: pb.TxnRequest) -> pb.TxnResponse:
        if apply:
            real(request)
        raise Unavailable("etcd store: no member answered (test: the reply was lost)")

    real = store.txn
    monkeypatch.setattr(store, "txn", txn)


@pytest.mark.parametrize("applied", [True, False])
def test_a_commit_whose_reply_is_lost_is_decided_by_what_the_store_holds(
    etcd: EtcdMember, monkeypatch: pytest.MonkeyPatch, applied: bool
) -> None:
    """A commit Txn applied by etcd whose reply never came is a commit (the caller must not
    undo a change the store says is committed); one that was not applied raises, with the
    old partition kept."""
    store = _etcd_store(etcd)
    try:
        store.put("epoch_change", {"epoch": 3, "phase": "preparing"})
        _lose_txn_replies(store, monkeypatch, apply=applied)
        if applied:
            store.commit_change(PARTITION, {"epoch": 3, "phase": "preparing"})
            assert store.get("epoch_change") == {"epoch": 3, "phase": "committed"}
            assert store.partition() == PARTITION
        else:
            with pytest.raises(Unavailable, match="reply was lost") as raised:
                store.commit_change(PARTITION, {"epoch": 3, "phase": "preparing"})
            assert not isinstance(raised.value, CommitOutcomeUnknown)
            assert store.get("epoch_change") == {"epoch": 3, "phase": "preparing"}
            assert store.partition() is None
    finally:
        store.close()


def test_a_commit_that_cannot_be_read_back_says_its_outcome_is_unknown(
    etcd: EtcdMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reply and no read either: CommitOutcomeUnknown, so that the coordinator does not
    undo the stages' prepared change on a guess."""
    store = _etcd_store(etcd)
    try:
        _lose_txn_replies(store, monkeypatch, apply=False)
        monkeypatch.setattr(etcd_store, "COMMIT_READBACK_S", 0.0)

        def unreadable(key: bytes) -> Any:
            raise Unavailable("etcd store: no member answered (test: reads fail too)")

        monkeypatch.setattr(store, "_get_json", unreadable)
        with pytest.raises(CommitOutcomeUnknown, match=r"epoch 3 got no answer.*may or may not"):
            store.commit_change(PARTITION, {"epoch": 3, "phase": "preparing"})
    finally:
        store.close()


def test_a_new_stage_whose_txn_is_retried_after_it_applied_is_added_once(
    etcd: EtcdMember, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create Txn applied, its reply lost, and sent again (as ``call`` does on the next
    member): the retry finds its own record, which is success, not "exists"; a different
    record under the same id still is refused."""
    store = _etcd_store(etcd)
    real = store.txn

    def twice(request: pb.TxnRequest) -> pb.TxnResponse:
        real(request)
        return real(request)

    try:
        monkeypatch.setattr(store, "txn", twice)
        store.add_stage(A)
        assert store.stages() == [A]
        monkeypatch.setattr(store, "txn", real)
        with pytest.raises(ValueError, match="stage id 'st-a' exists"):
            store.add_stage(replace(A, name="other-host"))
    finally:
        store.close()


def test_a_long_history_is_read_in_pages(etcd: EtcdMember, monkeypatch: pytest.MonkeyPatch) -> None:
    """``epochs`` reads the history a page at a time (here 3 rows a page, 10 rows, two jobs),
    so no reply grows with the history, and still returns the newest rows of the job asked
    for, oldest first."""
    monkeypatch.setattr(etcd_store, "EPOCH_PAGE", 3)
    store = _etcd_store(etcd)
    try:
        for epoch in range(1, 11):
            job = "job1" if epoch % 2 else "job2"
            store.add_epoch(EpochRow(epoch, float(epoch), "r", (0, 9), ("st-a",), job_id=job))
        assert [r.epoch for r in store.epochs(limit=4, job_id="job1")] == [3, 5, 7, 9]
        assert [r.epoch for r in store.epochs(limit=100)] == list(range(1, 11))
        assert [r.epoch for r in store.epochs(limit=2)] == [9, 10]
    finally:
        store.close()


def test_tls_to_etcd_with_client_certificates(tmp_path: Path) -> None:
    """A member that serves TLS and asks for client certificates: the store with the CA
    and a client certificate of that CA reads and writes; without TLS, or with a
    certificate of another CA, nothing is read (the error names the member); an
    unreadable CA file is named before anything is dialled."""
    certs, other = tmp_path / "certs", tmp_path / "other"
    tls.init_ca(certs)
    tls.issue(certs, "etcd", "coordinator", hosts=("127.0.0.1",))
    tls.issue(certs, "coordinator", "coordinator")
    tls.init_ca(other)
    tls.issue(other, "coordinator", "coordinator")
    served = EtcdTLS(str(certs / "ca.pem"), str(certs / "etcd.pem"), str(certs / "etcd.key"))
    cluster = start_etcd_cluster(tmp_path / "etcd", 1, tls=served)
    try:
        url = f"etcd://{cluster.endpoints}/tls"
        client = EtcdTLS(
            str(certs / "ca.pem"), str(certs / "coordinator.pem"), str(certs / "coordinator.key")
        )
        store = open_store(url, client)
        store.put("job", {"over": "tls"})
        assert open_store(url, client).get("job") == {"over": "tls"}
        store.close()
        strangers = EtcdTLS(
            str(certs / "ca.pem"), str(other / "coordinator.pem"), str(other / "coordinator.key")
        )
        for wrong in (None, strangers):
            refused = EtcdStore.from_url(url, wrong)
            with pytest.raises(ElasticPipeError, match=cluster.members[0].endpoint):
                refused.call(
                    lambda ch, timeout: rpc_pb2_grpc.KVStub(ch).Range(
                        rpc_pb2.RangeRequest(key=b"/tls/kv/job"), timeout=timeout
                    ),
                    retry_for_s=0,
                )
            refused.close()
    finally:
        cluster.stop()
    with pytest.raises(InvalidRequest, match=r"missing\.pem"):
        open_store(url, EtcdTLS(str(tmp_path / "missing.pem")))
    with pytest.raises(InvalidRequest, match="together"):
        EtcdTLS(str(certs / "ca.pem"), cert=str(certs / "coordinator.pem"))
    with pytest.raises(InvalidRequest, match="not etcd://"):
        open_store(str(tmp_path / "s.sqlite"), client)
