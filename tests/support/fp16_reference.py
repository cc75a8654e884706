"""Plain PyTorch fp16 training on the whole model: what ``precision="fp16"`` must equal.

One optimizer over the whole model, every micro-batch's loss (its share of the mini-batch)
under ``torch.autocast("cpu", dtype=torch.float16)``, ``torch.amp.GradScaler`` scaling,
unscaling (then ``clip_grad_norm_`` if asked), stepping and updating, as its docs show for
gradient accumulation. It runs under a stage's thread count (``tests.support.numerics``).
"""

from __future__ import annotations

from typing import Any

import torch

from elasticpipe import models
from elasticpipe.training.objectives import loss_fn, make_optimizer
from elasticpipe.wire.structure import split_batch
from tests.support.numerics import stage_threads


class Fp16Reference:
    """The whole model, trained step by step with autocast and GradScaler."""

    def __init__(
        self,
        model: str,
        model_kwargs: dict[str, Any],
        seed: int,
        optimizer_kwargs: dict[str, Any],
        micro_batches: int,
        scaler_kwargs: dict[str, Any],
        max_norm: float | None = None,
    ) -> None:
        self.model = models.build(model, seed=seed, **model_kwargs)
        self.opt = make_optimizer("adam", self.model.parameters(), optimizer_kwargs)
        self.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
        self.micro_batches = micro_batches
        self.max_norm = max_norm
        self.loss = loss_fn("cross_entropy")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, bool, float | None]:
        """One step under a stage's thread count; returns (loss, the scale it used, whether
        it was skipped, the norm of the unscaled gradients when clipping)."""
        with stage_threads():
            self.opt.zero_grad(set_to_none=True)
            scale = self.scaler.get_scale()
            total = 0.0
            xs, ys, shares = split_batch(x, y, self.micro_batches, torch.device("cpu"))
            for xm, ym, share in zip(xs, ys, shares, strict=True):
                with torch.autocast("cpu", dtype=torch.float16):
                    out = self.model(xm)
                loss = self.loss(out.float(), ym) * share
                self.scaler.scale(loss).backward()
                total += float(loss.detach())
            self.scaler.unscale_(self.opt)
            norm = None
            if self.max_norm is not None:
                norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm))
            self.scaler.step(self.opt)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale
        return total, scale, skipped, norm
