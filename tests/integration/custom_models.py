"""A user-defined model factory, importable by path (``tests.integration.custom_models:tiny``)."""

from __future__ import annotations

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
