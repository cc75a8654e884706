"""Initial weights for a new job (``Pipeline(..., init_state=...)``): checked against the
model on the client, then handed out one layer at a time to the stages that own it."""

from __future__ import annotations

from typing import Any

from elasticpipe.models import weights
from elasticpipe.training.job import JobConfig


class InitialWeights:
    """A checked plan of where each layer's tensors come from."""

    def __init__(self, plan: weights.Plan):
        self._plan = plan

    def layer_state(self, layer: int) -> dict[str, Any]:
        """Layer ``layer``'s state as a stage loads it: weights only (a fresh optimizer)."""
        return {"index": layer, "model": self._plan.layer_state(layer)}

    def close(self) -> None:
        """Closes the files."""
        self._plan.source.close()


def check(job: JobConfig, init_state: Any) -> InitialWeights:
    """Opens ``init_state`` and checks it fits the job's model, touching no stage.

    Raises:
        InvalidRequest: unreadable, or missing/unexpected keys or wrong shapes (named).
    """
    expected, _ = weights.expected_state(job.model, job.model_kwargs)
    source = weights.open_source(init_state)
    try:
        plan = weights.plan(source, expected, weights.source_keys(job.model, job.model_kwargs))
    except BaseException:
        source.close()
        raise
    return InitialWeights(plan)
