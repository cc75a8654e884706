"""The layers a stage owns: per-layer compute with timing and slowdown, optimizers, state.

Each owned layer is run on its own, with its input detached, so that the stage can time
the forward *and* the backward of every layer it holds (what the planner needs) and can
hand any single layer, with its optimizer state, to another stage.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import torch
from torch import nn

from elasticpipe import models
from elasticpipe.errors import ElasticPipeError, InvalidRequest, ModelError, UserCodeError
from elasticpipe.security import allowlist
from elasticpipe.stage_server import devicepath, weightgrad
from elasticpipe.stage_server.devicetime import EventClock, Lap
from elasticpipe.training import clipping, loss_scaling, lr, precision, rng
from elasticpipe.training.clipping import GradClip
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import loss_fn, make_optimizer
from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value

EWMA_ALPHA = 0.3


@dataclass
class LayerTiming:
    """Smoothed measurements of one layer on this stage (slowdown included)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    output_bytes: int = 0
    samples: int = 0
    stash_bytes: int = 0  # profiling only (see profiling.py)
    state_bytes: int = 0  # profiling only

    def observe(self, forward_s: float | None, backward_s: float | None, out: int) -> None:
        """Folds one measurement in (EWMA; the first sample is taken as is)."""
        first = self.samples == 0
        if forward_s is not None:
            a = 1.0 if first else EWMA_ALPHA
            self.forward_s += a * (forward_s - self.forward_s)
            self.output_bytes = out
            self.samples += 1
        if backward_s is not None:
            a = 1.0 if self.backward_s == 0.0 else EWMA_ALPHA
            self.backward_s += a * (backward_s - self.backward_s)


@dataclass
class Stash:
    """What backward needs of one micro-batch: each layer's (detached inputs, outputs),
    as flat lists of tensors (``elasticpipe.wire.structure``); the outputs are None for a layer
    that recomputes its forward during backward (it keeps only its inputs)."""

    pairs: list[tuple[list[torch.Tensor], list[torch.Tensor] | None]] = field(default_factory=list)
    seeds: dict[int, int] = field(default_factory=dict)  # recomputed layers' RNG seeds
    # recomputed layers' input structures (None: a plain tensor), to rebuild the input
    shapes: dict[int, structure.Structure | None] = field(default_factory=dict)

    saved: list[weakref.ref[torch.Tensor]] = field(default_factory=list)  # by autograd
    # ZB-H1: the weight gradients B left for W, in the order B met the layers
    weights: list[_WeightWork] = field(default_factory=list)

    def nbytes(self) -> int:
        """Bytes of activation memory held: every layer's inputs and outputs, what the
        autograd graph still keeps for backward (parameters excluded), and after a ZB-H1 B
        the gradients kept for W, each storage once."""
        alive = [t for ref in self.saved if (t := ref()) is not None]
        alive += [t for pair in self.pairs for ts in pair if ts is not None for t in ts]
        alive += [t for w in self.weights for t in (*w.grads, *w.split.tensors())]
        held = {}
        for t in alive:
            storage = t.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
        return sum(held.values())


class _WeightWork(NamedTuple):
    """One layer's weight gradients, left by B for W (``weightgrad``); ``grads`` are the
    gradients of its outputs (named in errors), ``b_seconds`` what B spent on it."""

    layer: int
    split: weightgrad.Split
    grads: list[torch.Tensor]
    b_seconds: float | Lap


class Built(NamedTuple):
    """One layer with its optimizer and learning-rate scheduler (None without parameters
    or without a schedule), and its copy of the job's loss scale (fp16 only)."""

    module: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: lr.Scheduler | None
    loss_scale: loss_scaling.LossScale | None = None


class Slowdown:
    """Emulates a device ``factor`` times slower: each compute of t seconds owes (factor - 1) * t.

    The time reported for a layer is ``factor * t``, what the emulated device would take.
    The waits a layer owes are paid together at the end of the op (one micro-batch through
    the slice): sleeping between layers would also evict the caches of the next layer, and
    on a shared CPU host that made an emulated 2x straggler measure 2.5-3x. ``t`` comes from
    ``clock``: on CPU stages the thread's CPU time, so that stages sharing one host (tests,
    benchmarks, the demo) do not take each other's load for their own slowness; on CUDA,
    with ``events``, the time between two CUDA events around the layer, read later (a
    ``Lap``: no synchronize per layer), else wall time after a synchronize.
    """

    def __init__(
        self,
        factor: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
        events: EventClock | None = None,
    ):
        self.set(factor)
        self.clock = clock
        self.events = events
        self._owed = 0.0
        self._laps: list[Lap] = []  # events' laps of a slowed-down op, paid in ``pay``

    def set(self, factor: float) -> None:
        """Changes the factor (>= 1) while the stage runs."""
        if not factor >= 1.0 or not math.isfinite(factor):
            raise InvalidRequest(f"slowdown factor must be a finite number >= 1 (got {factor})")
        self.factor = float(factor)

    def timed(self, fn: Callable[[], Any], sync: Callable[[], None]) -> tuple[Any, float | Lap]:
        """Runs ``fn`` and returns (result, emulated seconds); the extra time is owed.
        With CUDA events the seconds are a ``Lap``, read once its events completed."""
        if self.events is not None:
            result, lap = self.events.time(fn, self.factor)
            if lap.factor > 1.0:
                self._laps.append(lap)
            return result, lap
        start = self.clock()
        result = fn()
        sync()
        compute = self.clock() - start
        factor = self.factor
        self._owed += (factor - 1.0) * compute
        return result, factor * compute

    def pay(self) -> None:
        """Waits for what the op's layers owe."""
        owed, self._owed = self._owed, 0.0
        laps, self._laps = self._laps, []
        owed += sum((lap.factor - 1.0) * lap.raw() for lap in laps)  # waits: slowed only
        if owed > 0:
            time.sleep(owed)


def _user_error(
    what: str, index: int, layer: nn.Module, x: Value, micro_batch: int, exc: Exception
) -> UserCodeError:
    """The user's layer raised: say which layer, on which micro-batch and input."""
    where = f" on micro-batch {micro_batch}" if micro_batch >= 0 else ""
    return UserCodeError(
        f"{what} of layer {index} ({type(layer).__name__}) failed{where} with input of "
        f"{structure.describe(x)}: {type(exc).__name__}: {exc}"
    )


class LayerSlice:
    """Layers [lo, hi) of a job's model on one device, with one optimizer per layer."""

    def __init__(
        self,
        job: JobConfig,
        device: torch.device,
        slowdown: Slowdown,
        allow: allowlist.Allow = (),
    ):
        self.job = job
        self.allow = allowlist.of(allow)
        self.device = device
        self.slowdown = slowdown
        self.layers: dict[int, nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.schedulers: dict[int, lr.Scheduler] = {}
        # fp16: every layer's copy of the job's loss scale (all equal; loss_scaling.py)
        self.scales: dict[int, loss_scaling.LossScale] = {}
        self.timings: dict[int, LayerTiming] = {}
        self.loss = loss_fn(job.loss, self.allow)
        self._lock = threading.Lock()
        # CUDA-event measurements not read yet: (layer, forward, backward, output bytes)
        self._deferred: list[tuple[int, Lap | None, Lap | None, int]] = []

    # ---- building ---------------------------------------------------------------------

    def build(self, lo: int, hi: int) -> None:
        """Builds layers [lo, hi) fresh from the job's factory (new job)."""
        built = models.build_layers(
            self.job.model,
            self.job.seed,
            self.job.model_kwargs,
            lo,
            hi,
            self.device,
            self.allow,
            external=self.job.external_weights,
        )
        self.layers = {lo + k: layer.train() for k, layer in enumerate(built)}
        self.optimizers = {
            i: opt for i, layer in self.layers.items() if (opt := self._optimizer(layer))
        }
        self.schedulers = {
            i: sched for i, opt in self.optimizers.items() if (sched := self._scheduler(opt))
        }
        self.timings = {i: LayerTiming() for i in self.layers}
        self.scales = {i: s for i in self.layers if (s := self._initial_scale()) is not None}

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

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- compute ------------------------------------------------------------------------

    def forward(
        self,
        x: Value,
        train: bool,
        input_grad: bool = True,
        micro_batch: int = -1,
        step: int = 0,
    ) -> tuple[Value, Stash | None]:
        """Runs every owned layer on ``x``; keeps what backward needs when ``train``.

        Inference (``train`` False) runs the layers in eval mode under
        ``torch.inference_mode``, and puts them back in training mode after: dropout is
        off and batch-norm statistics are used, not updated.

        Args:
            x: the slice's input: a tensor, or a tuple or flat dict of tensors.
            train: keep the graph for backward.
            input_grad: whether backward must produce the gradients of ``x``'s floating
                tensors (not on the first stage, whose input is data: computing them would
                waste a matmul).
            micro_batch: the micro-batch's index in its mini-batch (named in errors).
            step: the logical step (``elasticpipe.training.rng``: with ``micro_batch`` and the
                layer's index it seeds the layer's random draws).

        Raises:
            UserCodeError: a layer raised on the input it was given.
            ModelError: a layer returned something other than a tensor, a tuple of tensors
                or a flat dict of tensors.
        """
        if not train:
            return self._infer(x, micro_batch, step), None
        stash = Stash()
        with torch.enable_grad(), rng.forked(self.device) as seed_layer, self._saving(stash):
            for n, i in enumerate(self.indices):
                layer = self.layers[i]
                need = input_grad or n > 0
                shape: structure.Structure | None = None
                if isinstance(x, torch.Tensor):  # the common case, without a detour
                    if x.is_floating_point():
                        x = x.detach().requires_grad_(need)
                    xs = [x]
                else:
                    xs, shape = structure.flatten(x, f"the input of layer {i} is")
                    xs = [
                        t.detach().requires_grad_(need) if t.is_floating_point() else t for t in xs
                    ]
                    x = structure.unflatten(xs, shape)
                seed = rng.forward_seed(self.job.seed, step, micro_batch, i)
                seed_layer(seed)
                if self.job.recomputes(i):
                    # Keeps only the inputs and the layer's seed: backward runs the forward
                    # again (the same function) under the same seed: dropout masks match.
                    stash.seeds[i] = seed
                    stash.shapes[i] = shape
                    with torch.no_grad():
                        y = self._run_layer(i, layer, x, micro_batch)
                    stash.pairs.append((xs, None))
                else:
                    y = self._run_layer(i, layer, x, micro_batch)
                    stash.pairs.append(
                        (xs, [y] if isinstance(y, torch.Tensor) else structure.tensors(y))
                    )
                x = y
        self.slowdown.pay()
        return x, stash

    def _saving(self, stash: Stash) -> torch.autograd.graph.saved_tensors_hooks:
        """Counts what autograd saves for backward (parameters excluded) in ``stash``."""
        params = {
            p.untyped_storage().data_ptr() for m in self.layers.values() for p in m.parameters()
        }

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage().data_ptr() not in params:
                stash.saved.append(weakref.ref(t))
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)

    def _infer(self, x: Value, micro_batch: int, step: int) -> Value:
        with torch.inference_mode(), rng.forked(self.device) as seed_layer:
            for i in self.indices:
                layer = self.layers[i]
                layer.eval()
                seed_layer(rng.forward_seed(self.job.seed, step, micro_batch, i))
                try:
                    x = self._run_layer(i, layer, x, micro_batch)
                finally:
                    layer.train()
        self.slowdown.pay()
        return x

    def _run_layer(self, i: int, layer: nn.Module, x: Value, micro_batch: int) -> Value:
        y, seconds = self._forward_layer(i, layer, x, micro_batch)
        self._observe(i, seconds, None, structure.nbytes(y))
        return y

    def _observe(self, i: int, fwd: float | Lap | None, bwd: float | Lap | None, out: int) -> None:
        if isinstance(fwd, Lap) or isinstance(bwd, Lap):
            self._deferred.append((i, fwd, bwd, out))  # type: ignore[arg-type]  # both Laps
        else:
            self.timings[i].observe(fwd, bwd, out)

    def settle_timings(self) -> None:
        """Folds in the CUDA-event measurements taken so far (one wait for the device)."""
        deferred, self._deferred = self._deferred, []
        for i, fwd, bwd, out in deferred:
            if i in self.timings:
                f = fwd.seconds() if fwd is not None else None
                self.timings[i].observe(f, bwd.seconds() if bwd is not None else None, out)

    def _forward_layer(
        self, i: int, layer: nn.Module, x: Value, micro_batch: int
    ) -> tuple[Value, float | Lap]:
        """The one place a layer's forward runs: the first time and when recomputed."""
        try:
            y, seconds = self.slowdown.timed(lambda: self._call(layer, x), self._sync)
        except ElasticPipeError:
            raise
        except Exception as exc:  # the user's code may raise anything: report it as theirs
            raise _user_error("forward", i, layer, x, micro_batch, exc) from exc
        if not isinstance(y, torch.Tensor):
            where = f"layer {i} ({type(layer).__name__}) returned"
            structure.flatten(y, where, ModelError)
        return y, seconds

    def _recompute(
        self, i: int, xs: list[torch.Tensor], stash: Stash, micro_batch: int
    ) -> tuple[list[torch.Tensor], float | Lap]:
        """Runs layer ``i``'s forward on its stashed inputs again, with the graph.

        It runs under the seed of the first forward (``elasticpipe.training.rng``), in a fork of the
        generators, so dropout masks match and the stage's random stream is left as it was.
        The forward runs on copies of the layer's buffers (batch-norm statistics): the
        first forward already updated them once, as training without recomputation does.

        Returns:
            The layer's outputs as a flat list of tensors, and the seconds it took.
        """
        seed = stash.seeds.pop(i)
        x = structure.unflatten(xs, stash.shapes.pop(i, None))
        layer = self.layers[i]
        owners = [
            (module, name, buffer)
            for module in layer.modules()
            for name, buffer in module._buffers.items()
            if buffer is not None
        ]
        for module, name, buffer in owners:
            module._buffers[name] = buffer.clone()
        try:
            with torch.enable_grad(), rng.forked(self.device) as seed_layer:
                seed_layer(seed)
                y, seconds = self._forward_layer(i, layer, x, micro_batch)
        finally:
            for module, name, buffer in owners:
                module._buffers[name] = buffer
        return ([y] if isinstance(y, torch.Tensor) else structure.tensors(y)), seconds

    def _call(self, layer: nn.Module, x: Value) -> Any:
        """One layer's forward, under the job's autocast (``precision.py``)."""
        with precision.autocast(self.device, self.job.precision):
            return layer(x)

    def backward(
        self, stash: Stash, grad: Value | None, micro_batch: int = -1, split: bool = False
    ) -> Value | None:
        """Backpropagates ``grad`` (of the slice's output) through the stashed layers.

        ``grad`` holds one tensor per floating tensor of the slice's output, in order (a
        plain tensor when there is one, else a tuple; ``elasticpipe.wire.structure``); integer
        and bool tensors (masks, ids) get none. A floating output that does not require
        grad (no path from the parameters) just drops its gradient.

        With ``split`` (ZB-H1's B) only the input gradients are computed, layer by layer
        with the graph kept; each layer's weight gradients are left in ``stash`` for
        :meth:`backward_weights` (W). A layer whose input needs no gradient (the first
        stage's first layer) leaves its whole backward to W; one without trainable
        parameters runs whole here.

        Returns:
            The gradients of the slice's input's floating tensors in the same form (a
            floating input the layers do not use gets zeros), or None where the input
            needs none (the first stage).

        Raises:
            InvalidRequest: ``grad`` holds another number of tensors than the output has
                floating tensors.
            UserCodeError: a layer's backward raised.
        """
        grads = structure.tensors(grad) if grad is not None else None
        for i, (xs, kept) in zip(reversed(self.indices), reversed(stash.pairs), strict=True):
            if grads is None:
                break
            again: float | Lap
            ys, again = kept, 0.0
            if ys is None:
                with self._saving(stash):  # the rebuilt graph lives until W with ZB-H1
                    ys, again = self._recompute(i, xs, stash, micro_batch)
            outs, gs, n = [], [], 0  # the floating outputs that need their gradient
            for y in ys:
                if y.is_floating_point():
                    if n < len(grads) and y.requires_grad:
                        outs.append(y)
                        gs.append(grads[n])
                    n += 1
            if n != len(grads):
                raise InvalidRequest(
                    f"layer {i} returned {n} floating tensors but {len(grads)} gradients came "
                    f"back for them (micro-batch {micro_batch})"
                )
            params = [p for p in self.layers[i].parameters() if p.requires_grad] if split else []
            if not outs:
                grads = _input_grads(xs)
                continue
            if not params:  # the whole backward, now
                _, seconds = self._autograd(i, micro_batch, gs, partial(_backward, outs, gs))
                self._observe(i, None, seconds + again, 0)
                grads = _input_grads(xs)
                continue
            need = [x for x in xs if x.is_floating_point() and x.requires_grad]
            if not need:  # nothing for B: W runs the whole backward
                whole = weightgrad.Split(fallback=(outs, gs, None))  # as a whole backward
                stash.weights.append(_WeightWork(i, whole, gs, again))
                grads = _input_grads(xs)
                continue
            (got, halves), seconds = self._autograd(
                i, micro_batch, gs, partial(weightgrad.split_backward, outs, gs, need, params)
            )
            stash.weights.append(_WeightWork(i, halves, gs, seconds + again))
            by_id = {id(x): g for x, g in zip(need, got, strict=True)}
            grads = [
                g if (g := by_id.get(id(x))) is not None else torch.zeros_like(x)
                for x in xs
                if x.is_floating_point()
            ]
        stash.pairs.clear()
        stash.seeds.clear()
        stash.shapes.clear()
        self.slowdown.pay()
        return structure.grads_value(grads) if grads is not None else None

    def backward_weights(self, stash: Stash, micro_batch: int = -1) -> None:
        """ZB-H1's W: accumulates the weight gradients ``backward(split=True)`` left in
        ``stash``, in the order B met the layers (the order a whole backward accumulates
        them in), and frees the graphs.

        Raises:
            UserCodeError: a layer's backward raised.
        """
        work, stash.weights = stash.weights, []
        for w in work:
            _, seconds = self._autograd(w.layer, micro_batch, w.grads, w.split.weights)
            self._observe(w.layer, None, w.b_seconds + seconds, 0)
        self.slowdown.pay()

    def _autograd(
        self, i: int, micro_batch: int, gs: list[torch.Tensor], fn: Callable[[], Any]
    ) -> tuple[Any, float | Lap]:
        """Runs one layer's backward ``fn``, timed; the user's errors named."""
        try:
            return self.slowdown.timed(fn, self._sync)
        except Exception as exc:  # the user's code may raise anything
            g = structure.grads_value(gs)
            raise _user_error("backward", i, self.layers[i], g, micro_batch, exc) from exc

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

    def finish_backward(self) -> float | None:
        """After a run's last backward: unscales the accumulated gradients (fp16, as
        ``GradScaler.unscale_``) and returns their squared norm when the commit's decision
        needs it (``JobConfig.reports_grad_norm``), else None."""
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
        """Allocates layer ``index`` of the job's model, initialised, to load state into.

        Raises:
            InvalidRequest: no such layer.
        """
        skeleton = models.build_skeleton(self.job.model, self.job.model_kwargs, self.allow)
        if not 0 <= index < len(skeleton):
            raise InvalidRequest(f"layer {index} out of range (model has {len(skeleton)})")
        layer = models.materialize_layer(skeleton[index], self.device).train()
        # Initialise first: buffers that the state dict does not carry (non-persistent
        # ones, such as causal masks) must not stay uninitialised memory.
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


def _backward(outs: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
    """Accumulates the gradients of ``outs`` (given ``gs``) into the graph's leaves."""
    torch.autograd.backward(outs, gs)


def _input_grads(xs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The gradients of a layer's floating inputs (zeros for one it did not use), or None
    where they need none (the first stage's data)."""
    grads = []
    for x in xs:
        if x.is_floating_point():
            if not x.requires_grad:
                return None
            g = x.grad
            grads.append(g if g is not None else torch.zeros_like(x))
    return grads


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


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
