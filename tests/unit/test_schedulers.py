"""LR schedules by name: JSON-able arguments, one instance per layer equals one global
scheduler, state as JSON text."""

from __future__ import annotations

import json

import pytest
import torch
from torch.optim import lr_scheduler

from elasticpipe.errors import InvalidRequest
from elasticpipe.training import lr


def _lrs(scheduler: lr_scheduler.LRScheduler, opt: torch.optim.Optimizer, n: int) -> list[float]:
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


def _opt() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1, momentum=0.9)


@pytest.mark.timeout(10)
def test_warmup_then_the_scheduler() -> None:
    """warmup_steps=4: lr * k / 4 for steps 1-4, then the scheduler from its own start."""
    opt = _opt()
    got = _lrs(lr.build("StepLR", {"step_size": 1, "gamma": 0.5}, 4, opt), opt, 6)
    assert got == pytest.approx([0.025, 0.05, 0.075, 0.1, 0.1, 0.05])


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("CosineAnnealingLR", {"T_max": 5}),
        ("OneCycleLR", {"max_lr": 1.0, "total_steps": 8}),
        ("ChainedScheduler", {"schedulers": [{"name": "ExponentialLR", "kwargs": {"gamma": 0.9}}]}),
    ],
)
def test_the_state_round_trips_as_json(name: str, kwargs: dict[str, object]) -> None:
    """A scheduler loaded from its JSON state goes on exactly as the original."""
    opt = _opt()
    first = lr.build(name, kwargs, 0, opt)
    assert first is not None
    _lrs(first, opt, 3)
    text = lr.dumps(first)
    json.loads(text)
    opt2 = _opt()
    second = lr.build(name, kwargs, 0, opt2)
    assert second is not None
    opt2.load_state_dict(opt.state_dict())
    lr.loads(second, text, 0)
    assert _lrs(second, opt2, 4) == _lrs(first, opt, 4)


@pytest.mark.timeout(10)
def test_a_state_of_another_scheduler_is_refused() -> None:
    """Keys that do not fit the job's scheduler: InvalidRequest, nothing loaded."""
    opt = _opt()
    step = lr.build("StepLR", {"step_size": 2}, 0, opt)
    cosine = lr.build("CosineAnnealingLR", {"T_max": 2}, 0, opt)
    assert step is not None and cosine is not None
    with pytest.raises(InvalidRequest, match="has keys"):
        lr.loads(step, lr.dumps(cosine), 3)
    with pytest.raises(InvalidRequest, match="not JSON"):
        lr.loads(step, "{", 3)
