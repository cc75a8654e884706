"""The job the replica tests train (tests/integration/test_replicas.py and
test_replica_failures.py), its batches, and ``LocalPipeline``'s run of it: the reference
every loss and weight is compared with, bit for bit."""

from __future__ import annotations

import torch

from elasticpipe import LocalPipeline
from elasticpipe.local.cluster import LocalCluster
from tests.support import cli

MODEL = "tests.support.zb_models:unreached"  # a frozen weight, an unreached one, a Dropout
M = 8
STEPS = 3
JOB = {"model": MODEL, "seed": 5, "micro_batches": M, "optimizer": "adamw"}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s 16 rows (2 per micro-batch)."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def reference(steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    """``LocalPipeline``'s losses and final state over the first ``steps`` batches."""
    local = LocalPipeline(**JOB)  # type: ignore[arg-type]
    losses = [local.train_step(*batch(step)) for step in range(steps)]
    return losses, local.state_dict()


def eager_policy(stages: int, slowdown: float = 1.0) -> LocalCluster:
    """``stages`` stages (each an emulated device ``slowdown`` times slower than a core)
    and a coordinator whose policy acts at once: it re-plans every 0.3 s, without
    cool-down, and any predicted gain pays back (a long horizon)."""
    return LocalCluster(
        stages=stages,
        slowdowns=[slowdown] * stages,
        allow_models=("tests.support",),
        heartbeat_s=0.2,
        coordinator_args=[
            *("--policy-interval", "0.3", "--rebalance-cooldown", "0"),
            *("--rebalance-horizon", "100000"),
        ],
    )


def name_of(cluster: LocalCluster, stage_id: str) -> str:
    """The name of the stage with id ``stage_id`` (admin status)."""
    stages = cli.admin_json(cluster, "status")["stages"]
    return next(s["name"] for s in stages if s["stage_id"] == stage_id)


def same_bits(
    losses: list[float],
    state: dict[str, torch.Tensor],
    want: tuple[list[float], dict[str, torch.Tensor]],
) -> None:
    """Asserts ``losses`` and ``state`` are ``want``'s (``reference``'s) bit for bit."""
    want_losses, want_state = want
    assert losses == want_losses  # bitwise: the floats are equal, not close
    assert state.keys() == want_state.keys()
    for name, value in want_state.items():
        assert torch.equal(state[name], value), name
