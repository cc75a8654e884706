"""bf16 mixed precision: ``LocalPipeline(precision="bf16")`` against plain PyTorch autocast."""

from __future__ import annotations

import pytest
import torch

from elasticpipe import models
from elasticpipe.errors import InvalidRequest
from elasticpipe.local.reference import LocalPipeline
from elasticpipe.training.objectives import loss_fn, make_optimizer

GPT = {"vocab_size": 17, "d_model": 16, "n_heads": 2, "n_layers": 2, "max_seq_len": 8}
ADAM = {"lr": 1e-2}
STEPS = 4


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, 17, (n, 8), generator=g)
        out.append((x, torch.roll(x, -1, dims=1)))
    return out


def _autocast_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    x: torch.Tensor,
    y: torch.Tensor,
    micro_batches: int,
) -> float:
    """Plain PyTorch: autocast around the whole model, float32 loss, gradients accumulated
    over ``micro_batches`` chunks (1: the whole batch at once)."""
    opt.zero_grad(set_to_none=True)
    fn = loss_fn("cross_entropy")
    total = 0.0
    for xs, ys in zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches), strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(xs)
        loss = fn(out.float(), ys) * (xs.shape[0] / x.shape[0])
        loss.backward()
        total += float(loss.detach())
    opt.step()
    return total


@pytest.mark.numerics
@pytest.mark.timeout(60)
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_bf16_equals_plain_autocast_with_the_same_micro_batches(micro_batches: int) -> None:
    """Layer-by-layer autocast computes exactly what autocast around the whole model does:
    same losses and float32 weights, bit for bit, given the same micro-batches."""
    reference = models.build("gpt", seed=2, **GPT)
    opt = make_optimizer("adam", reference.parameters(), ADAM)
    pipe = LocalPipeline(
        "gpt", GPT, seed=2, optimizer_kwargs=ADAM, micro_batches=micro_batches, precision="bf16"
    )
    for x, y in _batches(6):
        want = _autocast_step(reference, opt, x, y, micro_batches)
        assert pipe.train_step(x, y) == pytest.approx(want, rel=1e-6, abs=0)
    state = pipe.state_dict()
    for key, value in reference.state_dict().items():
        assert state[key].dtype == value.dtype == torch.float32 or not value.is_floating_point()
        assert torch.equal(state[key], value), key


@pytest.mark.numerics
@pytest.mark.timeout(60)
def test_bf16_micro_batches_stay_close_to_whole_batch_autocast() -> None:
    """With 3 micro-batches against one whole-batch autocast step, bf16 rounding differs per
    chunk: losses agree within 1% (the documented tolerance), and differ from fp32's."""
    reference = models.build("gpt", seed=2, **GPT)
    opt = make_optimizer("adam", reference.parameters(), ADAM)
    pipe = LocalPipeline(
        "gpt", GPT, seed=2, optimizer_kwargs=ADAM, micro_batches=3, precision="bf16"
    )
    fp32 = LocalPipeline("gpt", GPT, seed=2, optimizer_kwargs=ADAM, micro_batches=3)
    differs = False
    for x, y in _batches(6):
        want = _autocast_step(reference, opt, x, y, 1)
        got = pipe.train_step(x, y)
        assert got == pytest.approx(want, rel=1e-2)
        differs |= got != fp32.train_step(x, y)
    assert differs, "bf16 computed exactly what fp32 did: autocast was not applied"


def test_unknown_precision_is_refused_naming_it() -> None:
    """precision="fp8" is refused with the choices."""
    with pytest.raises(InvalidRequest, match="unknown precision 'fp8'"):
        LocalPipeline("mlp", precision="fp8")
