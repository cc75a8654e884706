"""bf16 mixed precision through real stage processes equals ``LocalPipeline``."""

from __future__ import annotations

import pytest
import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.local.reference import LocalPipeline
from tests.support.numerics import stage_threads

GPT = {"vocab_size": 17, "d_model": 16, "n_heads": 2, "n_layers": 3, "max_seq_len": 8}
ADAM = {"lr": 1e-2}


@pytest.mark.numerics
@pytest.mark.timeout(240)
def test_bf16_pipeline_equals_local_pipeline_on_any_partition() -> None:
    """With precision="bf16" on 2 and 3 stages (bf16 activations on the wire), every loss
    equals LocalPipeline(precision="bf16") exactly and the final float32 weights and
    predictions within float32's default tolerance: the local side runs under a stage's
    thread count, with the same kernels (tests.support.numerics)."""
    with (
        LocalCluster(stages=3, state=":memory:", auto_rebalance=False) as cluster,
        stage_threads(),
    ):
        for stages in (2, 3):
            local = LocalPipeline(
                "gpt", GPT, seed=4, optimizer_kwargs=ADAM, micro_batches=3, precision="bf16"
            )
            g = torch.Generator().manual_seed(stages)
            with Pipeline(
                coordinator=cluster.coordinator,
                model="gpt",
                model_kwargs=GPT,
                seed=4,
                optimizer_kwargs=ADAM,
                micro_batches=3,
                stages=stages,
                precision="bf16",
            ) as pipe:
                for step in range(3):
                    x = torch.randint(0, 17, (7, 8), generator=g)
                    y = torch.roll(x, -1, dims=1)
                    assert pipe.train_step(x, y) == local.train_step(x, y), (stages, step)
                assert len(pipe.partition.addresses) == stages
                state = pipe.state_dict()
                out = pipe.predict(x)
            for key, value in local.state_dict().items():
                assert value.dtype == state[key].dtype
                torch.testing.assert_close(state[key], value, msg=f"{stages} stages: {key}")
            torch.testing.assert_close(out, local.predict(x))
