"""Tests of the coordinator's durable store: what survives a reopen, and upsert by name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.coordinator.store import EpochRow, PartitionRow, StageRow, Store

A = StageRow("st-a", "host-a", "10.0.0.1:7000", "cuda", 100.0)
B = StageRow("st-b", "host-b", "10.0.0.2:7000", "cpu", 200.0, drained=True)
PARTITION = PartitionRow(
    epoch=3,
    job_id="job1",
    boundaries=(0, 4, 9),
    stage_ids=("st-a", "st-b"),
    addresses=("10.0.0.1:7000", "10.0.0.2:7000"),
    predicted_step_s=0.25,
)
EPOCHS = [
    EpochRow(1, 10.0, "initial", (0, 5, 9), ("st-a", "st-b")),
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
    ),
]


@pytest.fixture
def path(tmp_path: Path) -> str:
    return str(tmp_path / "coordinator.db")


@pytest.fixture
def store(path: str) -> Iterator[Store]:
    s = Store(path)
    yield s
    s.close()


def _reopen(store: Store) -> Store:
    store.close()
    return Store(store.path)


def test_everything_survives_a_reopen(path: str) -> None:
    """Stages, key-values, the partition, epoch history and max_epoch survive a restart."""
    first = Store(path)
    first.upsert_stage(A)
    first.upsert_stage(B)
    first.put("job", {"model": "mlp", "kwargs": {"sizes": [1, 2]}})
    first.put_partition(PARTITION)
    for row in EPOCHS:
        first.add_epoch(row)
    first.close()

    second = Store(path)
    try:
        assert second.stages() == [A, B]
        assert second.get("job") == {"model": "mlp", "kwargs": {"sizes": [1, 2]}}
        assert second.partition() == PARTITION
        assert second.epochs() == EPOCHS
        assert second.max_epoch() == 3
    finally:
        second.close()


def test_upsert_by_name_keeps_the_id(store: Store) -> None:
    """Re-registering a name under a new id updates address and device but keeps the old id."""
    store.upsert_stage(A)
    store.upsert_stage(StageRow("st-new", "host-a", "10.0.0.9:7001", "cpu", 999.0))
    store = _reopen(store)
    assert store.stages() == [StageRow("st-a", "host-a", "10.0.0.9:7001", "cpu", 100.0)]


def test_drained_flag_survives_a_reopen(store: Store) -> None:
    """set_drained is durable, both ways."""
    store.upsert_stage(A)
    store.upsert_stage(B)
    store.set_drained("st-a", True)
    store.set_drained("st-b", False)
    store = _reopen(store)
    assert [(s.stage_id, s.drained) for s in store.stages()] == [("st-a", True), ("st-b", False)]


def test_stages_are_listed_in_registration_order(store: Store) -> None:
    """stages() orders by registration time, whatever the insertion order."""
    store.upsert_stage(B)
    store.upsert_stage(A)
    assert [s.stage_id for s in store.stages()] == ["st-a", "st-b"]


def test_put_overwrites_and_get_of_missing_is_none(store: Store) -> None:
    """put replaces the value of a key; an unknown key reads as None."""
    store.put("k", [1, 2])
    store.put("k", {"x": None})
    assert store.get("k") == {"x": None}
    assert store.get("missing") is None


def test_empty_store_has_no_partition_and_epoch_zero(store: Store) -> None:
    """A fresh store has no stages, no partition, no history and max_epoch 0."""
    assert (store.stages(), store.partition(), store.epochs(), store.max_epoch()) == (
        [],
        None,
        [],
        0,
    )


def test_max_epoch_covers_history_and_partition(store: Store) -> None:
    """max_epoch is the highest of the history and the current partition's epoch."""
    store.add_epoch(EpochRow(7, 1.0, "x", (0, 1)))
    store.put_partition(PARTITION)  # epoch 3
    assert store.max_epoch() == 7
    store.put_partition(PartitionRow(9, "j", (0, 1), ("s",), ("a",)))
    assert store.max_epoch() == 9


def test_epochs_limit_returns_the_most_recent_oldest_first(store: Store) -> None:
    """epochs(limit) keeps the newest records, listed oldest first."""
    for epoch in range(1, 6):
        store.add_epoch(EpochRow(epoch, float(epoch), f"e{epoch}", (0, 1)))
    assert [r.epoch for r in store.epochs(limit=3)] == [3, 4, 5]


def test_memory_store_works_without_a_file() -> None:
    """The default ':memory:' store keeps values for its lifetime."""
    store = Store()
    try:
        store.upsert_stage(A)
        assert store.stages() == [A]
    finally:
        store.close()
