"""The coordinator killed at any moment: training goes on, and a restart finishes or
undoes the epoch change it left in flight; a freeze it cannot end ends by its lease."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.local.cluster import LocalCluster
from tests.support.etcd import start_etcd
from tests.support.scenario import (
    FAST,
    STEPS,
    Trainer,
    batch,
    check,
    move_on_a_thread,
    pipeline,
)

pytestmark = pytest.mark.timeout(240)

LEASE = ["--freeze-lease", "4"]


@contextlib.contextmanager
def cluster_pausing_at(point: str, store: str = "") -> Iterator[LocalCluster]:
    """Three stages and a coordinator that blocks at ``point`` of its next epoch change
    (its state in ``store``: default, a SQLite file of the cluster's)."""
    args = [*FAST, *LEASE, *(["--pause-at", point] if point else [])]
    with LocalCluster(stages=3, coordinator_args=args, state=store or None) as cluster:
        yield cluster


@contextlib.contextmanager
def store_of(kind: str, tmp_path: Path) -> Iterator[str]:
    """The coordinator's store: "" (the cluster's SQLite file) or a real etcd member's URL."""
    if kind == "sqlite":
        yield ""
        return
    member = start_etcd(tmp_path / "etcd")
    try:
        yield f"etcd://{member.endpoint}/job-{uuid.uuid4().hex[:8]}"
    finally:
        member.stop()


def test_training_goes_on_while_the_coordinator_is_down() -> None:
    """Killed between steps, the coordinator is not missed: steps go on; restarted from its
    state file, it knows the job, the stages and the partition, and rebalancing works."""
    with cluster_pausing_at("") as cluster, pipeline(cluster) as pipe:

        def before(step: int) -> None:
            if step == 3:
                cluster.kill("coordinator")
            if step == 8:
                cluster.restart_coordinator()

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        deadline = time.monotonic() + 30
        while (status := cluster.status()).committed_step != STEPS:  # heard from every stage
            assert time.monotonic() < deadline, status
            time.sleep(0.1)
        assert status.job_id == pipe.partition.job_id
        assert sorted(s.state for s in status.stages) == ["chain"] * 3, [
            (s.name, s.state, s.alive, s.index) for s in status.stages
        ]


@pytest.mark.parametrize(
    ("point", "kind", "store"),
    [
        ("before_commit_point", "abandoned", "sqlite"),
        ("after_commit_point", "move", "sqlite"),
        # On etcd the restarted coordinator first waits for its old leadership's lease;
        # both outcomes with a standby instead: test_standby_coordinators.
        ("after_commit_point", "move", "etcd"),
    ],
    ids=["rolled-back", "rolled-forward", "rolled-forward-etcd"],
)
def test_a_coordinator_killed_mid_migration_finishes_or_undoes_it(
    point: str, kind: str, store: str, tmp_path: Path
) -> None:
    """Killed after every stage prepared a move but before the commit point, the restarted
    coordinator undoes the move; killed after the commit point, it finishes it. Either way
    training, which waits meanwhile, ends exact; on SQLite and on a real etcd alike."""
    with (
        store_of(store, tmp_path) as url,
        cluster_pausing_at(point, url) as cluster,
        pipeline(cluster) as pipe,
    ):
        moved: dict[str, object] = {}

        def before(step: int) -> None:
            if step != 4:
                return
            part = pipe.partition
            target = [0, part.boundaries[1] + 1, *part.boundaries[2:]]
            moved["before"], moved["target"] = part.epoch, target
            move_on_a_thread(cluster, target)
            cluster.wait_for_log("coordinator", "paused_at", timeout=60)
            cluster.kill("coordinator")
            threading.Timer(
                2.0, cluster.restart_coordinator, kwargs={"args": [*FAST, *LEASE]}
            ).start()

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        records = list(cluster.status().history)
        assert records[-1].kind == kind, records
        assert (list(pipe.partition.boundaries) == moved["target"]) == (kind == "move")


def test_a_freeze_whose_coordinator_never_returns_ends_by_its_lease() -> None:
    """The coordinator dies right after freezing every stage for a move: the stages release
    themselves when the freeze lease runs out, and training goes on without a coordinator."""
    with cluster_pausing_at("after_freeze") as cluster, pipeline(cluster) as pipe:

        def before(step: int) -> None:
            if step == 4:
                part = pipe.partition
                move_on_a_thread(cluster, [0, part.boundaries[1] + 1, *part.boundaries[2:]])
                cluster.wait_for_log("coordinator", "paused_at", timeout=60)
                cluster.kill("coordinator")

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        assert pipe.step == STEPS
        cluster.restart_coordinator([*FAST, *LEASE])
        assert cluster.status().history[-1].kind == "abandoned"
        assert pipe.train_step(*batch(STEPS + 1)) > 0  # and the restarted one serves it


@pytest.mark.parametrize(
    ("point", "abandoned"),
    [("before_commit_point", 1), ("after_commit_point", 0)],
    ids=["rolled-back", "rolled-forward"],
)
def test_a_coordinator_killed_mid_load_settles_it_and_the_load_completes(
    point: str, abandoned: int, tmp_path: Path
) -> None:
    """The coordinator killed while every stage holds a checkpoint load prepared, before or
    after its commit point: the restarted coordinator undoes or finishes the load, and
    ``load`` -- which the restart told it forgot the load -- reads how it was settled:
    it streams the checkpoint again if it was undone, and returns if it was finished.
    Training then ends exact (the checkpoint is of the same run's step 3)."""
    ckpt = tmp_path / "ckpt"
    with cluster_pausing_at(point) as cluster, pipeline(cluster) as pipe:

        def kill_and_restart() -> None:
            cluster.wait_for_log("coordinator", "paused_at", timeout=60)
            cluster.kill("coordinator")
            time.sleep(1.0)
            cluster.restart_coordinator([*FAST, *LEASE])

        def before(step: int) -> None:
            if step == 4:
                pipe.save(ckpt)
                killer = threading.Thread(target=kill_and_restart, daemon=True)
                killer.start()
                pipe.load(ckpt)
                killer.join(60)

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        kinds = [r.kind for r in cluster.status().history]
        assert kinds.count("restore") == 1, kinds  # the load took effect once
        assert kinds.count("abandoned") == abandoned, kinds
