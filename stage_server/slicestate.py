"""The state of a stage's layers: each owned layer with its optimizer, schedule and loss scale.

``SliceState`` builds the layers (fresh from the job's factory, or from exported state),
steps their optimizers, and hands any single layer's full state out (a migration, a
snapshot, ``state_dict``) or takes one in (staged as ``Built``, then installed). It is the
base class of ``layers.LayerSlice``, which runs the layers; ``LayerTiming`` holds what
running them measured, per layer.

Within a training run (``begin_grads`` .. ``finish_backward``) each layer's gradients are
summed in the canonical tree over the step's micro-batches (``training.gradsum``), not
accumulated into ``.grad`` in the order the backward passes end: the sum then has the same
bits however the micro-batches are split among replicas, and ``LocalPipeline`` (which runs
the same class) stays the reference.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from elasticpipe import models
from elasticpipe.errors import InvalidRequest
from elasticpipe.models.contract import layer_bytes
from elasticpipe.security import allowlist
from elasticpipe.stage_server import devicepath
from elasticpipe.training import clipping, loss_scaling, lr
from elasticpipe.training.clipping import GradClip
from elasticpipe.training.gradsum import Node, TreeSum
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import make_optimizer

__all__ = ["Built", "LayerTiming", "SliceState", "tensors_cloned"]


# The reported time of a layer is the median of its last WINDOW measurements: one slow
# micro-batch (a page fault, a neighbour's burst, a first call's warm-up) does not move
# it, as it moved an average; a real change of speed shows after WINDOW // 2 + 1 of them.
WINDOW = 9


@dataclass
class LayerTiming:
    """Measurements of one layer on this stage (slowdown included): the median of the
    recent ones (``observe``), or what profiling measured."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    output_bytes: int = 0
    samples: int = 0
    stash_bytes: int = 0  # profiling only (see profiling.py)
    state_bytes: int = 0  # profiling only
    _forwards: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)
    _backwards: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW), repr=False)

    def observe(self, forward_s: float | None, backward_s: float | None, out: int) -> None:
        """Folds one micro-batch's measurement in."""
        if forward_s is not None:
            self._forwards.append(forward_s)
            self.forward_s = statistics.median(self._forwards)
            self.output_bytes = out
            self.samples += 1
        if backward_s is not None:
            self._backwards.append(backward_s)
            self.backward_s = statistics.median(self._backwards)

    def snapshot(self) -> LayerTiming:
        """A copy of the reported figures (without the window: it goes on changing)."""
        return LayerTiming(
            self.forward_s,
            self.backward_s,
            self.output_bytes,
            self.samples,
            self.stash_bytes,
            self.state_bytes,
        )


class Built(NamedTuple):
    """One layer with its optimizer and learning-rate scheduler (None without parameters
    or without a schedule), and its copy of the job's loss scale (fp16 only)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: lr.Scheduler | None
    loss_scale: loss_scaling.LossScale | None = None


class SliceState:
    """Layers [lo, hi) of a job's model on one device, with one optimizer per layer."""

    def __init__(self, job: JobConfig, device: torch.device, allow: allowlist.Allow = ()):
        self.job = job
        self.allow = allowlist.of(allow)
        self.device = device
        self.layers: dict[int, nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.schedulers: dict[int, lr.Scheduler] = {}
        # fp16: every layer's copy of the job's loss scale (all equal; loss_scaling.py)
        self.scales: dict[int, loss_scaling.LossScale] = {}
        self.timings: dict[int, LayerTiming] = {}
        # in a training run: each layer's micro-batch gradients, summed in the canonical tree
        self._grad_sums: dict[int, TreeSum[Grads]] | None = None
        self._grad_params: dict[int, list[nn.Parameter]] = {}
        # ``defer_takes``: a whole slice's ``took_grads`` leaves the gradients in ``.grad``
        # (``_owed``: that micro-batch) until ``take_owed``, so that a stage sends a
        # backward's input gradients on before it adds its own to the sums (the executor)
        self.defer_takes = False
        self._owed: int | None = None

    # ---- building ---------------------------------------------------------------------

    def build(self, lo: int, hi: int, draw: bool = True) -> None:
        """Builds layers [lo, hi) fresh from the job's factory (new job); ``draw``: see
        ``models.prepare_layer``."""
        self.layers, self.optimizers, self.schedulers, self.scales = {}, {}, {}, {}
        self.timings = {}
        for index, built in self.fresh_layers(lo, hi, draw).items():
            self.install(index, built)

    def fresh_layers(self, lo: int, hi: int, draw: bool = True) -> dict[int, Built]:
        """Layers [lo, hi) as a new job starts them (``build``), not installed: a rollback
        stages them for a job whose init_state never loaded (``Stage.prepare_epoch``)."""
        built = models.build_layers(
            self.job.model,
            self.job.seed,
            self.job.model_kwargs,
            lo,
            hi,
            self.device,
            self.allow,
            external=self.job.external_weights,
            draw=draw,
        )
        fresh = {}
        for index, layer in enumerate(built, start=lo):
            optimizer = self._optimizer(layer.train())
            scheduler = self._scheduler(optimizer) if optimizer is not None else None
            fresh[index] = Built(layer, optimizer, scheduler, self._initial_scale())
        return fresh

    def _initial_scale(self) -> loss_scaling.LossScale | None:
        """A new layer's loss scale: ``init_scale`` with fp16, else none."""
        if self.job.precision != "fp16":
            return None
        return loss_scaling.LossScale.initial(self.job.scaler)

    def _optimizer(self, layer: nn.Module) -> torch.optim.Optimizer | None:
        """The layer's own optimizer; None for a layer without parameters (an activation)."""
        params = [p for p in layer.parameters() if p.requires_grad]
        if not params:
            return None
        return make_optimizer(self.job.optimizer, params, self.job.optimizer_kwargs, self.allow)

    def _scheduler(self, optimizer: torch.optim.Optimizer) -> lr.Scheduler | None:
        """The optimizer's learning-rate scheduler; None without a schedule."""
        job = self.job
        return lr.build(job.scheduler, job.scheduler_kwargs, job.warmup_steps, optimizer)

    @property
    def indices(self) -> list[int]:
        """Owned layer indices, ascending."""
        return sorted(self.layers)

    # ---- optimizer steps ----------------------------------------------------------------

    def timed_step(self, clip: GradClip = clipping.NO_CLIP) -> float | None:
        """``step``, timed: the bytes of the layers it stepped (as the planner counts a
        layer's, ``layer_bytes``) per second; None when it stepped nothing. On CUDA
        the device is synchronised before and after: the step's time, not its launch's."""
        stepped = sum(layer_bytes(self.layers[i]) for i in self.optimizers)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
        started = time.perf_counter()
        self.step(clip)
        if cuda:
            torch.cuda.synchronize(self.device)
        took = time.perf_counter() - started
        return stepped / took if stepped and took > 0 and not clip.skip else None

    def step(self, clip: GradClip = clipping.NO_CLIP) -> None:
        """Applies the accumulated gradients (one optimizer step) and clears them; then
        the learning-rate schedulers step, and with fp16 the loss scale updates.

        Args:
            clip: scale the gradients first, or skip the optimizer step (a non-finite
                global norm: the schedulers still step, see ``elasticpipe.training.clipping``; the
                loss scale backs off).
        """
        for i, opt in self.optimizers.items():
            if not clip.skip:
                if clip.coef:
                    _scale_grads(self.layers[i].parameters(), clip.coef)
                opt.step()
            opt.zero_grad(set_to_none=True)
        for sched in self.schedulers.values():
            sched.step()
        if self.scales:
            kwargs = self.job.scaler
            for scale in self.scales.values():
                scale.update(clip.skip, kwargs)

    def loss_scale(self) -> float:
        """What the loss is multiplied by before backward: the layers' loss scale with
        fp16 (the same on every layer), else 1."""
        if not self.scales:
            return 1.0
        return self.scales[min(self.scales)].scale

    def begin_grads(self, micro_batches: int, share: range | None = None) -> None:
        """Starts a training run of a step of ``micro_batches``, of which this slice runs
        ``share`` (all of them by default; a replica's range of them otherwise): drops any
        gradient left, and sums every layer's micro-batch gradients in the canonical tree
        from now on (``took_grads`` after each micro-batch's backward; at the end
        ``finish_backward``, or ``take_partials`` for a share to reduce with the others).

        Raises:
            ValueError: ``share`` is not inside the step's micro-batches.
        """
        self.zero_grad()
        share = range(micro_batches) if share is None else share
        self._grad_sums = {  # (a replica without a share sums nothing: it only reduces)
            i: TreeSum(micro_batches, _plus_grads, share.start, share.stop)
            for i in self.optimizers
            if share
        }
        # each layer's parameters, listed once a run (not once a micro-batch)
        self._grad_params = {i: list(self.layers[i].parameters()) for i in self._grad_sums}

    def take_partials(
        self, layers: Collection[int] | None = None
    ) -> dict[int, list[tuple[Node, Grads]]]:
        """After the run's last backward of ``layers`` (default: every layer not taken
        yet), for a share: each layer's partial sums, one per tree node the share covers
        (``gradsum.covering``), for the reduction among the layer's holders; their sums are
        handed over (``install_grads`` takes the result). Without ``layers`` the run's sums
        are all handed over; with them (a group whose last backward is done while the
        others' goes on) the rest stay.

        Raises:
            ValueError: no run is begun, or a micro-batch of the share never finished its
                backward (naming it).
        """
        self.take_owed()
        sums = self._grad_sums
        if sums is None:
            raise ValueError("no training run is begun (begin_grads) on this slice")
        if layers is None:
            self._grad_sums = None
            return {i: sums[i].partials() if i in sums else [] for i in self.optimizers}
        return {i: sums.pop(i).partials() if i in sums else [] for i in layers}

    def install_grads(self, grads: dict[int, Grads]) -> None:
        """Puts each layer's reduced gradients (its parameters' in order) into ``.grad``.

        Raises:
            ValueError: a layer is not held here, or gets another number of gradients
                than it has parameters.
        """
        for i, layer_grads in grads.items():
            if i not in self.layers:
                raise ValueError(f"layer {i} is not held here (layers {self.indices})")
            params = list(self.layers[i].parameters())
            if len(params) != len(layer_grads):
                raise ValueError(
                    f"layer {i} has {len(params)} parameters, {len(layer_grads)} gradients came"
                )
            for param, g in zip(params, layer_grads, strict=True):
                param.grad = g

    def took_grads(self, micro_batch: int, layers: Iterable[int] | None = None) -> None:
        """After ``micro_batch``'s whole backward on ``layers`` (default: every layer of
        this slice; its weight gradients included): moves each layer's gradients out of
        ``.grad`` into its tree sum, so that the next micro-batch's backward starts from
        none. Outside a run begun with ``begin_grads`` (profiling), gradients stay in
        ``.grad``.

        With ``defer_takes``, a whole slice's are left in ``.grad`` for ``take_owed``.

        Raises:
            ValueError: ``micro_batch`` was taken already in this run, or is outside it
                (deferred: from ``take_owed``).
        """
        if self._grad_sums is None:
            return
        self.take_owed()  # (the gradients in .grad are one micro-batch's)
        if layers is None and self.defer_takes:
            self._owed = micro_batch
        else:
            self._take(micro_batch, layers)

    def _take(self, micro_batch: int, layers: Iterable[int] | None) -> None:
        """``took_grads`` now, never deferred (``layers`` None: the whole slice)."""
        sums = self._grad_sums
        if sums is None:
            return
        for i in sums if layers is None else [i for i in layers if i in sums]:
            acc, params = sums[i], self._grad_params[i]
            acc.add(micro_batch, [p.grad for p in params])
            for p in params:
                p.grad = None

    def take_owed(self) -> None:
        """Takes the gradients a deferred ``took_grads`` left in ``.grad`` into the sums
        (before anything else writes ``.grad``: the next backward, the run's end).

        Raises:
            ValueError: as ``took_grads``.
        """
        owed, self._owed = self._owed, None
        if owed is not None:
            self._take(owed, None)

    def held_grads(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """In a training run, the gradients in ``.grad`` now, taken out of it (ZB-H1 keeps
        those B wrote until W); none outside a run."""
        self.take_owed()
        held: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self._grad_sums is not None:
            for params in self._grad_params.values():
                for param in params:
                    if param.grad is not None:
                        held.append((param, param.grad))
                        param.grad = None
        return held

    def finish_backward(self) -> float | None:
        """After a run's last backward: puts each layer's tree sum into ``.grad`` (unless
        ``take_partials`` took them for a reduction, whose result is installed already),
        unscales the gradients (fp16, as ``GradScaler.unscale_``) and returns their squared
        norm when the commit's decision needs it (``JobConfig.reports_grad_norm``), else
        None.

        Raises:
            ValueError: a micro-batch of the run never finished its backward (naming it).
        """
        self.take_owed()
        sums, self._grad_sums = self._grad_sums, None
        if sums is not None:  # (a share's sums were taken and reduced: installed already)
            self.install_grads({i: acc.result() for i, acc in sums.items()})
        if self.scales:
            loss_scaling.unscale_(
                [
                    p.grad
                    for i in self.optimizers
                    for p in self.layers[i].parameters()
                    if p.grad is not None
                ],
                self.loss_scale(),
            )
        return self.grad_sq_norm() if self.job.reports_grad_norm else None

    def grad_sq_norm(self) -> float:
        """Sum of the squared norms of every owned layer's accumulated gradients."""
        return devicepath.sq_norm(
            [
                [p.grad for p in self.layers[i].parameters() if p.grad is not None]
                for i in self.optimizers
            ]
        )

    def lr(self) -> float:
        """The learning rate the next optimizer step applies (the first owned layer with
        parameters; every layer's schedule is the same); 0 with no such layer."""
        for i in self.indices:
            if i in self.optimizers:
                return lr.current_lr(self.optimizers[i])
        return 0.0

    def zero_grad(self) -> None:
        """Discards accumulated gradients (an aborted step)."""
        self._grad_sums, self._owed = None, None
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)

    # ---- state, for migration and state_dict --------------------------------------------

    def snapshot_layer(self, index: int) -> dict[str, Any]:
        """One layer's full state, cloned: training may go on while it is packed."""
        state: dict[str, Any] = tensors_cloned(self.export_layer(index, include_optimizer=True))
        return state

    def export_layer(self, index: int, include_optimizer: bool) -> dict[str, Any]:
        """One layer's full state: weights and buffers, and optionally optimizer state."""
        layer = self.layers[index]
        state: dict[str, Any] = {
            "index": index,
            "model": {k: v.detach().cpu() for k, v in layer.state_dict().items()},
        }
        if include_optimizer and index in self.optimizers:
            state["optimizer"] = _tensors_to_cpu(self.optimizers[index].state_dict())
        if include_optimizer and index in self.schedulers:
            state["scheduler"] = lr.dumps(self.schedulers[index])
        if include_optimizer and index in self.scales:
            state["loss_scale"] = self.scales[index].to_state()
        return state

    def new_layer(self, index: int) -> nn.Module:
        """Allocates layer ``index`` of the job's model to load state into (strictly: every
        parameter and persistent buffer), its other buffers initialised.

        Raises:
            InvalidRequest: no such layer.
        """
        skeleton = models.build_skeleton(self.job.model, self.job.model_kwargs, self.allow)
        if not 0 <= index < len(skeleton):
            raise InvalidRequest(f"layer {index} out of range (model has {len(skeleton)})")
        layer = models.materialize_layer(skeleton[index], self.device).train()
        # The strict load that follows overwrites every parameter and persistent buffer;
        # a buffer that the state dict does not carry (a non-persistent one, such as a
        # causal mask) must not stay uninitialised memory. Only then is the layer
        # initialised first (for a 50257 x 768 embedding: 0.3 s of random numbers, all
        # overwritten).
        if models.unsaved_buffers(layer):
            models.prepare_layer(layer, self.job.seed, index, self.job.external_weights)
        return layer

    def load_layer(
        self, index: int, state: dict[str, Any], layer: nn.Module | None = None
    ) -> Built:
        """Builds a layer from exported state without installing it (staged).

        Args:
            layer: from ``new_layer``, possibly already holding the state's weights (they
                were received into it); a new one if None.

        Raises:
            InvalidRequest: the state does not fit the layer the job's model defines.
        """
        if state.get("index") != index:
            raise InvalidRequest(f"state for layer {state.get('index')} sent as layer {index}")
        if layer is None:
            layer = self.new_layer(index)
        try:
            layer.load_state_dict(state["model"], strict=True)
        except (RuntimeError, KeyError, TypeError) as exc:
            raise InvalidRequest(f"state of layer {index} does not fit the model: {exc}") from exc
        optimizer = self._optimizer(layer)
        # The scheduler is built before the states are loaded (building sets the lr of
        # step 0); loading the optimizer's state then sets the lr it had, as in PyTorch.
        scheduler = self._scheduler(optimizer) if optimizer is not None else None
        if optimizer is not None and "optimizer" in state:
            try:
                optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, TypeError) as exc:
                raise InvalidRequest(
                    f"optimizer state of layer {index} is unusable: {exc}"
                ) from exc
        if scheduler is not None and "optimizer" in state:
            text = state.get("scheduler")
            if not isinstance(text, str):
                raise InvalidRequest(
                    f"state of layer {index} carries no scheduler state, but the job "
                    f"schedules its learning rate ({self.job.scheduler or 'warm-up'})"
                )
            lr.loads(scheduler, text, index)
        # fp16: the exported scale; weights alone (init_state) start from init_scale.
        scale = self._initial_scale()
        if scale is not None and "loss_scale" in state:
            scale = loss_scaling.LossScale.from_state(state["loss_scale"], index)
        return Built(layer, optimizer, scheduler, scale)

    def install(self, index: int, built: Built) -> None:
        """Takes ownership of a staged layer."""
        self.layers[index] = built.module
        if built.optimizer is not None:
            self.optimizers[index] = built.optimizer
        if built.scheduler is not None:
            self.schedulers[index] = built.scheduler
        if built.loss_scale is not None:
            self.scales[index] = built.loss_scale
        self.timings.setdefault(index, LayerTiming())

    def drop(self, index: int) -> None:
        """Frees a layer that now lives elsewhere."""
        self.layers.pop(index, None)
        self.optimizers.pop(index, None)
        self.schedulers.pop(index, None)
        self.scales.pop(index, None)
        self.timings.pop(index, None)


Grads = list[torch.Tensor | None]  # one layer's parameters' gradients, in order


def _plus_grads(left: Grads, right: Grads) -> Grads:
    """Two partial sums of a layer's gradients added (into ``left``'s memory: each partial
    is added once); a parameter without a gradient in one of them adds nothing."""
    return [
        a if b is None else b if a is None else a.add_(b) for a, b in zip(left, right, strict=True)
    ]


def _scale_grads(params: Iterable[torch.Tensor], coef: float) -> None:
    """Multiplies the gradients by ``coef`` in place, as ``clip_grad_norm_`` does (it
    multiplies by the clamped coefficient even when that is 1)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads:
        # a fill, not a host-to-device copy: no synchronisation on a GPU
        scale = torch.full((), coef, dtype=torch.float32, device=grads[0].device)
        torch._foreach_mul_(grads, scale)


def tensors_cloned(obj: Any) -> Any:
    """``obj`` (nested dicts and lists) with every tensor cloned: a snapshot's private copy
    of a layer's exported state."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: tensors_cloned(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [tensors_cloned(v) for v in obj]
    return obj


def _tensors_to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _tensors_to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tensors_to_cpu(v) for v in obj]
    return obj
