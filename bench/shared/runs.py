"""What the failure benches share: the GPT job they train, its batches, and the check that
a run with failures ended where the failure-free run did."""

from __future__ import annotations

from typing import Any

import torch

from elasticpipe.client.pipeline import Pipeline


def token_batch(step: int, vocab: int, rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s next-token batch: ``rows`` sequences of ``seq`` tokens and targets."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def gpt_pipeline(coordinator: str, model: dict[str, int], stages: int, **extra: Any) -> Pipeline:
    """The benches' GPT job (seed 0, Adam at 1e-3, 4 micro-batches) on ``stages`` stages;
    ``extra`` adds or overrides Pipeline arguments."""
    options: dict[str, Any] = {
        "model": "gpt",
        "model_kwargs": model,
        "seed": 0,
        "optimizer": "adam",
        "optimizer_kwargs": {"lr": 1e-3},
        "micro_batches": 4,
        "stages": stages,
        **extra,
    }
    return Pipeline(coordinator=coordinator, **options)


def identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float]:
    """Whether two state dicts are bitwise equal, and their largest difference."""
    if a.keys() != b.keys():
        return False, float("inf")
    worst = max((float((a[k].float() - b[k].float()).abs().max()) for k in a), default=0.0)
    return all(torch.equal(a[k], b[k]) for k in a), worst
