"""Chains of any length: 64 stages of a tiny model train exactly (no fixed pool deadlocks)."""

from __future__ import annotations

import pytest
import torch

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.objectives import make_optimizer, reference_step

STAGES = 64
KWARGS = {"sizes": [4] * 34}  # 33 Linear + 32 ReLU = 65 layers


@pytest.mark.timeout(300)
def test_sixty_four_stages_train_exactly() -> None:
    """A chain of 64 stage servers (in one process, each with its own gRPC server) trains
    three steps and predicts, equal to single-process training: more stages than the
    client's or the coordinator's old 32-thread pools."""
    with CoordinatorServer(
        CoordinatorConfig(
            policy=PolicyConfig(enabled=False), heartbeat_interval_s=1.0, dead_after_s=30.0
        )
    ) as coordinator:
        servers = [
            StageServer(StageConfig(name=f"s{i:02d}"), coordinator.address).start()
            for i in range(STAGES)
        ]
        try:
            for server in servers:
                assert server.registered.wait(30)
            reference = models.build("mlp", seed=1, **KWARGS)
            opt = make_optimizer("sgd", reference.parameters(), {"lr": 0.1})
            g = torch.Generator().manual_seed(0)
            with Pipeline(
                coordinator=coordinator.address,
                model="mlp",
                model_kwargs=KWARGS,
                seed=1,
                optimizer="sgd",
                optimizer_kwargs={"lr": 0.1},
                micro_batches=4,
                stages=STAGES,
                snapshot_every=0,
            ) as pipe:
                for _ in range(3):
                    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 4, (8,), generator=g)
                    got = pipe.train_step(x, y)
                    want = reference_step(reference, opt, "cross_entropy", x, y)
                    torch.testing.assert_close(torch.tensor(got), torch.tensor(want))
                assert pipe.partition.num_stages == STAGES
                reference.eval()
                torch.testing.assert_close(pipe.predict(x), reference(x))
                state = pipe.state_dict()
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(state[key], value)
        finally:
            for server in servers:
                server.stop()
