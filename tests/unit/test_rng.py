"""Tests of the per-layer RNG protocol: seeds, forks, and dropout masks that do not depend
on how the layers are sliced."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.training import rng
from elasticpipe.training.job import JobConfig

DROPOUT = "tests.support.custom_models:dropout"
ALLOW = ("tests.support",)


def test_forward_seed_is_a_pure_function_of_its_four_inputs() -> None:
    """The same four ints give the same seed in [0, 2**63); changing any one changes it."""
    base = (5, 12, 3, 7)
    seed = rng.forward_seed(*base)
    assert seed == rng.forward_seed(*base)
    assert 0 <= seed < 2**63
    for k in range(4):
        for delta in (1, -1, 1000):
            changed = list(base)
            changed[k] += delta
            assert rng.forward_seed(*changed) != seed, (k, delta)


def test_forward_seed_matches_the_documented_protocol() -> None:
    """Protocol 1: BLAKE2b-64 of "seed:step:micro:layer", personalised, top bit cleared
    (a change here breaks reproducibility against recorded checkpoints)."""
    import hashlib

    digest = hashlib.blake2b(b"0:1:2:3", digest_size=8, person=b"elasticpipe-rng1").digest()
    assert rng.RNG_PROTOCOL == 1
    assert rng.forward_seed(0, 1, 2, 3) == int.from_bytes(digest, "little") & ((1 << 63) - 1)


def test_forked_seeds_draws_and_restores_the_global_generator() -> None:
    """Inside, draws follow the layer seed; after, the process's stream goes on untouched."""
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    with rng.forked(torch.device("cpu")) as seed_layer:
        seed_layer(99)
        inside = torch.rand(3)
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(99)))
    assert torch.equal(torch.rand(4), expected_next)


def _slice(lo: int, hi: int, seed: int = 5) -> LayerSlice:
    job = JobConfig(model=DROPOUT, seed=seed, micro_batches=2)
    layers = LayerSlice(job, torch.device("cpu"), Slowdown(), ALLOW)
    layers.build(lo, hi)
    return layers


def _through(slices: list[LayerSlice], x: torch.Tensor, step: int, micro: int) -> torch.Tensor:
    for part in slices:
        x, _ = part.forward(x, train=True, micro_batch=micro, step=step)
    return x.detach()


def test_dropout_masks_do_not_depend_on_the_slicing() -> None:
    """One slice of all 7 layers, or three slices chained, give the same training output
    for the same (step, micro-batch); another step or micro-batch gives another one."""
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    whole = _through([_slice(0, 7)], x, step=3, micro=1)
    parts = _through([_slice(0, 2), _slice(2, 5), _slice(5, 7)], x, step=3, micro=1)
    assert torch.equal(whole, parts)
    assert not torch.equal(whole, _through([_slice(0, 7)], x, step=4, micro=1))
    assert not torch.equal(whole, _through([_slice(0, 7)], x, step=3, micro=0))
    assert not torch.equal(whole, _through([_slice(0, 7, seed=6)], x, step=3, micro=1))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_forked_seeds_and_restores_the_cuda_generator() -> None:
    """On CUDA the device generator is seeded too (same mask twice) and restored after."""
    device = torch.device("cuda")
    drop = nn.Dropout(0.5).to(device)
    x = torch.ones(1000, device=device)
    masks = []
    for _ in range(2):
        with rng.forked(device) as seed_layer:
            seed_layer(rng.forward_seed(1, 2, 3, 4))
            masks.append(drop(x))
    assert torch.equal(masks[0], masks[1])
    torch.cuda.manual_seed(7)
    expected = torch.rand(5, device=device)
    torch.cuda.manual_seed(7)
    with rng.forked(device) as seed_layer:
        seed_layer(11)
        torch.rand(5, device=device)
    assert torch.equal(torch.rand(5, device=device), expected)
