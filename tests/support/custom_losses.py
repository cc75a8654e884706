"""A custom loss in a module that the reproducibility tests' stages do not allow."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def half_mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Half the mean squared error."""
    return 0.5 * F.mse_loss(output, target)
