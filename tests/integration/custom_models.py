"""User-defined model factories, a loss and an optimizer, importable by path
(``tests.integration.custom_models:tiny``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.integration import custom_losses


def tiny(width: int = 8, classes: int = 3) -> nn.Sequential:
    """Three layers: Linear, Tanh, Linear."""
    return nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, classes))


def normed(width: int = 8, classes: int = 3) -> nn.Sequential:
    """Layers whose train and eval behaviour differ: Linear, BatchNorm1d, ReLU, Dropout."""
    return nn.Sequential(
        nn.Linear(width, 2 * width),
        nn.BatchNorm1d(2 * width),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(2 * width, classes),
    )


def dropout(width: int = 8, classes: int = 3, p: float = 0.1) -> nn.Sequential:
    """Seven layers with two Dropouts (random in training): Linear, Dropout, ReLU, Linear,
    Dropout, ReLU, Linear."""
    return nn.Sequential(
        nn.Linear(width, 4 * width),
        nn.Dropout(p),
        nn.ReLU(),
        nn.Linear(4 * width, 4 * width),
        nn.Dropout(p),
        nn.ReLU(),
        nn.Linear(4 * width, classes),
    )


def half_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A custom loss: half the mean squared error (mean over the micro-batch)."""
    return 0.5 * F.mse_loss(output, target)


reexported_loss = custom_losses.half_mse  # allowed module, callable from one that is not


class GlobalNormSGD(torch.optim.Optimizer):
    """SGD on gradients scaled by their global norm: not per-parameter (refused)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        """Steps every parameter by ``lr * grad / ||all grads||``."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((g * g).sum() for g in grads)) if grads else torch.tensor(1.0)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])


def no_optimizer(params: Any, lr: float = 0.1) -> list[Any]:
    """Takes an optimizer's arguments but returns no optimizer (refused)."""
    return list(params)


class Scale(nn.Module):
    """Multiplies by a learned vector set in ``__init__``: it has no ``reset_parameters()``,
    as many library layers do not (a seed cannot initialise it; ``init_state`` can)."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def no_reset(width: int = 6, classes: int = 3) -> nn.Sequential:
    """Linear, Scale (no reset_parameters), Tanh, Linear."""
    return nn.Sequential(nn.Linear(width, 12), Scale(12), nn.Tanh(), nn.Linear(12, classes))
