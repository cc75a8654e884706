"""Tests of snapshot-copy accounting (which steps are safe, which recoverable) and of the
waits for copies around a leave."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, cast

import pytest

from elasticpipe.coordinator import epochs
from elasticpipe.coordinator.coordinator import Coordinator
from elasticpipe.coordinator.copies import copies_by_step, missing_layers, newest_step
from elasticpipe.v1 import stage_pb2

pytestmark = pytest.mark.timeout(20)


def held(step: int, layers: list[int], job: str = "j") -> stage_pb2.SnapshotHolding:
    return stage_pb2.SnapshotHolding(job_id=job, step=step, layers=layers)


# The docstring's example: a owns layers 0-1, b owns 2-3, each copies to the other.
HOLDINGS = {
    "a": [held(10, [0, 1]), held(10, [2, 3]), held(20, [0, 1]), held(30, [0, 1], job="old")],
    "b": [held(10, [2, 3]), held(10, [0, 1]), held(20, [2, 3])],
}


def test_a_step_is_safe_only_with_two_live_copies_of_every_layer() -> None:
    """Step 10 has two holders per layer, step 20 only one: 10 is the safe step."""
    found = copies_by_step(HOLDINGS, "j")
    assert newest_step(found, 4, {"a", "b"}, need=2) == 10
    assert newest_step(found, 4, {"a", "b"}, need=1) == 20


def test_after_a_death_the_newest_recoverable_step_is_chosen() -> None:
    """With b dead, only step 10 still has every layer (from a's copy of b's snapshot)."""
    found = copies_by_step(HOLDINGS, "j")
    assert newest_step(found, 4, {"a"}) == 10
    assert missing_layers(found, 20, 4, {"a"}) == [2, 3]
    assert newest_step(found, 4, set()) is None


def test_other_jobs_and_later_steps_are_ignored() -> None:
    """Holdings of another job never count; at_most bounds the step."""
    found = copies_by_step(HOLDINGS, "j")
    assert 30 not in found
    assert newest_step(found, 4, {"a", "b"}, at_most=15) == 10


class _Stages:
    """What ``wait_for_copies`` asks of a cluster: each stage's holdings (``GetStats``), the
    members (``dead`` ones as the membership declared them) and their names."""

    def __init__(self, holdings: dict[str, list[stage_pb2.SnapshotHolding]], dead: set[str]):
        self.holdings, self.dead, self.calls = holdings, dead, 0
        self.pool, self.members = self, self

    def each(self, calls: list[tuple[str, Any]], method: str, timeout: float) -> list[Any]:
        self.calls += 1
        return [stage_pb2.StageStats(snapshots=self.holdings[a]) for a, _ in calls]

    def by_id(self, stage_id: str) -> Any:
        return SimpleNamespace(row=SimpleNamespace(dead=stage_id in self.dead))

    def names(self, stage_ids: list[str]) -> list[str]:
        return list(stage_ids)


def _wait(stages: _Stages, step: int) -> bool:
    partition = SimpleNamespace(
        addresses=["a", "b"], stage_ids=["a", "b"], num_stages=2, num_layers=4
    )
    job = SimpleNamespace(job_id="j", snapshot_every=10)
    return epochs.wait_for_copies(
        cast(Any, stages), cast(Any, partition), cast(Any, job), step, 5.0
    )


def test_a_later_complete_snapshot_ends_the_wait_for_an_epochs_first() -> None:
    """The epoch's first snapshot (step 10) was given up for step 20's, whose copies are
    complete: the wait ends at once (it waited out its timeout for exactly step 10)."""
    both = [held(20, [0, 1]), held(20, [2, 3])]
    stages = _Stages({"a": both, "b": list(both)}, set())
    assert _wait(stages, 10) and stages.calls == 1


def test_a_dead_stage_of_the_chain_ends_the_wait_for_copies() -> None:
    """Copies to a stage declared dead never come: the wait gives up at its first look,
    not after its timeout (recovery waits for the move's lock meanwhile)."""
    stages = _Stages({"a": [held(10, [0, 1])], "b": []}, {"b"})
    assert not _wait(stages, 10) and stages.calls == 1


class _Recovering:
    """What ``Coordinator._stay_for_recovery`` reads: the job's failure, and the chain's
    dead stages (one until ``recovered_after`` looks, then none)."""

    def __init__(self, recovered_after: int | None):
        self.cluster, self.recovery = SimpleNamespace(failure=""), self
        self.looks, self.recovered_after = 0, recovered_after

    def dead_in_chain(self) -> list[str]:
        self.looks += 1
        done = self.recovered_after is not None and self.looks > self.recovered_after
        return [] if done else ["stage-0"]


def test_a_leaving_stage_stays_until_a_dead_neighbour_is_recovered() -> None:
    """Its copies of the dead stage's snapshots may be the last: it stays while the chain has
    a dead stage, until recovery replaced it, or until its own deadline."""
    recovering = _Recovering(recovered_after=3)
    Coordinator._stay_for_recovery(cast(Any, recovering), time.monotonic() + 30)
    assert recovering.looks == 4
    stuck = _Recovering(recovered_after=None)
    started = time.monotonic()
    Coordinator._stay_for_recovery(cast(Any, stuck), started + 0.3)
    assert 0.3 <= time.monotonic() - started < 5


class _History:
    """What ``epochs.unloaded`` reads: the job's epoch history (newest first, as many rows
    as asked for) and the members' last reports (stage id, epoch, committed step)."""

    def __init__(self, kinds: list[str], reports: list[tuple[str, int, int]]):
        self.kinds, self.store = kinds, self
        reported = [
            SimpleNamespace(row=SimpleNamespace(stage_id=sid), epoch=e, committed_step=step)
            for sid, e, step in reports
        ]
        self.members = SimpleNamespace(members=lambda: reported)

    def epochs(self, limit: int, job_id: str) -> list[Any]:
        newest = len(self.kinds) + 4  # the start row, the oldest, is epoch 5
        return [SimpleNamespace(kind=k, epoch=newest - n) for n, k in enumerate(self.kinds)][:limit]


def _unloaded(kinds: list[str], reports: list[tuple[str, int, int]], external: bool = True) -> bool:
    job = SimpleNamespace(job_id="j", external_weights=external)
    return epochs.unloaded(cast(Any, _History(kinds, reports)), cast(Any, job), ["a", "b"])


def test_only_an_init_state_job_never_loaded_nor_trained_is_built_anew() -> None:
    """Built anew: external weights, no load in the history, and no stage of the chain
    reporting a step since the job's start (epoch 5). A spare's step, or a report from
    before the start (another job's), does not count; a chain stage's does, dead or alive."""
    assert _unloaded(["start"], [("a", 5, 0), ("b", 6, 0), ("spare", 9, 1000), ("a", 4, 7)])
    assert not _unloaded(["start"], [], external=False)
    assert not _unloaded(["restore", "start"], [])
    assert not _unloaded(["start"], [("b", 6, 3)])


def test_a_history_longer_than_its_scan_counts_as_loaded() -> None:
    """When the rows read do not reach back to the job's start, a load may lie before
    them: the layers are taken as loaded, never rebuilt empty."""
    assert not _unloaded(["move"] * epochs.HISTORY_SCAN + ["start"], [])
    assert _unloaded(["move"] * (epochs.HISTORY_SCAN - 1) + ["start"], [])
