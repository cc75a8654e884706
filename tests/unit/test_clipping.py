"""The clipping decision equals torch.nn.utils.clip_grad_norm_ on the whole model."""

from __future__ import annotations

import math

import pytest
import torch

from elasticpipe.training.clipping import GradClip, decide
from elasticpipe.v1 import stage_pb2


@pytest.mark.numerics
@pytest.mark.timeout(10)
@pytest.mark.parametrize("max_norm", [0.1, 1.0, 100.0])
def test_the_decision_equals_clip_grad_norm(max_norm: float) -> None:
    """Per-stage squared norms summed: same norm, same scaled gradients as torch."""
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(5, 3)) for _ in range(4)]
    for p in params:
        p.grad = torch.randn(5, 3, generator=g)
    grads = [p.grad.clone() for p in params if p.grad is not None]
    stages = [params[:1], params[1:3], params[3:]]
    sq = [sum(float(p.grad.double().pow(2).sum()) for p in s if p.grad is not None) for s in stages]
    norm, clip = decide(sq, max_norm)
    want = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    assert norm == pytest.approx(want, rel=1e-6)
    assert (clip.coef < 1.0) == (want > max_norm)
    for p, raw in zip(params, grads, strict=True):
        assert p.grad is not None
        torch.testing.assert_close(raw * torch.tensor(clip.coef, dtype=torch.float32), p.grad)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_non_finite_norm_skips(bad: float) -> None:
    """An inf or nan on any stage: the step is skipped, the norm says why."""
    norm, clip = decide([1.0, bad, 4.0], 1.0)
    assert clip == GradClip(skip=True) and not math.isfinite(norm)
    assert math.isnan(norm) == math.isnan(bad)


@pytest.mark.timeout(10)
def test_the_wire_form_round_trips_and_refuses_impossible_coefficients() -> None:
    """A coefficient outside [0, 1] is no clipping decision: refused."""
    clip = GradClip(coef=0.5)
    assert GradClip.from_proto(clip.to_proto()) == clip
    with pytest.raises(ValueError, match=r"1\.5"):
        GradClip.from_proto(stage_pb2.GradClip(coef=1.5))
