"""Regressions of failures that used to end a job, with real processes and real SIGKILLs.

Each case is one a reviewer reproduced: a script killed in the middle of a checkpoint
load, a graceful leave followed by a crash, a crash right after a resume, a chain with no
spare left, and a migration's sender killed. Each trains the failure-free scenario and
requires its losses and final weights.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from elasticpipe import models
from elasticpipe.client.session import Session
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.objectives import make_optimizer
from tests.support.clusters import revive, revive_exited
from tests.support.faults import FaultPlan
from tests.support.numerics import reference_step
from tests.support.scenario import (
    ADAM,
    KWARGS,
    REFERENCE,
    Trainer,
    batch,
    check,
    history,
    kill_script_at,
    pipeline,
    script,
    train_and_check,
)


@pytest.fixture(scope="module")
def cluster(failing4: LocalCluster) -> LocalCluster:
    """Three chain stages and a spare that accept injected faults."""
    return failing4


@pytest.fixture(autouse=True)
def no_cascade(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that failed before reviving the stages it killed, brings them back: one
    failure then fails one test, not every test after it for want of stages."""
    yield
    if "cluster" in request.fixturenames:
        revive_exited(request.getfixturevalue("cluster"))


def _resume_and_check(cluster: LocalCluster, kill_first: bool = False) -> list[str]:
    """Resumes the job, optionally SIGKILLs its second chain stage at once, trains to the
    end and checks the failure-free results; returns the stages killed."""
    killed = []
    with pipeline(cluster, resume=True) as pipe:
        done = pipe.step
        if kill_first:
            killed.append(cluster.name_of(pipe.partition.addresses[1]))
            cluster.kill(killed[0])
        trainer = Trainer(pipe).start()
        state = trainer.finish()
    losses = dict(trainer.losses)
    losses.update({s: REFERENCE[0][s - 1] for s in range(1, done + 1)})
    check(losses, state)
    return killed


LOAD_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from tests.support.scenario import batch, pipeline
from elasticpipe.v1 import coordinator_pb2
class C: coordinator = {address!r}
pipe = pipeline(C)
for step in range(1, 5):
    pipe.train_step(*batch(step))
part = pipe.partition
pipe._coordinator_call(
    "BeginRestore",
    coordinator_pb2.RestoreBeginRequest(job_id=part.job_id, client=pipe._client),
    timeout=30,
)
print("load_begun", flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(150)
def test_a_script_killed_mid_load_blocks_neither_recovery_nor_its_resume(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The script SIGKILLed after BeginRestore (every stage frozen for the load), then a
    chain stage SIGKILLed: once the script's lease runs out the load is abandoned and
    recovered from (not after the 10-minute load lease); the resumed script trains on
    exactly."""
    kill_script_at(script(cluster, LOAD_SCRIPT), tmp_path / "script.log", os.environ, "load_begun")
    victim = cluster.name_of(
        next(s.address for s in cluster.status().stages if s.state == "chain" and s.layer_lo > 0)
    )
    cluster.kill(victim)
    deadline = time.monotonic() + 30  # lease 3 s, dead-after 2 s
    while not any(r.kind == "recovery" for r in history(cluster)):
        assert time.monotonic() < deadline, [(r.kind, r.reason) for r in history(cluster)]
        time.sleep(0.2)
    kinds = [(r.kind, r.reason) for r in history(cluster)]
    assert kinds[1][0] == "abandoned" and "went silent" in kinds[1][1], kinds
    assert kinds[2][0] == "recovery", kinds
    _resume_and_check(cluster)
    revive(cluster, victim)


@pytest.mark.timeout(150)
def test_a_resumed_script_survives_a_crash_before_the_next_snapshot(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The script SIGKILLed after step 4 (the last snapshot is step 3), resumed, and a
    chain stage SIGKILLed before any step: the rollback goes to the attach point (the
    resumed client never had step 4's mini-batch), and the results stay exact."""
    env = {**os.environ, "ELASTICPIPE_TEST_PAUSE": "after_commit:4"}
    kill_script_at(script(cluster), tmp_path / "script.log", env, "paused_at")
    killed = _resume_and_check(cluster, kill_first=True)
    records = history(cluster)
    attach = next(r for r in records if r.kind == "attach")
    assert "step 4" in attach.reason
    recovery = next(r for r in records if r.kind == "recovery")
    assert killed[0] in recovery.reason and recovery.restored_step == 4
    revive(cluster, *killed)


@pytest.mark.timeout(180)
def test_a_graceful_leave_then_a_crash_loses_nothing(cluster: LocalCluster) -> None:
    """SIGTERM on a chain stage (it held the only copy of its predecessor's snapshot),
    then its predecessor SIGKILLed before the next snapshot: the leave's move snapshotted
    the cut and copied it before the stage exited, so the crash recovers exactly."""
    # at step 5 (the last snapshot is step 3): the leave waits until its layers moved
    plan = FaultPlan().at(step=5).terminate(stage=1, wait=True).kill(stage=0)
    with pipeline(cluster) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        left, crashed = plan.killed
        records = history(cluster)
        leave = next(i for i, r in enumerate(records) if "leaving" in r.reason)
        assert records[leave].kind == "move"
        recovery = records[-1]
        assert recovery.kind == "recovery" and crashed in recovery.reason
        assert recovery.restored_step == 4  # the leave's cut, not step 3
    revive(cluster, crashed, left)


@pytest.mark.timeout(150)
def test_with_no_spare_left_the_chain_shrinks_and_stays_exact(cluster: LocalCluster) -> None:
    """Every live stage in the chain (no spare), one SIGKILLed mid-run: the job goes on
    over the survivors, re-partitioned, with exact results."""
    plan = FaultPlan().at(step=5).kill(stage=2)
    with pipeline(cluster, stages=4) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        assert pipe.partition.num_stages == 3
        recovery = history(cluster)[-1]
        assert recovery.kind == "recovery" and "shrank to 3 stages" in recovery.reason
        assert plan.killed[0] not in recovery.stages
    revive(cluster, *plan.killed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", ["prepare", "epoch_commit"])
def test_a_migration_sender_killed_mid_move_loses_nothing(
    cluster: LocalCluster, point: str
) -> None:
    """The stage *giving* layers away SIGKILLed while it prepares (before the commit
    point) or while it installs the new epoch (after it): the move is abandoned or
    finished, the sender is recovered from snapshots, and the results stay exact."""
    # the middle stage takes a layer from the last (or the first): the sender pauses
    plan = FaultPlan().at(step=5).pause("sender", point).move_a_layer_to(1).then_kill()
    with pipeline(cluster) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        records = history(cluster)
        assert records[-1].kind == "recovery" and plan.killed[0] in records[-1].reason
        if point == "prepare":
            assert any(r.kind == "abandoned" for r in records)
    revive(cluster, *plan.killed)


@pytest.mark.timeout(90)
def test_the_auto_rebalance_switch_survives_a_coordinator_restart(tmp_path: Path) -> None:
    """`admin auto off`, then the coordinator restarted with --auto-rebalance: the stored
    switch wins, and the coordinator logs that it overrode the flag."""
    state = str(tmp_path / "state.db")
    with LocalCluster(
        stages=1, coordinator_args=["--state", state, "--heartbeat-interval", "0.2"]
    ) as c:
        assert c.status().auto_rebalance
        with c.admin() as admin:
            admin.auto(False)
        c.kill("coordinator")
        c.restart_coordinator(["--auto-rebalance", "--heartbeat-interval", "0.2"])
        assert not c.status().auto_rebalance
        c.wait_for_log("coordinator", "auto_rebalance_from_state", timeout=10)


INIT_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from elasticpipe import models
from elasticpipe.errors import InvalidRequest
from elasticpipe.client.session import Session
from tests.support.scenario import KWARGS, batch, pipeline
class C: coordinator = {address!r}
def never_streams(self):
    print("set_up", flush=True)
    time.sleep(600)
Session._apply_init = never_streams
pipe = pipeline(C, init_state=models.build("mlp", seed=7, **KWARGS).state_dict())
pipe.train_step(*batch(1))
"""


@pytest.mark.timeout(120)
def test_a_script_killed_before_its_init_state_streamed_resumes_from_init_state(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The script SIGKILLed once its job was set up, before init_state streamed: the
    stages hold no step of it yet, so a script resumed without init_state is refused,
    naming it, and one resumed with it streams it, and trains as single-process training
    from those weights does. Neither attach snapshots the empty layers the load replaces
    (no attach epoch before the load)."""
    kill_script_at(script(cluster, INIT_SCRIPT), tmp_path / "script.log", os.environ, "set_up")
    with pipeline(cluster, resume=True) as pipe:
        for _ in range(2):  # and again: the refusal holds, the lease was given back
            with pytest.raises(InvalidRequest, match="init_state"):
                pipe.train_step(*batch(1))
    model = models.build("mlp", seed=7, **KWARGS)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = make_optimizer("adam", model.parameters(), ADAM)
    with pipeline(cluster, resume=True, init_state=init) as pipe:
        losses = [pipe.train_step(*batch(step)) for step in (1, 2, 3)]
        state = pipe.state_dict()
    kinds = [r.kind for r in history(cluster)]
    assert "restore" in kinds and "attach" not in kinds[: kinds.index("restore")], kinds
    want = [reference_step(model, optimizer, "cross_entropy", *batch(step)) for step in (1, 2, 3)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.timeout(120)
def test_a_stage_lost_before_init_state_streamed_is_built_anew(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job set up for its init_state keeps no snapshot of its empty layers (the set-up
    neither takes nor waits for one). A chain stage SIGKILLed between the set-up and the
    load: the recovery builds its layers anew on the spare instead of failing the job for
    want of a copy, and the load then trains as single-process training from those
    weights does."""
    model = models.build("mlp", seed=7, **KWARGS)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    load = Session._apply_init
    killed: list[str] = []

    def kill_then_load(session: Session) -> None:
        partition = session._partition
        assert partition is not None
        killed.append(cluster.name_of(partition.addresses[1]))
        cluster.kill(killed[0])
        deadline = time.monotonic() + 60
        while not any(r.kind == "recovery" for r in history(cluster)):
            failure = cluster.status().job_failure
            assert not failure, f"the job failed instead: {failure}"
            assert time.monotonic() < deadline, "no recovery within 60 s"
            time.sleep(0.1)
        load(session)

    monkeypatch.setattr(Session, "_apply_init", kill_then_load)
    with pipeline(cluster, init_state=init) as pipe:
        losses = [pipe.train_step(*batch(step)) for step in (1, 2, 3)]
        state = pipe.state_dict()
    recoveries = [r for r in history(cluster) if r.kind == "recovery"]
    assert [r.restored_step for r in recoveries] == [0]
    assert "built anew" in recoveries[0].reason, recoveries[0].reason
    revive(cluster, *killed)
    optimizer = make_optimizer("adam", model.parameters(), ADAM)
    want = [reference_step(model, optimizer, "cross_entropy", *batch(step)) for step in (1, 2, 3)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want))
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")
