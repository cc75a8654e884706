"""The layers a stage runs: per-layer forward and backward, with timing and slowdown.

The stage times the forward *and* the backward of every layer it holds (what the planner
needs) and can hand any single layer, with its optimizer state, to another stage
(``slicestate``: the layers' state and optimizers, ``LayerSlice``'s base class). Backward
runs one autograd pass through the layers ``forward`` linked, timed by hooks between them,
and layer by layer where it did not (``stash.Stash``: what a micro-batch holds for it). An
emulated slow device's time is ``devicetime.Slowdown``'s: each op pays its time there.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn

from elasticpipe.errors import ElasticPipeError, InvalidRequest, ModelError, UserCodeError
from elasticpipe.security import allowlist
from elasticpipe.stage_server import weightgrad
from elasticpipe.stage_server.alike import alike_key
from elasticpipe.stage_server.devicetime import Lap, Slowdown
from elasticpipe.stage_server.slicestate import SliceState
from elasticpipe.stage_server.stash import Stash, WeightWork
from elasticpipe.training import precision, rng
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import loss_fn
from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value


def _user_error(
    what: str, index: int, layer: nn.Module, x: Value, micro_batch: int, exc: Exception
) -> UserCodeError:
    """The user's layer raised: say which layer, on which micro-batch and input."""
    where = f" on micro-batch {micro_batch}" if micro_batch >= 0 else ""
    return UserCodeError(
        f"{what} of layer {index} ({type(layer).__name__}) failed{where} with input of "
        f"{structure.describe(x)}: {type(exc).__name__}: {exc}"
    )


class LayerSlice(SliceState):
    """Layers [lo, hi) of a job's model on one device, each layer timed."""

    def __init__(
        self,
        job: JobConfig,
        device: torch.device,
        slowdown: Slowdown,
        allow: allowlist.Allow = (),
    ):
        super().__init__(job, device, allow)
        self.slowdown = slowdown
        self.loss = loss_fn(job.loss, self.allow)
        self._lock = threading.Lock()
        # CUDA-event measurements not read yet: (layer, forward, backward, output bytes)
        self._deferred: list[tuple[int, Lap | None, Lap | None, int]] = []
        self._alike: dict[int, Hashable] = {}  # each layer's ``alike_key`` (fastest times)

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
        count: bool = True,
        split: bool = False,
    ) -> tuple[Value, Stash | None]:
        """Runs every owned layer on ``x``; keeps what backward needs when ``train``.

        Each layer whose input is one tensor (needing a gradient, if a float) is *linked*
        to the layer below (its input is that layer's output itself), so that one autograd
        pass runs through them all (``backward``; a pass per layer cost a 5-layer GPT slice
        6% more CPU), unless backward needs each layer on its own (``split``, a recomputed
        layer, per-op times: a ``fastest`` model, CUDA events, a non-CPU device) or the
        job runs under autocast (it caches the casts of leaves only). A linked layer must
        not change its input in place where autograd records it.

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
            count: note what autograd saves for backward, so that ``Stash.nbytes`` counts
                it (a Python hook per saved tensor: about 7% of a small GPT block's time,
                so the executor counts only the runs it measures, ``StashMeter``).
            split: backward will be ZB-H1's B and W (``backward(split=True)``).

        Raises:
            UserCodeError: a layer raised on the input it was given.
            ModelError: a layer returned something other than a tensor, a tuple of tensors
                or a flat dict of tensors.
        """
        if not train:
            return self._infer(x, micro_batch, step), None
        self.slowdown.begin()
        stash = Stash(counted=count)
        saving = self._saving(stash) if count else contextlib.nullcontext()
        chain = not split and self._chains()
        with torch.enable_grad(), rng.forked(self.device) as seed_layer, saving:
            for n, i in enumerate(self.indices):
                layer = self.layers[i]
                need = input_grad or n > 0
                shape: structure.Structure | None = None
                linked = (  # (a float that needs no gradient: detached, then it does)
                    chain
                    and n > 0
                    and isinstance(x, torch.Tensor)
                    and (x.requires_grad or not x.is_floating_point())
                )
                stash.linked.append(linked)
                node = x.grad_fn if linked else None  # type: ignore[union-attr]  # a tensor
                if isinstance(x, torch.Tensor):  # the common case, without a detour
                    if x.is_floating_point() and not linked:
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
                if linked and xs[0].grad_fn is not node:
                    # autograd allows it on a linked input, but the hook that times the layer
                    # would sit inside it; an unlinked input (a leaf) refuses it
                    what = RuntimeError("it changed its input in place")
                    raise _user_error("forward", i, layer, x, micro_batch, what)
                x = y
        self.slowdown.pay()
        return x, stash

    def _chains(self) -> bool:
        """Whether a run that does not split its backward links its layers (``forward``)."""
        slow = self.slowdown
        return (
            self.device.type == "cpu"
            and self.job.precision == "fp32"  # (autocast caches the casts of leaves only)
            and slow.events is None
            and slow.fastest is None
            and not any(self.job.recomputes(i) for i in self.indices)
        )

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
        self.slowdown.begin()
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
        op = None
        if self.slowdown.fastest is not None:
            inputs = [x] if isinstance(x, torch.Tensor) else structure.tensors(x)
            op = self.op(i, "forward", inputs)
        try:
            y, seconds = self.slowdown.timed(lambda: self._call(layer, x), self._sync, op)
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

    def op(
        self,
        i: int,
        kind: str,
        tensors: Sequence[torch.Tensor],
        inputs: Sequence[torch.Tensor] = (),
    ) -> Hashable | None:
        """What names layer ``i``'s ``kind`` of op for the fastest-run model
        (``devicetime.FastestTimes``), or None without that model: the job; what the layer
        computes (``alike_key``: alike layers, the blocks of a GPT, are one op, as the
        profile measures one for all; an id in it may be reused once its layer is freed,
        and a layer of the same tree would then share its times, harmless in an
        emulation); the kind; whether autograd records it, inference mode, the layer's
        mode (eval or train); the shapes, dtypes and gradient needs of ``tensors`` (the
        input of a forward, the output gradients of a backward); and which of ``inputs``
        (a backward's: the layer's inputs) need a gradient (the first stage's first layer
        computes none for its input, a cheaper backward than an alike layer's)."""
        if self.slowdown.fastest is None:
            return None
        alike = self._alike.get(i)
        if alike is None:
            alike = self._alike[i] = alike_key(self.layers[i])
        shapes = tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)
        needs = tuple(x.requires_grad for x in inputs if x.is_floating_point())
        modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        return (self.job.job_id, alike, kind, modes, self.layers[i].training, shapes, needs)

    def _call(self, layer: nn.Module, x: Value) -> Any:
        """One layer's forward, under the job's autocast (``precision.py``)."""
        with precision.autocast(self.device, self.job.precision):
            return layer(x)

    def backward(
        self,
        stash: Stash,
        grad: Value | None,
        micro_batch: int = -1,
        split: bool = False,
        done: Callable[[int], None] | None = None,
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

        ``done`` (the run's last backward here, without ``split``): each layer's gradients
        are taken into the run's sums as soon as its backward is done, and ``done(i)`` is
        told, highest layer first, so that a reduction of the layers above can start while
        the layers below run theirs.

        Returns:
            The gradients of the slice's input's floating tensors in the same form (a
            floating input the layers do not use gets zeros), or None where the input
            needs none (the first stage).

        Raises:
            InvalidRequest: ``grad`` holds another number of tensors than the output has
                floating tensors.
            UserCodeError: a layer's backward raised.
        """
        self.slowdown.begin()
        grads = structure.tensors(grad) if grad is not None else None
        finished = _Finished(self, micro_batch, done if not split else None)
        if len(stash.pairs) != len(self.indices):
            raise ValueError(f"a stash of {len(stash.pairs)} layers for layers {self.indices}")
        if split and any(stash.linked):
            raise ValueError("a backward split into B and W needs a forward with split=True")
        at = len(stash.pairs) - 1  # the next layer's place in the slice, top down
        while at >= 0:
            i, (xs, kept) = self.indices[at], stash.pairs[at]
            low = at  # the lowest layer linked to this one: one autograd pass runs to it
            while low > 0 and stash.linked[low]:
                low -= 1
            top, at = at, at - 1
            finished.above(i)
            if grads is None:
                break
            again: float | Lap
            ys, again = kept, 0.0
            if ys is None:
                # the rebuilt graph lives until W with ZB-H1 (counted if the forward was)
                with self._saving(stash) if stash.counted else contextlib.nullcontext():
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
            if low < top:  # (``forward`` links no layer when splitting or recomputing)
                stop = self._linked_backward(stash, low, top, outs, gs, micro_batch, finished)
                grads, at = _input_grads(stash.pairs[stop][0]), stop - 1
                continue
            if not params:  # the whole backward, now
                _, seconds = self._autograd(
                    i, micro_batch, gs, partial(_backward, outs, gs), "backward", xs
                )
                self._observe(i, None, seconds + again, 0)
                grads = _input_grads(xs)
                continue
            need = [x for x in xs if x.is_floating_point() and x.requires_grad]
            if not need:  # nothing for B: W runs the whole backward
                whole = weightgrad.Split(fallback=(outs, gs, None))  # as a whole backward
                stash.weights.append(WeightWork(i, whole, gs, again))
                grads = _input_grads(xs)
                continue
            (got, halves), seconds = self._autograd(
                i,
                micro_batch,
                gs,
                partial(weightgrad.split_backward, outs, gs, need, params),
                "input grads",
                xs,
            )
            stash.weights.append(WeightWork(i, halves, gs, seconds + again))
            by_id = {id(x): g for x, g in zip(need, got, strict=True)}
            grads = [
                g if (g := by_id.get(id(x))) is not None else torch.zeros_like(x)
                for x in xs
                if x.is_floating_point()
            ]
        for part in (stash.pairs, stash.linked, stash.seeds, stash.shapes):
            part.clear()
        if not split:  # with ZB-H1 the weight gradients come with W
            finished.above(None)
        else:
            stash.early = self.held_grads()
        self.slowdown.pay()
        return structure.grads_value(grads) if grads is not None else None

    def _linked_backward(
        self,
        stash: Stash,
        bottom: int,
        top: int,
        outs: list[torch.Tensor],
        gs: list[torch.Tensor],
        micro_batch: int,
        finished: _Finished,
    ) -> int:
        """One autograd pass from the outputs ``outs`` of the slice's ``top``-th layer down
        through the ``bottom``-th, the layers between linked. A hook on each linked input
        notes when the layer above it is done (the engine runs a CPU graph made on one
        thread on this thread, highest sequence number first, gradient accumulations
        before anything: a layer's nodes before the layer below's; ``none_late`` checks):
        its time, and its gradients taken into the run's sums (``finished``).

        Returns:
            The lowest layer reached: ``bottom``, or one whose input, needing a gradient,
            got none (the layers below then get zeros, as one by one).
        """
        clock, indices, pairs = self.slowdown.clock, self.indices, stash.pairs
        ends: dict[int, float] = {}  # by position: when that layer's backward was done
        ours: dict[int, float] = {}  # by mark: what its hook spent taking gradients
        failed: list[BaseException] = []  # the hooks' own work's, not the user's

        def mark(n: int) -> Callable[[torch.Tensor], None]:
            def done(_: torch.Tensor) -> None:
                ends[n] = t = clock()
                if finished.done is not None:  # (else nothing to take before the end)
                    try:
                        finished.above(indices[n - 1])
                    except BaseException as exc:
                        failed.append(exc)
                        raise
                    ours[n] = clock() - t

            return done

        hooks = [  # top down: hooks on one tensor (identity layers) run in this order
            x.register_hook(mark(n))  # type: ignore[no-untyped-call]  # torch stub
            for n in range(top, bottom, -1)
            if (x := pairs[n][0][0]).requires_grad
        ]
        start = clock()
        try:
            _, seconds = self.slowdown.timed(
                partial(_backward, outs, gs), self._sync, outside=lambda: sum(ours.values())
            )
        except Exception as exc:  # the user's code may raise anything: name the layer
            if failed or isinstance(exc, ElasticPipeError):
                raise  # the hooks' own (the run's sums, a reduction), as one by one
            n = next(n for n in range(top, bottom - 1, -1) if n not in ends)
            ys = pairs[n][1] or []
            g = structure.grads_value([y for y in ys if y.is_floating_point()])
            raise _user_error(
                "backward", indices[n], self.layers[indices[n]], g, micro_batch, exc
            ) from exc
        finally:
            for hook in hooks:
                hook.remove()
        end = clock()
        assert isinstance(seconds, float)  # (CUDA events' laps: never linked)
        if finished.done is not None:
            finished.none_late(indices[bottom : top + 1])
        stop = next((n for n in range(top, bottom, -1) if n not in ends), bottom)
        ends[stop] = end
        total, before = end - start - sum(ours.values()), start
        for n in range(top, stop - 1, -1):  # the time between two marks is the layer's
            took = max(0.0, ends[n] - before)
            share = took / total if total > 0 else 1.0 / (top - stop + 1)
            self._observe(indices[n], None, share * seconds, 0)
            before = max(before, ends[n]) + ours.get(n, 0.0)
        return stop

    def backward_weights(
        self, stash: Stash, micro_batch: int = -1, done: Callable[[int], None] | None = None
    ) -> None:
        """ZB-H1's W: computes the weight gradients ``backward(split=True)`` left in
        ``stash``, in the order B met the layers (the order a whole backward computes them
        in), adds them to the run's tree sums (at once: W sends nothing), and frees the
        graphs. ``done`` (the run's last W here): told of every layer once all are summed,
        highest first (a layer's gradients come from B and from W: whole only at the end).

        Raises:
            UserCodeError: a layer's backward raised.
        """
        self.slowdown.begin()
        self.take_owed()  # (W writes .grad)
        work, stash.weights = stash.weights, []
        for w in work:
            _, seconds = self._autograd(
                w.layer, micro_batch, w.grads, w.split.weights, "weight grads"
            )
            self._observe(w.layer, None, w.b_seconds + seconds, 0)
        early, stash.early = stash.early, []
        for param, g in early:  # (a parameter's gradient comes from B or from W, not both)
            param.grad = g
        self._take(micro_batch, None)  # (not deferred: W sends nothing)
        if done is not None:
            for i in reversed(self.indices):
                done(i)
        self.slowdown.pay()

    def _autograd(
        self,
        i: int,
        micro_batch: int,
        gs: list[torch.Tensor],
        fn: Callable[[], Any],
        kind: str,
        xs: Sequence[torch.Tensor] = (),
    ) -> tuple[Any, float | Lap]:
        """Runs one layer's backward ``fn`` (``kind``: which part of it; ``xs``: the
        layer's inputs), timed; the user's errors named."""
        try:
            return self.slowdown.timed(fn, self._sync, self.op(i, kind, gs, xs))
        except Exception as exc:  # the user's code may raise anything
            g = structure.grads_value(gs)
            raise _user_error("backward", i, self.layers[i], g, micro_batch, exc) from exc


class _Finished:
    """A backward's layers whose gradients are whole: taken into the run's sums as the
    backward goes down the layers, each told to ``done``; or, without ``done`` (every
    micro-batch but a run's last), all at once at its end (or, ``defer_takes``, later)."""

    def __init__(self, layers: LayerSlice, micro_batch: int, done: Callable[[int], None] | None):
        self.layers, self.micro_batch, self.done = layers, micro_batch, done
        self.left = list(reversed(layers.indices))  # not taken yet, highest first
        layers.take_owed()  # (a backward starts from no gradient in .grad)

    def none_late(self, layers: Sequence[int]) -> None:
        """Raises ModelError if a gradient reached a layer of ``layers`` once taken (a
        layer whose graph has nodes made on another thread)."""
        for i in layers:
            params = self.layers.layers[i].parameters()
            if i not in self.left and any(p.grad is not None for p in params):
                raise ModelError(
                    f"a gradient reached layer {i} after the layer below it began its backward "
                    "(a node of its graph made on another thread?)"
                )

    def above(self, layer: int | None) -> None:
        """Takes (and tells of) every layer above ``layer`` not taken yet; None: all."""
        if self.done is None:
            if layer is None:
                self.layers.took_grads(self.micro_batch)
            return
        while self.left and (layer is None or self.left[0] > layer):
            i = self.left.pop(0)
            self.layers.took_grads(self.micro_batch, (i,))
            self.done(i)


def _backward(outs: list[torch.Tensor], gs: list[torch.Tensor]) -> None:
    """Accumulates the gradients of ``outs`` (given ``gs``) into the graph's leaves."""
    torch.autograd.backward(outs, gs)


def _input_grads(xs: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The gradients of a layer's floating inputs (zeros for one it did not use, as for a
    linked input that no gradient reached), or None where they need none (data)."""
    grads = []
    for x in xs:
        if x.is_floating_point():
            if not x.requires_grad:
                return None
            g = x.grad if x.is_leaf else None
            grads.append(g if g is not None else torch.zeros_like(x))
    return grads


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
