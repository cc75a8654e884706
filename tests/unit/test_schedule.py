"""Tests of the pipeline schedules: op lists, in-flight memory, deadlock freedom, splits."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.errors import InvalidRequest
from elasticpipe.training.schedule import (
    SCHEDULES,
    SPLIT_BACKWARD,
    Op,
    OpKind,
    forward_ops,
    peak_in_flight,
    split_sizes,
    stage_ops,
)

SHAPES = [
    (schedule, stages, stage, m)
    for schedule in SCHEDULES
    for stages in range(1, 7)
    for stage in range(stages)
    for m in range(1, 11)
]


def _names(ops: list[Op]) -> str:
    return " ".join(str(op) for op in ops)


def _kinds(schedule: str) -> list[OpKind]:
    if schedule in SPLIT_BACKWARD:
        return [OpKind.FORWARD, OpKind.BACKWARD, OpKind.WEIGHT]
    return [OpKind.FORWARD, OpKind.BACKWARD]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_micro_batch_forwarded_then_backwarded_once(schedule: str) -> None:
    """Each stage forwards and backwards every micro-batch exactly once, F before B (before
    W where the schedule splits the backward)."""
    kinds = _kinds(schedule)
    for _, stages, stage, m in (s for s in SHAPES if s[0] == schedule):
        ops = stage_ops(schedule, stages, stage, m)
        assert len(ops) == len(kinds) * m
        for kind in kinds:
            assert sorted(op.micro_batch for op in ops if op.kind is kind) == list(range(m))
        for i in range(m):
            at = [ops.index(Op(kind, i)) for kind in kinds]
            assert at == sorted(at), (stages, stage, m, _names(ops))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_ops_run_in_micro_batch_order(schedule: str) -> None:
    """Forwards and backwards each run in ascending micro-batch order on every stage."""
    for _, stages, stage, m in (s for s in SHAPES if s[0] == schedule):
        ops = stage_ops(schedule, stages, stage, m)
        for kind in _kinds(schedule):
            order = [op.micro_batch for op in ops if op.kind is kind]
            assert order == list(range(m)), (stages, stage, m, _names(ops))


def test_1f1b_peak_in_flight_is_bounded_by_distance_to_the_end() -> None:
    """1F1B keeps at most min(S - stage, m) micro-batches of activations alive on a stage."""
    for _, stages, stage, m in (s for s in SHAPES if s[0] == "1f1b"):
        ops = stage_ops("1f1b", stages, stage, m)
        assert peak_in_flight(ops) == min(stages - stage, m), (stages, stage, m)


def test_zb_h1_peak_in_flight_is_1f1b_peak_on_every_stage() -> None:
    """ZB-H1 keeps a micro-batch until its W: at most min(S, m) alive, on every stage."""
    for _, stages, stage, m in (s for s in SHAPES if s[0] == "zb-h1"):
        ops = stage_ops("zb-h1", stages, stage, m)
        assert peak_in_flight(ops) == min(stages, m), (stages, stage, m)


def test_zb_h1_defers_each_weight_gradient_by_the_stage_index() -> None:
    """Stage s runs W(i) right after the (i + s)-th B, or at the end."""
    for _, stages, stage, m in (s for s in SHAPES if s[0] == "zb-h1"):
        ops = stage_ops("zb-h1", stages, stage, m)
        backs = [n for n, op in enumerate(ops) if op.kind is OpKind.BACKWARD]
        for i in range(m):
            w = ops.index(Op(OpKind.WEIGHT, i))
            if i + stage < m:
                assert w == backs[i + stage] + 1, (stages, stage, m, _names(ops))
            else:
                assert all(op.kind is OpKind.WEIGHT for op in ops[w:]), _names(ops)
        without = [op for op in ops if op.kind is not OpKind.WEIGHT]
        assert without == stage_ops("1f1b", stages, stage, m)  # 1F1B's order of F and B


def test_gpipe_peak_in_flight_is_every_micro_batch() -> None:
    """GPipe keeps all m micro-batches of activations alive on every stage."""
    for _, stages, stage, m in (s for s in SHAPES if s[0] == "gpipe"):
        assert peak_in_flight(stage_ops("gpipe", stages, stage, m)) == m


@pytest.mark.parametrize(
    ("schedule", "stage", "expected"),
    [
        ("gpipe", 0, "F0 F1 F2 F3 B0 B1 B2 B3"),
        ("gpipe", 2, "F0 F1 F2 F3 B0 B1 B2 B3"),
        ("1f1b", 0, "F0 F1 F2 B0 F3 B1 B2 B3"),
        ("1f1b", 1, "F0 F1 B0 F2 B1 F3 B2 B3"),
        ("1f1b", 2, "F0 B0 F1 B1 F2 B2 F3 B3"),
        ("zb-h1", 0, "F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3"),
        ("zb-h1", 1, "F0 F1 B0 F2 B1 W0 F3 B2 W1 B3 W2 W3"),
        ("zb-h1", 2, "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3"),
    ],
)
def test_docstring_tables(schedule: str, stage: int, expected: str) -> None:
    """The op order of 3 stages and 4 micro-batches matches the module docstring's tables."""
    assert _names(stage_ops(schedule, 3, stage, 4)) == expected


@pytest.mark.parametrize(
    ("ops", "peak"),
    [
        ("", 0),
        ("F0 B0 F1 B1", 1),
        ("F0 F1 B0 F2 B1 B2", 2),
        ("F0 F1 F2 B0 B1 B2", 3),
        ("F0 B0 F1 B1 W0 W1", 2),  # split: alive until W
        ("F0 B0 W0 F1 B1 W1", 1),
    ],
)
def test_peak_in_flight_counts_alive_forwards(ops: str, peak: int) -> None:
    """peak_in_flight is the largest number of forwarded, not yet backwarded micro-batches."""
    parsed = [Op(OpKind(name[0]), int(name[1:])) for name in ops.split()]
    assert peak_in_flight(parsed) == peak


def test_forward_ops_are_forwards_in_order() -> None:
    """An inference pass is the m forwards in micro-batch order."""
    assert _names(forward_ops(3)) == "F0 F1 F2"


# --------------------------------------------------------------------------- deadlock freedom


def _ready(op: Op, stage: int, stages: int, done: list[set[Op]]) -> bool:
    """Whether a stage may run ``op`` now: its input arrived (sends never block)."""
    if op.kind is OpKind.FORWARD:
        return stage == 0 or op in done[stage - 1]
    if op.kind is OpKind.WEIGHT:
        return Op(OpKind.BACKWARD, op.micro_batch) in done[stage]
    return stage == stages - 1 or op in done[stage + 1]


def _run(lists: list[list[Op]], pick: random.Random | None) -> list[str]:
    """Runs every stage's list together; returns the global trace, or fails on deadlock."""
    stages = len(lists)
    cursor = [0] * stages
    done: list[set[Op]] = [set() for _ in range(stages)]
    trace: list[str] = []
    while any(cursor[s] < len(lists[s]) for s in range(stages)):
        runnable = [
            s
            for s in range(stages)
            if cursor[s] < len(lists[s]) and _ready(lists[s][cursor[s]], s, stages, done)
        ]
        assert runnable, f"deadlock at {cursor} after {trace}"
        s = runnable[0] if pick is None else pick.choice(runnable)
        op = lists[s][cursor[s]]
        if op.kind is not OpKind.FORWARD:
            assert Op(OpKind.FORWARD, op.micro_batch) in done[s]
        done[s].add(op)
        cursor[s] += 1
        trace.append(f"{s}:{op}")
    return trace


def _simulate(schedule: str, stages: int, m: int, pick: random.Random | None) -> list[str]:
    return _run([stage_ops(schedule, stages, s, m) for s in range(stages)], pick)


@settings(deadline=None, max_examples=150)
@given(
    schedule=st.sampled_from(SCHEDULES),
    stages=st.integers(1, 6),
    m=st.integers(1, 10),
    seed=st.integers(0, 2**32 - 1),
)
def test_all_stages_together_never_deadlock(schedule: str, stages: int, m: int, seed: int) -> None:
    """Stages running their lists in any interleaving always finish every op."""
    trace = _simulate(schedule, stages, m, random.Random(seed))
    assert len(trace) == len(_kinds(schedule)) * m * stages


def test_every_shape_completes_in_order_of_readiness() -> None:
    """Every schedule, S in 1..6 and m in 1..10 completes under a fixed interleaving."""
    for schedule, stages, m in itertools.product(SCHEDULES, range(1, 7), range(1, 11)):
        assert len(_simulate(schedule, stages, m, None)) == len(_kinds(schedule)) * m * stages


def test_simulation_detects_a_deadlock() -> None:
    """The simulation does fail on lists that wait on each other (backwards out of order)."""
    f0, f1 = Op(OpKind.FORWARD, 0), Op(OpKind.FORWARD, 1)
    b0, b1 = Op(OpKind.BACKWARD, 0), Op(OpKind.BACKWARD, 1)
    with pytest.raises(AssertionError, match="deadlock"):
        _run([[f0, b0, f1, b1], [f0, f1, b1, b0]], None)


# --------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(
    ("args", "value"),
    [
        (("pipedream", 2, 0, 4), "'pipedream'"),
        (("1f1b", 0, 0, 4), "stages: 0"),
        (("1f1b", 3, 3, 4), "stage: 3"),
        (("gpipe", 3, -1, 4), "stage: -1"),
        (("gpipe", 3, 0, 0), "micro-batches: 0"),
    ],
)
def test_stage_ops_rejects_bad_arguments(args: tuple[str, int, int, int], value: str) -> None:
    """An unknown schedule or out-of-range shape raises InvalidRequest naming the value."""
    with pytest.raises(InvalidRequest, match=value):
        stage_ops(*args)


# --------------------------------------------------------------------------- split_sizes


@settings(deadline=None, max_examples=200)
@given(batch=st.integers(1, 500), m=st.integers(1, 40))
def test_split_sizes_are_balanced_and_cover_the_batch(batch: int, m: int) -> None:
    """Sizes sum to the batch, differ by at most one, are never zero, one per micro-batch."""
    sizes = split_sizes(batch, m)
    assert sum(sizes) == batch
    assert len(sizes) == min(batch, m)
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(
    ("batch", "m", "sizes"), [(8, 4, [2, 2, 2, 2]), (10, 4, [3, 3, 2, 2]), (3, 5, [1, 1, 1])]
)
def test_split_sizes_examples(batch: int, m: int, sizes: list[int]) -> None:
    """Uneven batches put the extra samples first; short batches get one sample each."""
    assert split_sizes(batch, m) == sizes


@pytest.mark.parametrize(
    ("batch", "m", "value"), [(0, 4, "0"), (-2, 4, "-2"), (8, 0, "0"), (8, -3, "-3")]
)
def test_split_sizes_rejects_bad_arguments(batch: int, m: int, value: str) -> None:
    """An empty batch or fewer than one micro-batch raises InvalidRequest naming the value."""
    with pytest.raises(InvalidRequest, match=rf"\(got {value}\)"):
        split_sizes(batch, m)
