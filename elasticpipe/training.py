"""Losses and optimizers by name: the pieces a stage and the reference both need.

Stages keep one optimizer per layer: for SGD, Adam and AdamW every update is elementwise per
parameter, so per-layer optimizers step exactly as one optimizer over the whole model would,
and a layer's optimizer state can move with the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from elasticpipe.errors import InvalidRequest

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # Sequence models produce (B, T, V) logits for (B, T) targets: every token counts once.
    if output.dim() > 2:
        return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
    return F.cross_entropy(output, target)


def _mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


LOSSES: dict[str, LossFn] = {"cross_entropy": _cross_entropy, "mse": _mse}

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def loss_fn(name: str) -> LossFn:
    """The mean-reduced loss called ``name``.

    Raises:
        InvalidRequest: unknown name.
    """
    try:
        return LOSSES[name]
    except KeyError:
        raise InvalidRequest(f"unknown loss {name!r} (choose from {sorted(LOSSES)})") from None


def make_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], kwargs: Mapping[str, Any]
) -> torch.optim.Optimizer:
    """Builds optimizer ``name`` over ``params``.

    Raises:
        InvalidRequest: unknown optimizer, or arguments it rejects.
    """
    try:
        cls = OPTIMIZERS[name]
    except KeyError:
        raise InvalidRequest(
            f"unknown optimizer {name!r} (choose from {sorted(OPTIMIZERS)})"
        ) from None
    try:
        return cls(list(params), **dict(kwargs))
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"optimizer {name!r} rejected {dict(kwargs)}: {exc}") from exc


def check_optimizer(name: str, kwargs: Mapping[str, Any]) -> None:
    """Fails early, on the client, for an optimizer a stage would refuse."""
    make_optimizer(name, [torch.nn.Parameter(torch.zeros(1))], kwargs)


def reference_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_name: str,
    inputs: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    """One ordinary single-process training step: the behaviour a pipeline must reproduce."""
    optimizer.zero_grad(set_to_none=True)
    loss = loss_fn(loss_name)(model(inputs), targets)
    torch.autograd.backward(loss)
    optimizer.step()
    return float(loss.detach())
