"""Tests of the stage's snapshot store and snapshotter: double buffering, pruning, copies."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import pytest
import torch

from elasticpipe.errors import InvalidRequest, NotReady, StageUnavailable
from elasticpipe.stage_server.callers import in_source_range
from elasticpipe.stage_server.snapshots import (
    Capture,
    Holding,
    SnapshotStore,
    Snapshotter,
    check_copy,
)
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import PackedLayer

pytestmark = pytest.mark.timeout(20)


def _sealed(state: bytes) -> PackedLayer:
    return layer_state.seal(PackedLayer(state, ()))


def test_the_last_two_complete_snapshots_are_kept() -> None:
    """A third complete snapshot drops the oldest; copies are kept per source the same way.
    Own snapshots carry each layer's digest (compared across replicas), copies none."""
    store = SnapshotStore(keep=2)
    for step in (10, 20, 30):
        assert store.add_own("j", step, {0: _sealed(b"own%d" % step)}, store.generation)
        store.add_copy("b", "j", step, {1: _sealed(b"copy%d" % step)}, store.generation)
    assert store.get("j", 10, 0) is None
    own30, copy20 = store.get("j", 30, 0), store.get("j", 20, 1)
    assert own30 is not None and own30.state == b"own30"
    assert copy20 is not None and copy20.state == b"copy20"
    assert store.get("other-job", 30, 0) is None
    digest = {step: _sealed(b"own%d" % step).digest for step in (20, 30)}
    assert sorted(store.holdings(), key=lambda h: (h.peer_copy, h.step)) == [
        Holding("j", 20, (0,), False, (digest[20],)),
        Holding("j", 30, (0,), False, (digest[30],)),
        Holding("j", 20, (1,), True),
        Holding("j", 30, (1,), True),
    ]
    assert len(digest[20]) == 32 and digest[20] != digest[30]


def test_snapshots_from_the_safe_step_on_are_never_trimmed() -> None:
    """Whatever keep says, the coordinator's newest safe step and later ones stay."""
    store = SnapshotStore(keep=2)
    store.keep_from(10)
    for step in (10, 20, 30, 40):
        store.add_own("j", step, {0: _sealed(b"x")}, store.generation)
    assert [h.step for h in store.holdings()] == [10, 20, 30, 40]
    store.keep_from(30)
    store.add_own("j", 50, {0: _sealed(b"x")}, store.generation)
    assert [h.step for h in store.holdings()] == [30, 40, 50]


def test_prune_after_a_rollback_and_captures_taken_before_it() -> None:
    """prune(k) drops steps after k; a capture taken before the prune is not kept."""
    store = SnapshotStore()
    store.add_own("j", 10, {0: _sealed(b"a")}, store.generation)
    stale = store.generation
    store.add_own("j", 20, {0: _sealed(b"b")}, stale)
    store.prune(10)
    assert [h.step for h in store.holdings()] == [10]
    assert not store.add_own("j", 30, {0: _sealed(b"c")}, stale)
    assert not store.add_copy("b", "j", 30, {1: b"c"}, stale)
    store.prune(None)
    assert store.holdings() == [] and store.nbytes() == 0


def test_the_snapshotter_packs_stores_and_pushes_off_the_critical_path() -> None:
    """A capture is packed, stored and pushed on the snapshotter's thread; a failed push
    keeps the snapshot here and is logged, not raised."""
    store = SnapshotStore()
    pushed: list[tuple[str, int, list[int]]] = []
    fail = threading.Event()

    def push(
        peer: str,
        capture: Capture,
        blobs: Sequence[tuple[int, PackedLayer]],
        superseded: Callable[[], bool],
    ) -> bool:
        if fail.is_set():
            raise StageUnavailable("peer gone")
        pushed.append((peer, capture.step, [layer for layer, _ in blobs]))
        return True

    snapper = Snapshotter(store, push, lambda: None)
    try:
        state = {"index": 0, "model": {"w": torch.ones(2)}}
        snapper.submit(Capture("j", 4, "s0", {0: state}, "h:2", store.generation))
        assert snapper.flush(10)
        assert pushed == [("h:2", 4, [0])]
        held = store.get("j", 4, 0)
        assert held is not None and held.unpack()["model"]["w"].tolist() == [1, 1]
        fail.set()
        snapper.submit(Capture("j", 8, "s0", {0: state}, "h:2", store.generation))
        assert snapper.flush(10)
        assert store.get("j", 8, 0) is not None
    finally:
        snapper.close()


def test_copies_are_kept_only_for_this_job_and_chain() -> None:
    """A copy of another job, or from a stage outside the chain, is refused."""
    check_copy("j", "j", "a", ("a", "b"))
    with pytest.raises(NotReady, match="job 'x'"):
        check_copy("x", "j", "a", ("a", "b"))
    with pytest.raises(NotReady, match="not in the chain"):
        check_copy("j", "j", "z", ("a", "b"))


def test_a_copy_outside_the_sources_layers_is_not_ready_during_an_epoch_change() -> None:
    """A copy of layers the source does not own here is invalid; while this stage's epoch
    change is in progress (the source may own them in the new epoch), it is not ready, so
    its sender tries again once this stage has committed."""
    in_source_range(range(3, 5), "a")(4)
    with pytest.raises(InvalidRequest, match=r"holds layer 1, outside the layers it owns \[3, 5\)"):
        in_source_range(range(3, 5), "a")(1)
    with pytest.raises(NotReady, match=r"holds layer 1, .* before this stage's epoch change"):
        in_source_range(range(3, 5), "a", changing=True)(1)
