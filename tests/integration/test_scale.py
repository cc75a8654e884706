"""Chains of any length: 64 stages of a tiny model train exactly (no fixed pool deadlocks)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from elasticpipe import models
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.objectives import make_optimizer, reference_step
from tests.support import jobs
from tests.support.numerics import assert_steps_match
from tests.support.servers import stage_servers

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
        configs = [StageConfig(name=f"s{i:02d}") for i in range(STAGES)]
        with stage_servers(coordinator.address, configs, register_s=30):
            reference = models.build("mlp", seed=1, **KWARGS)
            opt = make_optimizer("sgd", reference.parameters(), {"lr": 0.1})
            g = torch.Generator().manual_seed(0)
            with jobs.mlp(
                coordinator.address,
                **KWARGS,
                seed=1,
                optimizer="sgd",
                optimizer_kwargs={"lr": 0.1},
                micro_batches=4,
                stages=STAGES,
                snapshot_every=0,
            ) as pipe:
                batches = [
                    (torch.randn(8, 4, generator=g), torch.randint(0, 4, (8,), generator=g))
                    for _ in range(3)
                ]
                assert_steps_match(
                    pipe, batches, partial(reference_step, reference, opt, "cross_entropy")
                )
                x = batches[-1][0]
                assert pipe.partition.num_stages == STAGES
                reference.eval()
                torch.testing.assert_close(pipe.predict(x), reference(x))
                state = pipe.state_dict()
            for key, value in reference.state_dict().items():
                torch.testing.assert_close(state[key], value)
