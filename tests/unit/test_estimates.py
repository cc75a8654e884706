"""Tests of the estimates: unit costs and speeds from profiles, live speeds, plan evaluation."""

from __future__ import annotations

import pytest

from elasticpipe.coordinator.planning.estimates import (
    Timing,
    evaluate,
    fallback_costs,
    fill_speeds,
    from_profiles,
    live_speed,
)

FAST: list[Timing] = [(0.25, 0.5, 1024, 8), (0.5, 1.0, 1024, 8), (0.125, 0.25, 64, 8)]
SLOW: list[Timing] = [(2 * f, 2 * b, n, s) for f, b, n, s in FAST]


def test_two_x_slower_stage_has_half_the_speed_and_sets_the_costs() -> None:
    """A stage 2x slower on every layer is speed 1, the other 2; costs are the slow times."""
    profile = from_profiles({"fast": FAST, "slow": SLOW})
    assert profile.speeds == pytest.approx({"fast": 2.0, "slow": 1.0})
    assert profile.costs == pytest.approx([f + b for f, b, _, _ in SLOW])


def test_identical_stages_have_unit_speed() -> None:
    """Stages that ran the model equally fast all have speed 1 and their own times as costs."""
    profile = from_profiles({"a": FAST, "b": FAST, "c": FAST})
    assert profile.speeds == pytest.approx({"a": 1.0, "b": 1.0, "c": 1.0})
    assert profile.costs == pytest.approx([0.75, 1.5, 0.375])


def test_costs_average_the_speed_corrected_times() -> None:
    """A layer's unit cost is the mean over stages of its time times that stage's speed."""
    a: list[Timing] = [(1.0, 0.0, 0, 1), (1.0, 0.0, 0, 1)]  # total 2 -> speed 2
    b: list[Timing] = [(3.0, 0.0, 0, 1), (1.0, 0.0, 0, 1)]  # total 4 -> speed 1
    profile = from_profiles({"a": a, "b": b})
    assert profile.speeds == pytest.approx({"a": 2.0, "b": 1.0})
    assert profile.costs == pytest.approx([(2.0 + 3.0) / 2, (2.0 + 1.0) / 2])


def test_zero_time_layers_get_a_tiny_positive_cost() -> None:
    """A layer measured at zero seconds still costs a little, so plans stay well defined."""
    profile = from_profiles({"a": [(0.0, 0.0, 0, 1), (1.0, 1.0, 0, 1)]})
    assert 0 < profile.costs[0] < 1e-6
    assert profile.costs[1] == pytest.approx(2.0)


COSTS = [1.0, 2.0, 1.0]


@pytest.mark.parametrize(
    ("timings", "speed"),
    [
        ({0: (0.25, 0.5, 0, 8), 1: (0.25, 0.5, 0, 8)}, 2.0),  # docstring: stage A
        ({2: (1.0, 1.0, 0, 8)}, 0.5),  # docstring: stage B
        ({}, None),
        ({2: (1.0, 1.0, 0, 0)}, None),  # no samples: not a measurement
        ({2: (0.0, 0.0, 0, 8)}, None),  # no time spent
        ({7: (1.0, 1.0, 0, 8)}, None),  # a layer outside the model
        ({-1: (1.0, 1.0, 0, 8)}, None),
        ({1: (1.0, 1.0, 0, 8), 7: (5.0, 5.0, 0, 8)}, 1.0),  # the stray layer is ignored
        ({0: (0.5, 0.5, 0, 8), 2: (0.5, 0.5, 0, 0)}, 1.0),  # the sample-less layer is ignored
    ],
    ids=[
        "stage-A",
        "stage-B",
        "nothing",
        "no-samples",
        "no-time",
        "out-of-range",
        "negative-layer",
        "ignores-stray",
        "ignores-empty",
    ],
)
def test_live_speed(timings: dict[int, Timing], speed: float | None) -> None:
    """Live speed is unit cost of the layers run over the time spent, or None without data."""
    got = live_speed(COSTS, timings)
    assert got == (None if speed is None else pytest.approx(speed))


@pytest.mark.parametrize(
    ("known", "filled"),
    [
        ([2.0, None, 1.0], [2.0, 1.5, 1.0]),
        ([None, None], [1.0, 1.0]),
        ([], []),
        ([3.0, 0.0, -1.0, None], [3.0, 3.0, 3.0, 3.0]),
        ([0.5, 1.5], [0.5, 1.5]),
    ],
    ids=["mean", "none-known", "empty", "non-positive-unknown", "all-known"],
)
def test_fill_speeds(known: list[float | None], filled: list[float]) -> None:
    """Unknown (or non-positive) speeds become the mean of the known ones, 1.0 if none."""
    assert fill_speeds(known) == pytest.approx(filled)


def test_fallback_costs_are_proportional_to_parameters() -> None:
    """Without a profile, costs follow parameter bytes, scaled to 1, floored at 0.05."""
    assert fallback_costs([400, 200, 0, 4]) == pytest.approx((1.0, 0.5, 0.05, 0.05))
    assert fallback_costs([]) == ()


def test_evaluate_matches_hand_computation() -> None:
    """Stage times are summed unit costs over speed; the bottleneck is the slowest stage."""
    plan = evaluate([0, 2, 3], COSTS, [2.0, 0.5])
    assert plan.boundaries == (0, 2, 3)
    assert plan.stage_times == pytest.approx((1.5, 2.0))
    assert plan.link_times == (0.0,)
    assert plan.bottleneck == pytest.approx(2.0)


def test_evaluate_single_stage() -> None:
    """One stage owning everything takes the total cost over its speed, with no links."""
    plan = evaluate([0, 3], COSTS, [4.0])
    assert plan.stage_times == pytest.approx((1.0,))
    assert plan.link_times == ()
    assert plan.bottleneck == pytest.approx(1.0)


def test_evaluate_counts_link_times_when_links_are_given() -> None:
    """With activation bytes and link bandwidths, each cut's transfer time is a link term."""
    result = evaluate(
        [0, 1, 3],
        [1.0, 2.0, 2.0],
        [1.0, 2.0],
        activation_bytes=[300, 10, 10],
        link_bandwidths=[100.0],
    )
    assert result.stage_times == (1.0, 2.0)
    assert result.link_times == (3.0,)
    assert result.bottleneck == 3.0


def test_profiles_give_bytes_of_forward_activation_and_backward_gradient() -> None:
    """The bytes at a cut are twice the largest output a stage reported for that layer."""
    profile = from_profiles(
        {"a": [(1.0, 1.0, 40, 1), (1.0, 1.0, 8, 1)], "b": [(1.0, 1.0, 40, 1), (1.0, 1.0, 8, 1)]}
    )
    assert profile.activation_bytes == (80, 16)
