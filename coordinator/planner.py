"""The planner: an exact min-bottleneck contiguous partition of layers over unequal stages."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from elasticpipe.errors import InvalidRequest
from elasticpipe.training.schedule import SCHEDULES

__all__ = ["Plan", "PlanError", "moved_layers", "order_hosts", "plan", "predict_step_time"]

Numbers = Sequence[float] | npt.NDArray[np.floating[Any]] | npt.NDArray[np.integer[Any]]
_Floats = npt.NDArray[np.float64]
_Ints = npt.NDArray[np.int64]
_Bools = npt.NDArray[np.bool_]

# A probe at bottleneck T accepts a slice whose time is up to T * (1 + _SLACK), so that float
# rounding in prefix-sum differences never rejects the very slice that defines T.
_SLACK = 1e-11
# The search stops once the feasible bound is within this relative gap of the proven lower bound.
_GAP = 1e-10
# With `current=`, plans up to this much (relative) slower than the optimum count as optimal ties.
_TIE = 1e-10
# order_hosts accepts a new chain order only when it is better by more than this (relative).
_IMPROVE = 1e-9
# order_hosts enumerates every chain order up to this many hosts, and searches beyond it.
_EXACT_HOSTS = 7
# The local search of order_hosts tries at most this many swaps (each costs one probe).
_MAX_SWAPS = 1000
# Aimed at the bottleneck, order_hosts tries each hot position with this many other hosts.
_RELIEVE_TRIES = 64
# Bisection steps before giving up on closing the last gap (each halves it at least).
_MAX_PROBES = 200


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
    forward and input gradient through the chain, the bottleneck's for the others and the
    first stage's last weight gradient::

        step = max(m * bottleneck + (sum(stage_times) - max(stage_times)) / 3,
                   2/3 * sum(stage_times) + 2/3 * (m - 1) * bottleneck + stage_times[0] / 3)
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
        chain = (2 * total + 2 * (m - 1) * bottleneck + plan.stage_times[0]) / 3
        # A link as the bottleneck: splitting backwards relieves no link, so never more
        # than 1F1B's time.
        return min(max(steady, chain) + links, one_f_one_b)
    return one_f_one_b


def spare_positions(stage_times: Sequence[float], busiest: int = 3) -> list[int]:
    """Chain positions worth trying for a new stage: both ends and beside the ``busiest``
    stages of the current plan.

    A constant number of candidates keeps evaluating a scale-out linear in the chain's
    length (trying all ``S + 1`` positions, each a plan of ``O(S)``, is quadratic); a new
    stage relieves the chain most next to its bottleneck, and the ends matter when they
    are heavy (embedding, head).

    Args:
        stage_times: the current plan's time per stage (``Plan.stage_times``).
        busiest: how many of the slowest stages to try beside.

    Returns:
        Sorted insertion positions in ``[0, S]`` (all of them for short chains).
    """
    n = len(stage_times)
    slowest = sorted(range(n), key=lambda s: (-stage_times[s], s))[:busiest]
    return sorted({0, n, *slowest, *(s + 1 for s in slowest)})


def order_hosts(
    layer_costs: Numbers,
    host_speeds: Numbers,
    activation_bytes: Numbers | None = None,
    link_bandwidths: Numbers | None = None,
    layer_memory: Numbers | None = None,
    stage_memory: Numbers | None = None,
) -> tuple[list[int], Plan]:
    """Chooses the chain order of the hosts as well as the partition.

    Which host comes first matters when the ends are heavy (embedding, LM head) or memory
    differs. Up to 7 hosts every distinct order is tried (hosts of equal speed and memory are
    interchangeable, so duplicates are skipped); beyond that a local search starts from the
    best of a few sensible orders (as given, fastest first, slowest first, fastest at both
    ends). While a pass over every pair of hosts fits in 1000 swap probes (up to 45 hosts)
    it swaps pairs while that helps; then it swaps the hosts that set the bottleneck (the
    slowest stage and its neighbours, or the two beside the slowest link) with the 64
    fastest other hosts, again after each improvement; then it goes on swapping pairs with
    what is left. It stops after 1000 probes in all, or when no order can do better
    (balance by speed, the costliest layer on the fastest host), so its cost is a bounded
    number of probes of O(S log L) each, at any length.

    Args:
        layer_costs: as in :func:`plan`.
        host_speeds: ``H`` relative host speeds, > 0, indexed by host.
        activation_bytes: as in :func:`plan`.
        link_bandwidths: ``H - 1`` bytes/s per chain *position* (link between the hosts placed
            at positions ``p`` and ``p + 1``), whichever hosts end up there.
        layer_memory: as in :func:`plan`.
        stage_memory: ``H`` bytes available on each host, indexed like ``host_speeds`` (memory
            travels with its host).

    Returns:
        ``(order, plan)``: ``order[p]`` is the host at chain position ``p``; ``plan`` is the
        optimal partition for that order (its stage ``p`` runs on host ``order[p]``). Among
        equally good orders the first in lexicographic order wins.

    Raises:
        PlanError: as :func:`plan`; for memory, when no order of the hosts fits.
    """
    inst, inputs = _instance(
        layer_costs=layer_costs,
        named_speeds=("host_speeds", host_speeds),
        activation_bytes=activation_bytes,
        link_bandwidths=link_bandwidths,
        layer_memory=layer_memory,
        stage_memory=stage_memory,
    )
    n_hosts = inst.speeds.size
    kinds = [(float(inst.speeds[h]), float(inputs.caps[h])) for h in range(n_hosts)]

    best: tuple[float, list[int], tuple[int, ...]] | None = None  # bottleneck, order, bounds

    def consider(order: Sequence[int]) -> None:
        """Keeps ``order`` if it beats the best so far; a probe rejects most orders cheaply."""
        nonlocal best
        permuted = inst.permuted(order)
        if best is not None and not _feasible(permuted, best[0] * (1 - _IMPROVE)):
            return
        bounds = _solve(permuted, None)
        if bounds is None:
            return
        value = _bottleneck(permuted, bounds)
        if best is None or value < best[0] * (1 - _IMPROVE):
            best = (value, list(order), bounds)

    if n_hosts <= _EXACT_HOSTS:
        seen: set[tuple[tuple[float, float], ...]] = set()
        for perm in itertools.permutations(range(n_hosts)):
            key = tuple(kinds[h] for h in perm)
            if key not in seen:
                seen.add(key)
                consider(perm)
    else:
        for seed in _seed_orders(inst.speeds):
            consider(seed)
        floor = _order_free_bound(inst)
        swaps = 0 if len(set(kinds)) > 1 else _MAX_SWAPS  # all hosts alike: nothing to swap

        def done() -> bool:
            return best is None or swaps >= _MAX_SWAPS or best[0] <= floor * (1 + _GAP)

        def sweep() -> None:
            """Swaps every pair of hosts in turn, keeping what helps, while a pass helps."""
            nonlocal swaps
            improved = True
            while improved and not done():
                improved = False
                for i, j in itertools.combinations(range(n_hosts), 2):
                    assert best is not None
                    base = best[1]
                    if kinds[base[i]] == kinds[base[j]]:
                        continue
                    if done():
                        break
                    swaps += 1
                    trial = list(base)
                    trial[i], trial[j] = trial[j], trial[i]
                    before = best[0]
                    consider(trial)
                    improved = improved or best[0] < before

        def relieve() -> None:
            """Swaps the hosts that set the bottleneck with every other host, again after
            each improvement."""
            nonlocal swaps
            improved = True
            while improved and not done():
                assert best is not None
                improved = False
                value, base, bounds = best
                hot = _hot_positions(inst.permuted(base), bounds)
                # The fastest hosts first: they relieve a hot position most.
                others = sorted(
                    (j for j in range(n_hosts) if j not in hot),
                    key=lambda j: (-kinds[base[j]][0], -kinds[base[j]][1], j),
                )
                for i in hot:
                    for j in others[:_RELIEVE_TRIES]:
                        if kinds[base[i]] == kinds[base[j]] or improved or done():
                            continue
                        swaps += 1
                        trial = list(base)
                        trial[i], trial[j] = trial[j], trial[i]
                        consider(trial)
                        improved = best[0] < value

        # Every pair first when a whole pass fits the budget (short chains), then the swaps
        # aimed at the bottleneck, then pairs with what is left of the budget. The budget
        # bounds the probes whatever the chain's length: a constant number of O(S) probes.
        if n_hosts * (n_hosts - 1) // 2 <= _MAX_SWAPS:
            sweep()
        relieve()
        sweep()
    if best is None:
        raise PlanError(
            "no chain order of the hosts fits the memory caps; in the given order: "
            + _memory_message(inst, inputs)
        )
    _, order, bounds = best
    return order, _make_plan(inputs.permuted(order), bounds)


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
    if (activation_bytes is None) != (link_bandwidths is None):
        given = "activation_bytes" if link_bandwidths is None else "link_bandwidths"
        raise PlanError(f"activation_bytes and link_bandwidths go together (got {given} only)")
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
    if (layer_memory is None) != (stage_memory is None):
        given = "layer_memory" if stage_memory is None else "stage_memory"
        raise PlanError(f"layer_memory and stage_memory go together (got {given} only)")
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


def _order_free_bound(inst: _Instance) -> float:
    """A bottleneck no chain order beats: balance by speed, and the costliest layer on the
    fastest host."""
    costs = np.diff(inst.prefix)
    return max(
        float(inst.prefix[-1]) / float(inst.speeds.sum()),
        float(costs.max()) / float(inst.speeds.max()),
    )


def _hot_positions(inst: _Instance, bounds: tuple[int, ...]) -> list[int]:
    """The chain positions whose hosts set the bottleneck of ``bounds``: the slowest stage,
    or the two stages beside the slowest link."""
    b = np.asarray(bounds)
    times = (inst.prefix[b[1:]] - inst.prefix[b[:-1]]) / inst.speeds
    slowest = int(np.argmax(times))
    if inst.link is not None and b.size > 2:
        links = inst.link[np.arange(b.size - 2), b[1:-1]]
        cut = int(np.argmax(links))
        if links[cut] > times[slowest]:
            return [cut, cut + 1]
    return [p for p in (slowest, slowest - 1, slowest + 1) if 0 <= p < times.size]


def _seed_orders(speeds: _Floats) -> list[list[int]]:
    """Starting chain orders for the local search of order_hosts."""
    n = speeds.size
    fastest = sorted(range(n), key=lambda h: (-speeds[h], h))
    ends_first = [0] * n
    left, right = 0, n - 1
    for rank, host in enumerate(fastest):
        if rank % 2 == 0:
            ends_first[left] = host
            left += 1
        else:
            ends_first[right] = host
            right -= 1
    # Fastest hosts at both ends, slowest in the middle: the heavy embedding and head sit on
    # the ends of most models.
    return [list(range(n)), fastest, fastest[::-1], ends_first]


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
