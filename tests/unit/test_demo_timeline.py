"""The demo's record: phases between events, moving step rates, JSON, the event plan."""

from __future__ import annotations

import pytest

from elasticpipe.demo.record import Event, Sample, Timeline
from elasticpipe.demo.run import Events
from elasticpipe.errors import InvalidRequest

pytestmark = pytest.mark.timeout(10)


def _timeline() -> Timeline:
    """Steps 1..10: one step per second, but steps 5-7 take 2 s each; events after 4 and 7."""
    samples, t = [], 10.0  # step 1 ends at 10 s (setup)
    for step in range(1, 11):
        if step > 1:
            t += 2.0 if 5 <= step <= 7 else 1.0
        layers = {"a": 2, "b": 2} if step <= 7 else {"a": 3, "b": 1}
        samples.append(Sample(step, t, 5.0 - step / 10, 1 if step <= 7 else 2, layers))
    return Timeline(
        samples=samples,
        events=[Event(4, 13.0, "slowdown", "b 3x slower"), Event(7, 19.0, "move", "epoch 2")],
    )


def test_phases_split_at_events_and_leave_out_the_setup_step() -> None:
    """Phases 2-4, 5-7, 8-10 run at 1, 0.5 and 1 steps/s, labelled by what began them."""
    phases = _timeline().phases()
    assert [(p.first, p.last) for p in phases] == [(2, 4), (5, 7), (8, 10)]
    assert [p.steps_per_s for p in phases] == pytest.approx([1.0, 0.5, 1.0])
    assert [p.after for p in phases] == ["start", "b 3x slower", "epoch 2"]
    assert phases[-1].layers == {"a": 3, "b": 1}


def test_rates_are_a_moving_window_over_steps() -> None:
    """Over 2 steps: 1/s before the slow steps, 0.5/s inside them."""
    rates = dict(_timeline().rates(window=2))
    assert rates[13.0] == pytest.approx(1.0)  # steps 3-4
    assert rates[19.0] == pytest.approx(0.5)  # steps 6-7
    assert 12.0 not in rates  # step 1's time is setup: no window ends before step 4


def test_json_round_trip_keeps_samples_and_events() -> None:
    """from_json(to_json()) gives back the same samples, events and phases."""
    timeline = _timeline()
    again = Timeline.from_json(timeline.to_json())
    assert again.samples == timeline.samples and again.events == timeline.events
    assert again.phases() == timeline.phases()


def test_events_are_spread_over_the_run_unless_given() -> None:
    """Defaults at 1/6, 9/20 and 3/4 of the steps; a given step overrides one."""
    assert Events.spread_over(120) == Events(slow_at=20, recover_at=54, kill_at=90)
    assert Events.spread_over(120, kill_at=0, slow_at=None).kill_at == 0


@pytest.mark.parametrize(
    ("events", "stages", "bad"),
    [
        (Events(slow_at=10, recover_at=5), 4, "--recover-at 5"),
        (Events(kill_at=200), 4, "--kill-at 200"),
        (Events(slow_at=3, slow_stage="stage-7"), 4, "'stage-7'"),
        (Events(kill_at=3, kill_stage="stage-0"), 1, "at least 2 stages"),
        (Events(slow_at=3, factor=0.5), 4, "0.5"),
    ],
)
def test_event_plans_that_cannot_happen_are_refused_naming_the_value(
    events: Events, stages: int, bad: str
) -> None:
    """Out of order, past the end, an unknown stage, nobody left, a speed-up: refused."""
    with pytest.raises(InvalidRequest, match=bad):
        events.validate(stages, steps=100)
