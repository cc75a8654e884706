"""The cost model: what a slice of layers costs on a stage, and what a partition's step costs.

Stage ``s`` runs the slice ``[a, b)`` in ``sum(costs[a:b]) / speed[s]`` seconds; a cut after
layer ``b - 1`` costs its link ``activation_bytes[b - 1] / bandwidth[s]``; the slice needs
``sum(memory[a:b])`` bytes of what the stage offers. A partition's bottleneck is its slowest
stage or link (``Plan``), and ``predict_step_time`` turns it into seconds per step under a
schedule. ``_instance`` validates these inputs once and precomputes them as the arrays the
solver probes (prefix sums, link times per cut, memory limits per start and end).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from elasticpipe.errors import InvalidRequest
from elasticpipe.training.schedule import SCHEDULES

__all__ = ["Numbers", "Plan", "PlanError", "moved_layers", "predict_step_time"]

Numbers = Sequence[float] | npt.NDArray[np.floating[Any]] | npt.NDArray[np.integer[Any]]
_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]
_Bools = npt.NDArray[np.bool_]


class PlanError(InvalidRequest):
    """No partition exists for these inputs, or an input is malformed; the message says which."""


@dataclass(frozen=True)
class Plan:
    """A contiguous partition of layers over a chain of stages, with its predicted times.

    Attributes:
        boundaries: ``S + 1`` cut positions ``0 = b0 < b1 < ... < bS = L``; stage ``s`` owns
            layers ``[b_s, b_{s+1})``.
        stage_times: seconds stage ``s`` spends on one micro-batch (forward + backward).
        link_times: seconds link ``s`` (between stage ``s`` and ``s + 1``) spends on one
            micro-batch (activation forward + gradient backward); zeros without link terms.
        bottleneck: the largest of ``stage_times`` and ``link_times``.
    """

    boundaries: tuple[int, ...]
    stage_times: tuple[float, ...]
    link_times: tuple[float, ...]
    bottleneck: float

    def layers_moved(self, other_boundaries: Sequence[int]) -> int:
        """Counts the layers whose stage differs between this plan and ``other_boundaries``.

        Args:
            other_boundaries: boundaries with the same stage count and layer count.

        Returns:
            How many layers change owner.

        Raises:
            PlanError: ``other_boundaries`` is not a valid partition of the same shape.
        """
        other = _check_boundaries("other_boundaries", other_boundaries, self.boundaries)
        return self.boundaries[-1] - _kept(self.boundaries, other)


def moved_layers(old: Sequence[int], new: Sequence[int]) -> list[tuple[int, int, int]]:
    """Lists the layers that change owner from partition ``old`` to partition ``new``.

    Args:
        old: boundaries (``S + 1`` ints) of the partition in force.
        new: boundaries of the partition to move to, same ``S`` and ``L``.

    Returns:
        ``(layer, old_stage, new_stage)`` for each moved layer, in layer order.

    Raises:
        PlanError: either tuple is not a valid partition, or their shapes differ.
    """
    before = _check_boundaries("old", old, None)
    after = _check_boundaries("new", new, before)
    moves: list[tuple[int, int, int]] = []
    s_old = s_new = 0
    for layer in range(before[-1]):
        while layer >= before[s_old + 1]:
            s_old += 1
        while layer >= after[s_new + 1]:
            s_new += 1
        if s_old != s_new:
            moves.append((layer, s_old, s_new))
    return moves


def predict_step_time(plan: Plan, micro_batches: int, schedule: str = "1f1b") -> float:
    """Predicts the seconds of one synchronous mini-batch step of ``plan``.

    The model: one micro-batch spends ``stage_times[s]`` (forward + backward) on stage ``s`` and
    ``link_times[s]`` on link ``s``. The first micro-batch crosses every stage and link once
    each way before the pipeline is full and after it drains (fill + drain), and in steady
    state one micro-batch leaves the pipeline every ``bottleneck`` seconds, so::

        step = sum(stage_times) + sum(link_times) + (micro_batches - 1) * bottleneck

    GPipe (all forwards, then all backwards) and 1F1B (alternate once full) have the same
    bubble in this model — ``S - 1`` fill and drain slots — so they predict the same time;
    1F1B saves activation memory (at most ``S - s`` micro-batches live on stage ``s`` instead
    of ``micro_batches``), not time.

    ZB-H1 (``elasticpipe.training.schedule``) leaves each weight gradient for later, so of every
    stage but the bottleneck only the forward and the input gradient lie on the fill and
    drain path, the weight gradients filling its gaps. Taking forward, input gradient and
    weight gradient as a third of a stage's time each (one matmul each for a linear layer),
    the step is the longer of two paths: the bottleneck busy for every micro-batch plus a
    third of every other stage, and, with few micro-batches, the first micro-batch's
    forward through the chain, the bottleneck's forward and input gradient for the others,
    and the drain: the input gradients from the last stage down to some stage ``s`` and
    ``s``'s last weight gradient (the first stage's, unless a slower stage's outlasts the
    input gradients after it)::

        tail = max over s of (sum(stage_times[s:]) + stage_times[s])
        step = max(m * bottleneck + (sum(stage_times) - max(stage_times)) / 3,
                   (sum(stage_times) + tail + 2 * (m - 1) * bottleneck) / 3)
               + sum(link_times)

    capped at 1F1B's prediction (a link as the bottleneck gains nothing from the split).

    Against the critical path of the schedule's own ops (``elasticpipe.observe.efficiency``) it is
    within 14% for 1-7 stages of unequal speed and 1-16 micro-batches, as 1F1B's formula is
    within 26% of its own (tests/unit/test_planner.py); never above 1F1B's prediction.

    Args:
        plan: the partition and its per-stage and per-link times.
        micro_batches: micro-batches per mini-batch, >= 1.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"zb-h1"``.

    Returns:
        Predicted seconds per step.

    Raises:
        PlanError: ``micro_batches`` < 1 or ``schedule`` unknown.
    """
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r} (expected one of {list(SCHEDULES)})")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise PlanError(f"micro_batches must be an int >= 1 (got {micro_batches!r})")
    links = math.fsum(plan.link_times)
    one_f_one_b = math.fsum(plan.stage_times) + links + (micro_batches - 1) * plan.bottleneck
    if schedule == "zb-h1" and plan.stage_times:
        total, m, bottleneck = math.fsum(plan.stage_times), micro_batches, plan.bottleneck
        steady = m * bottleneck + (total - max(plan.stage_times)) / 3
        # The drain ends with some stage's last weight gradient after the input gradients
        # from the last stage down to it: the first stage's, unless a slower stage's own
        # weight gradient outlasts the input gradients that follow it.
        times = plan.stage_times
        tail = max(math.fsum(times[s:]) + times[s] for s in range(len(times)))
        chain = (total + tail + 2 * (m - 1) * bottleneck) / 3
        # A link as the bottleneck: splitting backwards relieves no link, so never more
        # than 1F1B's time.
        return min(max(steady, chain) + links, one_f_one_b)
    return one_f_one_b


@dataclass(frozen=True)
class _Inputs:
    """The validated inputs in plain Python form, to report exact times and messages."""

    costs: list[float]
    speeds: list[float]
    act: list[float] | None
    bandwidths: list[float] | None
    memory: list[float] | None
    caps: list[float]

    def permuted(self, order: Sequence[int]) -> _Inputs:
        """The same inputs with the stages (speeds, memory) in ``order``."""
        return _Inputs(
            self.costs,
            [self.speeds[h] for h in order],
            self.act,
            self.bandwidths,
            self.memory,
            [self.caps[h] for h in order],
        )


@dataclass(frozen=True)
class _Instance:
    """The arrays a probe needs: prefix sums, speeds, link times per cut, memory limits."""

    prefix: _Floats  # L + 1 prefix sums of the costs
    prefix_list: list[float]  # the same, for scalar binary searches
    speeds: _Floats  # S
    link: _Floats | None  # (S, L + 1): time of link s when cut at position b (last row 0)
    # One row per distinct memory cap (a single row without caps), so that reordering the
    # stages costs O(S) rather than copying O(S * L) tables:
    lo_mem: _Ints  # (K, L + 1): smallest start a such that [a, b) fits row k's memory
    hi_mem: _Ints  # (K, L + 1): largest end b such that [a, b) fits row k's memory
    mem_row: _Ints  # (S,): the row of lo_mem / hi_mem that stage s uses
    capped: bool  # whether memory caps were given

    def permuted(self, order: Sequence[int]) -> _Instance:
        """The same instance with the stages (speeds, memory) in ``order``."""
        idx = np.asarray(order, dtype=np.int64)
        return _Instance(
            self.prefix,
            self.prefix_list,
            self.speeds[idx],
            self.link,
            self.lo_mem,
            self.hi_mem,
            self.mem_row[idx],
            self.capped,
        )

    def lo(self, s: int, end: int) -> int:
        """The smallest start of a slice ending at ``end`` that fits stage ``s``'s memory."""
        return int(self.lo_mem[self.mem_row[s], end])

    def hi(self, s: int, start: int) -> int:
        """The largest end of a slice starting at ``start`` that fits stage ``s``'s memory."""
        return int(self.hi_mem[self.mem_row[s], start])


def _instance(
    *,
    layer_costs: Numbers,
    named_speeds: tuple[str, Numbers],
    activation_bytes: Numbers | None,
    link_bandwidths: Numbers | None,
    layer_memory: Numbers | None,
    stage_memory: Numbers | None,
) -> tuple[_Instance, _Inputs]:
    """Validates the inputs and precomputes what every probe needs."""
    costs = _floats("layer_costs", layer_costs, None, per="layer", positive=True, finite=True)
    speeds = _floats(*named_speeds, None, per="stage", positive=True, finite=True)
    n_layers, n_stages = costs.size, speeds.size
    if n_layers < n_stages:
        raise PlanError(f"too few layers for the stages (layers: {n_layers}, stages: {n_stages})")
    prefix = np.concatenate(([0.0], np.cumsum(costs)))

    link = act = bandwidths = None
    _together("activation_bytes", activation_bytes, "link_bandwidths", link_bandwidths)
    if activation_bytes is not None and link_bandwidths is not None:
        act = _floats(
            "activation_bytes", activation_bytes, n_layers, per="layer", positive=False, finite=True
        )
        bandwidths = _floats(
            "link_bandwidths",
            link_bandwidths,
            n_stages - 1,
            per="link",
            positive=True,
            finite=False,
        )
        link = np.zeros((n_stages, n_layers + 1))  # the last stage has no link: a zero row
        link[:-1, 1:n_layers] = act[None, : n_layers - 1] / bandwidths[:, None]

    memory = None
    caps = np.full(n_stages, np.inf)
    lo_mem: _Ints = np.zeros((1, n_layers + 1), dtype=np.int64)
    hi_mem: _Ints = np.full((1, n_layers + 1), n_layers, dtype=np.int64)
    mem_row: _Ints = np.zeros(n_stages, dtype=np.int64)
    _together("layer_memory", layer_memory, "stage_memory", stage_memory)
    if layer_memory is not None and stage_memory is not None:
        memory = _floats(
            "layer_memory", layer_memory, n_layers, per="layer", positive=False, finite=True
        )
        caps = _floats(
            "stage_memory", stage_memory, n_stages, per="stage", positive=False, finite=False
        )
        mem_prefix = np.concatenate(([0.0], np.cumsum(memory)))
        distinct, rows = np.unique(caps, return_inverse=True)
        mem_row = rows.astype(np.int64).reshape(n_stages)
        lo_mem = np.zeros((distinct.size, n_layers + 1), dtype=np.int64)
        hi_mem = np.zeros((distinct.size, n_layers + 1), dtype=np.int64)
        for k, cap in enumerate(distinct.tolist()):
            # [a, b) fits iff mem_prefix[b] - cap <= mem_prefix[a]: one comparison, used both ways.
            floor = mem_prefix - cap
            lo_mem[k] = np.searchsorted(mem_prefix, floor, side="left")
            hi_mem[k] = np.searchsorted(floor, mem_prefix, side="right") - 1

    inst = _Instance(
        prefix, prefix.tolist(), speeds, link, lo_mem, hi_mem, mem_row, memory is not None
    )
    inputs = _Inputs(
        costs.tolist(),
        speeds.tolist(),
        None if act is None else act.tolist(),
        None if bandwidths is None else bandwidths.tolist(),
        None if memory is None else memory.tolist(),
        caps.tolist(),
    )
    return inst, inputs


def _together(first: str, a: Numbers | None, second: str, b: Numbers | None) -> None:
    """Checks that two optional inputs that only mean something together are both given or
    both left out.

    Raises:
        PlanError: only one of them is given (named).
    """
    if (a is None) != (b is None):
        given = first if b is None else second
        raise PlanError(f"{first} and {second} go together (got {given} only)")


def _floats(
    name: str, values: Numbers, size: int | None, *, per: str, positive: bool, finite: bool
) -> _Floats:
    """Converts and checks one numeric input, naming the first bad value."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise PlanError(f"{name} must be a sequence of numbers (got {values!r:.80})") from exc
    if arr.ndim != 1:
        raise PlanError(f"{name} must be one-dimensional (got shape {arr.shape})")
    if size is None and arr.size == 0:
        raise PlanError(f"{name} is empty")
    if size is not None and arr.size != size:
        raise PlanError(f"{name} needs {size} values, one per {per} (got {arr.size})")
    bad = np.isnan(arr) | ((arr <= 0) if positive else (arr < 0))
    if finite:
        bad |= np.isinf(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        need = "> 0" if positive else ">= 0"
        kind = "a finite number" if finite else "a number"
        raise PlanError(f"{name}[{i}] must be {kind} {need} (got {float(arr[i])})")
    return arr


def _make_plan(inputs: _Inputs, bounds: tuple[int, ...]) -> Plan:
    """Builds the public plan, summing each slice exactly rather than from prefix sums."""
    n_stages = len(bounds) - 1
    stage_times = tuple(
        math.fsum(inputs.costs[bounds[s] : bounds[s + 1]]) / inputs.speeds[s]
        for s in range(n_stages)
    )
    if inputs.act is None or inputs.bandwidths is None:
        link_times = tuple(0.0 for _ in range(n_stages - 1))
    else:
        link_times = tuple(
            inputs.act[bounds[s + 1] - 1] / inputs.bandwidths[s] for s in range(n_stages - 1)
        )
    return Plan(bounds, stage_times, link_times, max(stage_times + link_times))


def _kept(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """Layers that stay on the same stage between two partitions of the same shape."""
    return sum(max(0, min(a[s + 1], b[s + 1]) - max(a[s], b[s])) for s in range(len(a) - 1))


def _check_boundaries(
    name: str, values: Sequence[int], like: tuple[int, ...] | None
) -> tuple[int, ...]:
    """Checks that ``values`` is 0 = b0 < b1 < ... < bS, shaped like ``like`` if given."""
    bounds = tuple(values)
    if not all(isinstance(b, int | np.integer) and not isinstance(b, bool) for b in bounds):
        raise PlanError(f"{name} must be ints (got {list(bounds)})")
    bounds = tuple(int(b) for b in bounds)
    if len(bounds) < 2 or bounds[0] != 0:
        raise PlanError(f"{name} must start at 0 and have at least 2 entries (got {list(bounds)})")
    steps = [i for i in range(len(bounds) - 1) if bounds[i + 1] <= bounds[i]]
    if steps:
        raise PlanError(
            f"{name} must increase strictly, every stage >= 1 layer "
            f"(stage {steps[0]} is empty in {list(bounds)})"
        )
    if like is not None and (len(bounds) != len(like) or bounds[-1] != like[-1]):
        raise PlanError(
            f"{name} has {len(bounds) - 1} stages over {bounds[-1]} layers, expected "
            f"{len(like) - 1} stages over {like[-1]} layers (got {list(bounds)})"
        )
    return bounds
