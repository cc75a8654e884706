"""Which option mends a replica that lost stages (``coordinator.replica_options``): a
spare, a re-partition over the survivors, a borrowed stage, or dissolving it, by the
predicted step; one that moves more layers wins only by more than the policy's threshold."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from elasticpipe.coordinator.planning.layouts import PerStep
from elasticpipe.coordinator.planning.memory import MemoryTerms
from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.replica_options import choose, layout_step, mend, note_overheads
from elasticpipe.coordinator.state import LinkTerms
from elasticpipe.layout import Layout
from elasticpipe.partition import Partition, StageRef
from elasticpipe.stage_server.measures import EpochTime
from elasticpipe.training.job import JobConfig

pytestmark = pytest.mark.timeout(30)

LAYERS = 7


def _cluster(speeds: dict[str, float], spares: tuple[str, ...] = ()) -> Any:
    members = {
        sid: SimpleNamespace(row=SimpleNamespace(stage_id=sid, name=sid, address=f"{sid}:1"))
        for sid in [*speeds, *spares]
    }
    for m in members.values():
        m.replica_pin, m.between_runs = "", None
    return SimpleNamespace(
        job=JobConfig(model="mlp", micro_batches=8),
        config=SimpleNamespace(policy=PolicyConfig()),
        costs=lambda: tuple([1.0] * LAYERS),
        speeds=lambda ids: [speeds.get(i, 1.0) for i in ids],
        links=lambda n: LinkTerms(),
        memory=lambda ids: MemoryTerms(),
        names=list,
        name=lambda sid: sid,
        members=SimpleNamespace(by_id=members.get),
        spare_members=[members[s] for s in spares],
        in_seconds=lambda ids: True,
        per_step=lambda in_seconds=True: PerStep(),  # (nothing learned: the model alone)
        reduce_bandwidth=lambda in_seconds=True: None,  # (none measured: reductions free)
        param_bytes=None,
    )


def _chain(*stages: str, cuts: tuple[int, ...]) -> Partition:
    return Partition(
        epoch=1, job_id="j", boundaries=cuts, stages=tuple(StageRef(s, f"{s}:1") for s in stages)
    )


REPLICAS = (_chain("a", "b", cuts=(0, 4, 7)), _chain("c", "d", "e", cuts=(0, 3, 5, 7)))


def _mend(
    speeds: dict[str, float], dead: set[str], spares: tuple[str, ...] = (), reduce_at: float = 0
) -> Any:
    cluster = _cluster(speeds, spares)
    if reduce_at:  # bytes/s; every layer 10 bytes
        cluster.reduce_bandwidth = lambda in_seconds=True: reduce_at
        cluster.param_bytes = [10.0] * LAYERS
    live = set(speeds) - dead
    return choose(cluster, REPLICAS, 0, dead, live | set(spares), cluster.spare_members)


def test_a_spare_takes_the_dead_stages_place_first() -> None:
    option = _mend(dict.fromkeys("abcde", 1.0), {"b"}, spares=("f",))
    assert option.replicas[0].stage_ids == ("a", "f") and option.replicas[1] == REPLICAS[1]
    assert "f took the place of b" in option.what


def test_a_slow_survivor_borrows_a_fast_stage() -> None:
    """a is 5x slower: alone it would hold every layer (35 units a micro-batch); with d
    borrowed, a takes one layer and d six, and replica 1 runs on c and e: predicted 24
    units against 35, more than the 10% threshold."""
    option = _mend({"a": 0.2, "b": 1.0, "c": 1.0, "d": 1.0, "e": 1.0}, {"b"})
    assert option.what.startswith("borrowed"), option.what
    borrower, lender = option.replicas
    assert len(borrower.stage_ids) == 2 and "a" in borrower.stage_ids
    assert len(lender.stage_ids) == 2 and set(lender.stage_ids) | set(borrower.stage_ids) == {
        "a",
        "c",
        "d",
        "e",
    }


def test_equal_stages_re_partition_over_the_survivors() -> None:
    """Borrowing predicts a step only 5% shorter (20 units against 21): within the
    threshold, the survivors re-partition (fewer layers move)."""
    option = _mend(dict.fromkeys("abcde", 1.0), {"b"})
    assert option.what.startswith("re-partitioned over its survivors a"), option.what
    assert option.replicas[0].stage_ids == ("a",) and option.replicas[1] == REPLICAS[1]


def test_a_replica_with_no_survivor_dissolves() -> None:
    option = _mend(dict.fromkeys("abcde", 1.0), {"a", "b"})
    assert option.replicas == (None, REPLICAS[1]) and option.what == "dissolved"


def test_the_survivors_of_every_replica_re_form_one_chain_as_the_last_resort() -> None:
    """b and d die; a (3 layers of memory) cannot take d's 4 layers, c (4) cannot hold 7
    alone, no replica is whole to lend: a and c re-form one chain, each once."""
    caps = {"a": 3.0, "b": 7.0, "c": 4.0, "d": 7.0}
    cluster = _cluster(dict.fromkeys(caps, 1.0))
    cluster.memory = lambda ids: MemoryTerms([1.0] * LAYERS, [caps[i] for i in ids])
    layout = Layout((_chain("a", "b", cuts=(0, 4, 7)), _chain("c", "d", cuts=(0, 3, 7))), (4, 4))
    mended = mend(cluster, layout, {"b", "d"}, {"a", "c"}, [])
    assert not isinstance(mended, str), mended
    replicas, said = mended
    assert len(replicas) == 1 and sorted(replicas[0].stage_ids) == ["a", "c"], replicas
    assert "one chain of the survivors" in said[-1]


def test_a_replica_pipeline_is_timed_from_its_epochs_second_run() -> None:
    """The first run of an epoch (connections, caches cold) is left out; then an EWMA."""
    timed = EpochTime()
    timed.note(5, 1.0)
    assert timed.at(5) == 0.0
    timed.note(5, 2.0)
    assert timed.at(5) == 2.0
    timed.note(5, 4.0)
    assert timed.at(5) == 3.0 and timed.at(6) == 0.0
    timed.note(6, 9.0)  # a new epoch starts afresh
    assert timed.at(6) == 0.0 and timed.at(5) == 0.0


def test_a_jobs_overhead_per_slot_is_pooled_over_its_chains_once_all_measured() -> None:
    """``note_overheads``: replicas (a, b) on cuts (0, 4, 7) and (c, d, e) on (0, 3, 5, 7),
    every layer of cost 1 at speed 1, shares 5 and 3, 1F1B: predicted 7 + 4 x 4 = 23 s and
    7 + 2 x 3 = 13 s (``predict_step_time``: the stages' times, then the bottleneck's for
    each further micro-batch), measured 30 and 19 s in their epoch. Shortfalls 7 and 6 over
    6 and 5 slots pool to 13 / 11 per slot, one figure for the job.
    Nothing is noted while a stage has not measured this epoch, or without a unit. The
    figure per step: the smallest wait between runs, less the optimizer steps predicted
    (``note_step_overhead``), once every stage measured a wait."""
    cluster = _cluster(dict.fromkeys("abcde", 1.0))
    noted: dict[str, float] = {}
    cluster.note_slot_overhead = noted.__setitem__
    cluster.in_seconds = lambda ids: True
    cluster.layout = Layout(REPLICAS, (5, 3))
    cluster.partition = REPLICAS[0]
    cluster.job = JobConfig(model="mlp", micro_batches=8, job_id="j")
    for sid, seconds in {"a": 30.0, "b": 28.0, "c": 19.0, "d": 12.0}.items():
        cluster.members.by_id(sid).pipeline_s = (1, seconds)
    cluster.members.by_id("e").pipeline_s = (0, 50.0)  # an earlier epoch's
    note_overheads(cluster)
    assert noted == {}
    cluster.members.by_id("e").pipeline_s = (1, 9.0)
    cluster.in_seconds = lambda ids: False
    note_overheads(cluster)
    assert noted == {}
    cluster.in_seconds = lambda ids: True
    steps: dict[str, float] = {}
    cluster.note_step_overhead = steps.__setitem__
    # the optimizer steps: the busiest stage's 4 layers of 10 bytes at 20 B/s, 2 s
    cluster.per_step = lambda: PerStep(0.0, [10.0] * LAYERS, 20.0)
    note_overheads(cluster)
    assert noted == {"j": pytest.approx(13 / 11)} and steps == {}  # (no waits measured)
    for sid, seconds in {"a": 3.0, "b": 2.5, "c": 2.75, "d": 4.0, "e": 3.5}.items():
        cluster.members.by_id(sid).between_runs = (1, seconds)
    note_overheads(cluster)
    assert steps == {"j": pytest.approx(0.5)}  # the smallest wait, less the optimizer's


def test_a_layouts_step_counts_its_optimizer_steps_and_reduction() -> None:
    """``layout_step`` (how the policy prices a new replica, moves inside replicas and
    recovery's options): the slowest replica at the water-filled shares, plus the
    optimizer steps (``Cluster.per_step``, without its fixed part, the same for every
    option) and the reduction: here shares 4 and 4, the first replica's 7 + 3 x 4 = 19 s
    the slower (the second's 7 + 3 x 3 = 16 s), plus the busiest stage's 4 layers of 10
    bytes stepped at 20 B/s, plus the busiest holder's reduction (the first replica's
    first stage: 4 layers, sending 2 (R - 1) / R of their 40 bytes) at 10 B/s."""
    cluster = _cluster(dict.fromkeys("abcde", 1.0))
    cluster.per_step = lambda in_seconds=True: PerStep(0.5, [10.0] * LAYERS, 20.0)
    assert layout_step(cluster, REPLICAS) == pytest.approx(19.0 + 2.0)
    cluster.param_bytes = [10.0] * LAYERS
    cluster.reduce_bandwidth = lambda in_seconds=True: 10.0
    assert layout_step(cluster, REPLICAS) == pytest.approx(19.0 + 2.0 + 4.0)
    # one replica: all 8 micro-batches, its busiest stage's 3 layers stepped, no reduction
    assert layout_step(cluster, REPLICAS[1:]) == pytest.approx(7 + 7 * 3 + 30 / 20)


def test_a_replica_whose_reduction_costs_more_than_it_saves_dissolves() -> None:
    """A spare could take the dead stage's place, but the reduction the two replicas pay
    (the busiest holder's 40 bytes at 2 B/s: 20 s) costs more than the second replica's
    share saves: both run a step in 19 + 20 = 39 s, the survivor alone (3 stages, all 8
    micro-batches) in 7 + 7 x 3 = 28 s. The policy dissolves the replica instead. At 200
    B/s (0.2 s of reduction), the spare takes the place."""
    option = _mend(dict.fromkeys("abcde", 1.0), {"b"}, spares=("f",), reduce_at=2.0)
    assert option.replicas == (None, REPLICAS[1]) and option.what.startswith("dissolved"), option
    option = _mend(dict.fromkeys("abcde", 1.0), {"b"}, spares=("f",), reduce_at=200.0)
    assert "f took the place of b" in option.what, option
