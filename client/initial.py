"""Initial weights for a new job (``Pipeline(..., init_state=...)``): checked against the
model on the client, then handed out one layer at a time to the stages that own it."""

from __future__ import annotations

import warnings
from typing import Any

from elasticpipe.logs import get_logger
from elasticpipe.models import weights
from elasticpipe.security import allowlist
from elasticpipe.training.job import JobConfig

log = get_logger(__name__)

HF_MODEL = "elasticpipe.models.hf:causal_lm"


class InitialWeights:
    """A checked plan of where each layer's tensors come from."""

    def __init__(self, plan: weights.LoadPlan):
        self._plan = plan

    def layer_state(self, layer: int) -> dict[str, Any]:
        """Layer ``layer``'s state as a stage loads it: weights only (a fresh optimizer)."""
        return {"index": layer, "model": self._plan.layer_state(layer)}

    def close(self) -> None:
        """Closes the files."""
        self._plan.source.close()


def check(job: JobConfig, init_state: Any) -> InitialWeights:
    """Opens ``init_state`` and checks it fits the job's model, touching no stage.

    Warns:
        UserWarning: tied weights in the files (one tensor read into several of the
            model's keys), which are then trained as separate tensors.

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
    _warn_untied(job, plan)
    return InitialWeights(plan)


def _warn_untied(job: JobConfig, plan: weights.LoadPlan) -> None:
    """Warns of each file tensor that starts several of the model's tensors (a tied
    embedding and LM head): they are trained apart and differ after the first step."""
    readers: dict[str, list[str]] = {}
    for key, source_key in plan.keys.items():
        readers.setdefault(source_key, []).append(key)
    for source_key, keys in sorted(readers.items()):
        if len(keys) < 2:
            continue
        log.warning("tied_weights_untied", source=source_key, keys=keys)
        export = (
            " elasticpipe.models.hf.save_pretrained writes them back untied "
            "(tie_word_embeddings=false) once they differ, so that from_pretrained "
            "predicts what the pipeline predicts."
            if allowlist.current_path(job.model) == HF_MODEL
            else ""
        )
        warnings.warn(
            f"init_state: {' and '.join(repr(k) for k in keys)} all start from the one "
            f"tensor {source_key!r} (tied weights) but are trained as {len(keys)} separate "
            f"tensors, which differ after the first step.{export}",
            UserWarning,
            stacklevel=4,  # at Pipeline(...) or LocalPipeline(...) in the user's code
        )
