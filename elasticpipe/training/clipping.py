"""Global-norm gradient clipping across stages: the decision and how a stage applies it.

Each stage reports the sum of the squared 2-norms of its accumulated gradients with its
step report; the client adds them up, and decides one coefficient for the whole model,
exactly as ``torch.nn.utils.clip_grad_norm_`` does on one process::

    norm = sqrt(sum over stages of sq_norm)      # stages report 9.0 and 16.0: norm 5.0
    coef = min(1, max_norm / (norm + 1e-6))      # max_norm 1.0: coef 0.19999996

Every stage multiplies its gradients by ``coef`` before its optimizer step. The decision
travels with ``CommitStep`` and with the run's decision replayed in the next ``RunStep``
(a lost commit), so every stage applies the same one. A non-finite norm (an inf or nan
gradient anywhere) skips the optimizer step on every stage: the gradients are dropped,
the step still counts (``pipe.step`` advances, the scheduler steps), the weights and the
optimizer state stay as they were.

``precision="fp16"`` always decides (with or without ``max_grad_norm``): its stages report
the norms of their unscaled gradients, and an inf or nan one is an overflow that skips the
step everywhere (``elasticpipe.training.loss_scaling``).

Pure (no torch): the stage's ``LayerSlice.step`` applies the decision to its tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticpipe.v1 import stage_pb2

if TYPE_CHECKING:
    import structlog

EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


@dataclass(frozen=True)
class GradClip:
    """What a commit does to the accumulated gradients before the optimizer step.

    Attributes:
        coef: multiply them by this (0: leave them as they are).
        skip: the global norm was not finite: drop them, no optimizer step.
    """

    coef: float = 0.0
    skip: bool = False

    def to_proto(self) -> stage_pb2.GradClip:
        """The wire form."""
        return stage_pb2.GradClip(coef=self.coef, skip=self.skip)

    @classmethod
    def from_proto(cls, msg: stage_pb2.GradClip) -> GradClip:
        """Parses the wire form; a coefficient outside [0, 1] is refused.

        Raises:
            ValueError: a coefficient no clipping decision produces.
        """
        if not (0.0 <= msg.coef <= 1.0):
            raise ValueError(f"clip coefficient must be in [0, 1] (got {msg.coef})")
        return cls(coef=msg.coef, skip=msg.skip)


NO_CLIP = GradClip()


def decide(sq_norms: Sequence[float], max_norm: float | None) -> tuple[float, GradClip]:
    """The global norm and the clipping every stage applies.

    Args:
        sq_norms: each stage's sum of squared gradient norms.
        max_norm: the largest norm allowed (> 0); None: no clipping, only the skip on a
            non-finite norm (fp16 loss scaling, see ``elasticpipe.training.loss_scaling``).

    Returns:
        (norm, clip): ``clip.skip`` when the norm is not finite.
    """
    norm = math.sqrt(math.fsum(sq_norms)) if all(map(math.isfinite, sq_norms)) else math.inf
    if math.isnan(sum(sq_norms)):
        norm = math.nan
    if not math.isfinite(norm):
        return norm, GradClip(skip=True)
    if max_norm is None:
        return norm, NO_CLIP
    return norm, GradClip(coef=min(1.0, max_norm / (norm + EPS)))


def warn_if_skipped(
    log: structlog.stdlib.BoundLogger,
    step: int,
    norm: float | None,
    clip: GradClip,
    loss_scale: float | None,
) -> None:
    """Logs ``step_skipped`` (a warning, on the caller's logger) when ``clip`` skips the
    optimizer step: the event ``Pipeline`` and ``LocalPipeline`` both log for it.

    Args:
        log: the pipeline's logger.
        step: the step skipped.
        norm: the global gradient norm decided (None: none was).
        clip: the decision (``decide``'s).
        loss_scale: fp16's loss scale of the step; None for other precisions.
    """
    if clip.skip:
        log.warning(
            "step_skipped",
            step=step,
            grad_norm=norm,
            why="non-finite gradient norm",
            loss_scale=loss_scale,
        )
