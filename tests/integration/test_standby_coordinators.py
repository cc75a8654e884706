"""Standby coordinators on a real etcd: the leader killed with SIGKILL at any moment is
replaced by a standby within 5 s, the epoch change it left in flight is finished or
undone, a stage that dies meanwhile is recovered, and training equals the failure-free
run; a deposed leader commands no stage."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from elasticpipe import Pipeline
from elasticpipe.client.admin import Admin
from elasticpipe.local.cluster import LocalCluster
from tests.support.etcd import EtcdCluster, lead_elsewhere, start_etcd_cluster
from tests.support.replica_jobs import JOB, batch, reference
from tests.support.scenario import FAST, STEPS, Trainer, check, move_on_a_thread, pipeline

pytestmark = pytest.mark.timeout(240)

FAILOVER_S = 5.0  # the goal: a standby leads within this long of the leader's kill
LEASE = ["--freeze-lease", "8"]


@contextlib.contextmanager
def ha_cluster(
    tmp_path: Path,
    point: str = "",
    stages: int = 3,
    etcd: EtcdCluster | None = None,
    **options: Any,
) -> Iterator[LocalCluster]:
    """``stages`` stages and two coordinators on ``etcd`` (default: one member of its
    own); the coordinators block at ``point`` of an epoch change (none: ""); ``options``
    go to ``LocalCluster``."""
    own = etcd is None
    etcd = etcd or start_etcd_cluster(tmp_path / "etcd", 1)
    url = f"etcd://{etcd.endpoints}/ha-{uuid.uuid4().hex[:8]}"
    args = [*FAST, *LEASE, *(["--pause-at", point] if point else [])]
    try:
        with LocalCluster(
            stages=stages, coordinators=2, coordinator_args=args, state=url, **options
        ) as cluster:
            yield cluster
    finally:
        if own:
            etcd.stop()


def kill_leader(cluster: LocalCluster) -> tuple[str, int, float]:
    """Kills the leading coordinator; returns its name, its term and when it died."""
    status = cluster.status()
    name = cluster.leader()
    cluster.kill(name)
    return name, status.term, time.monotonic()


def wait_for_new_leader(cluster: LocalCluster, old: str, old_term: int) -> tuple[str, float]:
    """Waits until another coordinator leads with a higher term; its name and when."""
    deadline = time.monotonic() + 30
    while True:
        with contextlib.suppress(Exception):
            status = cluster.status(timeout=1.0)
            if status.term > old_term and status.leader != cluster.coordinator_addresses[old]:
                return cluster.leader(), time.monotonic()
        assert time.monotonic() < deadline, "no standby took over within 30 s"
        time.sleep(0.05)


def test_a_standby_leads_within_5_s_of_the_leaders_kill_and_training_is_exact(
    tmp_path: Path,
) -> None:
    """The leader killed between steps: a standby leads within 5 s, with a higher term,
    reporting the job, the stages and the partition; training, which never needed a
    coordinator, ends equal to the failure-free run, and a move works afterwards."""
    with ha_cluster(tmp_path) as cluster, pipeline(cluster) as pipe:
        took: dict[str, float] = {}

        def before(step: int) -> None:
            if step == 4:
                old, term, killed = kill_leader(cluster)
                new, leading = wait_for_new_leader(cluster, old, term)
                took["failover_s"] = leading - killed
                took["new"] = float(cluster.coordinator_names.index(new))

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        assert took["failover_s"] < FAILOVER_S, took
        status = cluster.status()
        assert status.job_id == pipe.partition.job_id
        assert sorted(s.state for s in status.stages) == ["chain"] * 3
        part = pipe.partition
        with cluster.admin(timeout=120) as admin:
            moved = admin.set_partition([0, part.boundaries[1] + 1, *part.boundaries[2:]])
        assert moved.changed, moved


@pytest.mark.parametrize(
    ("point", "kind"),
    [
        ("after_freeze", "abandoned"),
        ("before_commit_point", "abandoned"),
        ("after_commit_point", "move"),
    ],
    ids=["frozen", "rolled-back", "rolled-forward"],
)
def test_a_leader_killed_mid_migration_is_replaced_and_the_move_settled(
    tmp_path: Path, point: str, kind: str
) -> None:
    """The leader killed once every stage froze for a move, or prepared it (before or
    after its commit point): the standby leads within 5 s, undoes or finishes the move
    from the store, and training, frozen meanwhile, ends exact."""
    with ha_cluster(tmp_path, point) as cluster, pipeline(cluster) as pipe:
        took: dict[str, float] = {}
        target: list[int] = []

        def before(step: int) -> None:
            if step != 4:
                return
            part = pipe.partition
            target.extend([0, part.boundaries[1] + 1, *part.boundaries[2:]])
            leader = cluster.leader()
            move_on_a_thread(cluster, target)
            cluster.wait_for_log(leader, "paused_at", timeout=60)
            old, term, killed = kill_leader(cluster)
            assert old == leader
            _, leading = wait_for_new_leader(cluster, old, term)
            took["failover_s"] = leading - killed

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        assert took["failover_s"] < FAILOVER_S, took
        records = list(cluster.status().history)
        assert records[-1].kind == kind, records
        assert (list(pipe.partition.boundaries) == target) == (kind == "move")


def test_a_stage_killed_while_no_coordinator_leads_is_recovered_by_the_new_leader(
    tmp_path: Path,
) -> None:
    """The leader killed, then a stage killed before the standby leads: the new leader
    replaces the stage from a spare well before the client's recovery timeout, and
    training ends exact."""
    with ha_cluster(tmp_path, stages=4) as cluster, pipeline(cluster, stages=3) as pipe:
        took: dict[str, float] = {}

        def before(step: int) -> None:
            if step != 4:
                return
            chain = cluster.status().chain
            old, term, killed = kill_leader(cluster)
            cluster.kill(cluster.name_of(chain[1].address))
            wait_for_new_leader(cluster, old, term)
            took["killed"] = killed

        started = time.monotonic()
        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        assert time.monotonic() - started < 60, "recovery waited out a long timeout"
        history = list(cluster.status().history)
        assert any(r.kind == "recovery" for r in history), history
        assert pipe.step == STEPS


def test_a_frozen_leader_is_replaced_and_after_it_thaws_commands_nothing(
    tmp_path: Path,
) -> None:
    """The leader stopped (SIGSTOP) for longer than its lease, as a long GC pause or a
    frozen VM would: the standby leads and moves layers under its higher term; thawed
    (SIGCONT), the old leader finds its lease gone, steps down and stands by, and no
    stage is left obeying it; training ends exact."""
    with ha_cluster(tmp_path) as cluster, pipeline(cluster) as pipe:
        seen: dict[str, object] = {}

        def before(step: int) -> None:
            if step != 4:
                return
            old = cluster.leader()
            term = cluster.status().term
            os.killpg(cluster.procs[old].pid, signal.SIGSTOP)
            try:
                new, _ = wait_for_new_leader(cluster, old, term)
                part = pipe.partition
                with cluster.admin(timeout=120) as admin:
                    moved = admin.set_partition([0, part.boundaries[1] + 1, *part.boundaries[2:]])
                assert moved.changed, moved
            finally:
                os.killpg(cluster.procs[old].pid, signal.SIGCONT)
            cluster.wait_for_log(old, "coordinator_stepped_down", timeout=30)
            seen.update(old=old, new=new, term=cluster.status().term)

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        status = cluster.status()
        assert status.leader == cluster.coordinator_addresses[str(seen["new"])]
        assert status.term == seen["term"]
        assert status.history[-1].kind == "move", status.history
        # Asked alone, the thawed one stands by and sends the caller to the leader.
        with Admin(cluster.coordinator_addresses[str(seen["old"])], timeout=10) as admin:
            assert admin.status().leader == status.leader


def test_gloo_replicas_go_on_after_the_leader_serving_their_rendezvous_is_killed(
    tmp_path: Path,
) -> None:
    """Replicas of (2, 2) reducing over gloo process groups, whose rendezvous store the
    leader serves: the leader SIGKILLed between steps, the groups already open reduce
    without it; its port taken meanwhile, the new leader serves a rendezvous of its own on
    another, which the stages learn from their heartbeats, and the next epoch's groups
    open there (a new split of the shares); every loss and weight equals LocalPipeline's
    bit for bit."""
    want_losses, want_state = reference(steps=7)
    served = re.compile(r"rendezvous_serving\s.*port=(\d+)")
    with (
        contextlib.ExitStack() as stack,
        ha_cluster(tmp_path, stages=4, allow_models=("tests.support",)) as cluster,
        Pipeline(cluster.coordinator, **JOB, stages=(2, 2), collectives="gloo") as pipe,  # type: ignore[arg-type]
    ):
        losses = [pipe.train_step(*batch(step)) for step in range(3)]
        old, term, _ = kill_leader(cluster)
        found = served.search((cluster.log_dir / f"{old}.log").read_text(errors="replace"))
        assert found, "the leader logged no rendezvous"
        taken = socket.create_server(("127.0.0.1", int(found[1])))  # the old port: not free
        stack.callback(taken.close)
        losses += [pipe.train_step(*batch(step)) for step in range(3, 5)]  # no leader needed
        new, _ = wait_for_new_leader(cluster, old, term)
        cluster.wait_for_log(new, "rendezvous_serving", timeout=10)
        again = served.search((cluster.log_dir / f"{new}.log").read_text(errors="replace"))
        assert again and again[1] != found[1], (found[1], again)
        with cluster.admin(timeout=120) as admin:
            cuts = [list(p.boundaries) for p in pipe.layout.replicas]
            assert admin.set_layout(cuts, shares=[5, 3]).changed
        losses += [pipe.train_step(*batch(step)) for step in range(5, 7)]
        assert pipe.layout.shares == (5, 3)
        state = pipe.state_dict()
        epoch = pipe.layout.epoch
        opened = [  # the stages that opened the new epoch's groups (on the new rendezvous)
            name
            for name in (f"stage-{i}" for i in range(4))
            if re.search(
                rf"process_group_opened\s+epoch={epoch}\b",
                (cluster.log_dir / f"{name}.log").read_text(errors="replace"),
            )
        ]
    assert len(opened) == 4, opened
    assert losses == want_losses
    for name, value in want_state.items():
        assert torch.equal(state[name], value), name


def test_one_of_three_etcd_members_killed_changes_nothing(tmp_path: Path) -> None:
    """A three-member etcd, the member every coordinator dials first killed mid-training
    (a follower: etcd's leadership is moved off it first, so that etcd holds no election,
    whose pause can outlast a coordinator's lease on a loaded host): the same coordinator
    leads in the same term, training ends exact, and an epoch change commits on the two
    members left."""
    etcd = start_etcd_cluster(tmp_path / "etcd", 3)
    try:
        with ha_cluster(tmp_path, etcd=etcd) as cluster, pipeline(cluster) as pipe:
            before_kill = cluster.status()

            def before(step: int) -> None:
                if step == 4:
                    lead_elsewhere(etcd, 0)
                    etcd.members[0].stop()

            trainer = Trainer(pipe, before).start()
            check(trainer.losses, trainer.finish())
            part = pipe.partition
            with cluster.admin(timeout=120) as admin:
                moved = admin.set_partition([0, part.boundaries[1] + 1, *part.boundaries[2:]])
            assert moved.changed, moved
            after = cluster.status()
            assert (after.leader, after.term) == (before_kill.leader, before_kill.term)
            assert after.history[-1].kind == "move", after.history
    finally:
        etcd.stop()
