"""fp16 dynamic loss scaling: LocalPipeline equals plain PyTorch autocast + GradScaler, the
scale's arithmetic is GradScaler's, and bad arguments or states are refused by name."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest
import torch

from elasticpipe.errors import InvalidRequest
from elasticpipe.local.reference import LocalPipeline
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.training import clipping
from elasticpipe.training.job import JobConfig
from elasticpipe.training.loss_scaling import LossScale, check_kwargs
from tests.support.fp16_reference import Fp16Reference
from tests.support.numerics import stage_threads

KWARGS = {"sizes": [12, 24, 24, 24, 6]}
ADAM = {"lr": 2e-2}
# 2**40 overflows float16 gradients: the first steps are skipped while the scale backs off
# by 2**-8; then it grows x16 every 3 clean steps, until it overflows again.
SCALER = {
    "init_scale": 2.0**40,
    "backoff_factor": 2.0**-8,
    "growth_factor": 16.0,
    "growth_interval": 3,
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(10, 12, generator=g) * 3, torch.randint(0, 6, (10,), generator=g)


@pytest.mark.numerics
@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_norm", [None, 0.5])
def test_local_fp16_equals_autocast_and_grad_scaler(max_norm: float | None) -> None:
    """Same skipped steps, same scale at every step, same losses, norms and weights: one
    process runs the same ops in the same order as plain PyTorch, so exactly; with clipping
    the weights within float32 tolerance (the global norm is summed in float64 here,
    clip_grad_norm_ sums in float32: the coefficient may differ in its last bit)."""
    reference = Fp16Reference("mlp", KWARGS, 4, ADAM, 3, SCALER, max_norm)
    local = LocalPipeline(
        "mlp",
        KWARGS,
        seed=4,
        optimizer_kwargs=ADAM,
        micro_batches=3,
        precision="fp16",
        grad_scaler_kwargs=SCALER,
        max_grad_norm=max_norm or 0.0,
    )
    skipped, scales = [], []
    for step in range(1, 12):
        x, y = _batch(step)
        with stage_threads():  # the thread count the reference's steps run under
            got = local.train_step(x, y)
        want, scale, skip, norm = reference.step(x, y)
        assert got == want, f"loss of step {step}"
        assert local.last_step.loss_scale == scale, f"scale of step {step}"
        assert (not math.isfinite(local.last_step.grad_norm or 0.0)) == skip, f"step {step}"
        if norm is not None and not skip:
            assert local.last_step.grad_norm == pytest.approx(norm, rel=1e-6)
        skipped.append(skip)
        scales.append(scale)
    assert skipped[:3] == [True] * 3 and not all(skipped[3:]) and any(skipped[3:])
    assert any(b > a for a, b in itertools.pairwise(scales)), "it must grow too"
    state = local.state_dict()
    for key, value in reference.model.state_dict().items():
        if max_norm is None:
            assert torch.equal(state[key], value), key
        else:
            torch.testing.assert_close(state[key], value, msg=key)


def test_the_scale_updates_as_grad_scaler_does() -> None:
    """Any sequence of skipped and clean steps (an inf gradient or a finite one through
    GradScaler.step and update): the same scale and tracker as GradScaler, at every step;
    factors that are not powers of two round as GradScaler's float32 scale does."""
    kwargs = check_kwargs(
        {"init_scale": 3.0, "growth_factor": 1.7, "backoff_factor": 0.3, "growth_interval": 2}
    )
    ours = LossScale.initial(kwargs)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler.scale(torch.ones(()))  # GradScaler creates its scale on first use
    for found_inf in [False, False, False, True, False, False, True, True, False, False] * 2:
        param.grad = torch.tensor([math.inf if found_inf else 1.0])
        scaler.step(opt)
        scaler.update()
        ours.update(found_inf, kwargs)
        assert ours.scale == scaler.get_scale()
        assert ours.growth_tracker == int(scaler._growth_tracker)
    assert ours.scale != 3.0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"grad_scaler_kwargs": {"init_scal": 2.0}}, "unknown grad_scaler_kwargs key 'init_scal'"),
        ({"grad_scaler_kwargs": {"growth_factor": 1.0}}, r"\['growth_factor'\] must be a finite"),
        ({"grad_scaler_kwargs": {"backoff_factor": 1.5}}, r"\['backoff_factor'\] must be in"),
        ({"grad_scaler_kwargs": {"growth_interval": 0}}, r"\['growth_interval'\] must be in"),
        ({"grad_scaler_kwargs": {"growth_interval": 2.5}}, "must be an integer"),
        ({"grad_scaler_kwargs": {"init_scale": "big"}}, r"\['init_scale'\] must be a number"),
        ({"grad_scaler_kwargs": {"init_scale": math.inf}}, r"\['init_scale'\] must be > 0"),
        ({"grad_scaler_kwargs": {"init_scale": 1e39}}, "finite float32"),
        ({"grad_scaler_kwargs": {"init_scale": 1e-50}}, "finite float32"),  # rounds to 0
        ({"grad_scaler_kwargs": {"init_scale": 10**400}}, r"\['init_scale'\] is too large"),
        ({"grad_scaler_kwargs": [2.0]}, "must be a dict"),
        ({"grad_scaler_kwargs": {"init_scale": 8.0}, "precision": "bf16"}, "need precision='fp16'"),
        ({"grad_scaler_kwargs": {"growth_interval": 3}, "precision": "fp32"}, "need precision"),
    ],
)
def test_bad_grad_scaler_kwargs_are_refused(options: dict[str, Any], message: str) -> None:
    options = {"precision": "fp16", **options}
    with pytest.raises(InvalidRequest, match=message):
        LocalPipeline("mlp", KWARGS, **options)


def _slice() -> LayerSlice:
    job = JobConfig(
        model="mlp",
        model_kwargs=KWARGS,
        precision="fp16",
        grad_scaler_kwargs={"init_scale": 1024.0},
    )
    layers = LayerSlice(job, torch.device("cpu"), Slowdown())
    layers.build(0, 3)
    return layers


def test_a_moved_layer_carries_its_scale_and_a_bad_one_is_refused() -> None:
    """export_layer then load_layer: the scale and tracker travel (a parameter-less layer
    too); weights alone start from init_scale; an unusable state is named."""
    source = _slice()
    for i in source.scales:
        source.scales[i] = LossScale(64.0, 2)
    for index in (0, 1):  # a Linear and a ReLU
        state = source.export_layer(index, include_optimizer=True)
        assert state["loss_scale"] == {"scale": 64.0, "growth_tracker": 2}
        built = _slice().load_layer(index, state)
        assert built.loss_scale == LossScale(64.0, 2)
        weights_only = source.export_layer(index, include_optimizer=False)
        assert _slice().load_layer(index, weights_only).loss_scale == LossScale(1024.0, 0)
    underflowed = source.export_layer(0, include_optimizer=True)
    underflowed["loss_scale"] = {"scale": 0.0, "growth_tracker": 0}  # backed off to 0
    assert _slice().load_layer(0, underflowed).loss_scale == LossScale(0.0, 0)
    for bad in (
        {"scale": -1.0, "growth_tracker": 0},
        {"scale": 2.0},
        "64",
        {"scale": math.nan, "growth_tracker": 0},
    ):
        state = source.export_layer(0, include_optimizer=True)
        state["loss_scale"] = bad
        with pytest.raises(InvalidRequest, match="loss scale state of layer 0 is unusable"):
            _slice().load_layer(0, state)


def test_without_clipping_the_decision_only_skips() -> None:
    """max_norm None (fp16 without max_grad_norm): the norm, no coefficient (the gradients
    stay untouched), and a skip when any stage's norm is not finite."""
    assert clipping.decide([9.0, 16.0], None) == (5.0, clipping.NO_CLIP)
    norm, clip = clipping.decide([9.0, math.inf], None)
    assert norm == math.inf and clip.skip
    norm, clip = clipping.decide([math.nan, 1.0], None)
    assert math.isnan(norm) and clip.skip
