"""Memory-aware partitions through real stage processes started with ``--memory`` caps."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from elasticpipe.errors import ElasticPipeError
from elasticpipe.local.cluster import LocalCluster
from tests.support import cli, clusters, jobs
from tests.support.reference import Lockstep

# Layers: Linear(64, 256) 66.5 kB, ReLU, Linear(256, 256) 263 kB, ReLU, Linear(256, 256),
# ReLU, Linear(256, 8). With SGD a layer needs its weights and gradients (2x), plus the
# activations of the micro-batches in flight.
SIZES = [64, 256, 256, 256, 8]
SGD = {"lr": 0.05}
CAPS = ["400K", "2M"]
BAD = ["--memory", "12Q"]  # stage-0 holds layers 0-1 at most; stage-1 the rest


@pytest.fixture(scope="module")
def capped() -> Iterator[LocalCluster]:
    """Two stages, the first offering 400 KiB and the second 2 MiB."""
    with clusters.quiet(2, per_stage_args=[["--memory", cap] for cap in CAPS]) as cluster:
        yield cluster


@pytest.mark.timeout(180)
def test_small_caps_force_an_uneven_partition_and_training_stays_exact(
    capped: LocalCluster,
) -> None:
    """Stage-0's 400K cap leaves it two small layers at most (uncapped, about half);
    training on that partition equals single-process training; a set-partition or a drain
    that would overflow stage-0 is refused naming the shortfall and changes nothing; a forced
    rebalance towards stage-0 (stage-1 made 4x slower) stays within the cap; losses and
    weights equal LocalPipeline's bit for bit."""
    g = torch.Generator().manual_seed(0)
    with Lockstep(
        capped,
        model="mlp",
        model_kwargs={"sizes": SIZES},
        seed=1,
        optimizer="sgd",
        optimizer_kwargs=SGD,
        micro_batches=2,
    ) as both:
        pipe = both.pipe
        for step in range(4):
            both.train_step(
                torch.randn(16, 64, generator=g), torch.randint(0, 8, (16,), generator=g)
            )
            if step == 0:
                # The planner may put either stage first; stage-0 holds at most the small
                # layers at one end (0-1 or 5-6), never a 256x256 Linear (2 or 4).
                before = pipe.partition
                names = [capped.name_of(a) for a in before.addresses]
                s0 = names.index("stage-0")
                held = set(range(before.boundaries[s0], before.boundaries[s0 + 1]))
                assert held and (held <= {0, 1} or held <= {5, 6}), before.boundaries
                assert not held & {2, 4}, (names, before.boundaries)
                epoch = capped.status().partition.epoch
                refused = cli.admin(
                    capped, "set-partition", "0:4,4:7", "--stages", "stage-0", "stage-1", after=True
                )
                assert refused.returncode == 2, refused.stderr
                assert "stage 'stage-0' would hold layers 0..3" in refused.stderr
                assert "short by" in refused.stderr and "offers 409600 B" in refused.stderr
                drained = cli.admin(capped, "drain", "stage-1", after=True)
                assert drained.returncode == 2, drained.stderr
                assert "need" in drained.stderr and "stage_memory" in drained.stderr
                status = capped.status()
                assert status.partition.epoch == epoch
                assert {s.name: s.memory_bytes for s in status.stages} == {
                    "stage-0": 409600,
                    "stage-1": 2 << 20,
                }
                assert {s.state for s in status.stages} == {"chain"}
                # A 4x slower stage-1 would hand layers to stage-0, but they do not fit.
                assert cli.admin(capped, "slowdown", "stage-1", "4", after=True).returncode == 0
            if step == 2:
                time.sleep(1.5)  # a heartbeat with stage-1's slow timings
                moved = cli.admin(capped, "rebalance", after=True)
                assert moved.returncode == 0, moved.stderr
                assert capped.status().partition.epoch == epoch
                assert pipe.partition == before
        both.assert_same_weights()


@pytest.mark.timeout(120)
def test_a_model_too_big_for_every_stage_fails_clearly_at_setup(capped: LocalCluster) -> None:
    """A 4 MiB layer fits neither stage: job setup fails naming the layer, what it needs and
    what each stage offers."""
    with (
        pytest.raises(ElasticPipeError) as info,
        jobs.mlp(
            capped.coordinator, sizes=[64, 1024, 1024, 8], optimizer="sgd", optimizer_kwargs=SGD
        ) as pipe,
    ):
        pipe.train_step(torch.randn(4, 64), torch.randint(0, 8, (4,)))
    message = str(info.value)
    assert "layer 2 needs" in message and "no stage can hold it" in message, message
    assert "stage-0: 409600 B" in message and "stage-1: 2097152 B" in message, message


@pytest.mark.timeout(60)
def test_a_bad_memory_flag_is_refused_naming_it() -> None:
    """``elasticpipe stage --memory 12Q`` exits 2 quoting the bad value."""
    done = cli.elasticpipe("stage", "--coordinator", "127.0.0.1:1", *BAD, timeout=60)
    assert done.returncode == 2
    assert "invalid memory size '12Q'" in done.stderr
