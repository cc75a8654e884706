"""``epochs.history_row``: every row of the epoch history names its partition the same way."""

from __future__ import annotations

import time

from elasticpipe.coordinator import epochs
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import SqliteStore
from elasticpipe.partition import Partition, StageRef


def _cluster_and_partition() -> tuple[Cluster, Partition, list[str]]:
    cluster = Cluster(SqliteStore(":memory:"), CoordinatorConfig())
    ids = [cluster.members.register(n, f"127.0.0.1:{p}", "cpu")[0] for n, p in (("a", 1), ("b", 2))]
    partition = Partition(
        epoch=7,
        job_id="j1",
        boundaries=(0, 3, 4),
        stages=(StageRef(ids[0], "127.0.0.1:1"), StageRef(ids[1], "127.0.0.1:2")),
    )
    return cluster, partition, ids


def test_a_row_carries_the_partitions_epoch_cut_chain_and_names() -> None:
    """Without a move, the row is the partition's epoch, boundaries, stage ids, job and
    names looked up now, stamped with the time, and zero moved."""
    cluster, partition, ids = _cluster_and_partition()
    before = time.time()
    try:
        row = epochs.history_row(cluster, partition, "start", "job j1 started")
    finally:
        cluster.pool.close()
    assert (row.epoch, row.kind, row.reason) == (7, "start", "job j1 started")
    assert row.boundaries == (0, 3, 4)
    assert row.stage_ids == tuple(ids)
    assert row.stage_names == ("a", "b")
    assert row.job_id == "j1"
    assert before <= row.at <= time.time()
    assert (row.layers_moved, row.bytes_moved, row.pause_s, row.extra) == (0, 0, 0.0, {})
    assert (row.restored_step, row.lost_steps, row.detected_at) == (0, 0, 0.0)


def test_a_move_gives_its_layers_bytes_and_pause_and_names_given_are_kept() -> None:
    """``moved`` fills layers_moved, bytes_moved and pause_s; ``names`` looked up before
    the change are used as given; the other fields pass through."""
    cluster, partition, _ = _cluster_and_partition()
    moved = epochs.MoveResult(layers_moved=2, bytes_moved=4096, pause_s=0.25, committed_step=9)
    try:
        row = epochs.history_row(
            cluster,
            partition,
            "recovery",
            "stage b died",
            names=("x", "y"),
            moved=moved,
            restored_step=9,
            lost_steps=1,
            detected_at=12.5,
            extra={"recover_s": 1.5},
        )
    finally:
        cluster.pool.close()
    assert (row.layers_moved, row.bytes_moved, row.pause_s) == (2, 4096, 0.25)
    assert row.stage_names == ("x", "y")
    assert (row.restored_step, row.lost_steps, row.detected_at) == (9, 1, 12.5)
    assert row.extra == {"recover_s": 1.5}
