"""The coordinator's memory model: per-layer needs, stage caps, and refusing overflows."""

from __future__ import annotations

import math

import pytest

from elasticpipe.coordinator.planning import PlanError, memory, plan
from elasticpipe.coordinator.planning.estimates import Profile
from elasticpipe.training.job import JobConfig


def _job(**kw: object) -> JobConfig:
    return JobConfig(model="mlp", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("schedule", "micro_batches", "stages", "expected"),
    [
        ("gpipe", 8, 4, 8),
        ("1f1b", 8, 4, 4),
        ("1f1b", 2, 4, 2),
        ("1f1b", 1, 1, 1),
        ("zb-h1", 8, 4, 7),  # 4 alive, 3 of them also holding what B kept for W
        ("zb-h1", 2, 4, 4),
        ("zb-h1", 1, 1, 1),
    ],
)
def test_in_flight_counts_the_busiest_stage(
    schedule: str, micro_batches: int, stages: int, expected: int
) -> None:
    """GPipe holds every micro-batch; 1F1B's first stage holds min(m, S); ZB-H1 counts the
    gradients kept for W on top, as up to min(m, S - 1) more stashes."""
    assert memory.in_flight(micro_batches, schedule, stages) == expected


@pytest.mark.parametrize(
    ("optimizer", "kwargs", "factor"),
    [
        ("sgd", {"lr": 0.1}, 0.0),
        ("sgd", {"lr": 0.1, "momentum": 0.9}, 1.0),
        ("adam", {}, 2.0),
        ("adamw", {"amsgrad": True}, 3.0),
        ("RMSprop", {}, 3.0),
    ],
)
def test_optimizer_factor_per_optimizer(
    optimizer: str, kwargs: dict[str, object], factor: float
) -> None:
    """Optimizer state per parameter byte: SGD 0/1, Adam 2 (3 with amsgrad), others 3."""
    assert memory.optimizer_factor(optimizer, kwargs) == factor


def test_layer_needs_use_the_profile_when_there_is_one() -> None:
    """Profiled state and stash x in-flight; without a profile, parameter bytes x factor;
    either way, with 8 micro-batches, 3 more copies of the parameter bytes for the
    canonical gradient sum's partials (1 with 2 micro-batches)."""
    job = _job(optimizer="adam", micro_batches=8, schedule="1f1b")
    assert memory.layer_needs([100, 0], None, job, 2) == [700.0, 0.0]
    profile = Profile((1.0, 1.0), {}, (), stash_bytes=(10, 20), state_bytes=(300, 0))
    assert memory.layer_needs([100, 0], profile, job, 2) == [620.0, 40.0]
    gpipe = _job(optimizer="adam", micro_batches=8, schedule="gpipe")
    assert memory.layer_needs([100, 0], profile, gpipe, 2) == [680.0, 160.0]
    two = _job(optimizer="adam", micro_batches=2, schedule="gpipe")
    assert memory.layer_needs([100, 0], profile, two, 2) == [420.0, 40.0]


def test_terms_without_any_reported_capacity_put_no_cap() -> None:
    """Stages that report nothing (0) or more than the model needs are uncapped; without
    any cap there are no memory terms."""
    job = _job()
    assert memory.terms([0, 0], [10, 10], None, job) == memory.MemoryTerms()
    needs, caps = memory.terms([0, 50], [10, 10], None, job)
    assert caps == [math.inf, 50.0] and needs == [60.0, 60.0]  # 4 micro-batches: 2 partials
    # A stage that holds the whole model (120 B) is never constrained.
    assert memory.terms([120, 1 << 40], [10, 10], None, job) == memory.MemoryTerms()


def test_caps_force_an_uneven_partition_through_the_planner() -> None:
    """Equal costs on equal stages split evenly, unless the first stage's memory is small."""
    job = _job(optimizer="sgd")
    needs, caps = memory.terms([450, 0], [100] * 6, None, job)  # 400 B per layer
    assert plan([1.0] * 6, [1.0, 1.0]).boundaries == (0, 3, 6)
    assert plan([1.0] * 6, [1.0, 1.0], None, None, needs, caps).boundaries == (0, 1, 6)


def test_check_fits_names_the_stage_and_the_shortfall() -> None:
    """A partition that overflows a stage is refused with needed, offered and short bytes."""
    terms = memory.MemoryTerms([100.0, 100.0, 100.0], [150.0, math.inf])
    memory.check_fits((0, 1, 3), terms, ["a", "b"], "move")
    with pytest.raises(PlanError) as info:
        memory.check_fits((0, 2, 3), terms, ["a", "b"], "set-partition")
    message = str(info.value)
    assert "stage 'a'" in message and "layers 0..1" in message
    assert "needing 200 B" in message and "offers 150 B" in message and "short by 50 B" in message
    memory.check_fits((0, 2, 3), memory.MemoryTerms(), ["a", "b"], "move")  # no caps: no check
