"""Tests of the rebalancing policy: every branch of ``decide`` and the numbers it reports."""

from __future__ import annotations

import pytest

from elasticpipe.coordinator.planning.policy import PolicyConfig, decide

BASE = PolicyConfig(
    threshold=0.10, horizon_steps=20, cooldown_s=5.0, bandwidth_bytes_per_s=400e6, fixed_pause_s=0.3
)
OFF = PolicyConfig(**{**BASE.__dict__, "enabled": False})
MB = 1_000_000


@pytest.mark.parametrize(
    ("config", "current", "proposed", "nbytes", "since", "measured", "move", "reason"),
    [
        (BASE, 1.2, 0.8, 40 * MB, 60.0, None, True, "gain 33.3% > 10%, saves 8.00s vs 0.40s"),
        (BASE, 1.2, 1.2, 0, 60.0, None, False, "already optimal"),
        (BASE, 1.2, 0.8, 0, 60.0, None, False, "already optimal"),
        (OFF, 1.2, 0.8, 40 * MB, 60.0, None, False, "auto-rebalance is off"),
        (BASE, 1.0, 0.95, 40 * MB, 60.0, None, False, "gain 5.0% is within the 10% threshold"),
        (BASE, 1.0, 0.90, 40 * MB, 60.0, None, False, "within the 10% threshold"),
        (BASE, 0.0, 0.0, 40 * MB, 60.0, None, False, "gain 0.0% is within"),
        (BASE, 1.2, 0.8, 4000 * MB, 60.0, None, False, "saves 8.00s over 20 steps, less than"),
        (BASE, 1.2, 0.8, 40 * MB, 60.0, 9.0, False, "less than the 9.10s pause"),
        (BASE, 1.2, 0.8, 40 * MB, 2.0, None, False, "cooling down (2.0s since the last move"),
        (BASE, 1.2, 0.8, 40 * MB, 5.0, None, True, "gain 33.3%"),
    ],
    ids=[
        "worked-example-moves",
        "no-bytes",
        "no-bytes-despite-gain",
        "disabled",
        "below-threshold",
        "at-threshold",
        "zero-step",
        "payback-not-met",
        "measured-pause-too-long",
        "cool-down",
        "cool-down-just-over",
    ],
)
def test_decide_branches(
    config: PolicyConfig,
    current: float,
    proposed: float,
    nbytes: int,
    since: float,
    measured: float | None,
    move: bool,
    reason: str,
) -> None:
    """Each branch of the policy decides as documented and says why."""
    decision = decide(config, current, proposed, nbytes, since, measured)
    assert decision.move is move
    assert reason in decision.reason


def test_decision_carries_the_numbers() -> None:
    """The docstring's worked example: gain 1/3, pause 40 MB/400 MB/s + 0.3 s = 0.4 s."""
    decision = decide(BASE, 1.2, 0.8, 40 * MB, 60.0)
    assert decision.gain == pytest.approx(1 / 3)
    assert decision.pause_s == pytest.approx(0.4)
    assert (decision.current_step_s, decision.proposed_step_s) == (1.2, 0.8)
    assert decision.bytes_to_move == 40 * MB


def test_measured_pause_replaces_the_fixed_overhead() -> None:
    """A measured pause of the last move replaces the configured fixed overhead."""
    decision = decide(BASE, 1.2, 0.8, 40 * MB, 60.0, measured_pause_s=1.0)
    assert decision.pause_s == pytest.approx(1.1)


def test_disabled_policy_still_reports_the_gain() -> None:
    """When auto-rebalance is off, the decision still carries the would-be gain."""
    decision = decide(OFF, 2.0, 1.0, MB, 60.0)
    assert decision.move is False
    assert decision.gain == pytest.approx(0.5)


def test_defaults_are_conservative() -> None:
    """By default the policy is on with a 10% threshold and a 5 s cool-down."""
    config = PolicyConfig()
    assert (config.enabled, config.threshold, config.cooldown_s) == (True, 0.10, 5.0)
