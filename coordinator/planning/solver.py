"""The planner's solver: an exact min-bottleneck contiguous partition of layers over unequal
stages, by bisection on the bottleneck with exact probes (the algorithm is drawn below
``plan``)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from elasticpipe.coordinator.planning.cost import (
    Numbers,
    Plan,
    PlanError,
    _Bools,
    _check_boundaries,
    _Floats,
    _Inputs,
    _Instance,
    _instance,
    _Ints,
    _make_plan,
)

__all__ = ["plan"]

# A probe at bottleneck T accepts a slice whose time is up to T * (1 + _SLACK), so that float
# rounding in prefix-sum differences never rejects the very slice that defines T.
_SLACK = 1e-11
# The search stops once the feasible bound is within this relative gap of the proven lower bound.
_GAP = 1e-10
# With `current=`, plans up to this much (relative) slower than the optimum count as optimal ties.
_TIE = 1e-10
# Bisection steps before giving up on closing the last gap (each halves it at least).
_MAX_PROBES = 200


def plan(
    layer_costs: Numbers,
    stage_speeds: Numbers,
    activation_bytes: Numbers | None = None,
    link_bandwidths: Numbers | None = None,
    layer_memory: Numbers | None = None,
    stage_memory: Numbers | None = None,
    current: Sequence[int] | None = None,
) -> Plan:
    """Finds the contiguous partition with the smallest bottleneck (slowest stage or link).

    Args:
        layer_costs: ``L`` seconds, > 0: forward + backward of one micro-batch through layer
            ``l`` on a device of speed 1.
        stage_speeds: ``S`` relative speeds, > 0, in chain order; stage ``s`` runs a slice in
            ``sum(costs) / speed`` seconds.
        activation_bytes: ``L`` bytes, >= 0, crossing a cut placed after layer ``l``
            (activation forward + gradient backward). Needs ``link_bandwidths``.
        link_bandwidths: ``S - 1`` bytes/s, > 0, of the link between stage ``s`` and ``s + 1``.
            Needs ``activation_bytes``.
        layer_memory: ``L`` bytes, >= 0, that layer ``l`` needs where it lives. Needs
            ``stage_memory``.
        stage_memory: ``S`` bytes, >= 0 (``inf`` for no cap), available on stage ``s``. Needs
            ``layer_memory``.
        current: boundaries in force (``S + 1`` ints); among optimal partitions (within a
            relative 1e-10 of the optimum) the one that moves the fewest layers is returned.

    Returns:
        The optimal plan (bottleneck within a relative 1e-9 of the exact optimum).

    Raises:
        PlanError: an input is malformed (the message names the value), there are fewer layers
            than stages, or no partition fits the memory caps (the message names the layer or
            stage that cannot fit).
    """
    inst, inputs = _instance(
        layer_costs=layer_costs,
        named_speeds=("stage_speeds", stage_speeds),
        activation_bytes=activation_bytes,
        link_bandwidths=link_bandwidths,
        layer_memory=layer_memory,
        stage_memory=stage_memory,
    )
    n_layers, n_stages = inst.prefix.size - 1, inst.speeds.size
    cur = None
    if current is not None:
        cur = _check_boundaries("current", current, None)
        if len(cur) != n_stages + 1 or cur[-1] != n_layers:
            raise PlanError(
                f"current does not partition {n_layers} layers over {n_stages} stages "
                f"(current: {list(cur)})"
            )
    bounds = _solve(inst, cur)
    if bounds is None:
        raise PlanError(_memory_message(inst, inputs))
    return _make_plan(inputs, bounds)


# --------------------------------------------------------------------------------------------
# The algorithm.
#
# With prefix sums P[b] = costs[0] + ... + costs[b-1], stage s can take the slice [a, b) under a
# bottleneck T iff (P[b] - P[a]) / speed[s] <= T and its memory fits. Costs are > 0 and memory
# >= 0, so the starts that work for an end b form an interval lo_s(b) <= a <= b - 1, found by
# binary search on the prefix sums. A probe at T computes, stage by stage, the set R_s of cut
# positions that the first s + 1 stages can reach: b is in R_s iff some a in R_{s-1} lies in
# [lo_s(b), b - 1] (a prefix count of R_{s-1} answers that for every b at once) and link s
# carries the activations cut at b within T. T is feasible iff L is in R_{S-1}. A greedy "take
# as many layers as fit" would be exact only if every R_s were an interval; a slow link at one
# cut, or a layer too big for one stage's memory or speed, punches holes in it. To keep probes
# cheap, each R_s is computed only inside a band of ends: at most where stages 0..s reach by
# each taking as much as fits, at least where stages s+1.. must start to cover the rest. Most
# probes below the optimum find an empty band and stop there; a probe whose "take as much as
# fits" chain is itself a partition (no holes in the way) uses it and skips the bands.
#
# The optimum is found by bisection on T in which both ends snap to exact candidates: a
# feasible probe lowers `hi` to the actual bottleneck of the partition it found; an infeasible
# probe raises `low` to the smallest slice or link time at which some band or R_s would grow
# (below it every probe gives the same answer, so the optimum cannot be lower). Worked example,
# costs [2, 1, 1, 1, 3] (P = [0, 2, 3, 4, 5, 8]) on speeds [2, 1, 1], without bands:
#
#     T     R_0          R_1            last stage [a, 5)        smallest change above T
#     2     {1, 2, 3}    {2, 3, 4}      needs P[a] >= 6: none    stage 0 takes [0, 4): 2.5
#     2.5   {1, 2, 3, 4} {2, 3, 4}      needs P[a] >= 5.5: none  stage 2 takes [4, 5): 3
#     3     {1, 2, 3, 4} {2, 3, 4, 5}   a = 4 works: feasible    -> optimum 3
#
# Walking back from b = 5 and taking the latest a that works gives boundaries (0, 3, 4, 5),
# stage times (2, 1, 3).
#
# With `current`, a second pass maximises the layers that stay put among partitions within
# _TIE of the optimum: keep[s][b] = max over feasible a of keep[s-1][a] + overlap of [a, b) with
# the current slice of stage s. As a function of a that overlap is constant, then falls by one
# per layer, then is zero, so each of the three pieces is a range-maximum query over keep[s-1]
# (or keep[s-1][a] - a), answered for all b at once by a sparse table. With current
# (0, 2, 4, 5) in the example, T = 3 allows (0, 2, 4, 5) itself (times 1.5, 2, 3): no move.
# --------------------------------------------------------------------------------------------


def _last_end(prefix: list[float], start: int, budget: float) -> int:
    """The largest b with prefix[b] - budget <= prefix[start] (the probe's own comparison)."""
    end = bisect.bisect_right(prefix, prefix[start] + budget) - 1
    # The two forms of the comparison can round differently; settle on the probe's.
    while end + 1 < len(prefix) and prefix[end + 1] - budget <= prefix[start]:
        end += 1
    while prefix[end] - budget > prefix[start]:
        end -= 1
    return end


def _first_start(prefix: list[float], end: int, budget: float) -> int:
    """The smallest a with prefix[a] >= prefix[end] - budget (as the probe's searchsorted)."""
    return bisect.bisect_left(prefix, prefix[end] - budget)


@dataclass(frozen=True)
class _Probe:
    """What a probe at ``limit`` found, stage by stage, inside each stage's band of ends.

    Stage s considered the ends ``first[s] .. first[s] + width[s] - 1``; its per-end arrays are
    the slice ``offset[s]:offset[s + 1]`` of the flat arrays. Stages after the first one that
    reached nothing have no band.
    """

    limit: float
    budgets: list[float]  # the limit in cost units of each stage: limit * (1 + slack) * speed
    fwd: list[int]  # no stage s can end after fwd[s]
    back: list[int]  # ... nor before back[s]
    first: list[int]
    offset: list[int]
    lo_time: _Ints  # smallest start whose slice ends here within the time budget
    lo: _Ints  # the same, memory included
    arrive: _Bools  # reached from the previous stage's reached ends, before the link check
    reach: _Bools  # and the link after this stage carries the cut within the limit

    @property
    def feasible(self) -> bool:
        """Whether some partition has its bottleneck within the limit."""
        return len(self.first) == len(self.budgets) and bool(self.reach[-1])

    def stage(self, s: int) -> slice:
        """Where stage ``s``'s ends lie in the flat arrays."""
        return slice(self.offset[s], self.offset[s + 1])


def _bounds(inst: _Instance, limit: float) -> tuple[list[float], list[int], list[int]]:
    """Each stage's budget in cost units, and the latest and earliest ends it could have.

    The latest ends come from every stage taking as many layers as fit (forward), the earliest
    from every stage taking as many as fit from the back; both ignore holes, so every
    partition within ``limit`` has its ends between them.
    """
    prefix = inst.prefix_list
    n_layers, n_stages = len(prefix) - 1, inst.speeds.size
    budgets: list[float] = (limit * (1 + _SLACK) * inst.speeds).tolist()
    fwd, start = [], 0
    for s, budget in enumerate(budgets):
        end = min(_last_end(prefix, start, budget), n_layers - (n_stages - 1 - s))
        if inst.capped:
            end = min(end, inst.hi(s, start))
        fwd.append(end)
        start = end
    back = [n_layers] * n_stages
    for s in range(n_stages - 1, 0, -1):
        end = back[s]
        back[s - 1] = max(_first_start(prefix, end, budgets[s]), inst.lo(s, end), s)
    return budgets, fwd, back


def _greedy(
    inst: _Instance, limit: float, bounds: tuple[list[float], list[int], list[int]]
) -> tuple[int, ...] | None:
    """The forward or the backward bounds as a partition, when either is one.

    Each is a partition within ``limit`` unless a hole got in the way (a stage left empty, or a
    link too slow at its cut); then the probe has to look at the bands.
    """
    budgets, fwd, back = bounds
    n_stages = len(budgets)
    # The backward chain also needs stage 0 to hold [0, back[0]), which it did not check.
    back_ok = _first_start(inst.prefix_list, back[0], budgets[0]) == 0 and inst.lo(0, back[0]) == 0
    for chain, ok in (((0, *fwd), True), ((0, *back), back_ok)):
        if not ok or chain[-1] != inst.prefix.size - 1:
            continue
        if any(chain[s + 1] <= chain[s] for s in range(n_stages)):
            continue
        if inst.link is not None:
            cut = inst.link[np.arange(n_stages - 1), chain[1:-1]]
            if np.any(cut > limit * (1 + _SLACK)):
                continue
        return chain
    return None


def _probe(
    inst: _Instance, limit: float, bounds: tuple[list[float], list[int], list[int]] | None = None
) -> _Probe:
    """Computes the reached ends of every stage under ``limit``, inside the bands."""
    n_stages = inst.speeds.size
    scaled = limit * (1 + _SLACK)
    budgets, fwd, back = _bounds(inst, limit) if bounds is None else bounds
    # Lay every band out in one flat array so the per-end work is a few vectorised calls.
    first: list[int] = []
    offset = [0]
    for s in range(n_stages):
        lo_end = max(back[s], s + 1)
        if lo_end > fwd[s]:
            # An empty band: infeasible, and it stays so until a bound moves, which only the
            # bounds' own events can do, so the reached sets are not needed.
            none = np.zeros(0, dtype=np.int64)
            return _Probe(limit, budgets, fwd, back, [], [0], none, none, none > 0, none > 0)
        first.append(lo_end)
        offset.append(offset[-1] + fwd[s] - lo_end + 1)
    n_bands, size = len(first), offset[-1]
    flat_at = np.asarray(offset, dtype=np.int64)
    width = np.diff(flat_at)
    stage = np.repeat(np.arange(n_bands), width)
    starts = np.asarray(first, dtype=np.int64)
    ends = np.arange(size) + np.repeat(starts - flat_at[:-1], width)
    lo_time = np.searchsorted(inst.prefix, inst.prefix[ends] - np.asarray(budgets)[stage])
    lo = np.maximum(lo_time, inst.lo_mem[inst.mem_row[stage], ends]) if inst.capped else lo_time
    # Index ranges into the previous stage's band (stage -1 reached only position 0).
    prev_first = np.repeat(np.concatenate(([0], starts[:-1])), width)
    prev_width = np.repeat(np.concatenate(([1], width[:-1])), width)
    upto = np.minimum(ends - prev_first, prev_width)
    since = np.minimum(np.maximum(lo - prev_first, 0), prev_width)
    link_ok = inst.link[stage, ends] <= scaled if inst.link is not None else None

    arrive = np.zeros(size, dtype=np.bool_)
    reach = np.zeros(size, dtype=np.bool_)
    prev = np.ones(1, dtype=np.bool_)
    for s in range(n_bands):
        here = slice(offset[s], offset[s + 1])
        counts = np.zeros(prev.size + 1, dtype=np.int64)
        np.cumsum(prev, out=counts[1:])  # counts[i]: reached ends of stage s - 1 before i
        got = counts[upto[here]] > counts[since[here]]
        arrive[here] = got
        if link_ok is not None:
            got &= link_ok[here]
        reach[here] = got
        if not got.any():
            first, offset = first[: s + 1], offset[: s + 2]
            break
        prev = got
    n = offset[-1]
    return _Probe(
        limit, budgets, fwd, back, first, offset, lo_time[:n], lo[:n], arrive[:n], reach[:n]
    )


def _next_change(inst: _Instance, probe: _Probe) -> float:
    """The smallest limit above ``probe.limit`` at which some band or reached set would grow."""
    prefix = inst.prefix_list
    n_layers, n_stages = len(prefix) - 1, inst.speeds.size
    speeds: list[float] = inst.speeds.tolist()
    best = math.inf
    start = 0
    for s in range(n_stages):  # a forward bound grows when its stage can take one more layer
        end = probe.fwd[s]
        room = n_layers - (n_stages - 1 - s)
        if inst.capped:
            room = min(room, inst.hi(s, start))
        if end < room:
            best = min(best, (prefix[end + 1] - prefix[start]) / speeds[s])
        start = end
    for s in range(n_stages - 1, 0, -1):  # a backward bound falls when its stage starts earlier
        end = probe.back[s]
        by_time = _first_start(prefix, end, probe.budgets[s])
        if by_time > max(inst.lo(s, end), s):
            best = min(best, (prefix[end] - prefix[by_time - 1]) / speeds[s])

    # Within the bands: for each end, the latest reached start before lo_time gives the cheapest
    # slice not yet allowed. One running maximum over [position 0] + all bands finds it, as
    # long as the start found lies in the previous stage's band.
    n_bands = len(probe.first)
    size = probe.offset[-1]
    flat_at = np.asarray(probe.offset, dtype=np.int64)
    width = np.diff(flat_at)
    starts = np.asarray(probe.first, dtype=np.int64)
    stage = np.repeat(np.arange(n_bands), width)
    ends = np.arange(size) + np.repeat(starts - flat_at[:-1], width)
    positions = np.concatenate(([0], ends))
    reached = np.concatenate(([True], probe.reach))
    latest = np.maximum.accumulate(np.where(reached, np.arange(size + 1), -1))
    prev_first = np.concatenate(([0], starts[:-1]))[stage]
    prev_flat = np.concatenate(([0], flat_at[:-2] + 1))[stage]
    prev_width = np.concatenate(([1], width[:-1]))[stage]
    below = probe.lo_time - 1 - prev_first  # last index in the previous band to look at
    pick = latest[prev_flat + np.minimum(np.maximum(below, 0), prev_width - 1)]
    grows = (below >= 0) & (pick >= prev_flat)
    start_at = positions[np.where(grows, pick, 0)]
    if inst.capped:
        grows &= start_at >= inst.lo_mem[inst.mem_row[stage], ends]
    if grows.any():
        cost = (inst.prefix[ends[grows]] - inst.prefix[start_at[grows]]) / inst.speeds[stage[grows]]
        best = min(best, float(cost.min()))
    blocked = probe.arrive & ~probe.reach
    if inst.link is not None and blocked.any():
        best = min(best, float(inst.link[stage[blocked], ends[blocked]].min()))
    return best


def _walk_back(probe: _Probe) -> tuple[int, ...]:
    """Rebuilds a partition from a feasible probe, taking the latest start each time."""
    end = probe.back[-1]
    bounds = [end]
    for s in range(len(probe.first) - 1, 0, -1):
        here, prev = probe.stage(s), probe.stage(s - 1)
        start = max(int(probe.lo[here][end - probe.first[s]]), probe.first[s - 1])
        window = probe.reach[prev][start - probe.first[s - 1] : end - probe.first[s - 1]]
        end = start + int(np.flatnonzero(window)[-1])
        bounds.append(end)
    bounds.append(0)
    return tuple(reversed(bounds))


def _bottleneck(inst: _Instance, bounds: tuple[int, ...]) -> float:
    """The bottleneck of ``bounds`` computed from the probe's own arrays."""
    b = np.asarray(bounds)
    worst = float(np.max((inst.prefix[b[1:]] - inst.prefix[b[:-1]]) / inst.speeds))
    if inst.link is not None:
        worst = max(worst, float(np.max(inst.link[np.arange(b.size - 2), b[1:-1]], initial=0)))
    return worst


def _proportional(inst: _Instance) -> tuple[int, ...] | None:
    """Cuts where the cost prefix matches each stage's share of the total speed, if it fits."""
    n_layers, n_stages = inst.prefix.size - 1, inst.speeds.size
    share = np.cumsum(inst.speeds)[:-1] / inst.speeds.sum() * inst.prefix[-1]
    bounds = [0]
    for s, cut in enumerate(np.searchsorted(inst.prefix, share).tolist()):
        bounds.append(min(max(int(cut), bounds[-1] + 1), n_layers - (n_stages - 1 - s)))
    bounds.append(n_layers)
    return tuple(bounds) if _fits(inst, tuple(bounds)) else None


def _lower_bound(inst: _Instance) -> float:
    """A bottleneck no partition beats: balance by speed, and each layer on its best stage."""
    n_layers, n_stages = inst.prefix.size - 1, inst.speeds.size
    layers = np.arange(n_layers)
    # Layer l can only sit on stages max(0, l - (L - S)) .. min(l, S - 1), each >= 1 layer.
    fastest = _SparseMax(inst.speeds, 0).query(
        np.maximum(layers - (n_layers - n_stages), 0), np.minimum(layers, n_stages - 1)
    )
    alone = float(np.max(np.diff(inst.prefix) / fastest))
    return max(float(inst.prefix[-1]) / float(inst.speeds.sum()), alone)


def _solve(inst: _Instance, current: tuple[int, ...] | None) -> tuple[int, ...] | None:
    """The optimal boundaries, or None when no partition fits the memory caps."""
    best = _proportional(inst)
    if best is not None:
        hi = _bottleneck(inst, best)
    else:  # over memory: any partition that fits is at most this slow
        hi = float(inst.prefix[-1] / inst.speeds.min())
        if inst.link is not None:
            hi = max(hi, float(inst.link.max()))
    low = _lower_bound(inst)
    mid = low  # the lower bound is often the answer (a heavy layer on its only stage)
    for _ in range(_MAX_PROBES):
        if hi <= low * (1 + _GAP):
            break
        bounds = _bounds(inst, mid)
        found = _greedy(inst, mid, bounds)  # cheap, and enough unless there are holes
        if found is None:
            probe = _probe(inst, mid, bounds)
            if probe.feasible:
                found = _walk_back(probe)
            else:
                low = max(low, mid, _next_change(inst, probe))
        if found is not None and (best is None or _bottleneck(inst, found) < hi):
            best, hi = found, _bottleneck(inst, found)
        mid = math.sqrt(low * hi) if hi > 2 * low else 0.5 * (low + hi)
    if best is None:  # every probe failed: is even the upper bound infeasible?
        probe = _probe(inst, hi)
        if not probe.feasible:
            return None
        best = _walk_back(probe)
        hi = _bottleneck(inst, best)
    if current is None:
        return best
    limit = hi * (1 + _TIE)
    if _bottleneck(inst, current) <= limit and _fits(inst, current):
        return current  # staying put is optimal
    return _fewest_moves(inst, limit, current)


def _fits(inst: _Instance, bounds: tuple[int, ...]) -> bool:
    """Whether every stage's slice of ``bounds`` fits its memory."""
    return all(inst.lo(s, bounds[s + 1]) <= bounds[s] for s in range(len(bounds) - 1))


def _feasible(inst: _Instance, limit: float) -> bool:
    """Tells whether some partition has a bottleneck within ``limit`` (and fits memory)."""
    bounds = _bounds(inst, limit)
    return _greedy(inst, limit, bounds) is not None or _probe(inst, limit, bounds).feasible


def _fewest_moves(inst: _Instance, limit: float, current: tuple[int, ...]) -> tuple[int, ...]:
    """Among partitions within ``limit``, the one keeping the most layers where they are."""
    probe = _probe(inst, limit)
    assert probe.feasible, "the optimum found by the search must be feasible"
    keep_prev, prev_first = np.zeros(1), 0
    keeps = []
    for s, first in enumerate(probe.first):
        here = probe.stage(s)
        lo = probe.lo[here]
        ends = np.arange(first, first + lo.size)
        c0, c1 = current[s], current[s + 1]
        top = np.minimum(ends, c1)  # overlap of [a, b) with [c0, c1) = max(0, top - max(a, c0))
        prev_positions = np.arange(prev_first, prev_first + keep_prev.size)
        flat = _SparseMax(keep_prev, prev_first)
        slope = _SparseMax(keep_prev - prev_positions, prev_first)
        piece_a = flat.query(lo, np.minimum(ends - 1, c0)) + np.maximum(top - c0, 0)
        piece_b = slope.query(np.maximum(lo, c0 + 1), top - 1) + top
        piece_c = flat.query(np.maximum(lo, np.maximum(top, c0 + 1)), ends - 1)
        keep = np.maximum(np.maximum(piece_a, piece_b), piece_c)
        keep[~probe.reach[here]] = -np.inf
        keeps.append(keep)
        keep_prev, prev_first = keep, first
    end = probe.back[-1]
    bounds = [end]
    for s in range(len(probe.first) - 1, 0, -1):
        lo_end = int(probe.lo[probe.stage(s)][end - probe.first[s]])
        prev_first = probe.first[s - 1]
        stop = min(end, prev_first + keeps[s - 1].size)
        starts = np.arange(max(lo_end, prev_first), stop)
        overlap = np.maximum(np.minimum(end, current[s + 1]) - np.maximum(starts, current[s]), 0)
        end = int(starts[np.argmax(keeps[s - 1][starts - prev_first] + overlap)])
        bounds.append(end)
    bounds.append(0)
    return tuple(reversed(bounds))


class _SparseMax:
    """Range-maximum queries over a fixed array, O(1) each and vectorised (a sparse table)."""

    def __init__(self, values: _Floats, offset: int) -> None:
        """Indexes ``values[i]`` as position ``offset + i``."""
        size = values.size
        levels = max(size, 1).bit_length()
        table = np.full((levels, size + 1), -np.inf)  # the extra last column answers "empty"
        table[0, :size] = values
        for k in range(1, levels):
            width = 1 << (k - 1)  # level k holds max(values[i .. i + 2^k - 1])
            np.maximum(
                table[k - 1, : size - width], table[k - 1, width:size], out=table[k, : size - width]
            )
        self._flat = table.ravel()
        self._offset = offset
        self._size = size

    def query(self, first: _Ints, last: _Ints) -> _Floats:
        """The max over positions ``first[i]..last[i]`` per i; -inf where that range is empty."""
        size = self._size
        lo = np.maximum(first - self._offset, 0)
        hi = np.minimum(last - self._offset, size - 1)
        length = np.maximum(hi - lo + 1, 0)
        level = np.frexp(np.maximum(length, 1))[1].astype(np.int64) - 1  # floor(log2(length))
        row = level * (size + 1)
        empty = length == 0  # both lookups then read the -inf column
        left = np.where(empty, size, lo) + row
        right = np.where(empty, size, hi - (1 << level) + 1) + row
        out: _Floats = np.maximum(self._flat[left], self._flat[right])
        return out


def _memory_message(inst: _Instance, inputs: _Inputs) -> str:
    """Says which layer or stage cannot fit when no partition fits the memory caps."""
    memory = inputs.memory or [0.0] * len(inputs.costs)
    caps = inputs.caps
    biggest = max(range(len(caps)), key=lambda s: caps[s])
    for layer, need in enumerate(memory):
        if need > caps[biggest]:
            return (
                f"layer {layer} needs {_fmt_bytes(need)} but no stage can hold it "
                f"(largest stage_memory: {_fmt_bytes(caps[biggest])} on stage {biggest})"
            )
    total, room = math.fsum(memory), math.fsum(caps)
    if total > room:
        return (
            f"the layers need {_fmt_bytes(total)} in all but the stages hold "
            f"{_fmt_bytes(room)} (layer_memory sum vs stage_memory sum)"
        )
    # Memory alone decides, so walk the reached ends once without bands or time limits.
    n_layers, n_stages = len(memory), len(caps)
    positions = np.arange(n_layers + 1)
    prev = positions == 0
    for s in range(n_stages):
        counts = np.concatenate(([0], np.cumsum(prev)))
        reach = counts[positions] > counts[inst.lo_mem[inst.mem_row[s]]]
        reach &= (positions > s) & (positions <= n_layers - (n_stages - 1 - s))
        if s == n_stages - 1 and not reach[n_layers]:
            start = int(np.flatnonzero(prev).max())
            return (
                f"no contiguous partition fits the memory caps: the last stage {s} holds "
                f"{_fmt_bytes(caps[s])} but the layers left to it ({start}..{n_layers - 1}) "
                f"need at least {_fmt_bytes(math.fsum(memory[start:]))}"
            )
        if not reach.any():
            start = min(np.flatnonzero(prev).tolist(), key=lambda a: memory[a])
            return (
                f"no contiguous partition fits the memory caps: stage {s} holds "
                f"{_fmt_bytes(caps[s])} but the smallest first layer left to it, layer {start}, "
                f"needs {_fmt_bytes(memory[start])}"
            )
        prev = reach
    return "no contiguous partition fits the memory caps"


def _fmt_bytes(value: float) -> str:
    """Formats a byte count with a decimal unit, e.g. 3.2 GB."""
    if math.isinf(value):
        return "unlimited"
    for unit in ("B", "KB", "MB", "GB"):
        if abs(value) < 1000:
            return f"{value:.3g} {unit}"
        value /= 1000
    return f"{value:.3g} TB"
