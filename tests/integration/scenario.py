"""The scenario the failure tests share: a job, its data per step, and the failure-free
reference (single-process training, which the pipeline equals by transparency)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
import torch

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.objectives import make_optimizer
from elasticpipe.transport import rpc
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.support.numerics import reference_step

KWARGS = {"sizes": [12, 24, 24, 24, 24, 6]}  # 9 layers
ADAM = {"lr": 1e-2}
STEPS = 10
FAST = [
    "--heartbeat-interval",
    "0.2",
    "--dead-after",
    "2",
    "--no-auto-rebalance",
]


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
    return Pipeline(coordinator=cluster.coordinator, **options)  # type: ignore[arg-type]


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


def stage(address: str) -> stage_pb2_grpc.StageServiceStub:
    """A stub of one stage."""
    return stage_pb2_grpc.StageServiceStub(grpc.insecure_channel(address))


def arm(address: str, fault: int, point: str = "") -> None:
    """Arms a fault on a stage (it must run with --enable-fault-injection)."""
    stage(address).InjectFault(stage_pb2.FaultRequest(fault=fault, point=point), timeout=10)  # type: ignore[arg-type]


def admin(cluster: LocalCluster) -> coordinator_pb2_grpc.CoordinatorServiceStub:
    """The coordinator's admin stub."""
    return coordinator_pb2_grpc.CoordinatorServiceStub(rpc.channel(cluster.coordinator))


def history(cluster: LocalCluster) -> list[coordinator_pb2.EpochRecord]:
    """The current job's epoch history."""
    return list(cluster.status().history)
