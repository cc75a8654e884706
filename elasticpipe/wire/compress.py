"""Compressed activations between stages: what ``wire_dtype`` does to the tensors sent.

With ``wire_dtype="bf16"`` (or ``"fp16"``) a stage casts every float32 activation it sends
forward, and every float32 gradient it sends backward, to that dtype (half the bytes); the
receiver casts it back to float32 before computing with it. Everything on a stage stays
float32: weights, optimizer state, the loss, the gradients of its own layers. The effect
on the numbers is exactly that of rounding the tensor at each cut between two stages,
forward and backward, which ``cast`` reproduces in one process::

    y = wire.cast(x, "bf16")   # the forward value rounded to bf16, and its gradient too

bf16 keeps float32's range and 8 bits of mantissa (a relative error up to 2**-9 per
element); fp16 keeps 11 bits but overflows above 65504 (to inf) and flushes values
below about 6e-8 to zero, so it suits activations and gradients of modest range only.
"""

from __future__ import annotations

from typing import Any

import torch

from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


def encode(tensor: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """``tensor`` as it travels: float32 cast to ``wire_dtype`` ("" : unchanged)."""
    if wire_dtype and tensor.dtype == torch.float32:
        return tensor.to(DTYPES[wire_dtype])
    return tensor


def decode(tensor: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """A received tensor back in float32 (it arrived in ``wire_dtype``)."""
    if wire_dtype and tensor.dtype == DTYPES[wire_dtype]:
        return tensor.to(torch.float32)
    return tensor


def encode_value(value: Value, wire_dtype: str) -> Value:
    """``encode`` on each tensor of a tensor, tuple or flat dict (``elasticpipe.wire.structure``):
    every float32 tensor is cast, integer and bool tensors (ids, masks) travel unchanged."""
    if not wire_dtype:
        return value
    return structure.apply(value, lambda t: encode(t, wire_dtype))


def decode_value(value: Value, wire_dtype: str) -> Value:
    """``decode`` on each tensor of a received tensor, tuple or flat dict."""
    if not wire_dtype:
        return value
    return structure.apply(value, lambda t: decode(t, wire_dtype))


class _Cast(torch.autograd.Function):
    """Rounds the value forward and the gradient backward through ``wire_dtype``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, wire_dtype: str) -> torch.Tensor:
        ctx.wire_dtype = wire_dtype
        return decode(encode(x, wire_dtype), wire_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return decode(encode(grad, ctx.wire_dtype), ctx.wire_dtype), None


def cast(x: torch.Tensor, wire_dtype: str) -> torch.Tensor:
    """What the wire does to ``x`` at a cut between stages, in one process: the local
    reference of a pipeline with ``wire_dtype``."""
    out: torch.Tensor = _Cast.apply(x, wire_dtype)  # type: ignore[no-untyped-call]  # torch stub
    return out
