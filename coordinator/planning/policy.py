"""When to rebalance: a pure decision with hysteresis, payback and cool-down.

A move is worth it when (1) the planner's optimum beats the current partition's predicted
step time by more than ``threshold`` (hysteresis: small gains are noise and churn), (2) the
time saved over the next ``horizon_steps`` steps exceeds the pause the move costs (the bytes
to move at the measured bandwidth, plus a fixed freeze/commit overhead), and (3) the last
move is at least ``cooldown_s`` old, so a stage whose speed flickers does not make the
partition flap. Worked example: step 1.2 s now, 0.8 s after the move (gain 33%), 40 MB to
move at 400 MB/s plus 0.3 s overhead = 0.4 s pause, horizon 20 steps saves 8 s: move.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    """The operator's knobs (flags of ``elasticpipe coordinator``)."""

    enabled: bool = True
    threshold: float = 0.10
    horizon_steps: int = 50
    cooldown_s: float = 5.0
    interval_s: float = 1.0
    bandwidth_bytes_per_s: float = 200e6
    fixed_pause_s: float = 0.3
    reserve_spares: int = 0  # spares kept out of the chain to replace a stage that dies


@dataclass(frozen=True)
class Decision:
    """What the policy decided and why (logged whether taken or not)."""

    move: bool
    reason: str
    gain: float
    current_step_s: float
    proposed_step_s: float
    bytes_to_move: int
    pause_s: float
    outcome: str = ""  # one word for the metrics: move, forced, optimal, below_threshold, ...


def decide(
    config: PolicyConfig,
    current_step_s: float,
    proposed_step_s: float,
    bytes_to_move: int,
    seconds_since_last_move: float,
    measured_pause_s: float | None = None,
    layers_to_move: int | None = None,
    forced: bool = False,
) -> Decision:
    """Decides whether moving from the current partition to the proposed one pays off.

    Args:
        config: thresholds.
        current_step_s: predicted step time of the current partition (live speeds).
        proposed_step_s: predicted step time of the planner's optimum.
        bytes_to_move: weights + optimizer state of the layers that change owner.
        seconds_since_last_move: time since the last epoch change.
        measured_pause_s: the fixed overhead measured on the last move, if any.
        layers_to_move: how many layers change owner (default: as many as move bytes).
        forced: an operator asked: move whenever the optimum differs.

    Returns:
        The decision, with the numbers that explain it.
    """
    moves = layers_to_move if layers_to_move is not None else int(bytes_to_move > 0)
    if moves == 0:
        proposed_step_s = current_step_s  # the same partition: no gain to speak of
    gain = 1.0 - proposed_step_s / current_step_s if current_step_s > 0 else 0.0
    overhead = config.fixed_pause_s if measured_pause_s is None else measured_pause_s
    pause = bytes_to_move / config.bandwidth_bytes_per_s + overhead
    saved = config.horizon_steps * (current_step_s - proposed_step_s)

    def decision(move: bool, outcome: str, reason: str) -> Decision:
        return Decision(
            move, reason, gain, current_step_s, proposed_step_s, bytes_to_move, pause, outcome
        )

    if moves == 0:
        return decision(False, "optimal", "the current partition is already optimal")
    if forced:
        return decision(
            True, "forced", f"moving to the optimal partition on request (gain {gain:.1%})"
        )
    if not config.enabled:
        return decision(False, "disabled", "auto-rebalance is off")
    if gain <= config.threshold:
        return decision(
            False,
            "below_threshold",
            f"gain {gain:.1%} is within the {config.threshold:.0%} threshold",
        )
    if saved <= pause:
        return decision(
            False,
            "no_payback",
            f"saves {saved:.2f}s over {config.horizon_steps} steps, less than the "
            f"{pause:.2f}s pause",
        )
    if seconds_since_last_move < config.cooldown_s:
        return decision(
            False,
            "cooldown",
            f"cooling down ({seconds_since_last_move:.1f}s since the last move, "
            f"{config.cooldown_s:.0f}s needed)",
        )
    return decision(
        True,
        "move",
        f"gain {gain:.1%} > {config.threshold:.0%}, saves {saved:.2f}s vs {pause:.2f}s pause",
    )
