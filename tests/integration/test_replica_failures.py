"""Replicas through failures and departures, on real stage processes with real SIGKILLs
and SIGTERMs: a dead stage's replica is mended (a spare, a re-partition over its
survivors, or fewer replicas) with no rollback and only the interrupted run retried
(``replayed == 0``), also when the stage dies inside the step, as its replicas reduce (on
the data channel or gloo), or between its report and the commit; a layer lost in every
replica is restored from snapshots; a drained or SIGTERMed stage leaves at a consistent
cut; a client and a stage dying together are settled. Every loss and weight equals
``LocalPipeline``'s bit for bit."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from elasticpipe import Pipeline
from elasticpipe.v1 import stage_pb2
from tests.support import cli, clusters
from tests.support.faults import kill_when_paused
from tests.support.replica_jobs import JOB, M, batch, name_of, reference, same_bits
from tests.support.scenario import (
    REFERENCE,
    SCRIPT,
    Trainer,
    arm,
    check,
    kill_script_at,
    pipeline,
    script,
)

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize(
    ("stages", "shape", "victim", "after", "how", "flags"),
    [
        # 6 stages, replicas of (2, 3): the spare takes the place of replica 1's middle stage
        pytest.param(
            6, (2, 3), (1, 1), (2, 3), "took the place of", clusters.FIRST_OPTION, id="a-spare"
        ),
        # no spare: replica 1 of (1, 3) cuts its layers anew over its two survivors
        # (replica 0 has no stage to lend; borrowing is unit-tested, with the choice
        # between options: tests/unit/test_replica_options.py)
        pytest.param(
            4,
            (1, 3),
            (1, 1),
            (1, 2),
            "re-partitioned over",
            clusters.FIRST_OPTION,
            id="its-survivors",
        ),
        # both stages of replica 0 at once: it is gone, fewer replicas
        pytest.param(5, (2, 3), (0, None), (3,), "dissolved", [], id="both-stages-of-a-replica"),
    ],
)
def test_a_killed_stage_costs_no_replay_and_no_bits(
    stages: int,
    shape: tuple[int, ...],
    victim: tuple[int, int | None],
    after: tuple[int, ...],
    how: str,
    flags: list[str],
) -> None:
    """SIGKILL of stages of a job of replicas between steps: their layers live on in the
    other replica at the committed step, so the next step runs after one epoch change with
    nothing rolled back (``replayed == 0``), and every loss and weight still equals
    ``LocalPipeline``'s bit for bit. The option the predicted step chose is recorded."""
    want_losses, want_state = reference()
    with (
        clusters.fast(stages, allow_models=("tests.support",), coordinator_args=flags) as c,
        Pipeline(c.coordinator, **JOB, stages=shape, recovery_timeout=60) as pipe,  # type: ignore[arg-type]
    ):
        losses = [pipe.train_step(*batch(0))]
        replica, index = victim
        chain = pipe.layout.replicas[replica].stage_ids
        for killed in chain if index is None else [chain[index]]:
            c.kill(name_of(c, killed))
        losses.append(pipe.train_step(*batch(1)))
        assert pipe.last_step.replayed == 0
        losses.append(pipe.train_step(*batch(2)))
        layout = pipe.layout
        assert tuple(p.num_stages for p in layout.replicas) == after
        assert killed not in layout.stage_ids and sum(layout.shares) == M
        state = pipe.state_dict()
        history = cli.admin_json(c, "status")["history"]
    same_bits(losses, state, (want_losses, want_state))
    recovery = [r for r in history if r["kind"] == "recovery"]
    assert len(recovery) == 1 and "no rollback" in recovery[0]["reason"]
    assert how in recovery[0]["reason"], recovery[0]["reason"]


def test_a_layer_lost_in_every_replica_is_restored_from_snapshots(tmp_path: Path) -> None:
    """The first stage of both replicas of (2, 3) is SIGKILLed at once: layer 0 has no live
    holder left, so every replica rolls back to the newest snapshot with a live copy of
    every layer (on each first stage's successor), the survivors re-form the replicas, and
    the client replays the steps after it: still ``LocalPipeline``'s bits."""
    steps = 5
    want_losses, want_state = reference(steps)
    with (
        clusters.fast(5, allow_models=("tests.support",)) as c,
        Pipeline(
            c.coordinator, **JOB, stages=(2, 3), snapshot_every=2, recovery_timeout=60
        ) as pipe,  # type: ignore[arg-type]
    ):
        losses = [pipe.train_step(*batch(step)) for step in range(3)]
        for chain in pipe.layout.replicas:
            c.kill(name_of(c, chain.stage_ids[0]))
        losses.append(pipe.train_step(*batch(3)))
        replayed = pipe.last_step.replayed
        losses += [pipe.train_step(*batch(step)) for step in range(4, steps)]
        state = pipe.state_dict()
        history = cli.admin_json(c, "status")["history"]
    same_bits(losses, state, (want_losses, want_state))
    recovery = [r for r in history if r["kind"] == "recovery"]
    restored = recovery[0]["restored_step"]  # step 2's snapshot, or 1's if 2's copy was late
    assert len(recovery) == 1 and f"rolled back to step {restored}" in recovery[0]["reason"]
    assert restored >= 1 and replayed == 3 - restored


def test_a_drained_and_a_sigtermed_stage_leave_replicas_without_a_replay() -> None:
    """``admin drain`` of replica 1's last stage, then SIGTERM of replica 0's last stage:
    each time its replica is mended without it (no spare: re-partitioned over its
    survivors) at a consistent cut, the stage serving and lending its layers until the
    change commits. Nothing is replayed, the SIGTERMed stage exits 0 and is left, not
    dead, and the results stay LocalPipeline's bits."""
    want_losses, want_state = reference(4)
    with (
        clusters.fast(
            5, allow_models=("tests.support",), coordinator_args=clusters.FIRST_OPTION
        ) as c,
        Pipeline(c.coordinator, **JOB, stages=(2, 3)) as pipe,  # type: ignore[arg-type]
    ):
        losses = [pipe.train_step(*batch(0))]
        drained = name_of(c, pipe.layout.replicas[1].stage_ids[-1])
        moved = cli.admin_json(c, "drain", drained)
        assert moved["changed"], moved
        losses.append(pipe.train_step(*batch(1)))
        assert pipe.last_step.replayed == 0  # (its first attempt learns the new epoch)
        assert tuple(p.num_stages for p in pipe.layout.replicas) == (2, 2)
        leaving = name_of(c, pipe.layout.replicas[0].stage_ids[-1])
        assert c.terminate(leaving) == 0
        losses.append(pipe.train_step(*batch(2)))
        assert pipe.last_step.replayed == 0
        losses.append(pipe.train_step(*batch(3)))
        state = pipe.state_dict()
        status = cli.admin_json(c, "status")
        undrained = cli.admin_json(c, "undrain", drained)
    states = {s["name"]: s["state"] for s in status["stages"]}
    assert states[drained] == "drained" and states[leaving] == "left", states
    assert "a spare again" in undrained["decision"], undrained
    assert not [r for r in status["history"] if r["kind"] == "recovery"], status["history"]
    same_bits(losses, state, (want_losses, want_state))


@pytest.mark.parametrize(
    ("collectives", "points"),
    [
        pytest.param("", ["run_started", "reducing", "awaiting_commit"], id="data-channel"),
        # gloo: the others wait inside the process groups (their creation, a receive),
        # which a failed run cannot wake: they must give them up and open new ones.
        pytest.param("gloo", ["reducing", "awaiting_commit"], id="gloo"),
    ],
)
def test_stages_killed_inside_steps_cost_no_replay_and_no_bits(
    collectives: str, points: list[str]
) -> None:
    """Steps in a row, the middle stage of replica 1 is paused inside the step and
    SIGKILLed: as its run starts, as its replicas reduce their gradients (the others wait
    for its pieces), and between its report and the commit. Each time a spare takes its
    place with its layers from replica 0; the step is retried, not replayed, and the
    results stay LocalPipeline's, bit for bit, with either reduction engine."""
    want_losses, want_state = reference(steps=len(points) + 2)
    with (
        clusters.failing(
            8,
            allow_models=("tests.support",),
            # The spare is the default option, kept unless another predicts a far shorter
            # step (FIRST_OPTION). With the tiny model's compute alone, its reduction
            # (latency-bound here) would cost more than replica 1's share saves, and the
            # policy would dissolve it (tests/unit/test_replica_options.py); on devices 10x
            # slower than a core, the pipelines are most of a step.
            slowdowns=[10.0] * 8,
            coordinator_args=clusters.FIRST_OPTION,
        ) as c,
        Pipeline(
            c.coordinator,
            **JOB,  # type: ignore[arg-type]
            stages=(2, 3),
            recovery_timeout=60,
            collectives=collectives,
        ) as pipe,
    ):
        losses = [pipe.train_step(*batch(0))]
        for point in points:
            victim = pipe.layout.replicas[1].stages[1]
            arm(victim.address, stage_pb2.PAUSE_AT, point)
            name = name_of(c, victim.stage_id)
            killer = threading.Thread(target=kill_when_paused, args=(c, name))
            killer.start()
            losses.append(pipe.train_step(*batch(len(losses))))
            killer.join(timeout=60)
            assert pipe.last_step.replayed == 0, point
            assert victim.stage_id not in pipe.layout.stage_ids, point
            assert [p.num_stages for p in pipe.layout.replicas] == [2, 3], point
            mended = cli.admin_json(c, "status")["history"][-1]
            assert "took the place of" in mended["reason"], (point, mended)
        losses.append(pipe.train_step(*batch(len(losses))))
        state = pipe.state_dict()
    assert losses == want_losses
    for key, value in want_state.items():
        assert torch.equal(state[key], value), key


def test_a_client_and_a_stage_killed_together_are_settled_then_recovered(
    tmp_path: Path,
) -> None:
    """The training script SIGKILLed between RunStep and CommitStep of step 4 (the stages
    await its decision), and a stage of replica 1 SIGKILLed with it: once the script's
    lease runs out the coordinator decides the run on the live stages (no stage committed
    it: aborted), a spare takes the dead stage's place with no rollback, and a resumed
    script goes on from step 3 to the failure-free run's losses and weights."""
    with clusters.failing(4, coordinator_args=clusters.FIRST_OPTION) as c:
        code = script(c, SCRIPT.replace("pipeline(C)", "pipeline(C, stages=(1, 2))"))
        env = {**os.environ, "ELASTICPIPE_TEST_PAUSE": "before_commit:4"}
        kill_script_at(code, tmp_path / "script.log", env, "paused_at")
        stages = cli.admin_json(c, "status")["stages"]
        c.kill(next(s["name"] for s in stages if s["replica"] == 1))
        with pipeline(c, stages=(1, 2), resume=True) as pipe:
            assert pipe.step == 3
            trainer = Trainer(pipe).start()
            state = trainer.finish()
            assert [p.num_stages for p in pipe.layout.replicas] == [1, 2]
            assert pipe.last_step.replayed == 0
    losses = dict(trainer.losses)
    want = REFERENCE[0]
    losses.update({s: want[s - 1] for s in range(1, 4)})
    check(losses, state)
