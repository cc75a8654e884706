"""Layer state larger than any one tensor limit, sent in many small chunks, through real
stage processes: initial weights, save, load, a migration, and a recovery from snapshots
all give exactly single-process PyTorch's result."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from elasticpipe import models
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.objectives import make_optimizer
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc
from tests.support import jobs
from tests.support.numerics import assert_losses_close, reference_step

WIDE = {"sizes": [6, 96, 64, 3]}  # layer 2: a 24 KiB weight, 72 KiB with its Adam moments
LIMIT = 32 << 10  # per tensor, on every stage
CHUNK = 1 << 10  # stages send layer state in 1 KiB chunks
ADAM = {"lr": 1e-2}


@pytest.mark.timeout(240)
def test_a_layer_over_the_limit_in_tiny_chunks_moves_saves_loads_and_recovers_exactly(
    tmp_path: Path,
) -> None:
    weights = models.build("mlp", seed=42, **WIDE).state_dict()
    g = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(6)
    ]
    reference = models.build("mlp", seed=0, **WIDE)
    reference.load_state_dict(weights)
    opt = make_optimizer("adam", reference.parameters(), ADAM)
    expected = [reference_step(reference, opt, "cross_entropy", x, y) for x, y in batches]
    limits = ["--max-tensor-bytes", str(LIMIT), "--transfer-chunk-bytes", str(CHUNK)]
    with (
        LocalCluster(stages=3, stage_args=limits, auto_rebalance=False, heartbeat_s=0.2) as cluster,
        jobs.mlp(
            cluster.coordinator,
            **WIDE,
            optimizer="adam",
            optimizer_kwargs=ADAM,
            micro_batches=2,
            stages=2,
            init_state=weights,
            snapshot_every=2,
        ) as pipe,
    ):
        losses = [pipe.train_step(x, y) for x, y in batches[:2]]
        pipe.save(tmp_path / "ckpt")
        moments = load_file(str(tmp_path / "ckpt" / "optimizer-00002.safetensors"))
        assert sum(t.numel() * t.element_size() for t in moments.values()) > LIMIT
        pipe.load(tmp_path / "ckpt")
        before = list(pipe.partition.boundaries)
        target = [0, 3, 5] if before[1] == 2 else [0, 2, 5]  # layer 2 changes hands
        with grpc.insecure_channel(cluster.coordinator) as channel:
            coordinator_pb2_grpc.CoordinatorServiceStub(channel).SetPartition(
                coordinator_pb2.SetPartitionRequest(boundaries=target), timeout=60
            )
        losses += [pipe.train_step(x, y) for x, y in batches[2:4]]
        assert list(pipe.partition.boundaries) == target
        victim = cluster.name_of(pipe.partition.addresses[-1])
        cluster.kill(victim)  # its layers come back from the snapshot copies
        losses += [pipe.train_step(x, y) for x, y in batches[4:]]
        assert victim in {s.name for s in cluster.status().stages if s.state == "dead"}
        assert victim not in {cluster.name_of(a) for a in pipe.partition.addresses}
        assert_losses_close(losses, expected)
        torch.testing.assert_close(pipe.state_dict(), reference.state_dict())
