"""Failure injection with real processes and real SIGKILLs at named protocol points.

Each case trains the same script as the failure-free reference (ordinary single-process
training, which the pipeline equals by transparency) and kills a process exactly where
the case names -- a stage paused at a protocol point, the coordinator paused mid-change,
the training script paused between RunStep and CommitStep -- then requires the same
losses and the same final weights, with no exception reaching the training loop.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from safetensors.torch import load_file

from elasticpipe.client import checkpoints
from elasticpipe.client.pipeline import CHECKPOINT_FORMAT
from elasticpipe.errors import InvalidRequest, JobInUse
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.models import weights
from elasticpipe.v1 import coordinator_pb2, stage_pb2
from elasticpipe.wire import codec
from tests.support.scenario import (
    FAST,
    REFERENCE,
    STEPS,
    Trainer,
    admin,
    arm,
    batch,
    check,
    history,
    pipeline,
    stage,
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three chain stages and a spare that accept injected faults; a state file."""
    with LocalCluster(
        stages=4,
        stage_args=["--enable-fault-injection", "--commit-lease", "5"],
        coordinator_args=FAST,
        log_dir=os.environ.get("ELASTICPIPE_TEST_LOGS"),  # keep the processes' logs
    ) as c:
        yield c


def _revive(cluster: LocalCluster, name: str) -> None:
    """Brings a killed stage back under its name (a new incarnation, then a spare)."""
    cluster.add_stage(name, ["--enable-fault-injection", "--commit-lease", "5"])


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
    with pipeline(cluster, **options) as pipe:
        kill_at = 5
        victim: list[str] = []

        def before(step: int) -> None:
            if step == kill_at:
                address = pipe.partition.addresses[1]
                victim.append(cluster.name_of(address))
                arm(address, stage_pb2.PAUSE_AT, point)
                threading.Thread(target=_kill_when_paused, args=(cluster, victim[0])).start()

        trainer = Trainer(pipe, before).start()
        state = trainer.finish()
        check(trainer.losses, state)
        records = history(cluster)
        assert records[-1].kind == "recovery" and victim[0] in records[-1].reason
        stages = {s.name: s for s in cluster.status().stages if s.state == "dead"}
        assert victim[0] in stages
    _revive(cluster, victim[0])


def _kill_when_paused(cluster: LocalCluster, name: str) -> None:
    cluster.wait_for_log(name, "paused_at", timeout=60)
    cluster.kill(name)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", ["prepare", "epoch_commit"])
def test_a_stage_killed_during_a_migration_loses_nothing(cluster: LocalCluster, point: str) -> None:
    """A stage receiving layers SIGKILLed while it prepares (before the commit point) or
    while it installs (after it): the move is abandoned or finished, the dead stage is
    recovered from snapshots, and the results stay exact."""
    with pipeline(cluster) as pipe:
        victim: list[str] = []

        def before(step: int) -> None:
            if step != 5:
                return
            part = pipe.partition
            receiver = part.addresses[1]
            victim.append(cluster.name_of(receiver))
            arm(receiver, stage_pb2.PAUSE_AT, point)
            target = list(part.boundaries)
            if target[3] - target[2] > 1:
                target[2] += 1  # the receiver takes a layer from the last stage
            else:
                target[1] -= 1  # ... or from the first
            request = coordinator_pb2.SetPartitionRequest(boundaries=target)

            def move() -> None:
                # Abandoned before its commit point, as expected for "prepare".
                with contextlib.suppress(grpc.RpcError):
                    admin(cluster).SetPartition(request, timeout=120)

            threading.Thread(target=move, daemon=True).start()
            _kill_when_paused(cluster, victim[0])

        trainer = Trainer(pipe, before).start()
        state = trainer.finish()
        check(trainer.losses, state)
        assert history(cluster)[-1].kind == "recovery"
    _revive(cluster, victim[0])


def test_a_lost_commit_is_settled_by_the_next_run(cluster: LocalCluster) -> None:
    """Every CommitStep of one run lost on one stage: that stage learns the decision from
    the next RunStep, and results stay exact (no recovery needed)."""
    with pipeline(cluster) as pipe:

        def before(step: int) -> None:
            if step == 4:
                arm(pipe.partition.addresses[2], stage_pb2.DROP_NEXT_COMMIT)

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        assert [r.kind for r in history(cluster)] == ["start"]  # no recovery, no move


def test_a_restarted_stage_is_a_new_incarnation_and_replaces_its_old_self(
    cluster: LocalCluster,
) -> None:
    """Killing a stage and starting it again under its name (new port, new incarnation):
    the old incarnation is declared dead, the new one is alive (it replaces the old one in
    the chain if it registered before the recovery, else it waits as a spare), and the
    coordinator never confuses the two."""
    with pipeline(cluster, stages=4) as pipe:
        name = ""

        def before(step: int) -> None:
            nonlocal name
            if step == 4:
                name = cluster.name_of(pipe.partition.addresses[3])
                cluster.kill(name)
                _revive(cluster, name)

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
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
    with pipeline(cluster) as pipe:
        name = ""

        def before(step: int) -> None:
            nonlocal name
            if step == 4:
                name = cluster.name_of(pipe.partition.addresses[1])
                threading.Thread(target=lambda: cluster.terminate(name), daemon=True).start()

        trainer = Trainer(pipe, before).start()
        check(trainer.losses, trainer.finish())
        assert cluster.procs[name].wait(30) == 0
        leaving = [r for r in history(cluster) if "leaving" in r.reason]
        assert leaving and leaving[-1].kind == "move"
    _revive(cluster, name)
    # a process's own leave is not an operator's drain: its restart is usable again
    newest = max(
        (s for s in cluster.status().stages if s.name == name), key=lambda s: s.incarnation
    )
    assert newest.state != "drained", newest


# ---- the training script killed ----------------------------------------------------------

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.support.scenario import batch, pipeline
class C: coordinator = {address!r}
with pipeline(C) as pipe:
    for step in range(pipe.step + 1, 11):
        pipe.train_step(*batch(step))
"""


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
    log = tmp_path / "script.log"
    env = {**os.environ, "ELASTICPIPE_TEST_PAUSE": f"{where}:{pause}"}
    with log.open("wb") as out:
        script = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SCRIPT.format(
                    root=str(Path(__file__).resolve().parents[2]), address=cluster.coordinator
                ),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 90
        while "paused_at" not in log.read_text(errors="replace"):
            assert script.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        script.kill()
        script.wait(10)
    finally:
        script.kill()
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
    log = tmp_path / "script.log"
    env = {**os.environ, "ELASTICPIPE_TEST_PAUSE": "before_commit:2"}
    with log.open("wb") as out:
        script = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SCRIPT.format(
                    root=str(Path(__file__).resolve().parents[2]), address=cluster.coordinator
                ),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 90
        while "paused_at" not in log.read_text(errors="replace"):
            assert script.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        script.kill()
        script.wait(10)
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
