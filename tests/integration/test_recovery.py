"""Failure injection with real processes and real SIGKILLs at named protocol points.

Each case trains the same script as the failure-free reference (ordinary single-process
training, which the pipeline equals by transparency) and kills a process exactly where
the case names -- a stage paused at a protocol point, the coordinator paused mid-change,
the training script paused between RunStep and CommitStep -- then requires the same
losses and the same final weights, with no exception reaching the training loop.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from elasticpipe.client import checkpoints
from elasticpipe.client.checkpoints import V1_FORMAT as CHECKPOINT_FORMAT
from elasticpipe.errors import InvalidRequest, JobInUse
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.models import weights
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec
from tests.support.clusters import revive
from tests.support.faults import FaultPlan
from tests.support.scenario import (
    REFERENCE,
    STEPS,
    Trainer,
    arm,
    batch,
    check,
    history,
    kill_script_at,
    pipeline,
    script,
    stage,
    train_and_check,
)


@pytest.fixture(scope="module")
def cluster(failing4: LocalCluster) -> LocalCluster:
    """Three chain stages and a spare that accept injected faults; a state file."""
    return failing4


# ---- a stage killed at each point of the step protocol -----------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", ["run_started", "awaiting_commit", "commit", "snapshot"])
def test_a_stage_killed_at_any_step_point_costs_time_not_results(
    cluster: LocalCluster, point: str
) -> None:
    """A chain stage SIGKILLed while running a step, between RunStep and CommitStep, inside
    its commit, or while copying a snapshot: the spare (or the survivors) take over from
    the last snapshot, the client replays, and training ends with the failure-free run's
    losses and weights, without an exception."""
    _kill_a_stage_at(cluster, point)


@pytest.mark.timeout(180)
def test_zero_bubble_training_survives_a_stage_killed_mid_step(cluster: LocalCluster) -> None:
    """ZB-H1 (weight gradients left for later in the run): a stage SIGKILLed while running
    a step costs time, not results."""
    _kill_a_stage_at(cluster, "run_started", schedule="zb-h1")


def _kill_a_stage_at(cluster: LocalCluster, point: str, **options: object) -> None:
    plan = FaultPlan().at(step=5).pause(stage=1, point=point).then_kill()
    with pipeline(cluster, **options) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        records = history(cluster)
        assert records[-1].kind == "recovery" and plan.killed[0] in records[-1].reason
        stages = {s.name: s for s in cluster.status().stages if s.state == "dead"}
        assert plan.killed[0] in stages
    revive(cluster, *plan.killed)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", ["prepare", "epoch_commit"])
def test_a_stage_killed_during_a_migration_loses_nothing(cluster: LocalCluster, point: str) -> None:
    """A stage receiving layers SIGKILLed while it prepares (before the commit point) or
    while it installs (after it): the move is abandoned or finished, the dead stage is
    recovered from snapshots, and the results stay exact."""
    # The move is abandoned before its commit point, as expected for "prepare".
    plan = FaultPlan().at(step=5).pause("receiver", point).move_a_layer_to(1).then_kill()
    with pipeline(cluster) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        assert history(cluster)[-1].kind == "recovery"
    revive(cluster, *plan.killed)


def test_a_lost_commit_is_settled_by_the_next_run(cluster: LocalCluster) -> None:
    """Every CommitStep of one run lost on one stage: that stage learns the decision from
    the next RunStep, and results stay exact (no recovery needed)."""
    plan = FaultPlan().at(step=4).drop_commit(stage=2)
    with pipeline(cluster) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        assert [r.kind for r in history(cluster)] == ["start"]  # no recovery, no move


def test_a_restarted_stage_is_a_new_incarnation_and_replaces_its_old_self(
    cluster: LocalCluster,
) -> None:
    """Killing a stage and starting it again under its name (new port, new incarnation):
    the old incarnation is declared dead, the new one is alive (it replaces the old one in
    the chain if it registered before the recovery, else it waits as a spare), and the
    coordinator never confuses the two."""
    plan = FaultPlan().at(step=4).kill(stage=3).revive()
    with pipeline(cluster, stages=4) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        name = plan.killed[0]
        same_name = sorted(
            (s for s in cluster.status().stages if s.name == name), key=lambda s: s.incarnation
        )
        old, new = same_name[-2:]
        assert (old.incarnation + 1, old.state) == (new.incarnation, "dead")
        assert new.state in ("chain", "spare") and new.alive and new.stage_id != old.stage_id


@pytest.mark.timeout(180)
def test_sigterm_moves_a_stage_off_before_it_exits(cluster: LocalCluster) -> None:
    """SIGTERM on a chain stage: its layers move to the others at the next cut and then it
    exits 0; nothing is rolled back and results stay exact."""
    plan = FaultPlan().at(step=4).terminate(stage=1)
    with pipeline(cluster) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
        name = plan.killed[0]
        try:  # the stage waits up to its --drain-timeout (60 s) for the move, then exits
            code: int | None = cluster.procs[name].wait(70)
        except subprocess.TimeoutExpired:
            code = None
        assert code == 0, cluster.logs()
        leaving = [r for r in history(cluster) if "leaving" in r.reason]
        assert leaving and leaving[-1].kind == "move"
    revive(cluster, name)
    # a process's own leave is not an operator's drain: its restart is usable again
    newest = max(
        (s for s in cluster.status().stages if s.name == name), key=lambda s: s.incarnation
    )
    assert newest.state != "drained", newest


# ---- the training script killed ----------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["before_commit", "after_commit"])
def test_a_killed_training_script_resumes_as_if_it_never_died(
    cluster: LocalCluster, where: str, tmp_path: Path
) -> None:
    """The training script SIGKILLed between RunStep and CommitStep (nobody committed), or
    after one stage missed its commit (some committed): Pipeline(resume=True) attaches
    once the dead script's lease runs out, the undecided step is settled (aborted, or
    committed everywhere), pipe.step says where to go on, and the result is exact."""
    pause = 6
    if where == "after_commit":
        status = cluster.status()
        # The next job's chain: the first three live stages; one of them loses its commit.
        chain = [s for s in status.stages if s.alive and s.state != "drained"][:3]
        arm(chain[1].address, stage_pb2.DROP_NEXT_COMMIT)
    env = {**os.environ, "ELASTICPIPE_TEST_PAUSE": f"{where}:{pause}"}
    kill_script_at(script(cluster), tmp_path / "script.log", env, "paused_at")
    with pipeline(cluster, resume=True) as pipe:
        assert pipe.step == (pause - 1 if where == "before_commit" else pause)
        trainer = Trainer(pipe).start()
        state = trainer.finish()
    losses = dict(trainer.losses)
    want = REFERENCE[0]
    losses.update({s: want[s - 1] for s in range(1, pipe.step + 1) if s not in losses})
    check(losses, state)


def test_a_second_pipeline_cannot_take_a_held_job(cluster: LocalCluster) -> None:
    """While a pipeline holds the job, a new Pipeline (with or without resume) is refused
    with an error naming the holder; once it is closed, a new job may start."""
    with pipeline(cluster) as pipe:
        pipe.train_step(*batch(1))
        with (
            pipeline(cluster, setup_timeout=2.0) as intruder,
            pytest.raises(JobInUse, match="is held by client"),
        ):
            intruder.train_step(*batch(1))
    with pipeline(cluster) as fresh:
        assert fresh.train_step(*batch(1)) == pytest.approx(REFERENCE[0][0], rel=1e-5)


@pytest.mark.timeout(120)
def test_an_undecided_run_ends_by_the_commit_lease(cluster: LocalCluster, tmp_path: Path) -> None:
    """A script killed between RunStep and CommitStep, with no successor: once its lease
    and the stages' commit lease run out, the coordinator settles the run (abort) and no
    stage stays AWAITING_COMMIT."""
    env = {**os.environ, "ELASTICPIPE_TEST_PAUSE": "before_commit:2"}
    kill_script_at(script(cluster), tmp_path / "script.log", env, "paused_at")
    chain = [s.address for s in cluster.status().stages if s.state == "chain"]
    phases = [stage(a).GetStats(stage_pb2.StatsRequest(), timeout=5).state.phase for a in chain]
    assert phases == ["awaiting_commit"] * len(chain)
    deadline = time.monotonic() + 60  # lease 3 s + commit lease 5 s + asking
    while any(
        stage(a).GetStats(stage_pb2.StatsRequest(), timeout=5).state.phase != "idle" for a in chain
    ):
        assert time.monotonic() < deadline, "a stage is still waiting for its commit"
        time.sleep(0.2)
    steps = {stage(a).GetStats(stage_pb2.StatsRequest(), timeout=5).committed_step for a in chain}
    assert steps == {1}


def legacy_checkpoint(directory: Path) -> dict[str, Any]:
    """The msgpack checkpoint of earlier versions, built from a checkpoint directory."""
    reader = checkpoints.Reader(directory)
    _, params = weights.expected_state(reader.job["model"], reader.job["model_kwargs"])
    layers = {}
    for layer, names in enumerate(params):
        shard = load_file(str(directory / checkpoints.weights_name(layer)))
        model = {k.partition(".")[2]: v for k, v in shard.items()}
        layers[layer] = codec.pack_state(reader.layer_state(layer, model, names))
    reader.close()
    job = {k: reader.job[k] for k in ("model", "model_kwargs", "seed", "optimizer")}
    return {"format": CHECKPOINT_FORMAT, "job": job, "step": reader.step, "layers": layers}


def test_a_load_is_atomic_across_stages(cluster: LocalCluster, tmp_path: Path) -> None:
    """A checkpoint whose last layer does not fit the model: load fails on that stage,
    and no stage changed (the others staged their layers but never installed them);
    training goes on exactly, and the history records the abandoned load."""
    with pipeline(cluster) as pipe:
        for step in (1, 2):
            pipe.train_step(*batch(step))
        pipe.save(tmp_path / "ckpt")
        # A directory is checked against the model on the client, before any stage sees
        # it; the one-file format of earlier versions (still loadable) is checked by the
        # stages, which is what this test needs.
        checkpoint = legacy_checkpoint(tmp_path / "ckpt")
        last = max(checkpoint["layers"])
        state = codec.unpack_state(checkpoint["layers"][last])
        state["model"]["weight"] = torch.zeros(2, 2)  # the wrong shape
        checkpoint["layers"][last] = codec.pack_state(state)
        broken = tmp_path / "broken.msgpack"
        broken.write_bytes(codec.pack_state(checkpoint))
        for step in (3, 4):
            pipe.train_step(*batch(step))
        before = pipe.state_dict()
        # Refused on the layer's header, before the stage allocates anything for it.
        wrong = rf"layer {last}: tensor 'weight' declared as float32 \[2, 2\]"
        with pytest.raises(InvalidRequest, match=wrong):
            pipe.load(broken)
        after = pipe.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert history(cluster)[-1].kind == "abandoned"
        losses = {s: pipe.train_step(*batch(s)) for s in range(5, STEPS + 1)}
        losses.update({s: REFERENCE[0][s - 1] for s in range(1, 5)})
        check(losses, pipe.state_dict())
