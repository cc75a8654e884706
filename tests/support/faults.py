"""A declarative fault plan: what goes wrong, at which step, to which stage, written as a
scenario and run as the ``before(step)`` hook of ``scenario.Trainer``.

    plan = FaultPlan().at(step=5).pause(stage=1, point="commit").then_kill()
    with pipeline(cluster) as pipe:
        train_and_check(pipe, plan.hook(cluster, pipe))
    revive(cluster, *plan.killed)

It is built on the two mechanisms the stages and ``LocalCluster`` offer: a fault armed on a
stage by ``InjectFault`` (it must run with ``--enable-fault-injection``) and a signal sent
to a process (SIGKILL as a crash, SIGTERM as a graceful leave).

A stage is named by its index in the chain as it stands when the step's faults begin (the
partition the client holds before that step), or, in a step that moves a layer, as the
move's ``"sender"`` or ``"receiver"``. The faults of a step run in the order written.

``then_kill()`` SIGKILLs the stage the last ``pause`` named once it has logged that it is
paused there. A point of the step protocol (``run_started``, ``awaiting_commit``,
``commit``, ``snapshot``) is reached only once the step runs, so the kill waits on a thread
and the hook returns; a point of an epoch change (``prepare``, ``epoch_commit``) is reached
by the step's own move, so the hook waits for the kill before the step starts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.v1 import stage_pb2
from tests.support.clusters import revive
from tests.support.scenario import arm, move_on_a_thread

STEP_POINTS = frozenset({"run_started", "awaiting_commit", "commit", "snapshot"})
EPOCH_POINTS = frozenset({"prepare", "epoch_commit"})

StageRef = int | str  # a chain index, or "sender" / "receiver" of the step's move


@dataclass
class _Step:
    """Where one step's faults run: the cluster, the chain before the step, and its move."""

    cluster: LocalCluster
    addresses: list[str]
    boundaries: list[int]
    move: tuple[list[int], int, int] | None = None  # (target, sender, receiver)
    paused: tuple[str, str] | None = None  # (the paused stage's name, its point)

    def address(self, stage: StageRef) -> str:
        if isinstance(stage, int):
            return self.addresses[stage]
        assert self.move is not None, f"stage {stage!r} names the move, but none is planned"
        _, sender, receiver = self.move
        return self.addresses[{"sender": sender, "receiver": receiver}[stage]]

    def name(self, stage: StageRef) -> str:
        return self.cluster.name_of(self.address(stage))


Action = Callable[[_Step, list[str]], None]  # (the step, the stages killed so far)


@dataclass
class FaultPlan:
    """Faults to inject at given steps of a training run; ``killed`` names, in order, the
    stages it SIGKILLed or SIGTERMed (once run), for the test's checks and revival."""

    killed: list[str] = field(default_factory=list)
    _steps: dict[int, list[Action]] = field(default_factory=dict)
    _moves: dict[int, int] = field(default_factory=dict)  # step -> the receiving stage
    _at: int | None = None

    def at(self, step: int) -> FaultPlan:
        """The faults written next happen just before ``step`` trains."""
        self._at = step
        self._steps.setdefault(step, [])
        return self

    def _add(self, action: Action) -> FaultPlan:
        assert self._at is not None, "say at(step=...) first"
        self._steps[self._at].append(action)
        return self

    def pause(self, stage: StageRef, point: str) -> FaultPlan:
        """Arms a stage to block at protocol point ``point`` (until killed)."""
        assert point in STEP_POINTS | EPOCH_POINTS, point

        def run(step: _Step, killed: list[str]) -> None:
            step.paused = (step.name(stage), point)
            arm(step.address(stage), stage_pb2.PAUSE_AT, point)

        return self._add(run)

    def then_kill(self) -> FaultPlan:
        """SIGKILLs the stage the last ``pause`` named once it is paused there."""

        def run(step: _Step, killed: list[str]) -> None:
            assert step.paused is not None, "then_kill() follows a pause()"
            name, point = step.paused
            killed.append(name)
            if point in EPOCH_POINTS:
                kill_when_paused(step.cluster, name)
            else:
                threading.Thread(target=kill_when_paused, args=(step.cluster, name)).start()

        return self._add(run)

    def kill(self, stage: StageRef) -> FaultPlan:
        """SIGKILLs a stage at once, as a crash would."""

        def run(step: _Step, killed: list[str]) -> None:
            name = step.name(stage)
            killed.append(name)
            step.cluster.kill(name)

        return self._add(run)

    def revive(self) -> FaultPlan:
        """Starts the stage killed last again under its name, in the hook (a new
        incarnation: it replaces its old self or waits as a spare)."""
        return self._add(lambda step, killed: revive(step.cluster, killed[-1]))

    def terminate(self, stage: StageRef, wait: bool = False) -> FaultPlan:
        """SIGTERMs a stage (a graceful leave) on a thread, or with ``wait`` in the hook,
        requiring it to exit 0 (once its layers moved off)."""

        def run(step: _Step, killed: list[str]) -> None:
            name = step.name(stage)
            killed.append(name)
            if wait:
                assert step.cluster.terminate(name, timeout=60) == 0
            else:
                threading.Thread(target=step.cluster.terminate, args=(name,), daemon=True).start()

        return self._add(run)

    def drop_commit(self, stage: StageRef) -> FaultPlan:
        """Arms a stage to lose its next CommitStep (not applied, no reply)."""
        return self._add(lambda step, killed: arm(step.address(stage), stage_pb2.DROP_NEXT_COMMIT))

    def move_a_layer_to(self, stage: int) -> FaultPlan:
        """Asks the coordinator, on a thread, to move one layer into chain stage ``stage``
        (from the next stage if it holds more than one, else from the one before); a move
        abandoned before its commit point is expected, so its error is ignored."""
        assert self._at is not None, "say at(step=...) first"
        self._moves[self._at] = stage

        def run(step: _Step, killed: list[str]) -> None:
            assert step.move is not None
            move_on_a_thread(step.cluster, list(step.move[0]))

        return self._add(run)

    def hook(self, cluster: LocalCluster, pipe: Pipeline) -> Callable[[int], None]:
        """The ``before(step)`` hook that runs this plan on ``cluster`` for ``pipe``."""

        def before(number: int) -> None:
            actions = self._steps.get(number)
            if actions is None:
                return
            part = pipe.partition
            step = _Step(cluster, list(part.addresses), list(part.boundaries))
            if number in self._moves:
                step.move = _one_layer_to(step.boundaries, self._moves[number])
            for action in actions:
                action(step, self.killed)

        return before


def _one_layer_to(boundaries: list[int], receiver: int) -> tuple[list[int], int, int]:
    """(target boundaries, sender, receiver) of a move of one layer into ``receiver``."""
    target = list(boundaries)
    if target[receiver + 2] - target[receiver + 1] > 1:
        target[receiver + 1] += 1  # the receiver takes a layer from the next stage
        return target, receiver + 1, receiver
    target[receiver] -= 1  # ... or from the one before
    return target, receiver - 1, receiver


def kill_when_paused(cluster: LocalCluster, name: str) -> None:
    cluster.wait_for_log(name, "paused_at", timeout=60)
    cluster.kill(name)
