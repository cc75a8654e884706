"""``bench/overhead.py``'s job, which ``bench/anatomy.py`` and ``bench/ab.py`` measure too:
an MLP of 4 ``Linear(1024, 1024)`` with ReLUs between (7 layers, about 4.2 M parameters),
SGD, mean-squared error, batches of 256 in 4 micro-batches, and the same 8 mini-batches
for every side of a comparison."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["BATCH", "JOB", "MICRO_BATCHES", "NUM_BATCHES", "SIZES", "batches"]

SIZES = [1024] * 5
BATCH = 256
MICRO_BATCHES = 4
LOSS = "mse"
OPTIMIZER = "sgd"
OPTIMIZER_KWARGS = {"lr": 0.05}
NUM_BATCHES = 8  # distinct mini-batches, cycled
JOB: dict[str, Any] = {  # a Pipeline's job arguments (micro_batches apart)
    "model": "mlp",
    "model_kwargs": {"sizes": SIZES},
    "optimizer": OPTIMIZER,
    "optimizer_kwargs": OPTIMIZER_KWARGS,
    "loss": LOSS,
}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The mini-batches (inputs, targets), drawn from seed 1234: the same in every run."""
    gen = torch.Generator().manual_seed(1234)
    return [
        (torch.randn(BATCH, SIZES[0], generator=gen), torch.randn(BATCH, SIZES[-1], generator=gen))
        for _ in range(NUM_BATCHES)
    ]
