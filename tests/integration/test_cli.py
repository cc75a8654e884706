"""The operator's command line against a live cluster: status, plan, moves, errors."""

from __future__ import annotations

import json

import pytest
import torch

from elasticpipe.local.cluster import LocalCluster
from tests.support import cli, jobs

pytestmark = pytest.mark.timeout(240)


def test_admin_commands_inspect_and_move_a_running_job(cluster4: LocalCluster) -> None:
    """status lists every stage with its layers and the epoch history; plan is a dry run;
    set-partition, drain, undrain and slowdown act; bad ranges exit 2 naming the range."""
    with jobs.mlp(
        cluster4.coordinator, sizes=[8, 16, 16, 16, 4], micro_batches=2, stages=3
    ) as pipe:
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        status = cli.admin(cluster4, "status")
        assert status.returncode == 0, status.stderr
        for name in ("stage-0", "stage-1", "stage-2", "stage-3"):
            assert name in status.stdout
        assert "model: mlp" in status.stdout and "epoch history" in status.stdout

        plan = cli.admin(cluster4, "plan")
        assert plan.returncode == 0, plan.stderr
        assert "predicted step" in plan.stdout and "optimal" in plan.stdout
        epoch = pipe.partition.epoch
        dry = cli.admin(cluster4, "rebalance", "--dry-run")
        assert dry.returncode == 0 and dry.stdout.startswith("dry run: would move to 0:")
        assert cluster4.status().partition.epoch == epoch  # a dry run moves nothing

        moved = cli.admin(cluster4, "set-partition", "0:1,1:2,2:7")
        assert moved.returncode == 0, moved.stderr
        assert moved.stdout.startswith("moved") and "0:1,1:2,2:7" in moved.stdout
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        assert pipe.partition.epoch == epoch + 1
        assert pipe.partition.boundaries == (0, 1, 2, 7)

        victim = cli.admin(cluster4, "--json", "status")
        stages = json.loads(victim.stdout)["stages"]
        middle = next(s["name"] for s in stages if s.get("index", -1) == 1)
        drained = cli.admin(cluster4, "drain", middle)
        assert drained.returncode == 0 and drained.stdout.startswith("moved"), drained.stderr
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        assert len(pipe.partition.addresses) == 2
        back = cli.admin(cluster4, "undrain", middle)
        assert back.returncode == 0 and back.stdout.startswith("moved"), back.stderr
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 4, (4,)))
        assert len(pipe.partition.addresses) == 3

        slow = cli.admin(cluster4, "slowdown", middle, "2.5")
        assert slow.returncode == 0 and "2.5" in slow.stdout
        history = cli.admin(cluster4, "status").stdout
        assert "admin set-partition" in history and f"drain {middle}" in history

        bad = cli.admin(cluster4, "set-partition", "0:3,4:7")
        assert bad.returncode == 2 and "'4:7'" in bad.stderr
        wrong = cli.admin(cluster4, "set-partition", "0:3,3:9")
        assert wrong.returncode == 2 and "[0, 3, 9]" in wrong.stderr
        cli.admin(cluster4, "slowdown", middle, "1")
