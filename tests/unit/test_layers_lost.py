"""LayersLost names every host the layers were lost with, former copy holders included,
and how to continue from the last checkpoint."""

from __future__ import annotations

from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.recovery import Recovery
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import SqliteStore
from elasticpipe.partition import Partition, StageRef
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import stage_pb2


def _holding(step: int, layers: list[int], peer_copy: bool) -> stage_pb2.SnapshotHolding:
    return stage_pb2.SnapshotHolding(job_id="j1", step=step, layers=layers, peer_copy=peer_copy)


def test_layers_lost_names_the_dead_owner_and_a_former_holder_of_the_copy() -> None:
    """Chain a (layers 0-1), b (2-3); c, which left the chain, held the only copy of a's
    snapshot and is gone too. a dies: layers 0 and 1 have no live copy, and the error
    names a (the owner) and c (the copy's holder), not b."""
    cluster = Cluster(SqliteStore(":memory:"), CoordinatorConfig(dead_after_s=60.0))
    members = cluster.members
    ids = {}
    # Unreachable addresses: the live-holdings probe fails at once and falls back to
    # the heartbeats' reports.
    for name, port in (("a", 1), ("b", 2), ("c", 3)):
        ids[name], _ = members.register(name, f"127.0.0.1:{port}", "cpu")
    held = {
        "a": [_holding(3, [0, 1], False)],
        "b": [_holding(3, [2, 3], False)],
        "c": [_holding(3, [0, 1], True)],
    }
    for name, snapshots in held.items():
        members.heartbeat(ids[name], 1, {}, 3, 1.0, None, snapshots)
    members.declare_dead(ids["c"], "left and exited")
    members.declare_dead(ids["a"], "killed")
    cluster.job = JobConfig(model="mlp", job_id="j1", snapshot_every=3)
    cluster.num_layers = 4
    cluster.partition = Partition(
        epoch=1,
        job_id="j1",
        boundaries=(0, 2, 4),
        stages=(StageRef(ids["a"], "127.0.0.1:1"), StageRef(ids["b"], "127.0.0.1:2")),
    )
    dead = [m for m in members.members() if m.row.stage_id == ids["a"]]
    try:
        assert Recovery(cluster).recover(dead) is None
    finally:
        cluster.pool.close()
    assert "layers [0, 1] have no live copy" in cluster.failure
    assert "['a', 'c']" in cluster.failure, cluster.failure
    assert "to continue from your last pipe.save(DIR)" in cluster.failure


def test_a_lost_job_says_how_to_continue_from_the_last_save() -> None:
    """Every chain stage dead and no spare: the failure (what LayersLost carries to the
    client) says to start a new Pipeline without resume=True and load the last save, and
    the API it names exists."""
    import inspect

    from elasticpipe.client.pipeline import Pipeline

    cluster = Cluster(SqliteStore(":memory:"), CoordinatorConfig(dead_after_s=60.0))
    stage_id, _ = cluster.members.register("a", "127.0.0.1:1", "cpu")
    cluster.members.declare_dead(stage_id, "killed")
    cluster.job = JobConfig(model="mlp", job_id="j1", snapshot_every=3)
    cluster.num_layers = 2
    cluster.partition = Partition(
        epoch=1, job_id="j1", boundaries=(0, 2), stages=(StageRef(stage_id, "127.0.0.1:1"),)
    )
    try:
        assert Recovery(cluster).recover(list(cluster.members.members())) is None
    finally:
        cluster.pool.close()
    assert "every stage of the chain died (['a'])" in cluster.failure
    assert "pipe.save(DIR)" in cluster.failure and "pipe.load(DIR)" in cluster.failure
    assert "without resume=True" in cluster.failure
    assert "resume" in inspect.signature(Pipeline).parameters
    assert callable(Pipeline.load) and callable(Pipeline.save)
