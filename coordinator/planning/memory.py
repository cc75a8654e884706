"""What each layer needs where it lives, what each stage offers, and whether a partition fits.

A layer ``l`` on a stage needs::

    need[l] = state[l] + grads[l] + stash[l] * in_flight

* ``state[l]``: weights, buffers, gradients and optimizer state. Measured by the profiling
  pass (after one optimizer step, so any optimizer is covered); without a profile, estimated
  from the layer's parameter bytes ``p``: ``p`` (weights) + ``p`` (gradients) + ``k * p``
  (optimizer), with ``k`` = 0 for plain SGD, 1 for SGD with momentum, 2 for Adam/AdamW (3
  with ``amsgrad``), and a conservative 3 for any other optimizer.
* ``grads[l]``: the partial sums of the canonical gradient sum (``training.gradsum``) held
  while the next micro-batch's gradient is computed into a fresh ``.grad``: ``peak_partials(m)``
  copies of the layer's parameter bytes (1 for ``m <= 3``, 2 for 4 to 7 micro-batches, 3
  for 8 to 15), beyond the one gradient ``state[l]`` counts.
* ``stash[l]``: what one micro-batch keeps for the layer's backward (its input, output and
  autograd's saved tensors), measured by the profiling pass; 0 without a profile (a job set
  up without a sample input is planned on its state alone, see docs/operations.md).
* ``in_flight``: micro-batches whose activations a stage holds at once. GPipe runs every
  forward before any backward, so ``m``. Under 1F1B stage ``s`` of ``S`` holds
  ``min(m, S - s)``, which depends on the stage's position while the planner's model is one
  additive need per layer; the need is therefore taken at its largest, ``min(m, S)`` (the
  first stage's), for every stage. That over-reserves activations on later stages, never
  under-reserves, and keeps the planner exact for what it is given. ZB-H1 keeps a
  micro-batch alive on stage ``s`` until its weight gradients, ``s`` backwards after its
  input gradients: ``min(m, S)`` on every stage, of which up to ``min(m, s)`` also hold the
  gradients B kept for W (at most about one stash more each: a gradient per tensor the
  weights' nodes produced); taken at its largest, ``min(m, S) + min(m, S - 1)``.

A stage offers what it reports (``stage_server.memory.detect``: ``--memory``, free CUDA memory
less a headroom, or the host's available memory); 0 means unknown, and such a stage has no
cap, nor has one that offers more than the whole model needs (it can never overflow).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from elasticpipe.coordinator.planning.cost import PlanError
from elasticpipe.coordinator.planning.estimates import Profile
from elasticpipe.training.gradsum import peak_partials
from elasticpipe.training.job import JobConfig

__all__ = [
    "MemoryTerms",
    "check_fits",
    "in_flight",
    "layer_needs",
    "offers",
    "optimizer_factor",
    "terms",
]

_UNKNOWN_OPTIMIZER_FACTOR = 3.0


class MemoryTerms(NamedTuple):
    """The planner's optional memory inputs (both None: no stage has a cap)."""

    layer_memory: list[float] | None = None
    stage_memory: list[float] | None = None


def in_flight(micro_batches: int, schedule: str, num_stages: int) -> int:
    """Micro-batches whose activations the busiest stage holds at once (see module doc)."""
    if schedule == "gpipe":
        return micro_batches
    alive = min(micro_batches, max(num_stages, 1))
    if schedule == "zb-h1":
        return alive + min(micro_batches, max(num_stages - 1, 0))
    return alive


def optimizer_factor(optimizer: str, kwargs: dict[str, object]) -> float:
    """Optimizer state as a multiple of the parameter bytes (without a profile)."""
    if optimizer == "sgd":
        momentum = kwargs.get("momentum", 0)
        return 1.0 if isinstance(momentum, int | float) and momentum else 0.0
    if optimizer in ("adam", "adamw"):
        return 3.0 if kwargs.get("amsgrad") else 2.0
    return _UNKNOWN_OPTIMIZER_FACTOR


def layer_needs(
    param_bytes: Sequence[int], profile: Profile | None, job: JobConfig, num_stages: int
) -> list[float]:
    """Bytes each layer needs on the stage that holds it, for a chain of ``num_stages``."""
    count = in_flight(job.micro_batches, job.schedule, num_stages)
    # A profile from stages that did not measure memory carries zeros: estimate instead.
    profiled = (
        profile is not None
        and len(profile.state_bytes) == len(param_bytes)
        and any(profile.state_bytes)
    )
    factor = 2.0 + optimizer_factor(job.optimizer, job.optimizer_kwargs)
    partials = peak_partials(job.micro_batches)
    needs = []
    for layer, size in enumerate(param_bytes):
        if profile is not None and profiled:
            state = float(profile.state_bytes[layer])
            stash = float(profile.stash_bytes[layer])
        else:
            state, stash = size * factor, 0.0
        needs.append(state + size * partials + stash * count)
    return needs


def terms(
    capacities: Sequence[int],
    param_bytes: Sequence[int],
    profile: Profile | None,
    job: JobConfig,
) -> MemoryTerms:
    """The planner's memory inputs for stages offering ``capacities`` (chain order)."""
    needs = layer_needs(param_bytes, profile, job, len(capacities))
    total = math.fsum(needs)
    # A stage that can hold the whole model is not constrained: no cap, so that stages
    # differing only in memory they will never fill stay interchangeable to the planner.
    caps = [float(c) if 0 < c < total else math.inf for c in capacities]
    if all(math.isinf(c) for c in caps):
        return MemoryTerms()
    return MemoryTerms(needs, caps)


def check_fits(
    boundaries: Sequence[int], memory: MemoryTerms, names: Sequence[str], what: str
) -> None:
    """Refuses a partition in which some stage would hold more than it offers.

    Args:
        boundaries: the partition's ``S + 1`` cuts.
        memory: the needs and capacities (chain order); no check when both are None.
        names: stage names, chain order, for the message.
        what: what is refused ("set-partition", "move").

    Raises:
        PlanError: naming the stage, its layers, bytes needed vs offered, and the shortfall.
    """
    needs, caps = memory
    if needs is None or caps is None:
        return
    for s in range(len(boundaries) - 1):
        lo, hi = boundaries[s], boundaries[s + 1]
        need = math.fsum(needs[lo:hi])
        if need > caps[s]:
            raise PlanError(
                f"{what} refused: stage {names[s]!r} would hold layers {lo}..{hi - 1}, needing "
                f"{_fmt(need)} but it offers {_fmt(caps[s])} (short by {_fmt(need - caps[s])}); "
                "nothing changed"
            )


def offers(names: Sequence[str], memory: MemoryTerms) -> str:
    """Says what the model needs and what each stage offers (for an error message)."""
    needs, caps = memory
    if needs is None or caps is None:
        return "no stage reported its memory"
    offered = ", ".join(f"{n}: {_fmt(c)}" for n, c in zip(names, caps, strict=True))
    return (
        f"the model needs {_fmt(math.fsum(needs))} in all (largest layer {_fmt(max(needs))}); "
        f"the stages offer {offered}"
    )


def _fmt(value: float) -> str:
    """Bytes, exact and in MiB, e.g. ``3145728 B (3.0 MiB)``."""
    if math.isinf(value):
        return "unlimited"
    return f"{int(value)} B ({value / (1 << 20):.1f} MiB)"
