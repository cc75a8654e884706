"""The scenario the failure tests share: a job, its data per step, and the failure-free
reference (single-process training, which the pipeline equals by transparency)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc
import torch

from elasticpipe import models
from elasticpipe.client.admin import EpochRecord
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.errors import ElasticPipeError
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.objectives import make_optimizer
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from tests.support.clusters import FAST  # noqa: F401 (the scenario's coordinator flags)
from tests.support.numerics import reference_step

KWARGS = {"sizes": [12, 24, 24, 24, 24, 6]}  # 9 layers
ADAM = {"lr": 1e-2}
STEPS = 10


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The mini-batch of a step (the same whoever trains it, however often)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(10, 12, generator=g), torch.randint(0, 6, (10,), generator=g)


def _reference(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = models.build("mlp", seed=3, **KWARGS)
    opt = make_optimizer("adam", model.parameters(), ADAM)
    losses = [reference_step(model, opt, "cross_entropy", *batch(s)) for s in range(1, steps + 1)]
    return losses, model.state_dict()


REFERENCE = _reference(STEPS)


def pipeline(cluster: LocalCluster, **kwargs: object) -> Pipeline:
    """The scenario's Pipeline on ``cluster`` (``kwargs`` override its arguments)."""
    return pipeline_at(cluster.coordinator, **kwargs)


def pipeline_at(coordinator: str, **kwargs: object) -> Pipeline:
    """The scenario's Pipeline on the coordinator(s) at ``coordinator``."""
    options: dict[str, object] = {
        "model": "mlp",
        "model_kwargs": KWARGS,
        "seed": 3,
        "optimizer": "adam",
        "optimizer_kwargs": ADAM,
        "micro_batches": 3,
        "stages": 3,
        "snapshot_every": 3,
        "lease_s": 3.0,
    }
    options.update(kwargs)
    return Pipeline(coordinator=coordinator, **options)  # type: ignore[arg-type]


def check(losses: dict[int, float], state: dict[str, torch.Tensor], upto: int = STEPS) -> None:
    """Same losses and same weights as the failure-free run."""
    want_losses, want_state = _reference(upto) if upto != STEPS else REFERENCE
    for step in range(1, upto + 1):
        torch.testing.assert_close(
            torch.tensor(losses[step]), torch.tensor(want_losses[step - 1]), msg=f"step {step}"
        )
    for key, value in want_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")


class Trainer:
    """Runs the training loop on a thread, calling ``before(step)`` before each step."""

    def __init__(self, pipe: Pipeline, before: Callable[[int], None] = lambda step: None):
        self.pipe, self.before = pipe, before
        self.losses: dict[int, float] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for step in range(self.pipe.step + 1, STEPS + 1):
                self.before(step)
                self.losses[step] = self.pipe.train_step(*batch(step))
        except BaseException as exc:
            self.error = exc

    def start(self) -> Trainer:
        self.thread.start()
        return self

    def finish(self, timeout: float = 120) -> dict[str, torch.Tensor]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "training hung"
        if self.error is not None:
            raise self.error
        return self.pipe.state_dict()


def train_and_check(pipe: Pipeline, before: Callable[[int], None] = lambda step: None) -> None:
    """Trains ``pipe`` to the end on a thread, ``before(step)`` first at each step (a fault
    plan's hook, say), and checks the failure-free run's losses and weights."""
    trainer = Trainer(pipe, before).start()
    check(trainer.losses, trainer.finish())


def stage(address: str) -> stage_pb2_grpc.StageServiceStub:
    """A stub of one stage."""
    return stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(address))


def arm(address: str, fault: int, point: str = "") -> None:
    """Arms a fault on a stage (it must run with --enable-fault-injection)."""
    stage(address).InjectFault(stage_pb2.FaultRequest(fault=fault, point=point), timeout=10)  # type: ignore[arg-type]


def move_on_a_thread(cluster: LocalCluster, boundaries: list[int]) -> threading.Thread:
    """Asks the coordinator for a move to ``boundaries`` on a thread, and returns it: the
    coordinator may die, or abandon the move, before it answers, so its error is ignored."""

    def move() -> None:
        with contextlib.suppress(ElasticPipeError), cluster.admin(timeout=120) as admin:
            admin.set_partition(boundaries)

    thread = threading.Thread(target=move, daemon=True)
    thread.start()
    return thread


def history(cluster: LocalCluster) -> list[EpochRecord]:
    """The current job's epoch history."""
    return list(cluster.status().history)


ROOT = str(Path(__file__).resolve().parents[2])  # the repository, for scripts run apart
SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from tests.support.scenario import batch, pipeline
class C: coordinator = {address!r}
with pipeline(C) as pipe:
    for step in range(pipe.step + 1, 11):
        pipe.train_step(*batch(step))
"""  # the scenario's training as a script of its own (a process a test can kill)


def script(cluster: LocalCluster, text: str = SCRIPT) -> str:
    """A training script (``SCRIPT`` or another of its placeholders) for ``cluster``."""
    return text.format(root=ROOT, address=cluster.coordinator)


def kill_script_at(code: str, log: Path, env: Mapping[str, str], until: str) -> None:
    """Runs the Python ``code`` until ``until`` appears in its output, then SIGKILLs it."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", code], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    try:
        deadline = time.monotonic() + 90
        while until not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(10)
