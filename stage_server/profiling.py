"""The profiling pass, one layer at a time: time, activation and state bytes of every layer.

Only one layer of the model exists on the device at any moment: layer ``l`` is built, run
forward and backward (one warm-up pass, then up to ``repeats`` timed ones) on the output of layer
``l - 1``, measured (its optimizer's state too, see ``state_bytes`` below), and freed before
layer ``l + 1`` is built. The peak is one layer's state plus its activations, so
a stage can profile a model far larger than its memory.

**A layer like one already measured is not run again.** Two layers are alike when their
module trees match in everything that can change what they compute (``alike_key``): each
module's class, its parameters' and buffers' shapes and dtypes, and its other attributes
(plain values compared by value, anything else, a function or a config object, by
identity: only the same object matches). A layer alike to one measured on an input of
the same form (shapes and dtypes), and recomputed or not as it was, takes that layer's
figures, and its output stands for this one's: the twelve blocks of a GPT-2 are profiled
once. (``layer_idx``, the index
Hugging Face's layers keep for their key-value cache, is left out: a model whose compute
depends on the index keeps that in attributes of its own, such as ``sliding_window``.)

What is measured per layer, for one micro-batch (the sample):

* forward and backward seconds: the fastest of ``repeats`` (what delays a run, a page
  fault, a neighbour's burst on a shared host, only ever adds time; the median of five
  runs put some layers of a uniform MLP at 4x the others on a loaded host); a stage
  timing with ``--timer fastest`` asks for more (``Stage.profile``). A layer stops sooner
  once its timed runs (two at least) took ``LAYER_BUDGET_S`` of real time, or after one
  when it alone took ``LONG_RUN_S`` (a GPT-2-sized head, about half a second a run on
  one core of the 2-core Xeon; the warm-up, which carries one-time costs, never decides).
  Such a layer's delays are small next to it (its three runs in a row there were 0.48,
  0.49 and 0.49 s), and profiling a model stays a small share of its first step;
* ``output_bytes``: the activation it sends on;
* ``stash_bytes``: what a stage keeps for its backward while the micro-batch is in flight:
  its input and output and every tensor autograd saves, each storage counted once;
* ``state_bytes``: weights, buffers, gradients and optimizer state after one step (so any
  optimizer is measured, not guessed; on a meta copy of the layer where the optimizer can
  step one, see ``_optimizer_state_bytes``).

At GPT-2 small's size (162M parameters, AdamW, a micro-batch of 4 x 63 tokens, one
thread), the profile took 10.9 s before alike layers were skipped and the optimizer's state
was measured on the meta device, 3.0 s with two timed runs of its head, and 2.5 s with one
(``bench/first_step.py`` shows it within the first step).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from elasticpipe import models
from elasticpipe.stage_server.alike import alike_key
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.slicestate import LayerTiming
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import make_optimizer
from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value

MakeOptimizer = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

LAYER_BUDGET_S = 0.25  # timed runs (two at least) that took this long in all: they do
LONG_RUN_S = 0.4  # a first timed run this long: it does

__all__ = ["alike_key", "profile_layers", "tensor_bytes"]


def _storage(t: torch.Tensor) -> tuple[str, int]:
    """Identifies the storage behind a tensor (its views share it)."""
    return str(t.device), t.untyped_storage().data_ptr()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage count once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.device.type != "meta":
            seen[_storage(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _state_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _state_tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _state_tensors(v)]
    return []


def _state_bytes(
    layer: nn.Module, optimizer: torch.optim.Optimizer | None, twin: nn.Module, make: MakeOptimizer
) -> int:
    """Bytes of ``layer``'s weights, buffers and gradients, and of its optimizer's state
    after one step: see ``_optimizer_state_bytes``."""
    tensors = [*layer.parameters(), *layer.buffers()]
    tensors += [p.grad for p in layer.parameters() if p.grad is not None]
    if optimizer is None:
        return tensor_bytes(tensors)
    return tensor_bytes(tensors) + _optimizer_state_bytes(optimizer, layer, twin, make)


def _optimizer_state_bytes(
    optimizer: torch.optim.Optimizer, layer: nn.Module, twin: nn.Module, make: MakeOptimizer
) -> int:
    """Bytes of ``optimizer``'s state after one step. The job's optimizer, made again by
    ``make``, steps ``twin``, a meta copy of the layer: it creates its state as it
    would, but on the meta device, which allocates nothing and computes nothing (for a
    50257 x 768 embedding under AdamW, this saves 0.4 s of zeroing and arithmetic). An
    optimizer that cannot step meta tensors (one that reads a value, as ``Adafactor``
    does) steps the real layer instead, and that state is thrown away."""
    # the parameters the real backward gave a gradient (a step skips the others)
    graded = {name for name, p in layer.named_parameters() if p.grad is not None}
    params = [p for p in twin.parameters() if p.requires_grad]
    for name, p in twin.named_parameters():
        if name in graded:
            p.grad = torch.zeros_like(p)
    try:
        ghost = make(params)
        ghost.step()
        state = _state_tensors(ghost.state_dict()["state"])
    except Exception:  # any optimizer's meta step may fail: measure it for real
        optimizer.step()
        return tensor_bytes(_state_tensors(optimizer.state_dict()["state"]))
    distinct = {id(t): t for t in state}.values()  # (a meta tensor has no storage to tell)
    return sum(
        t.numel() * t.element_size() if t.is_meta else t.untyped_storage().nbytes()
        for t in distinct
    )


def _enough(timed: int, timed_s: float) -> bool:
    """Whether a layer's first ``timed`` runs (real seconds: ``timed_s``) measure it well
    enough: see the module's docstring."""
    return (timed == 1 and timed_s >= LONG_RUN_S) or (timed >= 2 and timed_s >= LAYER_BUDGET_S)


def profile_layers(
    job: JobConfig,
    sample: Value,
    device: torch.device,
    slowdown: Slowdown,
    allow: tuple[str, ...],
    repeats: int,
) -> list[LayerTiming]:
    """Profiles every layer of ``job``'s model on ``device``, one layer resident at a time.

    Args:
        job: the job (model, seed, optimizer, precision).
        sample: one micro-batch of inputs.
        device: where to run.
        slowdown: the stage's emulated slowdown (its times are reported; the stage's
            waits for none of them, ``Slowdown.unpaid``).
        allow: the stage's allowed model prefixes.
        repeats: timed passes per layer at most (after one warm-up; fewer for a layer
            whose passes take long, see ``LAYER_BUDGET_S``).

    Returns:
        One ``LayerTiming`` per layer, with ``stash_bytes`` and ``state_bytes`` set.

    Raises:
        UserCodeError / ModelError / PermissionDenied: as building or running the layers.
    """
    skeleton = models.build_skeleton(job.model, job.model_kwargs, allow)
    x = structure.to_device(sample, device)
    saved: list[torch.Tensor] = []

    def keep(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    results: list[LayerTiming] = []
    # Each kind of layer measured, by its key and its input's form: its figures, and
    # whether its output has its input's form. A layer alike to one that keeps the form
    # passes its input on as its output (a transformer's blocks); one alike to a layer
    # that changes it is measured anyway (its output is needed, and no output is kept
    # beyond the next layer's, whatever the model).
    alike: dict[tuple[Any, ...], tuple[LayerTiming, bool]] = {}
    for index in range(len(skeleton)):
        key = (
            alike_key(skeleton[index]),
            structure.signature(x),
            index > 0,
            job.recomputes(index),  # (its stash and backward differ)
        )
        if key in alike and alike[key][1]:
            results.append(dataclasses.replace(alike[key][0]))
            continue
        probe = LayerSlice(job, device, slowdown, allow)
        probe.build(index, index + 1)
        # Autograd saves the weights too: they are state, counted once in state_bytes.
        own = {
            _storage(t) for t in [*probe.layers[index].parameters(), *probe.layers[index].buffers()]
        }
        runs: list[LayerTiming] = []
        out, stash_bytes = x, 0
        timed_s = 0.0
        for run in range(max(1, repeats) + 1):
            if run > 1 and _enough(run - 1, timed_s):
                break
            started = time.perf_counter()
            probe.timings = {index: LayerTiming()}
            saved.clear()
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
                out, stash = probe.forward(x, train=True, input_grad=index > 0)
            assert stash is not None
            held = [
                *saved,
                *(t for pair in stash.pairs for ts in pair if ts is not None for t in ts),
            ]
            stash_bytes = tensor_bytes(t for t in held if _storage(t) not in own)
            saved.clear()
            outs = structure.tensors(out)
            ones = [torch.ones_like(outs[p]) for p in structure.floating(outs)]
            probe.backward(stash, structure.grads_value(ones))
            probe.settle_timings()  # CUDA events: read now (off the hot path)
            runs.append(probe.timings[index])
            if run > 0:
                timed_s += time.perf_counter() - started
        measured = runs[1:]
        results.append(
            LayerTiming(
                forward_s=min(r.forward_s for r in measured),
                backward_s=min(r.backward_s for r in measured),
                output_bytes=measured[-1].output_bytes,
                samples=len(measured),
                stash_bytes=stash_bytes,
                state_bytes=_state_bytes(
                    probe.layers[index],
                    probe.optimizers.get(index),
                    copy.deepcopy(skeleton[index]),
                    lambda params: make_optimizer(
                        job.optimizer, params, job.optimizer_kwargs, allow
                    ),
                ),
            )
        )
        keeps_form = structure.signature(out) == structure.signature(x)
        x = structure.detached(out)
        alike[key] = (results[-1], keeps_form)
        del probe, out  # only one layer is ever resident
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results
