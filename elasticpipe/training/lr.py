"""Learning-rate schedules by name: built from JSON-able arguments, state kept as JSON.

A job names a class of ``torch.optim.lr_scheduler`` and its arguments (plain data, never
code). Every layer's optimizer gets its own instance: the schedulers allowed here set each
parameter group's learning rate from the step count and the group's own initial values
only, so one instance per layer equals one scheduler over the whole model's optimizer.
``SequentialLR`` and ``ChainedScheduler`` take their children as ``{"name": ...,
"kwargs": {...}}``::

    build("SequentialLR", {"schedulers": [
              {"name": "LinearLR", "kwargs": {"start_factor": 0.1, "total_iters": 5}},
              {"name": "CosineAnnealingLR", "kwargs": {"T_max": 95}}],
          "milestones": [5]}, warmup_steps=0, optimizer=opt)

``warmup_steps=N`` (N >= 2) puts a linear warm-up first: the learning rate of step k
(k = 1..N) is ``lr * k / N``; from step N + 1 on the named scheduler runs from its own
start (``SequentialLR`` with milestone N).

A scheduler's state travels with its layer (migrations, snapshots, checkpoints) as the
JSON text of its ``state_dict()`` (``dumps`` / ``loads``): never pickled.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim import lr_scheduler

from elasticpipe.errors import InvalidRequest

Scheduler = lr_scheduler.LRScheduler

# Every class whose arguments are plain data and whose learning rate depends on the step
# count only (LambdaLR needs code; ReduceLROnPlateau needs a metric).
SIMPLE = (
    "ConstantLR",
    "CosineAnnealingLR",
    "CosineAnnealingWarmRestarts",
    "CyclicLR",
    "ExponentialLR",
    "LinearLR",
    "MultiStepLR",
    "OneCycleLR",
    "PolynomialLR",
    "StepLR",
)
NESTED = ("ChainedScheduler", "SequentialLR")
SCHEDULERS = tuple(sorted(SIMPLE + NESTED))
MAX_WARMUP_STEPS = 10_000_000
MAX_DEPTH = 4


def check_name(name: str) -> None:
    """Raises InvalidRequest for a scheduler name that is not allowed ("" is none)."""
    if name and name not in SCHEDULERS:
        raise InvalidRequest(
            f"unknown scheduler {name!r} (choose from {', '.join(SCHEDULERS)}; "
            "LambdaLR and ReduceLROnPlateau are not supported: they need code or a metric)"
        )


def _one(name: str, kwargs: Any, optimizer: torch.optim.Optimizer, depth: int) -> Scheduler:
    check_name(name)
    if not name:
        raise InvalidRequest("a nested scheduler needs a name")
    if not isinstance(kwargs, Mapping):
        raise InvalidRequest(f"scheduler {name!r}: kwargs must be an object (got {kwargs!r})")
    args = dict(kwargs)
    if "optimizer" in args:
        raise InvalidRequest(f"scheduler {name!r}: 'optimizer' is set by the stage, not kwargs")
    if name in NESTED:
        if depth >= MAX_DEPTH:
            raise InvalidRequest(f"scheduler {name!r} nested deeper than {MAX_DEPTH}")
        children = args.pop("schedulers", None)
        if not isinstance(children, list) or not children:
            raise InvalidRequest(
                f"scheduler {name!r} needs 'schedulers': a list of "
                '{"name": ..., "kwargs": {...}} (got ' + repr(children)[:80] + ")"
            )
        built = []
        for child in children:
            if not isinstance(child, Mapping) or set(child) - {"name", "kwargs"}:
                raise InvalidRequest(
                    f"scheduler {name!r}: each child must be "
                    '{"name": ..., "kwargs": {...}} (got ' + repr(child)[:80] + ")"
                )
            built.append(
                _one(str(child.get("name", "")), child.get("kwargs", {}), optimizer, depth + 1)
            )
        args["schedulers"] = built
    args["optimizer"] = optimizer
    cls = getattr(lr_scheduler, name)
    try:
        scheduler: Scheduler = cls(**args)
    except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
        raise InvalidRequest(f"scheduler {name!r} rejected {dict(kwargs)}: {exc}") from exc
    return scheduler


def build(
    name: str, kwargs: Mapping[str, Any], warmup_steps: int, optimizer: torch.optim.Optimizer
) -> Scheduler | None:
    """The scheduler of ``optimizer``; None without a schedule (constant learning rate).

    Raises:
        InvalidRequest: an unknown name, arguments the class rejects, a bad warm-up.
    """
    if not 0 <= warmup_steps <= MAX_WARMUP_STEPS:
        raise InvalidRequest(
            f"warmup_steps must be in [0, {MAX_WARMUP_STEPS}] (got {warmup_steps})"
        )
    if not name and kwargs:
        raise InvalidRequest(f"scheduler_kwargs {dict(kwargs)} given without a scheduler")
    main = _one(name, kwargs, optimizer, 0) if name else None
    if warmup_steps < 2:
        return main
    warmup = lr_scheduler.LinearLR(
        optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0, total_iters=warmup_steps - 1
    )
    if main is None:
        return warmup
    return lr_scheduler.SequentialLR(optimizer, [warmup, main], milestones=[warmup_steps])


def check(name: str, kwargs: Mapping[str, Any], warmup_steps: int) -> None:
    """Fails early, on the client, for a schedule a stage would refuse: builds it on a
    dummy optimizer, steps it and checks that its state is JSON-able.

    Raises:
        InvalidRequest: see ``build``; or a state that JSON cannot hold.
    """
    try:
        json.dumps(dict(kwargs))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"scheduler_kwargs must be JSON-able: {exc}") from exc
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build(name, kwargs, warmup_steps, optimizer)
    if scheduler is None:
        return
    optimizer.step()
    scheduler.step()
    loads(scheduler, dumps(scheduler), "the check")
    if not all(math.isfinite(lr) for lr in scheduler.get_last_lr()):
        raise InvalidRequest(f"scheduler {name!r} with {dict(kwargs)} gives a non-finite lr")


def dumps(scheduler: Scheduler) -> str:
    """The scheduler's state as JSON text.

    Raises:
        InvalidRequest: the state holds something JSON cannot (a function, say).
    """
    try:
        return json.dumps(scheduler.state_dict(), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(
            f"the state of scheduler {type(scheduler).__name__} is not JSON-able: {exc}"
        ) from exc


def loads(scheduler: Scheduler, text: str, layer: object) -> None:
    """Restores a state written by ``dumps`` (load the optimizer's state first).

    Raises:
        InvalidRequest: not JSON, or a state of another scheduler.
    """
    try:
        state = json.loads(text)
    except (json.JSONDecodeError, RecursionError, TypeError) as exc:
        raise InvalidRequest(f"scheduler state of layer {layer} is not JSON: {exc}") from exc
    if not isinstance(state, dict):
        raise InvalidRequest(f"scheduler state of layer {layer} is not an object")
    expected = set(scheduler.state_dict())
    if set(state) != expected:
        raise InvalidRequest(
            f"scheduler state of layer {layer} has keys {sorted(state)}, "
            f"{type(scheduler).__name__} has {sorted(expected)}"
        )
    try:
        scheduler.load_state_dict(state)
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise InvalidRequest(f"scheduler state of layer {layer} is unusable: {exc}") from exc


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate the next optimizer step applies (first parameter group's)."""
    return float(optimizer.param_groups[0]["lr"])
