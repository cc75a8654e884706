"""Host ordering: which host takes which chain position, as well as the partition
(``order_hosts``), and where a new stage could join the chain (``spare_positions``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from elasticpipe.coordinator.planning.cost import (
    Numbers,
    Plan,
    PlanError,
    _Floats,
    _Instance,
    _instance,
    _make_plan,
)
from elasticpipe.coordinator.planning.solver import (
    _GAP,
    _bottleneck,
    _feasible,
    _memory_message,
    _solve,
)

__all__ = ["order_hosts", "spare_positions"]

# order_hosts accepts a new chain order only when it is better by more than this (relative).
_IMPROVE = 1e-9
# order_hosts enumerates every chain order up to this many hosts, and searches beyond it.
_EXACT_HOSTS = 7
# The local search of order_hosts tries at most this many swaps (each costs one probe).
_MAX_SWAPS = 1000
# Aimed at the bottleneck, order_hosts tries each hot position with this many other hosts.
_RELIEVE_TRIES = 64


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
