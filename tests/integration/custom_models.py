"""A user-defined model factory, importable by path (``tests.integration.custom_models:tiny``)."""

from __future__ import annotations

import torch
from torch import nn


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
