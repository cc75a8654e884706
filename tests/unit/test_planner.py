"""Tests of the planner: optimality against brute force, errors, step time and host order."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from elasticpipe.coordinator.planning import (
    Plan,
    PlanError,
    cost,
    hosts,
    moved_layers,
    order_hosts,
    plan,
    predict_step_time,
)
from elasticpipe.errors import InvalidRequest
from elasticpipe.observe.efficiency import ideal_step_time

TOL = 1e-9


@dataclass(frozen=True)
class Case:
    """One small planning instance; the optional terms are None when absent."""

    costs: list[float]
    speeds: list[float]
    act: list[float] | None = None
    bandwidths: list[float] | None = None
    memory: list[float] | None = None
    caps: list[float] | None = None

    def solve(self, current: Sequence[int] | None = None) -> Plan:
        """Runs the planner on this case."""
        return plan(
            self.costs,
            self.speeds,
            activation_bytes=self.act,
            link_bandwidths=self.bandwidths,
            layer_memory=self.memory,
            stage_memory=self.caps,
            current=current,
        )


def bottleneck_of(case: Case, bounds: Sequence[int]) -> float | None:
    """The bottleneck of one partition computed the plain way, or None if it breaks memory."""
    n_stages = len(case.speeds)
    if case.memory is not None and case.caps is not None:
        for s in range(n_stages):
            if sum(case.memory[bounds[s] : bounds[s + 1]]) > case.caps[s]:
                return None
    times = [sum(case.costs[bounds[s] : bounds[s + 1]]) / case.speeds[s] for s in range(n_stages)]
    if case.act is not None and case.bandwidths is not None:
        times += [case.act[bounds[s + 1] - 1] / case.bandwidths[s] for s in range(n_stages - 1)]
    return max(times)


def all_partitions(n_layers: int, n_stages: int) -> list[tuple[int, ...]]:
    """Every composition of n_layers into n_stages non-empty contiguous parts."""
    return [
        (0, *cuts, n_layers) for cuts in itertools.combinations(range(1, n_layers), n_stages - 1)
    ]


def brute_force(case: Case) -> list[tuple[float, tuple[int, ...]]]:
    """Every partition that fits memory, with its bottleneck."""
    found = []
    for bounds in all_partitions(len(case.costs), len(case.speeds)):
        value = bottleneck_of(case, bounds)
        if value is not None:
            found.append((value, bounds))
    return found


@st.composite
def cases(draw: st.DrawFn, links: bool, memory: bool, max_layers: int = 10) -> Case:
    """Small instances; integer-valued costs make exact ties common."""
    n_layers = draw(st.integers(1, max_layers))
    n_stages = draw(st.integers(1, min(4, n_layers)))
    cost = st.one_of(st.integers(1, 4).map(float), st.floats(0.05, 10.0))
    speed = st.one_of(st.sampled_from([0.5, 1.0, 2.0, 3.0]), st.floats(0.2, 4.0))
    case = Case(
        costs=draw(st.lists(cost, min_size=n_layers, max_size=n_layers)),
        speeds=draw(st.lists(speed, min_size=n_stages, max_size=n_stages)),
    )
    if links:
        act = st.integers(0, 8).map(float)
        case = Case(
            case.costs,
            case.speeds,
            act=draw(st.lists(act, min_size=n_layers, max_size=n_layers)),
            bandwidths=draw(
                st.lists(
                    st.sampled_from([1.0, 2.0, 4.0]), min_size=n_stages - 1, max_size=n_stages - 1
                )
            ),
        )
    if memory:
        case = Case(
            case.costs,
            case.speeds,
            case.act,
            case.bandwidths,
            memory=draw(
                st.lists(st.integers(0, 5).map(float), min_size=n_layers, max_size=n_layers)
            ),
            caps=draw(
                st.lists(st.integers(0, 14).map(float), min_size=n_stages, max_size=n_stages)
            ),
        )
    return case


TERMS = [(False, False), (True, False), (False, True), (True, True)]


@pytest.mark.parametrize(("links", "memory"), TERMS)
@settings(deadline=None, max_examples=80)
@given(data=st.data())
def test_bottleneck_is_the_brute_force_optimum(
    links: bool, memory: bool, data: st.DataObject
) -> None:
    """The bottleneck is the best over all partitions; PlanError exactly when none fits."""
    case = data.draw(cases(links, memory))
    found = brute_force(case)
    if not found:
        with pytest.raises(PlanError):
            case.solve()
        return
    result = case.solve()
    best = min(value for value, _ in found)
    assert math.isclose(result.bottleneck, best, rel_tol=TOL)
    assert bottleneck_of(case, result.boundaries) is not None  # it fits memory
    assert math.isclose(bottleneck_of(case, result.boundaries) or 0.0, best, rel_tol=TOL)


@pytest.mark.parametrize(("links", "memory"), TERMS)
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_current_breaks_ties_by_fewest_moved_layers(
    links: bool, memory: bool, data: st.DataObject
) -> None:
    """With current, the plan is optimal and moves no more layers than any optimal partition."""
    case = data.draw(cases(links, memory))
    found = brute_force(case)
    if not found:
        return
    n_layers, n_stages = len(case.costs), len(case.speeds)
    current = data.draw(st.sampled_from(all_partitions(n_layers, n_stages)))
    result = case.solve(current=current)
    best = min(value for value, _ in found)
    assert math.isclose(result.bottleneck, best, rel_tol=TOL)
    fewest = min(
        len(moved_layers(current, bounds)) for value, bounds in found if value <= best * (1 + 1e-12)
    )
    assert result.layers_moved(current) <= fewest


@settings(deadline=None, max_examples=40)
@given(case=cases(links=True, memory=True, max_layers=30))
def test_matches_a_quadratic_dp_on_larger_instances(case: Case) -> None:
    """On up to 30 layers the bottleneck equals a plain O(L^2 S) dynamic program's."""
    n_layers, n_stages = len(case.costs), len(case.speeds)
    prefix = [0.0, *itertools.accumulate(case.costs)]
    mem = [0.0, *itertools.accumulate(case.memory or [0.0] * n_layers)]
    caps = case.caps or [math.inf] * n_stages
    act, bws = case.act or [0.0] * n_layers, case.bandwidths or [1.0] * n_stages
    best = [0.0] + [math.inf] * n_layers  # best[b]: stages so far ending at b
    for s in range(n_stages):
        nxt = [math.inf] * (n_layers + 1)
        for b in range(1, n_layers + 1):
            link = act[b - 1] / bws[s] if s < n_stages - 1 else 0.0
            for a in range(b):
                if best[a] < math.inf and mem[b] - mem[a] <= caps[s]:
                    value = max(best[a], (prefix[b] - prefix[a]) / case.speeds[s], link)
                    nxt[b] = min(nxt[b], value)
        best = nxt
    if best[n_layers] == math.inf:
        with pytest.raises(PlanError):
            case.solve()
    else:
        assert math.isclose(case.solve().bottleneck, best[n_layers], rel_tol=1e-7)


def test_plan_fields_follow_their_definitions() -> None:
    """stage_times, link_times and bottleneck are computed from the boundaries as documented."""
    costs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    act = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    result = plan(costs, [1.0, 2.0, 3.0], activation_bytes=act, link_bandwidths=[100.0, 10.0])
    b = result.boundaries
    assert b[0] == 0 and b[-1] == len(costs) and all(x < y for x, y in itertools.pairwise(b))
    assert result.stage_times == tuple(
        sum(costs[b[s] : b[s + 1]]) / speed for s, speed in enumerate([1.0, 2.0, 3.0])
    )
    assert result.link_times == (act[b[1] - 1] / 100.0, act[b[2] - 1] / 10.0)
    assert result.bottleneck == max(result.stage_times + result.link_times)


def test_worked_example_of_the_module_comment() -> None:
    """The example in the planner's comment: optimum 3 at (0, 3, 4, 5), or current kept."""
    assert plan([2, 1, 1, 1, 3], [2, 1, 1]).boundaries == (0, 3, 4, 5)
    kept = plan([2, 1, 1, 1, 3], [2, 1, 1], current=(0, 2, 4, 5))
    assert kept.boundaries == (0, 2, 4, 5) and kept.bottleneck == 3.0


def test_heavy_ends_go_to_fast_stages() -> None:
    """A heavy embedding and head make the first and last stages take fewer layers."""
    costs = [8.0] + [1.0] * 14 + [8.0]
    result = plan(costs, [1.0, 1.0, 1.0, 1.0])
    assert result.bottleneck == 8.0
    assert result.boundaries[1] == 1 and result.boundaries[-2] == 15


def test_slow_link_moves_the_cut() -> None:
    """A cut whose activations are too big for the link is avoided when another cut is as good."""
    costs = [1.0] * 4
    act = [0.0, 100.0, 0.0, 0.0]  # cutting after layer 1 would cost 100 s on the link
    result = plan(costs, [1.0, 1.0], activation_bytes=act, link_bandwidths=[1.0])
    assert result.boundaries != (0, 2, 4)
    assert result.bottleneck == 3.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_costs": [1.0] * 3, "stage_speeds": [1.0] * 4}, "(layers: 3, stages: 4)"),
        ({"layer_costs": [1.0, math.nan], "stage_speeds": [1.0]}, "layer_costs[1]"),
        ({"layer_costs": [1.0, 0.0], "stage_speeds": [1.0]}, "layer_costs[1] must be"),
        ({"layer_costs": [1.0, 1.0], "stage_speeds": [-2.0]}, "stage_speeds[0] must be"),
        ({"layer_costs": [1.0, 1.0], "stage_speeds": [math.inf]}, "(got inf)"),
        ({"layer_costs": [], "stage_speeds": [1.0]}, "layer_costs is empty"),
        ({"layer_costs": [[1.0]], "stage_speeds": [1.0]}, "one-dimensional"),
        (
            {"layer_costs": [1.0] * 3, "stage_speeds": [1.0], "activation_bytes": [1.0] * 3},
            "go together (got activation_bytes only)",
        ),
        (
            {
                "layer_costs": [1.0] * 3,
                "stage_speeds": [1.0, 1.0],
                "activation_bytes": [1.0] * 2,
                "link_bandwidths": [1.0],
            },
            "activation_bytes needs 3 values, one per layer (got 2)",
        ),
        (
            {
                "layer_costs": [1.0] * 3,
                "stage_speeds": [1.0, 1.0],
                "activation_bytes": [1.0] * 3,
                "link_bandwidths": [0.0],
            },
            "link_bandwidths[0] must be a number > 0 (got 0.0)",
        ),
        (
            {"layer_costs": [1.0] * 3, "stage_speeds": [1.0], "stage_memory": [1.0]},
            "go together (got stage_memory only)",
        ),
        (
            {"layer_costs": [1.0] * 3, "stage_speeds": [1.0, 1.0], "current": (0, 3)},
            "current does not partition 3 layers over 2 stages",
        ),
        (
            {"layer_costs": [1.0] * 3, "stage_speeds": [1.0, 1.0], "current": (0, 2, 2)},
            "stage 1 is empty",
        ),
    ],
)
def test_bad_inputs_raise_plan_error_naming_the_value(
    kwargs: dict[str, object], message: str
) -> None:
    """Malformed inputs raise PlanError whose message carries the offending value."""
    with pytest.raises(PlanError) as info:
        plan(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_layer_too_big_for_every_stage_is_named() -> None:
    """A layer bigger than every stage's memory is named with both sizes."""
    with pytest.raises(PlanError) as info:
        plan(
            [1.0] * 8,
            [1.0, 1.0],
            layer_memory=[1e9] * 7 + [3.2e9],
            stage_memory=[2e9, 8e9 / 4],
        )
    assert str(info.value) == (
        "layer 7 needs 3.2 GB but no stage can hold it (largest stage_memory: 2 GB on stage 0)"
    )


def test_a_stage_that_cannot_fit_is_named() -> None:
    """When every layer fits somewhere but no contiguous cut does, the stage is named."""
    with pytest.raises(PlanError) as info:
        plan([1.0] * 4, [1.0] * 3, layer_memory=[3.0, 3.0, 1.0, 1.0], stage_memory=[5.0, 2.0, 99.0])
    assert str(info.value) == (
        "no contiguous partition fits the memory caps: stage 1 holds 2 B but the smallest "
        "first layer left to it, layer 1, needs 3 B"
    )
    with pytest.raises(PlanError) as info:
        plan([1.0] * 4, [1.0, 1.0], layer_memory=[1.0, 1.0, 3.0, 3.0], stage_memory=[100.0, 2.0])
    assert str(info.value) == (
        "no contiguous partition fits the memory caps: the last stage 1 holds 2 B but the "
        "layers left to it (3..3) need at least 3 B"
    )


def test_plan_error_is_an_invalid_request_and_a_value_error() -> None:
    """PlanError maps to INVALID_ARGUMENT through the shared hierarchy."""
    assert issubclass(PlanError, InvalidRequest)
    assert issubclass(PlanError, ValueError)


def test_moved_layers_lists_each_move() -> None:
    """moved_layers gives (layer, old stage, new stage) and layers_moved counts them."""
    assert moved_layers((0, 2, 5, 6), (0, 3, 4, 6)) == [(2, 1, 0), (4, 1, 2)]
    assert moved_layers((0, 2, 5, 6), (0, 2, 5, 6)) == []
    result = plan([1.0] * 6, [1.0, 1.0, 1.0])
    assert result.layers_moved(result.boundaries) == 0
    assert result.layers_moved((0, 1, 2, 6)) == len(moved_layers(result.boundaries, (0, 1, 2, 6)))
    with pytest.raises(PlanError, match="expected 3 stages over 6 layers"):
        result.layers_moved((0, 3, 6))


def test_step_time_is_fill_and_drain_plus_one_bottleneck_per_extra_micro_batch() -> None:
    """predict_step_time = sum(stage) + sum(link) + (m - 1) * bottleneck, for both schedules."""
    result = Plan((0, 1, 3, 4), (2.0, 3.0, 1.0), (0.5, 0.25), 3.0)
    assert predict_step_time(result, 1) == 6.75
    assert predict_step_time(result, 8) == 6.75 + 7 * 3.0
    assert predict_step_time(result, 8, "gpipe") == predict_step_time(result, 8, "1f1b")


@settings(deadline=None, max_examples=60)
@given(
    times=st.lists(st.floats(0.5, 4.0), min_size=1, max_size=7),
    m=st.integers(1, 16),
    link=st.floats(0.0, 8.0),
)
# Found by hypothesis: one micro-batch, the middle stage slowest: its own weight gradient,
# not the first stage's, ends the step (predicted 5.17 s against 6.17 s walked).
@example(times=[0.5, 4.0, 3.0], m=1, link=0.0)
def test_zb_h1_prediction_follows_the_schedule_critical_path(
    times: list[float], m: int, link: float
) -> None:
    """With F, B and W a third of each stage's time, the ZB-H1 prediction is within 14%
    of the critical path of the schedule's own ops, and never above 1F1B's prediction
    (whose own formula is within 26% of its critical path: asserted beside it)."""
    stages = len(times)
    result = Plan(tuple(range(stages + 1)), tuple(times), (0.0,) * (stages - 1), max(times))
    thirds = [[t / 3] * m for t in times]
    walked = ideal_step_time("zb-h1", thirds, thirds, thirds)
    predicted = predict_step_time(result, m, "zb-h1")
    assert predicted == pytest.approx(walked, rel=0.14)
    assert predicted <= predict_step_time(result, m, "1f1b") + 1e-9
    links = (link,) * (stages - 1)
    linked = Plan(result.boundaries, result.stage_times, links, max([*times, *links]))
    assert predict_step_time(linked, m, "zb-h1") <= predict_step_time(linked, m, "1f1b") + 1e-9
    one_f_one_b = ideal_step_time("1f1b", thirds, [[2 * t / 3] * m for t in times])
    assert predict_step_time(result, m, "1f1b") == pytest.approx(one_f_one_b, rel=0.27)


@pytest.mark.parametrize("m", [1, 4, 16])
def test_zb_h1_prediction_with_a_link_as_bottleneck_is_not_above_1f1b(m: int) -> None:
    """A 10 s link between two 1 s stages: ZB-H1 predicts no more than 1F1B (found by a
    second reader: the link was counted m + 1 times)."""
    result = Plan((0, 1, 2), (1.0, 1.0), (10.0,), 10.0)
    assert predict_step_time(result, m, "zb-h1") <= predict_step_time(result, m, "1f1b")


@pytest.mark.parametrize(
    ("micro_batches", "schedule", "message"),
    [(0, "1f1b", "micro_batches must be an int >= 1 (got 0)"), (4, "zb", "unknown schedule 'zb'")],
)
def test_step_time_rejects_bad_arguments(micro_batches: int, schedule: str, message: str) -> None:
    """An unknown schedule or fewer than one micro-batch raises PlanError."""
    result = plan([1.0, 1.0], [1.0, 1.0])
    with pytest.raises(PlanError) as info:
        predict_step_time(result, micro_batches, schedule)
    assert message in str(info.value)


@settings(deadline=None, max_examples=40)
@given(case=cases(links=True, memory=True, max_layers=7))
def test_order_hosts_is_optimal_over_all_orders(case: Case) -> None:
    """For up to 4 hosts, order_hosts matches the best order and partition found by brute force."""
    n_hosts = len(case.speeds)
    best = math.inf
    for order in itertools.permutations(range(n_hosts)):
        caps = None if case.caps is None else [case.caps[h] for h in order]
        permuted = Case(
            case.costs,
            [case.speeds[h] for h in order],
            case.act,
            case.bandwidths,
            case.memory,
            caps,
        )
        best = min([best, *(value for value, _ in brute_force(permuted))])
    kwargs = {
        "activation_bytes": case.act,
        "link_bandwidths": case.bandwidths,
        "layer_memory": case.memory,
        "stage_memory": case.caps,
    }
    if best == math.inf:
        with pytest.raises(PlanError, match="no chain order"):
            order_hosts(case.costs, case.speeds, **kwargs)
        return
    order, result = order_hosts(case.costs, case.speeds, **kwargs)
    assert sorted(order) == list(range(n_hosts))
    assert math.isclose(result.bottleneck, best, rel_tol=TOL)
    again = plan(
        case.costs,
        [case.speeds[h] for h in order],
        case.act,
        case.bandwidths,
        case.memory,
        None if case.caps is None else [case.caps[h] for h in order],
    )
    assert math.isclose(again.bottleneck, result.bottleneck, rel_tol=TOL)


def test_order_hosts_puts_fast_hosts_on_heavy_ends() -> None:
    """With a heavy embedding and head, the two fast hosts go to the ends of the chain."""
    costs = [6.0] + [1.0] * 12 + [6.0]
    order, result = order_hosts(costs, [1.0, 3.0, 1.0, 3.0])
    assert {order[0], order[-1]} == {1, 3}
    assert result.bottleneck <= plan(costs, [1.0, 3.0, 1.0, 3.0]).bottleneck


def test_order_hosts_heuristic_beyond_seven_hosts() -> None:
    """With 10 hosts the local search returns a permutation no worse than the given order."""
    rng = np.random.default_rng(3)
    costs = [20.0, *rng.uniform(0.5, 2.0, 60).tolist(), 30.0]
    speeds = [1.0, 1.0, 2.0, 4.0, 1.0, 2.0, 1.0, 4.0, 1.0, 2.0]
    order, result = order_hosts(costs, speeds)
    assert sorted(order) == list(range(len(speeds)))
    assert result.bottleneck <= plan(costs, speeds).bottleneck * (1 + TOL)
    assert math.isclose(
        result.bottleneck, plan(costs, [speeds[h] for h in order]).bottleneck, rel_tol=TOL
    )


def test_large_instance_runs_and_is_consistent() -> None:
    """L = 1000, S = 64 with every term returns a valid plan; the time is printed, not asserted."""
    rng = np.random.default_rng(0)
    n_layers, n_stages = 1000, 64
    costs = rng.lognormal(0.0, 1.0, n_layers)
    speeds = np.tile([1.0, 2.0, 4.0], 22)[:n_stages]
    memory = rng.uniform(0.5, 1.5, n_layers)
    caps = np.full(n_stages, 40.0)
    act = rng.uniform(0.0, 1e6, n_layers)
    bws = np.full(n_stages - 1, 1e8)
    current = tuple(np.linspace(0, n_layers, n_stages + 1).astype(int).tolist())
    start = time.perf_counter()
    result = plan(costs, speeds, act, bws, memory, caps, current=current)
    elapsed = time.perf_counter() - start
    print(f"plan(L={n_layers}, S={n_stages}, all terms, current): {elapsed * 1e3:.1f} ms")
    b = result.boundaries
    assert len(b) == n_stages + 1 and b[0] == 0 and b[-1] == n_layers
    assert all(memory[b[s] : b[s + 1]].sum() <= caps[s] for s in range(n_stages))
    assert result.bottleneck >= costs.sum() / speeds.sum()


def test_spare_positions_are_the_ends_and_beside_the_busiest_stages() -> None:
    """A constant number of candidates, whatever the chain's length; all for short chains."""
    from elasticpipe.coordinator.planning import spare_positions

    assert spare_positions([1.0, 1.0, 1.0]) == [0, 1, 2, 3]
    times = [1.0] * 256
    times[100], times[7], times[200] = 5.0, 4.0, 3.0
    assert spare_positions(times) == [0, 7, 8, 100, 101, 200, 201, 256]
    assert len(spare_positions([float(i % 7) for i in range(1000)])) <= 8


@pytest.mark.timeout(30)
@pytest.mark.parametrize("n_hosts", [64, 256])
def test_order_hosts_long_chain_moves_fast_hosts_to_heavy_ends(
    n_hosts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a long chain the search aims at the bottleneck: two fast hosts in the middle of
    the given order move to the heavy ends, within a bounded number of reorderings."""
    costs = [8.0] + [1.0] * (2 * n_hosts - 2) + [8.0]
    speeds = [1.0] * n_hosts
    speeds[n_hosts // 3] = speeds[2 * n_hosts // 3] = 4.0
    reorders = 0
    permuted = cost._Instance.permuted

    def counted(self: cost._Instance, order: Sequence[int]) -> cost._Instance:
        nonlocal reorders
        reorders += 1
        return permuted(self, order)

    monkeypatch.setattr(cost._Instance, "permuted", counted)
    order, result = order_hosts(costs, speeds)
    assert sorted(order) == list(range(n_hosts))
    assert {order[0], order[-1]} == {n_hosts // 3, 2 * n_hosts // 3}
    # Each end takes its heavy layer and one more (9 / 4); the slow hosts take 2 each.
    assert result.bottleneck == pytest.approx(2.25)
    assert plan(costs, speeds).bottleneck == pytest.approx(8.0)
    assert reorders <= 2 * hosts._MAX_SWAPS
