"""The ideal step time is the schedule's critical path of the measured op durations."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest
from elasticpipe.observe.efficiency import critical_path, efficiency, ideal_step_time
from elasticpipe.training.schedule import Op, OpKind


def _equal(stages: int, m: int, f: float, b: float) -> tuple[list[list[float]], list[list[float]]]:
    return [[f] * m for _ in range(stages)], [[b] * m for _ in range(stages)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "m"), [(1, 1), (1, 4), (2, 2), (3, 4), (4, 8), (4, 2), (5, 3)])
def test_equal_op_times_give_m_plus_s_minus_one_slots(schedule: str, stages: int, m: int) -> None:
    """With every F taking f and every B taking b, the ideal is (m + S - 1)(f + b)."""
    forward, backward = _equal(stages, m, 1.0, 2.0)
    assert ideal_step_time(schedule, forward, backward) == pytest.approx((m + stages - 1) * 3.0)


@pytest.mark.parametrize(("stages", "m"), [(1, 4), (2, 4), (3, 4), (4, 8), (8, 16)])
def test_zb_h1_bubble_is_a_third_of_1f1b(stages: int, m: int) -> None:
    """F = B = W = 1: ZB-H1 ends after 3m + (S - 1) units, 1F1B (B = 2) after 3m + 3(S - 1)."""
    ones = [[1.0] * m for _ in range(stages)]
    zb = ideal_step_time("zb-h1", ones, ones, ones)
    one_f_one_b = ideal_step_time("1f1b", *_equal(stages, m, 1.0, 2.0))
    assert zb == pytest.approx(3 * m + (stages - 1))
    assert one_f_one_b - 3 * m == pytest.approx(3 * (zb - 3 * m))


@pytest.mark.parametrize(
    ("schedule", "weights"), [("zb-h1", None), ("1f1b", [[1.0], [1.0]]), ("zb-h1", [[1.0]])]
)
def test_weight_durations_go_with_split_schedules_only(
    schedule: str, weights: list[list[float]] | None
) -> None:
    """ZB-H1 needs one W duration per micro-batch and stage; the others take none."""
    with pytest.raises(InvalidRequest, match="weight-gradient durations"):
        ideal_step_time(schedule, [[1.0], [1.0]], [[1.0], [1.0]], weights)


def test_the_worked_example_of_the_module() -> None:
    """1F1B, 2 stages, 2 micro-batches, F 1 s, B 2 s: B(0,1) ends at 9 s."""
    assert ideal_step_time("1f1b", [[1, 1], [1, 1]], [[2, 2], [2, 2]]) == pytest.approx(9.0)


def test_a_slow_stage_sets_the_pace() -> None:
    """GPipe, 2 stages, 3 micro-batches, stage 1 three times slower (hand-computed).

    Stage 0's forwards end at 1, 2, 3; stage 1's at 4, 7, 10 (each waits for the last);
    stage 1's backwards (6 s each) end at 16, 22, 28; stage 0's (2 s) at 18, 24, 30.
    """
    forward = [[1, 1, 1], [3, 3, 3]]
    backward = [[2, 2, 2], [6, 6, 6]]
    assert ideal_step_time("gpipe", forward, backward) == pytest.approx(30.0)


def test_one_slow_micro_batch_delays_only_what_depends_on_it() -> None:
    """1F1B, 2 stages, 2 micro-batches; F(0,1) takes 5 s instead of 1 (hand-computed).

    stage 0: F0 [0,1] F1 [1,6] B0 [6,8] B1 [9,11];
    stage 1: F0 [1,2] B0 [2,4] F1 [6,7] B1 [7,9].
    """
    forward = [[1, 5], [1, 1]]
    backward = [[2, 2], [2, 2]]
    assert ideal_step_time("1f1b", forward, backward) == pytest.approx(11.0)


@given(
    st.sampled_from(["gpipe", "1f1b"]),
    st.integers(1, 5),
    st.integers(1, 6),
    st.data(),
)
def test_the_ideal_lies_between_the_busiest_stage_and_the_sum_of_all_ops(
    schedule: str, stages: int, m: int, data: st.DataObject
) -> None:
    """No stage can finish before its own work is done; no path is longer than all work."""
    times = st.lists(st.floats(0.0, 10.0), min_size=m, max_size=m)
    forward = [data.draw(times) for _ in range(stages)]
    backward = [data.draw(times) for _ in range(stages)]
    ideal = ideal_step_time(schedule, forward, backward)
    busiest = max(sum(f) + sum(b) for f, b in zip(forward, backward, strict=True))
    assert busiest - 1e-9 <= ideal <= sum(map(sum, forward)) + sum(map(sum, backward)) + 1e-9


def test_stages_that_disagree_on_micro_batches_are_refused() -> None:
    """Reports of different micro-batch counts name the stage and both counts."""
    with pytest.raises(InvalidRequest, match="stage 1 reports 2 forwards"):
        ideal_step_time("1f1b", [[1, 1, 1], [1, 1]], [[1, 1, 1], [1, 1, 1]])


def test_efficiency_is_the_ratio_capped_at_one() -> None:
    """Ideal over measured; nothing measured gives 0; clock jitter above 1 is capped."""
    assert efficiency(3.0, 4.0) == pytest.approx(0.75)
    assert efficiency(3.0, 0.0) == 0.0
    assert efficiency(4.0, 3.999) == 1.0


def test_op_lists_that_deadlock_are_refused() -> None:
    """A stage whose backward comes before the forward its peer needs names the stuck ops."""
    ops = [
        [Op(OpKind.BACKWARD, 0), Op(OpKind.FORWARD, 0)],
        [Op(OpKind.FORWARD, 0), Op(OpKind.BACKWARD, 0)],
    ]
    with pytest.raises(InvalidRequest, match=r"stages wait at \['B0', 'F0'\]"):
        critical_path(ops, [[1.0], [1.0]], [[1.0], [1.0]])
