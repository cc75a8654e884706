"""Tests of the stage's step/epoch state machine: every transition, every lease, and
properties over random event sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticpipe.errors import (
    ElasticPipeError,
    Fenced,
    InvalidRequest,
    NotReady,
    Rebalancing,
    StaleEpoch,
    StepAborted,
)
from elasticpipe.stage_server.protocol import (
    ABORT_WINDOW,
    Decision,
    Do,
    Effect,
    Phase,
    StepMachine,
)
from elasticpipe.training.clipping import GradClip

pytestmark = pytest.mark.timeout(60)

LEASE = 10.0


def R(n: int) -> int:
    """A run id of client generation 1 (run ids carry their client's generation)."""
    return (1 << 40) + n


def machine(snapshot_every: int = 0) -> StepMachine:
    m = StepMachine("s0", commit_lease_s=LEASE, ask_interval_s=2.0)
    m.assign(epoch=1, snapshot_every=snapshot_every)
    m.fence_clients(1, "trainer")  # the coordinator granted the job to client generation 1
    return m


def kinds(effects: list[Effect]) -> list[Do]:
    return [e.do for e in effects]


def awaiting(m: StepMachine, run: int = 0, step: int = 1, client: int = 1) -> None:
    run = run or R(5)
    m.begin_run(1, run, step, client, True, [])
    m.finish_run(run, now=0.0)


# ---- the step protocol ----------------------------------------------------------------


def test_assign_resets_and_snapshots_step_zero() -> None:
    """A new job starts at step 0 in its epoch, voids old runs and snapshots, snapshots 0."""
    m = StepMachine("s0")
    effects = m.assign(epoch=3, snapshot_every=10)
    assert (m.epoch, m.committed_step, m.phase) == (3, 0, Phase.IDLE)
    assert kinds(effects) == [Do.RESET_RUNS, Do.PRUNE_SNAPSHOTS, Do.SNAPSHOT]
    assert effects[-1].step == 0


def test_assign_of_layers_awaiting_init_state_snapshots_nothing() -> None:
    """Empty layers (init_state follows) are not snapshotted: the load replaces them all."""
    m = StepMachine("s0")
    effects = m.assign(epoch=3, snapshot_every=10, empty=True)
    assert (m.epoch, m.committed_step, m.phase) == (3, 0, Phase.IDLE)
    assert kinds(effects) == [Do.RESET_RUNS, Do.PRUNE_SNAPSHOTS]


def test_a_training_run_goes_running_awaiting_idle() -> None:
    """begin -> RUNNING, finish -> AWAITING_COMMIT with a lease, commit -> IDLE at step+1
    with one optimizer step and the run closed."""
    m = machine()
    assert m.begin_run(1, R(5), 1, 1, True, []) == []
    assert m.phase is Phase.RUNNING and m.active_run == R(5)
    m.finish_run(R(5), now=100.0)
    assert m.phase is Phase.AWAITING_COMMIT and m.lease_until == 100.0 + LEASE
    effects = m.commit(1, R(5), 1, 1)
    assert kinds(effects) == [Do.APPLY_STEP, Do.CLOSE_RUNS]
    assert (m.phase, m.committed_step, m.committed_run) == (Phase.IDLE, 1, R(5))


def test_an_inference_run_goes_back_to_idle_without_commit() -> None:
    """An inference run never waits for a commit and never steps the optimizer."""
    m = machine()
    m.begin_run(1, R(5), 0, 1, False, [])
    assert m.finish_run(R(5), now=0.0) == []
    assert (m.phase, m.committed_step) == (Phase.IDLE, 0)


def test_a_repeated_commit_is_a_no_op() -> None:
    """A commit whose reply was lost and is asked again applies nothing the second time."""
    m = machine()
    awaiting(m)
    assert Do.APPLY_STEP in kinds(m.commit(1, R(5), 1, 1))
    assert m.commit(1, R(5), 1, 1) == []
    assert m.committed_step == 1


@pytest.mark.parametrize(
    ("epoch", "error"), [(2, StaleEpoch), (0, StaleEpoch)], ids=["newer", "older"]
)
def test_runs_of_another_epoch_are_refused(epoch: int, error: type[Exception]) -> None:
    """A run of another epoch is refused with a retryable StaleEpoch, changing nothing."""
    m = machine()
    with pytest.raises(error, match=f"stale epoch {epoch}: stage s0 is at epoch 1"):
        m.begin_run(epoch, R(5), 1, 1, True, [])
    assert m.phase is Phase.IDLE


def test_a_busy_stage_refuses_a_second_run() -> None:
    """While a run is active, another is refused, naming the active run."""
    m = machine()
    m.begin_run(1, R(5), 1, 1, True, [])
    with pytest.raises(NotReady, match=f"busy with run {R(5)}"):
        m.begin_run(1, R(6), 1, 1, True, [])


def test_a_run_must_train_the_next_step() -> None:
    """A training run of a step other than committed+1 is refused."""
    m = machine()
    with pytest.raises(NotReady, match="step 3 is not the next step"):
        m.begin_run(1, R(5), 3, 1, True, [])


def test_abort_of_an_awaiting_run_discards_it() -> None:
    """Aborting an awaiting run drops its gradients and closes it; it can never commit."""
    m = machine()
    awaiting(m)
    assert kinds(m.abort(R(5), 1)) == [Do.DISCARD_GRADS, Do.CLOSE_RUNS]
    assert m.phase is Phase.IDLE
    with pytest.raises(NotReady, match=f"run {R(5)} is not awaiting commit"):
        m.commit(1, R(5), 1, 1)


def test_abort_of_a_running_run_wakes_it_and_fail_run_ends_it() -> None:
    """Aborting a running run only wakes its waits; its executor's fail_run ends it, and
    its late finish is refused."""
    m = machine()
    m.begin_run(1, R(5), 1, 1, True, [])
    assert kinds(m.abort(R(5), 1)) == [Do.WAKE_RUN]
    assert m.phase is Phase.RUNNING
    with pytest.raises(StepAborted):
        m.finish_run(R(5), now=0.0)
    assert kinds(m.fail_run(R(5))) == [Do.DISCARD_GRADS, Do.CLOSE_RUNS]
    assert m.phase is Phase.IDLE


def test_a_run_aborted_before_it_started_never_starts() -> None:
    """AbortStep may overtake RunStep: the run is then refused when it arrives."""
    m = machine()
    assert kinds(m.abort(R(7), 1)) == [Do.CLOSE_RUNS]
    with pytest.raises(StepAborted, match=f"run {R(7)} was aborted before it started"):
        m.begin_run(1, R(7), 1, 1, True, [])


def test_an_abort_after_the_commit_changes_nothing() -> None:
    """Once a run committed here, a late abort of it is ignored (the decision was commit)."""
    m = machine()
    awaiting(m)
    m.commit(1, R(5), 1, 1)
    assert m.abort(R(5), 1) == []
    assert m.committed_step == 1


# ---- lost decisions and fencing ----------------------------------------------------


def test_the_next_run_carries_a_lost_commit() -> None:
    """A stage still awaiting the previous run commits it first when the next run says so."""
    m = machine()
    awaiting(m)
    effects = m.begin_run(1, R(6), 2, 1, True, [Decision(R(5), 1, commit=True)])
    assert kinds(effects) == [Do.APPLY_STEP, Do.CLOSE_RUNS]
    assert (m.committed_step, m.phase, m.active_run) == (1, Phase.RUNNING, R(6))


def test_a_commit_and_a_carried_commit_apply_their_clip() -> None:
    """The clipping decided for a run reaches the optimizer step however the commit
    arrives, and the state says which clipping the committed run applied."""
    clip = GradClip(coef=0.25)
    m = machine()
    awaiting(m)
    (apply, _) = m.commit(1, R(5), 1, 1, clip)
    assert (apply.do, apply.clip, m.state().committed_clip) == (Do.APPLY_STEP, clip, clip)
    awaiting(m, run=R(6), step=2)
    skip = GradClip(skip=True)
    effects = m.begin_run(1, R(7), 3, 1, True, [Decision(R(6), 2, True, skip)])
    assert effects[0].clip == skip and m.state().committed_clip == skip


def test_the_next_run_carries_a_lost_abort() -> None:
    """A stage still awaiting an aborted run discards it when the retry says so (picking
    its run's decision among the several a client may carry)."""
    m = machine()
    awaiting(m)
    effects = m.begin_run(
        1, R(6), 1, 1, True, [Decision(R(3), 1, commit=True), Decision(R(5), 1, commit=False)]
    )
    assert kinds(effects) == [Do.DISCARD_GRADS, Do.CLOSE_RUNS]
    assert (m.committed_step, m.active_run) == (0, R(6))


def test_a_decision_naming_another_step_is_refused() -> None:
    """A decision whose step is not the awaiting run's is refused before anything changes."""
    m = machine()
    awaiting(m)
    with pytest.raises(InvalidRequest, match="names step 4"):
        m.begin_run(1, R(6), 5, 1, True, [Decision(R(5), 4, commit=True)])
    assert m.phase is Phase.AWAITING_COMMIT


def test_a_fenced_client_can_neither_run_nor_commit_nor_abort() -> None:
    """After a fence, every request of an older client generation is refused."""
    m = machine()
    awaiting(m, client=1)
    m.fence_clients(2)
    for call in (
        lambda: m.begin_run(1, R(6), 2, 1, True, []),
        lambda: m.commit(1, R(5), 1, 1),
        lambda: m.abort(R(5), 1),
    ):
        with pytest.raises(Fenced, match="client generation 1"):
            call()
    assert m.phase is Phase.AWAITING_COMMIT
    assert Do.APPLY_STEP in kinds(m.commit(1, R(5), 1, 2))  # the new client decides


def test_fencing_wakes_a_run_of_an_older_client() -> None:
    """A run still computing for a fenced client is woken (it can never commit)."""
    m = machine()
    m.begin_run(1, R(5), 1, 1, True, [])
    assert kinds(m.fence_clients(2)) == [Do.WAKE_RUN]
    assert m.fence_clients(2) == []  # no longer the newest: nothing more


def test_only_the_coordinators_fence_admits_a_newer_client() -> None:
    """A run, commit or abort of a generation past the fence is refused and moves
    nothing: only the coordinator's fence (with the holder) lets a newer client in."""
    m = machine()
    awaiting(m, client=1)
    for call in (
        lambda: m.begin_run(1, (3 << 40) + 5, 0, 3, False, []),
        lambda: m.commit(1, R(5), 1, 3),
        lambda: m.abort(((3 + 17) << 40) - 1, 3),
    ):
        before = vars(m).copy()
        with pytest.raises(NotReady, match="granted the job to generation 1, not 3"):
            call()
        assert vars(m) == before
    m.abort(R(5), 1)
    m.fence_clients(3, "other")
    assert (m.fence, m.holder) == (3, "other")
    m.fence_clients(2, "late")  # an older grant arriving late changes nothing
    assert (m.fence, m.holder) == (3, "other")
    m.begin_run(1, (3 << 40) + 5, 0, 3, False, [])
    assert m.phase is Phase.RUNNING


def test_an_abort_closes_runs_only_near_the_newest_run_seen() -> None:
    """An abort of the current generation may close runs a little ahead (a RunStep lost
    on the way), never arbitrary future runs."""
    m = machine()
    awaiting(m, run=R(5))
    far = R(5 + ABORT_WINDOW + 1)
    with pytest.raises(InvalidRequest, match=f"at most {ABORT_WINDOW} past"):
        m.abort(far, 1)
    assert m.closed_below == 0 and m.phase is Phase.AWAITING_COMMIT
    assert kinds(m.abort(R(5 + ABORT_WINDOW), 1)) == [Do.CLOSE_RUNS]
    assert m.closed_below == R(5 + ABORT_WINDOW) + 1


# ---- leases -------------------------------------------------------------------------


def test_an_awaiting_run_asks_for_resolution_when_its_lease_runs_out() -> None:
    """Past the commit lease the machine asks to resolve the run, then asks again at the
    ask interval (never silently forever)."""
    m = machine()
    awaiting(m)
    assert m.tick(LEASE - 0.1) == []
    assert m.tick(LEASE) == [Effect(Do.RESOLVE_RUN, run=R(5), step=1)]
    assert m.tick(LEASE + 1.0) == []
    assert kinds(m.tick(LEASE + 2.0)) == [Do.RESOLVE_RUN]


def test_a_long_prepare_extends_the_freeze() -> None:
    """A transfer that outlasts the freeze lease holds the freeze for as long as it needs;
    an abandoned change cannot be extended."""
    m = machine()
    m.freeze(2, lease_s=5.0, now=0.0)
    m.extend(2, lease_s=100.0, now=4.0)
    assert m.tick(50.0) == []
    assert m.frozen is not None and m.frozen.until == 104.0
    with pytest.raises(NotReady, match="not frozen for epoch 3"):
        m.extend(3, 1.0, now=0.0)


def test_an_unprepared_freeze_ends_by_its_lease() -> None:
    """A freeze whose coordinator never comes back is dropped when its lease runs out."""
    m = machine()
    m.freeze(2, lease_s=5.0, now=0.0)
    with pytest.raises(Rebalancing):
        m.begin_run(1, R(5), 1, 1, True, [])
    assert m.tick(4.9) == []
    assert m.tick(5.0) == [Effect(Do.DROP_STAGED, epoch=2)]
    assert m.frozen is None
    m.begin_run(1, R(5), 1, 1, True, [])


def test_a_prepared_freeze_asks_for_the_outcome_when_its_lease_runs_out() -> None:
    """A prepared stage cannot know whether the commit point passed: it asks, and goes
    on asking, until the coordinator answers."""
    m = machine()
    m.freeze(2, lease_s=5.0, now=0.0)
    m.prepared(2, 0, now=1.0, lease_s=5.0)
    assert m.tick(6.0) == [Effect(Do.ASK_EPOCH, epoch=2)]
    assert m.frozen is not None and m.frozen.prepared
    assert kinds(m.tick(8.0)) == [Do.ASK_EPOCH]


# ---- epochs ---------------------------------------------------------------------------


def test_an_epoch_change_freezes_prepares_and_commits() -> None:
    """freeze -> prepared -> commit_epoch installs the staged layers in the new epoch."""
    m = machine()
    assert m.freeze(2, 60.0, now=0.0) == []
    m.prepared(2, 0, now=0.0, lease_s=60.0)
    assert m.commit_epoch(2) == [Effect(Do.INSTALL_STAGED, epoch=2), Effect(Do.SNAPSHOT, step=0)]
    assert (m.epoch, m.frozen) == (2, None)
    assert m.commit_epoch(2) == []  # a retried CommitEpoch


def test_a_freeze_needs_a_step_boundary_and_a_newer_epoch() -> None:
    """Freezing mid-run, or for an epoch not newer, is refused."""
    m = machine()
    m.begin_run(1, R(5), 1, 1, True, [])
    with pytest.raises(NotReady, match="not at a step boundary"):
        m.freeze(2, 60.0, now=0.0)
    m.abort(R(5), 1)
    m.fail_run(R(5))
    with pytest.raises(InvalidRequest, match="epoch 1"):
        m.freeze(1, 60.0, now=0.0)


def test_an_aborted_epoch_leaves_the_old_one() -> None:
    """abort_epoch drops what was staged; the old epoch stays in force."""
    m = machine()
    m.freeze(2, 60.0, now=0.0)
    m.prepared(2, 0, now=0.0, lease_s=60.0)
    assert m.abort_epoch(2) == [Effect(Do.DROP_STAGED, epoch=2)]
    assert m.epoch == 1
    with pytest.raises(NotReady, match="nothing is prepared for epoch 2"):
        m.commit_epoch(2)


def test_a_migration_needs_the_cut_to_be_this_stages_step() -> None:
    """A move prepared for a cut this stage has not committed is refused."""
    m = machine()
    m.freeze(2, 60.0, now=0.0)
    with pytest.raises(NotReady, match="the cut of epoch 2 is step 4"):
        m.prepared(2, 4, now=0.0, lease_s=60.0)


def test_a_rollback_epoch_resets_the_step_and_snapshots_it() -> None:
    """A recovery's epoch rolls the committed step back, voids pending messages, drops
    later snapshots and snapshots the restored step."""
    m = machine(snapshot_every=2)
    for step, run in ((1, 5), (2, 6), (3, 7)):
        awaiting(m, run=R(run), step=step)
        m.commit(1, R(run), step, 1)
    m.freeze(2, 60.0, now=0.0)
    m.prepared(2, 2, now=0.0, lease_s=60.0, rollback=True)
    effects = m.commit_epoch(2)
    assert kinds(effects) == [Do.INSTALL_STAGED, Do.RESET_RUNS, Do.PRUNE_SNAPSHOTS, Do.SNAPSHOT]
    assert effects[2] == Effect(Do.PRUNE_SNAPSHOTS, step=2)
    assert m.committed_step == 2
    m.begin_run(2, R(9), 3, 1, True, [])


def test_a_stage_joining_the_chain_drops_snapshots_after_the_step_it_joins_at() -> None:
    """A stage back in the chain at step 3 (it held no layers before this epoch) may still
    hold snapshots of a history that rolled back without it: those after step 3 go, the
    step it joins at is snapshotted."""
    m = machine(snapshot_every=2)
    m.freeze(2, 60.0, now=0.0)
    m.prepared(2, 3, now=0.0, lease_s=60.0, joining=True)
    effects = m.commit_epoch(2)
    assert kinds(effects) == [Do.INSTALL_STAGED, Do.RESET_RUNS, Do.PRUNE_SNAPSHOTS, Do.SNAPSHOT]
    assert effects[2] == Effect(Do.PRUNE_SNAPSHOTS, step=3)
    assert effects[3] == Effect(Do.SNAPSHOT, step=3)


def test_preempt_ends_the_active_run_for_a_recovery() -> None:
    """A recovery's freeze first ends whatever run is active (awaiting or running)."""
    m = machine()
    awaiting(m)
    assert kinds(m.preempt()) == [Do.DISCARD_GRADS, Do.CLOSE_RUNS]
    m.begin_run(1, R(6), 1, 1, True, [])
    assert kinds(m.preempt()) == [Do.WAKE_RUN]


def test_snapshots_come_every_snapshot_every_steps() -> None:
    """Commits of multiples of snapshot_every snapshot the committed state."""
    m = machine(snapshot_every=2)
    snapped = []
    for step in range(1, 6):
        awaiting(m, run=R(10 + step), step=step)
        snapped += [e.step for e in m.commit(1, R(10 + step), step, 1) if e.do is Do.SNAPSHOT]
    assert snapped == [2, 4]


# ---- properties over random event sequences -------------------------------------------

EVENTS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "begin",
                "begin_prev_commit",
                "begin_prev_abort",
                "finish",
                "fail",
                "commit",
                "abort",
                "fence",
                "tick",
                "freeze",
                "prepare",
                "commit_epoch",
                "abort_epoch",
                "preempt",
            ]
        ),
        st.integers(0, 3),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(EVENTS)
def test_random_event_sequences_keep_the_protocol_invariants(
    events: list[tuple[str, int]],
) -> None:
    """Whatever happens: each step is applied at most once and only by a run that finished
    everywhere here; a discarded run is never applied; the step only moves back through a
    rollback; a frozen stage runs nothing; errors change nothing."""
    m = machine(snapshot_every=2)
    now, runs = 0.0, iter(range(100, 10_000))
    finished: set[int] = set()
    discarded: set[int] = set()
    applied: set[int] = set()
    for name, arg in events:
        now += arg
        before = vars(m).copy()
        run = m.active_run
        try:
            if name.startswith("begin"):
                run = R(next(runs))
                prev = []
                if name != "begin" and m.phase is Phase.AWAITING_COMMIT:
                    prev = [Decision(m.active_run, m.active_step, name == "begin_prev_commit")]
                effects = m.begin_run(m.epoch, run, m.committed_step + 1, 1, arg != 0, prev)
            elif name == "finish":
                effects = m.finish_run(run, now)
                finished.add(run)
            elif name == "fail":
                effects = m.fail_run(run)
            elif name == "commit":
                effects = m.commit(m.epoch, run, m.active_step, 1)
            elif name == "abort":
                effects = m.abort(run, 1)
            elif name == "fence":
                effects = m.fence_clients(1)
            elif name == "tick":
                effects = m.tick(now)
            elif name == "freeze":
                effects = m.freeze(m.epoch + 1, 5.0, now)
            elif name == "prepare":
                frozen = m.frozen.epoch if m.frozen else m.epoch + 1
                effects = m.prepared(
                    frozen, m.committed_step - (arg % 2), now, 5.0, rollback=arg > 1
                )
            elif name == "commit_epoch":
                effects = m.commit_epoch(m.frozen.epoch if m.frozen else m.epoch)
            elif name == "abort_epoch":
                effects = m.abort_epoch(m.frozen.epoch if m.frozen else m.epoch)
            else:
                effects = m.preempt()
        except ElasticPipeError:
            assert vars(m) == before, f"{name} raised but changed the machine"
            continue
        rolled_back = (
            Do.RESET_RUNS in kinds(effects) and m.committed_step < before["committed_step"]
        )
        if rolled_back:
            applied = {s for s in applied if s <= m.committed_step}
        else:
            assert m.committed_step >= before["committed_step"]
        for e in effects:
            if e.do is Do.DISCARD_GRADS:
                discarded.add(before["active_run"])
            if e.do is Do.APPLY_STEP:
                assert e.run in finished, "a run applied before it finished"
                assert e.run not in discarded, "a discarded run applied"
                assert e.step not in applied, f"step {e.step} applied twice"
                applied.add(e.step)
        if m.frozen is not None:
            assert m.phase is Phase.IDLE, "a frozen stage is running"
        if m.phase is Phase.AWAITING_COMMIT:
            assert m.lease_until < float("inf")


def test_run_ids_belong_to_their_client_and_stay_near_the_fence() -> None:
    """A run id carries its client's generation: a run of another client's generation is
    refused, and data of a generation far past the fence cannot close future runs."""
    m = machine()
    with pytest.raises(InvalidRequest, match="not the caller's 1"):
        m.begin_run(1, (2 << 40) + 5, 1, 1, True, [])
    with pytest.raises(InvalidRequest, match="not the caller's 1"):
        m.abort(2**64 - 1, 1)
    m.check_run(((m.fence + 16) << 40) + 3)  # a newer client's data may arrive first
    with pytest.raises(InvalidRequest, match="more than 16 past"):
        m.check_run(((m.fence + 17) << 40) + 3)
    assert m.closed_below == 0
