"""Transparency on CUDA: stage servers on ``--device cuda`` train as plain PyTorch on the GPU
(same losses and weights, within float32 GPU tolerance), and predict the same outputs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from elasticpipe import models
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.training.objectives import make_optimizer, reference_step
from tests.support import clusters, jobs

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

KWARGS = {"sizes": [32, 64, 64, 64, 10]}
OPTIMIZER = ("adam", {"lr": 1e-2})
STEPS = 4
TOL = {"rtol": 1e-4, "atol": 1e-5}  # GPU kernels sum micro-batches in other orders


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[LocalCluster]:
    """Three stage processes on the GPU and a coordinator."""
    with clusters.quiet(3, stage_args=["--device", "cuda"]) as cluster:
        yield cluster


@pytest.mark.timeout(300)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [1, 2, 3])
def test_cuda_pipeline_matches_plain_pytorch_on_the_gpu(
    gpu_cluster: LocalCluster, schedule: str, stages: int
) -> None:
    """Losses of every step and every final weight agree with training on the GPU."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the stages' default, here too
    reference = models.build("mlp", seed=5, **KWARGS).cuda()
    ref_opt = make_optimizer(OPTIMIZER[0], reference.parameters(), OPTIMIZER[1])
    g = torch.Generator().manual_seed(stages)
    with jobs.mlp(
        gpu_cluster.coordinator,
        **KWARGS,
        seed=5,
        optimizer=OPTIMIZER[0],
        optimizer_kwargs=OPTIMIZER[1],
        loss="cross_entropy",
        micro_batches=4,
        schedule=schedule,
        stages=stages,
    ) as pipe:
        for step in range(STEPS):
            x, y = torch.randn(22, 32, generator=g), torch.randint(0, 10, (22,), generator=g)
            got = pipe.train_step(x, y)
            want = reference_step(reference, ref_opt, "cross_entropy", x.cuda(), y.cuda())
            assert got == pytest.approx(want, rel=1e-4, abs=1e-5), step
        state = pipe.state_dict()
        x = torch.randn(9, 32, generator=g)
        predicted = pipe.predict(x)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(state[key], value.cpu(), **TOL, msg=key)
    with torch.no_grad():
        assert isinstance(predicted, torch.Tensor)
        torch.testing.assert_close(predicted, reference(x.cuda()).cpu(), **TOL)
