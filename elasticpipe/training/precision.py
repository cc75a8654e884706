"""Mixed precision: the autocast context every layer's forward runs in, by job precision.

``precision="bf16"`` runs each layer's forward under ``torch.autocast(device_type,
dtype=torch.bfloat16)`` on the stage's device (CPU autocast supports bfloat16 too). Weights,
their gradients and the optimizer's state stay float32 (autocast casts a weight to
bfloat16 inside the op; the cast's backward returns a float32 gradient), so the optimizer
steps the float32 master weights. The loss is computed in float32 from the last layer's
output (``training.scaled_loss``). Activations between layers, and on the wire between
stages, are whatever the layer returns: bfloat16 for autocast's low-precision ops.

``precision="fp16"`` is the same with ``torch.float16``, plus dynamic loss scaling (float16
overflows past 65504 and underflows early): ``elasticpipe.training.loss_scaling``.

Because autocast decides per op, running the layers one by one with their inputs detached
(as a stage does) computes the same thing as running the whole model under one autocast.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["autocast"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """The context a layer's forward runs in: autocast for ``"bf16"`` and ``"fp16"``,
    nothing for fp32."""
    if precision in DTYPES:
        with torch.autocast(device.type, dtype=DTYPES[precision]):
            yield
    else:
        yield
