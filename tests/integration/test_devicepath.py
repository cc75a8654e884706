"""The executor with an asynchronous data path, on CPU stages: sends handed to the links
later, by another thread (as a CUDA stage's copy stream does), and staged copies of every
input still train exactly as one process does; every run drains and gives its buffers back."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from elasticpipe import models
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.stage_server.devicepath import PlainPath, Sink
from elasticpipe.stage_server.server import StageServer
from elasticpipe.training.objectives import make_optimizer, reference_step
from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value
from tests.support import jobs
from tests.support.numerics import assert_steps_match

KWARGS = {"sizes": [12, 16, 16, 6]}
DELAY_S = 0.005  # each send waits this long on the sender thread: a copy in flight


class DelayedPath(PlainPath):
    """``CudaPath``'s shape on the CPU: inputs are copied (a staging copy), sends go to a
    sender thread that delivers them in order after ``DELAY_S``, ``drain`` waits for it."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.queue: queue.Queue[tuple[Sink, Any] | None] = queue.Queue()
        self.pending = 0
        self.idle = threading.Condition()
        self.delivered = self.finished = self.abandoned = self.copied = self.early = 0
        self.thread = threading.Thread(target=self._deliver, daemon=True)
        self.thread.start()

    def to_device(self, value: Value) -> Value:
        self.copied += 1
        return structure.apply(value, torch.clone)

    def send(self, sink: Sink, value: Value, make: Callable[[Value], Any]) -> None:
        with self.idle:
            self.pending += 1
        self.queue.put((sink, make(structure.apply(value, torch.clone))))

    def _deliver(self) -> None:
        while (item := self.queue.get()) is not None:
            time.sleep(DELAY_S)
            item[0].put(item[1])
            with self.idle:
                self.pending -= 1
                self.delivered += 1
                self.idle.notify_all()

    def drain(self, deadline: float) -> None:
        with self.idle:
            assert self.idle.wait_for(lambda: self.pending == 0, deadline - time.monotonic())

    def finish(self) -> None:
        with self.idle:
            self.early += self.pending > 0  # buffers back while a send is still queued
        self.finished += 1

    def abandon(self) -> None:
        self.abandoned += 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_asynchronous_path_trains_exactly_as_one_process(
    coordinator_server: CoordinatorServer, stage_servers: list[StageServer], schedule: str
) -> None:
    """Two stages whose sends leave late, from another thread: same losses and weights as
    plain PyTorch; every send was delivered and every run finished (none abandoned)."""
    paths = []
    for server in stage_servers:
        assert server.stage is not None
        server.stage.path = DelayedPath()
        paths.append(server.stage.path)
    reference = models.build("mlp", seed=2, **KWARGS)
    sgd = {"lr": 0.1, "momentum": 0.9}
    ref_opt = make_optimizer("sgd", reference.parameters(), sgd)
    g = torch.Generator().manual_seed(0)
    with jobs.mlp(
        coordinator_server.address,
        **KWARGS,
        seed=2,
        optimizer="sgd",
        optimizer_kwargs=sgd,
        loss="cross_entropy",
        micro_batches=4,
        schedule=schedule,
        stages=2,
    ) as pipe:
        batches = (
            (torch.randn(10, 12, generator=g), torch.randint(0, 6, (10,), generator=g))
            for _ in range(3)
        )
        assert_steps_match(
            pipe, batches, partial(reference_step, reference, ref_opt, "cross_entropy")
        )
        x = torch.randn(5, 12, generator=g)
        predicted = pipe.predict(x)
        state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value, msg=key)
    with torch.no_grad():
        torch.testing.assert_close(predicted, reference(x))
    # 3 steps x 4 micro-batches: 12 activations forward, 12 gradients back; inference: 4.
    assert sum(p.delivered for p in paths) == 12 + 12 + 4
    assert all(p.finished >= 4 and p.abandoned == 0 and p.early == 0 for p in paths)
    assert all(p.copied > 0 for p in paths)
