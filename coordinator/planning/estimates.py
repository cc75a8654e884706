"""Turning what stages measure into the planner's inputs: per-layer unit costs, stage speeds.

A stage reports, per layer it ran, smoothed forward and backward seconds (its slowdown
included). The profiling pass at job start times *every* layer on *every* stage, which
fixes both unknowns: stage s's speed is how much faster it ran the whole model than the
slowest stage, and layer l's unit cost is its time on a speed-1 device (averaged over
stages). In training each stage only runs its own layers; its live speed is then the unit
cost of the layers it ran divided by the time it took::

    costs = [1, 2, 1]          (seconds on a speed-1 device)
    stage A ran layers 0-1 in 1.5 s  ->  speed (1 + 2) / 1.5 = 2.0
    stage B ran layer 2 in 2.0 s     ->  speed 1 / 2.0 = 0.5

A stage with no measurement yet (it just joined, or its layers just arrived) keeps its
last known speed, else its profiled speed, else the mean of the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elasticpipe.coordinator.planning.cost import Plan

Timing = tuple[float, float, int, int]  # (forward_s, backward_s, output_bytes, samples)


@dataclass(frozen=True)
class Profile:
    """Unit costs of every layer, each profiled stage's speed, and the bytes at each cut."""

    costs: tuple[float, ...]
    speeds: dict[str, float]
    # Bytes crossing a cut after layer l per micro-batch: the activation forward and its
    # gradient backward (the same size).
    activation_bytes: tuple[int, ...] = ()
    # Per layer, for memory planning (``memory.py``): bytes one micro-batch keeps for its
    # backward, and bytes of its weights, gradients and optimizer state. Empty: not measured.
    stash_bytes: tuple[int, ...] = ()
    state_bytes: tuple[int, ...] = ()

    def to_store(self) -> dict[str, object]:
        """The persisted form (the store's ``profile`` key)."""
        return {
            "costs": list(self.costs),
            "speeds": self.speeds,
            "activation_bytes": list(self.activation_bytes),
            "stash_bytes": list(self.stash_bytes),
            "state_bytes": list(self.state_bytes),
        }


def from_profiles(
    profiles: Mapping[str, Sequence[Timing]],
    memory: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> Profile:
    """Combines the full-model profiles of several stages.

    Args:
        profiles: stage id -> one timing per layer of the whole model.
        memory: stage id -> ``(stash_bytes, state_bytes)`` per layer; the largest of the
            stages is kept (devices may differ, e.g. in what autocast saves).

    Returns:
        Unit costs (seconds on a speed-1 device) and speeds (the slowest stage is 1).
    """
    totals = {sid: sum(t[0] + t[1] for t in timings) for sid, timings in profiles.items()}
    slowest = max(totals.values())
    speeds = {sid: slowest / total if total > 0 else 1.0 for sid, total in totals.items()}
    num_layers = len(next(iter(profiles.values())))
    costs = []
    for layer in range(num_layers):
        per_stage = [(t[layer][0] + t[layer][1]) * speeds[s] for s, t in profiles.items()]
        costs.append(max(sum(per_stage) / len(per_stage), 1e-9))
    activation_bytes = tuple(
        2 * max(t[layer][2] for t in profiles.values()) for layer in range(num_layers)
    )
    stash: tuple[int, ...] = ()
    state: tuple[int, ...] = ()
    if memory:
        stash = tuple(max(m[layer][0] for m in memory.values()) for layer in range(num_layers))
        state = tuple(max(m[layer][1] for m in memory.values()) for layer in range(num_layers))
    return Profile(
        costs=tuple(costs),
        speeds=speeds,
        activation_bytes=activation_bytes,
        stash_bytes=stash,
        state_bytes=state,
    )


def fallback_costs(param_bytes: Sequence[int]) -> tuple[float, ...]:
    """Unit costs when nothing was profiled: proportional to parameters (at least 1)."""
    scale = max(max(param_bytes, default=1), 1)
    return tuple(max(b / scale, 0.05) for b in param_bytes)


def live_speed(costs: Sequence[float], timings: Mapping[int, Timing]) -> float | None:
    """A stage's speed from its reported per-layer times, or None without measurements."""
    unit = spent = 0.0
    for layer, (fwd, bwd, _, samples) in timings.items():
        if samples > 0 and 0 <= layer < len(costs) and fwd + bwd > 0:
            unit += costs[layer]
            spent += fwd + bwd
    if spent <= 0 or not math.isfinite(unit / spent):
        return None
    return unit / spent


def fill_speeds(known: Sequence[float | None]) -> list[float]:
    """Replaces unknown speeds by the mean of the known ones (1.0 if none is known)."""
    values = [v for v in known if v is not None and v > 0]
    mean = sum(values) / len(values) if values else 1.0
    return [v if v is not None and v > 0 else mean for v in known]


def evaluate(
    boundaries: Sequence[int],
    costs: Sequence[float],
    speeds: Sequence[float],
    activation_bytes: Sequence[int] | None = None,
    link_bandwidths: Sequence[float] | None = None,
) -> Plan:
    """The times of a given partition (no optimisation), as a ``Plan``."""
    stage_times = tuple(
        math.fsum(costs[boundaries[s] : boundaries[s + 1]]) / speeds[s] for s in range(len(speeds))
    )
    link_times = tuple(
        activation_bytes[boundaries[s + 1] - 1] / link_bandwidths[s]
        if activation_bytes and link_bandwidths
        else 0.0
        for s in range(len(speeds) - 1)
    )
    return Plan(
        boundaries=tuple(boundaries),
        stage_times=stage_times,
        link_times=link_times,
        bottleneck=max(stage_times + link_times),
    )
