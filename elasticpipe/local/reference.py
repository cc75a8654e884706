"""``LocalPipeline``: the single-process reference, with the semantics of ``Pipeline``.

::

    with LocalPipeline(model="mlp", model_kwargs={"sizes": [32, 64, 10]},
                       micro_batches=4) as pipe:
        loss = pipe.train_step(inputs, targets)   # same loss as Pipeline, bit for bit
        out = pipe.predict(inputs)
        sd = pipe.state_dict()

It runs the whole model through the code a stage runs (``LayerSlice``): the same
micro-batches, each layer on its own with its input detached, the loss of micro-batch ``i``
scaled by its share of the mini-batch, gradients summed in the canonical tree over the
micro-batches (``training.gradsum``), one
optimizer per layer stepped once per mini-batch, and every layer's forward seeded by
(job seed, step, micro-batch, layer) (``elasticpipe.training.rng``). A model with dropout therefore
trains exactly as it does on any number of stages, across migrations and replays; a model
without randomness trains as ordinary PyTorch does (up to the rounding of summing
micro-batch gradients, none with one micro-batch).

Model factories, losses and optimizers given as ``"package.module:name"`` are imported as
they are: this is the user's own process importing the user's own code, so no allow-list
applies -- unless ``allow`` gives one, which is then checked as a stage checks its
``--allow-models``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from elasticpipe import models
from elasticpipe.client import initial
from elasticpipe.client.pipeline import StepStats
from elasticpipe.errors import PipelineClosed
from elasticpipe.logs import get_logger
from elasticpipe.security import allowlist
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.training import clipping
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import check_job, scaled_loss
from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value, split_batch

log = get_logger(__name__)


class LocalPipeline:
    """A model trained in this process exactly as ``Pipeline`` trains it across stages."""

    def __init__(
        self,
        model: str,
        model_kwargs: dict[str, Any] | None = None,
        seed: int = 0,
        optimizer: str = "adam",
        optimizer_kwargs: dict[str, Any] | None = None,
        loss: str = "cross_entropy",
        micro_batches: int = 4,
        schedule: str = "1f1b",
        device: str | torch.device = "cpu",
        allow: Sequence[str] | None = None,
        init_state: Any = None,
        precision: str = "fp32",
        grad_scaler_kwargs: dict[str, Any] | None = None,
        scheduler: str = "",
        scheduler_kwargs: dict[str, Any] | None = None,
        warmup_steps: int = 0,
        max_grad_norm: float = 0.0,
        recompute: bool | list[int] | tuple[int, ...] = False,
    ):
        """Builds the model and its per-layer optimizers.

        Args:
            model, model_kwargs, seed, optimizer, optimizer_kwargs, loss, micro_batches:
                as for ``Pipeline``.
            schedule: accepted for symmetry with ``Pipeline``; one process runs each
                micro-batch's forward then backward; its gradients are summed in the same
                canonical tree as every schedule's (the order backward passes end in does
                not change the sum).
            device: where the layers live.
            allow: module prefixes allowed for ``"package.module:name"`` factories,
                losses and optimizers (what ``--allow-models`` is to a stage); None (the
                default): any module.
            init_state: initial weights, as for ``Pipeline`` (checked the same way).
            precision, grad_scaler_kwargs: as for ``Pipeline`` ("fp32", "bf16" or "fp16",
                with fp16's dynamic loss scaling).
            scheduler, scheduler_kwargs, warmup_steps, max_grad_norm, recompute: as for
                ``Pipeline``. (``wire_dtype`` has no counterpart: one process has no cuts
                between stages to round at.)

        Raises:
            InvalidRequest: an argument that ``Pipeline``'s stages would refuse.
            PermissionDenied: a path outside ``allow``.
        """
        self._job = JobConfig.from_arguments(
            model=model,
            model_kwargs=model_kwargs,
            seed=seed,
            optimizer=optimizer,
            optimizer_kwargs=optimizer_kwargs,
            loss=loss,
            micro_batches=micro_batches,
            schedule=schedule,
            external_weights=init_state is not None,
            precision=precision,
            grad_scaler_kwargs=grad_scaler_kwargs,
            scheduler=scheduler,
            scheduler_kwargs=scheduler_kwargs,
            warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm,
            recompute=recompute,
        )
        self.allow = (
            allowlist.LOCAL
            if allow is None
            else allowlist.AllowList(
                (allow,) if isinstance(allow, str) else tuple(allow), allowlist.LOCAL_REMEDY
            )
        )
        check_job(loss, optimizer, self._job.optimizer_kwargs, self.allow)
        num_layers, _ = models.describe(model, self._job.model_kwargs, self.allow)
        self._slice = LayerSlice(self._job, torch.device(device), Slowdown(1.0), self.allow)
        if init_state is None:
            self._slice.build(0, num_layers)
        else:
            init = initial.check(self._job, init_state)
            try:
                for i in range(num_layers):
                    self._slice.install(i, self._slice.load_layer(i, init.layer_state(i)))
            finally:
                init.close()
        self._num_layers = num_layers
        self._step = 0
        self._last_step = StepStats()
        self._closed = False

    # ---- lifecycle (for symmetry with Pipeline) ----------------------------------------

    def __enter__(self) -> LocalPipeline:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release, but afterwards ``train_step``, ``predict``, ``state_dict``
        and ``layers`` raise ``PipelineClosed``, as ``Pipeline``'s do, so that code can swap
        the two pipelines. Closing twice does nothing the second time."""
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise PipelineClosed(
                "this LocalPipeline is closed; make a new one to train on (or stay inside "
                "its with block)"
            )

    @property
    def step(self) -> int:
        """Optimizer steps committed so far: the next ``train_step`` is step ``step + 1``."""
        return self._step

    @property
    def last_step(self) -> StepStats:
        """What the last ``train_step`` took (``StepStats``; no per-stage figures here)."""
        return self._last_step

    @property
    def num_layers(self) -> int:
        """How many layers the model has."""
        return self._num_layers

    @property
    def layers(self) -> list[torch.nn.Module]:
        """The model's layers, in order (live: training changes them)."""
        self._check_open()
        return [self._slice.layers[i] for i in self._slice.indices]

    # ---- training ----------------------------------------------------------------------

    def _split(
        self, inputs: Value, targets: torch.Tensor | None
    ) -> tuple[list[Value], list[torch.Tensor], list[float]]:
        return split_batch(inputs, targets, self._job.micro_batches, self._slice.device)

    def train_step(self, inputs: Value, targets: torch.Tensor) -> float:
        """One training step on a mini-batch, as ``Pipeline.train_step`` (``inputs`` a
        tensor, or a tuple or flat dict of tensors).

        Returns:
            The mini-batch's mean loss.

        Raises:
            InvalidRequest: inputs or targets of the wrong kind or batch size (named).
            UserCodeError: the model or the loss raised on them (a target out of range, an
                input shape a layer cannot take): the message has the original error, the
                layer or loss, and the micro-batch; nothing of the step is kept.
            PipelineClosed: ``close`` was called.
        """
        self._check_open()
        started = time.perf_counter()
        xs, ys, scales = self._split(inputs, targets)
        step = self._step + 1
        layers = self._slice
        losses: list[float] = []
        loss_scale = layers.loss_scale()
        layers.begin_grads(len(xs))
        try:
            for i, (x, y, scale) in enumerate(zip(xs, ys, scales, strict=True)):
                out, stash = layers.forward(
                    x, train=True, input_grad=False, micro_batch=i, step=step
                )
                assert stash is not None
                last = f"layer {self.num_layers - 1} returned"
                grad, loss = scaled_loss(
                    self._job.loss,
                    layers.loss,
                    structure.single(out, last),
                    y,
                    scale,
                    f"on micro-batch {i}",
                    loss_scale,
                )
                losses.append(loss)
                layers.backward(stash, grad, micro_batch=i)
        except BaseException:
            layers.zero_grad()  # the step is discarded, as a stage discards an aborted run
            raise
        norm: float | None = None
        clip = clipping.NO_CLIP
        sq_norm = layers.finish_backward()  # fp16: unscales the gradients first
        if sq_norm is not None:  # one stage's share is the whole model's here
            norm, clip = clipping.decide([sq_norm], self._job.max_grad_norm or None)
        clipping.warn_if_skipped(log, step, norm, clip, loss_scale if layers.scales else None)
        layers.step(clip)
        self._step = step
        total = float(sum(losses))
        self._last_step = StepStats(
            step=step,
            loss=total,
            micro_batches=len(xs),
            seconds=time.perf_counter() - started,
            attempts=1,
            grad_norm=norm,
            loss_scale=loss_scale if layers.scales else None,
        )
        return total

    def predict(self, inputs: Value) -> Value:
        """The model's output on ``inputs``: forward only, in eval mode; changes nothing
        (a tuple or dict when the last layer returns one).

        Raises:
            InvalidRequest: inputs of the wrong kind (named).
            UserCodeError: the model raised on them (the message says where).
            PipelineClosed: ``close`` was called.
        """
        self._check_open()
        xs, _, _ = self._split(inputs, None)
        cpu = torch.device("cpu")
        outs = [
            structure.to_device(
                self._slice.forward(x, train=False, micro_batch=i, step=self._step)[0], cpu
            )
            for i, x in enumerate(xs)
        ]
        return structure.cat(outs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights and buffers, keyed like the local ``nn.Sequential``
        (and like ``Pipeline.state_dict``).

        Raises:
            PipelineClosed: ``close`` was called.
        """
        self._check_open()
        state: dict[str, torch.Tensor] = {}
        for i in self._slice.indices:
            for name, tensor in self._slice.layers[i].state_dict().items():
                state[f"{i}.{name}"] = tensor.detach().cpu().clone()
        return state


__all__ = ["LocalPipeline"]
