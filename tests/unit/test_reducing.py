"""The reduction's wire form: a chunk of any number of parameters travels as one tensor per
run of one dtype plus its flags, and comes back as the chunk's parameters; anything else
is refused by name. And what the planner learns from the stages' measurements: the rate it
times reductions at when the operator gave no link bandwidth, and the overhead it adds per
pipeline slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elasticpipe.coordinator import replica_changes
from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.learned import JOBS
from elasticpipe.coordinator.planning import estimates, predict_step_time
from elasticpipe.coordinator.planning.estimates import Profile
from elasticpipe.coordinator.planning.layouts import PerStep
from elasticpipe.coordinator.state import SLOTS_KEY, STEPS_KEY, Cluster
from elasticpipe.coordinator.store import SqliteStore
from elasticpipe.errors import InvalidRequest
from elasticpipe.partition import Group, Partition, Placement, StageRef
from elasticpipe.stage_server.measures import WINDOW, EpochMedian, Rate
from elasticpipe.stage_server.reducing import _joined, _piece, share_of
from elasticpipe.stage_server.reduction import GroupReduction, cut
from elasticpipe.training.gradsum import Node
from elasticpipe.training.job import JobConfig


def _like() -> list[torch.Tensor]:
    """150 parameters (more than a message's 64 tensors), one run of float64 among float32
    ones, and an empty one."""
    sizes = [3] * 70 + [0] + [2] * 80
    dtypes = [torch.float32] * 70 + [torch.float32] + [torch.float64] * 5 + [torch.float32] * 75
    return [torch.zeros(n, dtype=d) for n, d in zip(sizes, dtypes, strict=True)]


def test_a_wide_mixed_chunk_goes_over_the_wire_in_runs_and_comes_back_whole() -> None:
    """Chunk 1 of 2 holders (81 parameters, an empty one among them): joined into 3 runs
    (float32, float64, float32) plus flags, then cut back into the same tensors, values
    and flags."""
    like = _like()
    reduction = GroupReduction(4, 1, [range(0, 4), range(4, 8)], 8, like)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(t.numel(), generator=g).to(t.dtype) for t in like]
    total = sum(t.numel() for t in like)
    lo, hi = total // 2, total
    chunk = cut(values, lo, hi)
    runs = _joined(chunk)
    assert [t.dtype for t in runs] == [torch.float32, torch.float64, torch.float32]
    present = tuple(j % 3 != 0 for j in range(len(chunk)))
    wire = (*runs, torch.tensor(present, dtype=torch.bool))
    piece = _piece(wire, reduction, 1, 0, Node(0, 4))
    assert len(piece.tensors) == len(chunk) and piece.present == present
    assert all(
        torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(piece.tensors, chunk, strict=True)
    )


@pytest.mark.parametrize(
    ("wire", "error"),
    [
        ("not tensors", "not a tuple of tensors"),
        ((torch.zeros(2),), "1-d bool flags"),
        ((torch.zeros(3), torch.ones(1, dtype=torch.bool)), r"runs \[\(3, 'torch.float32'\)\]"),
    ],
)
def test_a_piece_of_another_form_is_refused_by_name(wire: object, error: str) -> None:
    """Not a tuple of tensors, no bool flags at the end, runs of other sizes: refused."""
    reduction = GroupReduction(4, 1, [range(0, 4), range(4, 8)], 8, [torch.zeros(10)])
    with pytest.raises(InvalidRequest, match=error):
        _piece(wire, reduction, 1, 0, Node(0, 4))


def test_shares_must_fit_the_replica_and_leave_none_empty() -> None:
    """Replica 1 of 2 runs the second share: its ids start after the first's; shares that
    disagree with the placement, or leave a replica without micro-batches, are refused."""
    group = Group(0, 0, 2, (StageRef("a", "h:a"), StageRef("b", "h:b")))
    placement = Placement(
        epoch=1, index=0, num_stages=1, lo=0, hi=2, replica=1, num_replicas=2, groups=(group,)
    )
    assert share_of(placement, [5, 3], 3) == range(5, 8)
    for shares, runs in (([5, 3], 4), ([8], 8), ([8, 0], 0)):
        with pytest.raises(InvalidRequest, match="every replica runs at least one"):
            share_of(placement, shares, runs)


def test_the_reduction_rate_leaves_out_each_epochs_first_run_and_carries_over() -> None:
    """``Rate``: an epoch's first run is left out (it opens connections), the later
    ones are averaged (an EWMA of weight 0.5), a run that reduced nothing changes nothing,
    and the rate carries over into the next epoch (a figure of the hosts, not the layout)."""
    rate = Rate()
    assert rate.value() == 0.0
    rate.note(3, 1e6)  # epoch 3's first run: left out
    assert rate.value() == 0.0
    rate.note(3, 4e8)
    rate.note(3, None)
    assert rate.value() == 4e8
    rate.note(3, 2e8)
    assert rate.value() == pytest.approx(3e8)
    rate.note(4, 1.0)  # epoch 4's first run: left out; epoch 3's rate stays
    assert rate.value() == pytest.approx(3e8)
    rate.note(4, 5e8)
    assert rate.value() == pytest.approx(4e8)


def test_the_wait_between_runs_is_the_median_of_the_epochs_last_runs() -> None:
    """``EpochMedian`` (a stage's wait between runs): an epoch's first run is left out,
    then the median of its last ``WINDOW`` (8) runs, so one long wait (an evaluation, a
    checkpoint in the client's loop) does not move it; a new epoch starts afresh."""
    waits = EpochMedian()
    assert waits.at(1) == 0.0
    waits.note(1, 9.0)  # epoch 1's first: left out
    assert waits.at(1) == 0.0
    for seconds in (0.010, 0.012, 5.0, 0.011):
        waits.note(1, seconds)
    assert waits.at(1) == pytest.approx(0.0115) and waits.at(2) == 0.0
    for _ in range(WINDOW):
        waits.note(1, 0.020)
    assert waits.at(1) == 0.020  # (only the last WINDOW count)
    waits.note(2, 0.5)  # epoch 2's first: left out; epoch 1's figure is gone
    assert waits.at(2) == 0.0 and waits.at(1) == 0.0
    waits.note(2, 0.030)
    assert waits.at(2) == 0.030


def test_the_planner_times_reductions_at_the_link_bandwidth_else_the_stages_median() -> None:
    """``Cluster.reduce_bandwidth``: none known, reductions are free (None); then the
    median of the rates the live stages measured (a dead stage's left out); the operator's
    ``--link-bandwidth`` before any of them; none of them while the costs it adds to have
    no unit."""
    cluster = Cluster(SqliteStore(":memory:"), CoordinatorConfig(dead_after_s=60.0))
    try:
        ids = [
            cluster.members.register(n, f"127.0.0.1:{p}", "cpu")[0]
            for n, p in zip("abcd", range(1, 5), strict=True)
        ]
        assert cluster.reduce_bandwidth() is None
        for sid, rate in zip(ids, (1e8, 4e8, 2e8, 9e9), strict=True):
            member = cluster.members.by_id(sid)
            assert member is not None
            member.reduce_rate = rate
        cluster.members.declare_dead(ids[3], "killed")
        assert cluster.reduce_bandwidth() == 2e8
        assert cluster.reduce_bandwidth(in_seconds=False) is None  # (costs without a unit)
        cluster.link_bandwidth = 5e7
        assert cluster.reduce_bandwidth() == 5e7
        assert cluster.reduce_bandwidth(in_seconds=False) is None  # (seconds + no unit)
    finally:
        cluster.pool.close()


def test_the_planner_adds_the_jobs_measured_overhead_per_slot() -> None:
    """``Cluster.slot_overhead``: 0 before any job was measured, or for step times with no
    unit; then the median of the jobs' latest figures (a job measured again replaces its
    own), kept across jobs, the last ``learned.JOBS`` jobs only."""
    cluster = Cluster(SqliteStore(":memory:"), CoordinatorConfig())
    try:
        assert cluster.slot_overhead() == 0.0
        for n, per_slot in enumerate((0.004, 0.001, 0.010)):
            cluster.note_slot_overhead(f"j{n}", per_slot)
        assert cluster.slot_overhead() == 0.004
        assert cluster.slot_overhead(in_seconds=False) == 0.0
        cluster.note_slot_overhead("j0", 0.020)  # job j0 measured again
        assert cluster.slot_overhead() == 0.010
        for n in range(JOBS):  # later jobs push the first ones out
            cluster.note_slot_overhead(f"k{n}", 0.002)
        assert cluster.slot_overhead() == 0.002 and len(cluster.slot_overheads) == JOBS
    finally:
        cluster.pool.close()


def test_the_overheads_per_slot_outlive_the_coordinator(tmp_path: Path) -> None:
    """A coordinator restarted on the same store (or a standby taking over) predicts with
    the figures per slot the last one learned. ``store_learned`` (the coordinator's
    ``learned`` loop, never a heartbeat) writes them when a job is new or its figure moved
    by more than ``learned.STORE_CHANGE`` since it was last stored, also by small steps; a
    malformed stored value is ignored (learned again), never an error."""
    url = str(tmp_path / "coordinator.db")

    def cluster() -> Cluster:
        return Cluster(SqliteStore(url), CoordinatorConfig())

    first = cluster()
    try:
        first.note_slot_overhead("j0", 0.004)
        assert first.store.get(SLOTS_KEY) is None  # (noting writes nothing)
        assert first.store_learned() and not first.store_learned()
        first.note_slot_overhead("j1", 0.010)
        assert first.store_learned()
        first.note_slot_overhead("j1", 0.0104)  # within STORE_CHANGE of the stored
        assert not first.store_learned()
        first.note_slot_overhead("j1", 0.0108)  # 4% a step: 8% from what is stored
        assert first.store_learned()
        first.note_slot_overhead("j0", 0.004)  # the same figure, j0 the newest now
        assert first.store_learned()
        assert first.store.get(SLOTS_KEY) == [["j1", 0.0108], ["j0", 0.004]]
        first.note_step_overhead("j1", 0.012)  # the figure per step: stored the same way
        assert first.store_learned() and first.store.get(STEPS_KEY) == [["j1", 0.012]]
    finally:
        first.pool.close()
        first.store.close()
    second = cluster()
    try:
        assert list(second.slot_overheads.items()) == [("j1", 0.0108), ("j0", 0.004)]
        assert second.slot_overhead() == pytest.approx(0.0074)
        assert second.per_step().fixed_s == 0.012
        assert not second.store_learned()  # (what it loaded is what is stored)
        junk = [["j0", -1.0], ["j1", "x"], "junk", ["j2", True], ["j3", 3e-3]]
        second.store.put(SLOTS_KEY, junk)
    finally:
        second.pool.close()
        second.store.close()
    third = cluster()
    try:
        assert list(third.slot_overheads.items()) == [("j3", 0.003)]
    finally:
        third.pool.close()
        third.store.close()


def test_a_re_split_layout_is_predicted_as_a_new_one() -> None:
    """``replica_changes._relaid`` (a re-split, a move inside replicas, a recovery) stores
    each replica's step as ``replicas.lay_out`` predicts a new layout's: the model for its
    share, plus the learned overhead per slot for its ``share + S - 1`` slots, plus the
    reduction (two replicas cut alike at 2: each holder sends 2 x 1/2 of its 2000 gradient
    bytes, at the link bandwidth of 1000 B/s: 2 s), plus the learned figure per step and
    the optimizer steps at the stages' median rate."""
    cluster = Cluster(SqliteStore(":memory:"), CoordinatorConfig(link_bandwidth=1000.0))
    try:
        ids = [
            cluster.members.register(n, f"127.0.0.1:{p}", "cpu")[0] for p, n in enumerate("abcd", 1)
        ]
        cluster.job = JobConfig(model="mlp", micro_batches=8, job_id="j")
        cluster.profile = Profile(costs=(1.0, 2.0, 1.0, 2.0), speeds=dict.fromkeys(ids, 1.0))
        cluster.param_bytes, cluster.num_layers = [1000] * 4, 4
        cluster.note_slot_overhead("earlier", 0.5)
        cluster.note_step_overhead("earlier", 0.25)
        for sid, rate in zip(ids, (100.0, 400.0, 500.0, 0.0), strict=True):  # median: 400 B/s
            cluster.members.by_id(sid).optimizer_rate = rate  # type: ignore[union-attr]
        chains = [
            Partition(1, "j", (0, 2, 4), tuple(StageRef(s, f"{s}:1") for s in pair))
            for pair in (ids[:2], ids[2:])
        ]
        layout = replica_changes._relaid(cluster, chains, (5, 3))
        for chain, share in zip(layout.replicas, (5, 3), strict=True):
            plan = estimates.evaluate(chain.boundaries, cluster.profile.costs, [1.0, 1.0])
            model_s = predict_step_time(plan, share, cluster.job.schedule)
            # per step: 0.25 s, plus the busiest stage's 2000 parameter bytes at 400 B/s
            want = model_s + 0.5 * (share + 2 - 1) + 2.0 + 0.25 + 5.0
            assert chain.predicted_step_s == pytest.approx(want), (share, model_s)
    finally:
        cluster.pool.close()


def test_a_step_costs_its_busiest_stages_optimizer_step_once() -> None:
    """``PerStep.seconds``: the fixed part, plus the busiest stage's parameter bytes (over
    every replica: the commit waits for every stage's optimizer step) at the rate; without
    a rate, the fixed part alone."""
    param_bytes = [100.0, 300.0, 200.0, 400.0]
    per_step = PerStep(0.5, param_bytes, 100.0)
    assert per_step.seconds([(0, 4)]) == pytest.approx(0.5 + 10.0)
    assert per_step.seconds([(0, 2, 4), (0, 1, 4)]) == pytest.approx(0.5 + 9.0)  # 300+200+400
    assert per_step.seconds([(0, 1, 2, 3, 4)]) == pytest.approx(0.5 + 4.0)
    assert PerStep(0.5, param_bytes, None).seconds([(0, 4)]) == 0.5
    assert PerStep().seconds([(0, 4)]) == 0.0
