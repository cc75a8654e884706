"""The MLP jobs the tests build, spelled once: a test names the layer widths and what it
varies (seed, optimizer, micro-batches, stages, ...), not the model's name and wrapping.

``mlp(cluster.coordinator, sizes=[8, 16, 4], stages=3)`` is
``Pipeline(coordinator=cluster.coordinator, model="mlp", model_kwargs={"sizes": [8, 16, 4]},
stages=3)``; ``local_mlp(sizes=...)`` is the same job as a ``LocalPipeline``. A module that
keeps its model as ``KWARGS = {"sizes": [...]}`` (for ``models.build("mlp", **KWARGS)``)
passes ``**KWARGS``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.reference import LocalPipeline


def mlp(coordinator: str, *, sizes: Sequence[int], **options: Any) -> Pipeline:
    """A ``Pipeline`` on ``coordinator`` training the built-in MLP of layer widths ``sizes``;
    ``options`` are the Pipeline's other arguments."""
    return Pipeline(coordinator=coordinator, model="mlp", model_kwargs=_kwargs(sizes), **options)


def local_mlp(*, sizes: Sequence[int], **options: Any) -> LocalPipeline:
    """The same job as ``mlp`` in this process (a ``LocalPipeline``); ``options`` are its
    other arguments."""
    return LocalPipeline(model="mlp", model_kwargs=_kwargs(sizes), **options)


def _kwargs(sizes: Sequence[int]) -> dict[str, Any]:
    return {"sizes": list(sizes)}


def mlp_batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` mini-batches of 8 samples of 8 features and class ids in [0, 4), drawn from
    ``seed``: the data of an MLP of ``sizes=[8, ..., 4]``."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(n)
    ]
