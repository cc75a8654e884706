"""Training semantics that Pipeline and LocalPipeline share: the job, schedules, losses and
optimizers, learning rates, precision, loss scaling, clipping, randomness and the canonical
gradient sum.

* ``clipping``: Global-norm gradient clipping across stages: the decision and how a stage
  applies it.
* ``gradsum``: The canonical sum of a step's micro-batch gradients: one fixed binary tree,
  the same bits for any split among replicas and any order of arrival.
* ``job``: A training job's description, parsed once from its protobuf form and validated.
* ``loss_scaling``: Dynamic loss scaling for ``precision="fp16"``, with
  ``torch.amp.GradScaler``'s semantics.
* ``lr``: Learning-rate schedules by name: built from JSON-able arguments, state kept as JSON.
* ``objectives``: Losses and optimizers by name: the pieces a stage and the reference both need.
* ``precision``: Mixed precision: the autocast context every layer's forward runs in, by job
  precision.
* ``rng``: Reproducible randomness: every layer's forward draws from an RNG seeded by (job seed,
  step, micro-batch, layer), so a step computes the same thing wherever and however often it
  runs (design invariant 6).
* ``schedule``: Pipeline schedules: the ordered forward/backward ops each stage runs in one
  step.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticpipe.training.clipping import GradClip
    from elasticpipe.training.job import JobConfig
    from elasticpipe.training.loss_scaling import LossScale
    from elasticpipe.training.schedule import SCHEDULES, Op, OpKind

__all__ = ["SCHEDULES", "GradClip", "JobConfig", "LossScale", "Op", "OpKind"]

# Imported on first use, so that what needs only ``schedule`` (``elasticpipe admin``, by way
# of the traces' efficiency) starts without importing torch.
_HOMES = {"GradClip": "clipping", "JobConfig": "job", "LossScale": "loss_scaling"}
_HOMES |= {name: "schedule" for name in ("SCHEDULES", "Op", "OpKind")}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
