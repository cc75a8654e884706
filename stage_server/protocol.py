"""The stage's step and epoch protocol as a pure state machine: no gRPC, no torch, no clock.

The ``Stage`` feeds it events under its lock and carries out the effects it returns (apply
the optimizer step, discard gradients, close a run in the mailbox, ask the coordinator);
every rule about what may happen when lives here, where it is unit- and property-tested.
Every event either raises a domain error *before* changing anything, or changes the state
and returns the effects to carry out.

Step protocol (the consistent cut of invariant 3 is "every stage IDLE")::

    IDLE --begin_run--> RUNNING --finish_run (train)--> AWAITING_COMMIT --commit--> IDLE, step+1
      ^                   |  \\--finish_run (infer)-----------------------------> IDLE
      |                   +--fail_run / abort (woken)----------------------------> IDLE
      +----------------------------------------------abort / preempt-- AWAITING_COMMIT

* A committed or aborted run is closed: it never starts, its late messages are dropped,
  and a repeated commit of the committed run is a no-op (its reply may have been lost).
* ``begin_run`` carries the client's decisions on earlier runs: a stage still
  AWAITING_COMMIT for one of them applies that decision first (a CommitStep or AbortStep
  lost).
* Clients are fenced by generation: a request of a generation below the fence is refused
  (``Fenced``), so a client whose lease ran out can never commit after its successor.
  Only the coordinator moves the fence (``fence_clients``, with the holder's name): a run,
  commit or abort of a generation past it is refused too (``NotReady``; the stage asks
  the coordinator first, in case it missed the fence), so no caller can fence out the
  client that holds the job. An abort closes runs at most ``ABORT_WINDOW`` past the newest
  run the stage has seen of the current generation, never arbitrary future runs.
* AWAITING_COMMIT holds a lease of ``commit_lease_s``. When it runs out the stage asks for
  the run to be resolved (``Do.RESOLVE_RUN``): the coordinator applies "committed anywhere,
  so commit everywhere; else abort" once the client holding the job can no longer decide.

Epoch protocol, overlaid on the step protocol::

    unfrozen --freeze(E)--> FROZEN(E) --prepared(E)--> PREPARED(E) --commit_epoch(E)--> epoch E
                              |                           |
                              +--abort_epoch(E) / lease---+--abort_epoch(E)--> epoch unchanged

A freeze is taken only at IDLE and holds a lease. Unprepared, its expiry abandons the
change (the commit point cannot have passed: it needs every stage prepared); prepared, its
expiry asks the coordinator for the outcome (``Do.ASK_EPOCH``) and keeps waiting, since
only the coordinator's store knows whether the commit point passed. An epoch that rolls
back (recovery from a snapshot, a checkpoint load) also sets the committed step.

Snapshots: the committed state is snapshotted at step 0 (but for layers awaiting their
init_state), at every multiple of ``snapshot_every``, and at every new epoch's first step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum

from elasticpipe.errors import (
    Fenced,
    InvalidRequest,
    NotReady,
    Rebalancing,
    StaleEpoch,
    StepAborted,
)
from elasticpipe.security import bounds
from elasticpipe.training.clipping import NO_CLIP, GradClip

ABORT_WINDOW = 1024  # an abort may close runs this far past the newest run seen


class Phase(Enum):
    """Where a stage is in the step protocol."""

    IDLE = "idle"
    RUNNING = "running"
    AWAITING_COMMIT = "awaiting_commit"


class Do(Enum):
    """What the stage must carry out after a transition."""

    APPLY_STEP = "apply_step"  # one optimizer step from the run's accumulated gradients
    DISCARD_GRADS = "discard_grads"  # the run's gradients are dropped
    CLOSE_RUNS = "close_runs"  # mailbox: every run <= ``run`` is over
    WAKE_RUN = "wake_run"  # mailbox: fail the waits of the running ``run`` (it was aborted)
    RESOLVE_RUN = "resolve_run"  # ask the coordinator to decide ``run`` (commit lease out)
    ASK_EPOCH = "ask_epoch"  # ask the coordinator whether ``epoch`` committed (freeze lease out)
    DROP_STAGED = "drop_staged"  # forget what was staged for ``epoch``
    INSTALL_STAGED = "install_staged"  # install what was staged for ``epoch``
    RESET_RUNS = "reset_runs"  # rollback: every pending message is void
    SNAPSHOT = "snapshot"  # snapshot the committed state of ``step``
    PRUNE_SNAPSHOTS = "prune_snapshots"  # drop snapshots after ``step`` (all if ``everything``)


@dataclass(frozen=True)
class Effect:
    """One thing the stage must do, with the values it needs."""

    do: Do
    run: int = 0
    step: int = 0
    epoch: int = 0
    everything: bool = False
    clip: GradClip = NO_CLIP  # APPLY_STEP: what to do to the gradients first


@dataclass(frozen=True)
class Decision:
    """A client's decision on a run whose ops completed everywhere."""

    run: int
    step: int
    commit: bool
    clip: GradClip = NO_CLIP  # a commit's gradient clipping


@dataclass(frozen=True)
class Frozen:
    """An epoch change in progress on this stage."""

    epoch: int
    until: float
    prepared: bool = False
    committed_step: int = 0  # the step the new epoch starts from
    rollback: bool = False  # the new epoch restores state (recovery, checkpoint load)
    new_history: bool = False  # restored from outside (a checkpoint): older snapshots void
    joining: bool = False  # the stage holds no layers of the job before this epoch


@dataclass(frozen=True)
class RunState:
    """What the machine says about itself (stats, heartbeats, recovery)."""

    phase: Phase
    epoch: int
    committed_step: int
    committed_run: int
    active_run: int
    active_step: int
    fence: int
    frozen_for: int
    prepared: bool
    committed_clip: GradClip = NO_CLIP  # what the commit of ``committed_run`` clipped
    holder: str = ""


class StepMachine:
    """The step and epoch protocol of one stage."""

    def __init__(
        self,
        name: str,
        commit_lease_s: float = 60.0,
        ask_interval_s: float = 5.0,
    ):
        if not commit_lease_s > 0 or not ask_interval_s > 0:
            raise InvalidRequest(
                f"leases must be > 0 (commit_lease_s={commit_lease_s}, "
                f"ask_interval_s={ask_interval_s})"
            )
        self.name = name
        self.commit_lease_s = commit_lease_s
        self.ask_interval_s = ask_interval_s
        self.has_job = False
        self.snapshot_every = 0
        self.epoch = 0
        self.committed_step = 0
        self.committed_run = 0
        self.committed_clip = NO_CLIP
        self.phase = Phase.IDLE
        self.active_run = 0
        self.active_step = 0
        self.active_client = 0
        self.active_train = False
        self.lease_until = math.inf
        self.fence = 0
        self.holder = ""  # the certificate name of the fence's client (mutual TLS)
        self.closed_below = 0
        self.frozen: Frozen | None = None

    # ---- queries -------------------------------------------------------------------

    def state(self) -> RunState:
        """A copy of what the machine holds."""
        return RunState(
            phase=self.phase,
            epoch=self.epoch,
            committed_step=self.committed_step,
            committed_run=self.committed_run,
            committed_clip=self.committed_clip,
            active_run=self.active_run,
            active_step=self.active_step,
            fence=self.fence,
            frozen_for=self.frozen.epoch if self.frozen else 0,
            prepared=bool(self.frozen and self.frozen.prepared),
            holder=self.holder,
        )

    def check_epoch(self, epoch: int) -> None:
        """Checks that data of ``epoch`` may be accepted now.

        Raises:
            StaleEpoch: another epoch (retryable: the client refetches the partition).
            Rebalancing: an epoch change is in progress (retryable).
            NotReady: no job assigned.
        """
        if not self.has_job:
            raise NotReady(f"stage {self.name} has no job assigned")
        if epoch != self.epoch:
            raise StaleEpoch(f"stale epoch {epoch}: stage {self.name} is at epoch {self.epoch}")
        if self.frozen is not None:
            raise Rebalancing(
                f"rebalancing from epoch {self.epoch} to {self.frozen.epoch}: retry shortly"
            )

    def check_run(self, run: int, client: int | None = None, older: bool = False) -> None:
        """Checks a run id: of the calling ``client``'s generation (``older``: or of an
        older client's, which it fenced), or (data arriving before its RunStep) of a
        generation not far past the fence.

        Raises:
            InvalidRequest: naming the run, its generation and the bound.
        """
        generation = bounds.generation(run)
        if client is not None and (generation > client if older else generation != client):
            raise InvalidRequest(
                f"run {run} is of client generation {generation}, not the caller's {client}"
                + (" or an older one" if older else "")
            )
        if generation > self.fence + bounds.MAX_GENERATIONS_AHEAD:
            raise InvalidRequest(
                f"run {run} is of client generation {generation}, more than "
                f"{bounds.MAX_GENERATIONS_AHEAD} past stage {self.name}'s {self.fence}"
            )

    def _check_client(self, client: int, what: str) -> None:
        if client < self.fence:
            raise Fenced(
                f"fenced: {what} of client generation {client} refused by stage {self.name}, "
                f"which follows generation {self.fence} (another client took over the job)"
            )
        if client > self.fence:
            raise NotReady(
                f"{what} of client generation {client} refused by stage {self.name}: the "
                f"coordinator granted the job to generation {self.fence}, not {client}"
            )

    # ---- job -----------------------------------------------------------------------

    def assign(self, epoch: int, snapshot_every: int, empty: bool = False) -> list[Effect]:
        """A job starts here at step 0 in ``epoch``, voiding what ran (``empty``: no snapshot)."""
        effects = self.preempt()
        self.has_job, self.snapshot_every = True, snapshot_every
        self.epoch, self.committed_step, self.committed_run = epoch, 0, 0
        self.frozen = None
        return [
            *effects,
            Effect(Do.RESET_RUNS),
            Effect(Do.PRUNE_SNAPSHOTS, everything=True),
            *([] if empty else [Effect(Do.SNAPSHOT, step=0)]),
        ]

    def drop_job(self) -> list[Effect]:
        """The coordinator declared this incarnation dead: forget the job."""
        effects = self.preempt()
        self.has_job, self.frozen = False, None
        return [*effects, Effect(Do.RESET_RUNS), Effect(Do.PRUNE_SNAPSHOTS, everything=True)]

    # ---- steps ---------------------------------------------------------------------

    def begin_run(
        self,
        epoch: int,
        run: int,
        step: int,
        client: int,
        train: bool,
        previous: Sequence[Decision] = (),
    ) -> list[Effect]:
        """A client starts run ``run`` (of ``step`` when training).

        Raises:
            Fenced, StaleEpoch, Rebalancing, NotReady: see ``check_epoch``; or busy with
                another run, or ``step`` is not the next step.
            StepAborted: ``run`` was aborted before it started.
        """
        self._check_client(client, f"run {run}")
        self.check_epoch(epoch)
        self.check_run(run, client)
        awaiting = self.phase is Phase.AWAITING_COMMIT
        decided = [d for d in previous if awaiting and d.run == self.active_run]
        settle = bool(decided)
        prior = decided[0] if decided else None
        if not settle and self.phase is not Phase.IDLE:
            raise NotReady(
                f"stage {self.name} is busy with run {self.active_run} "
                f"({self.phase.value}); abort it first"
            )
        if run < self.closed_below:
            raise StepAborted(f"run {run} was aborted before it started on stage {self.name}")
        if prior is not None and prior.step != self.active_step:
            raise InvalidRequest(
                f"decision on run {prior.run} names step {prior.step}, but the run is "
                f"step {self.active_step} on stage {self.name}"
            )
        next_step = self.committed_step + 1
        if prior is not None and prior.commit:
            next_step = prior.step + 1
        if train and step != next_step:
            raise NotReady(
                f"step {step} is not the next step of stage {self.name} "
                f"(committed: {self.committed_step})"
            )
        effects: list[Effect] = []
        if prior is not None:
            if prior.commit:
                effects += self._commit(prior.run, prior.step, prior.clip)
            else:
                effects += self._abort_awaiting()
        self.phase, self.active_run, self.active_step = Phase.RUNNING, run, step
        self.active_client, self.active_train = client, train
        return effects

    def finish_run(self, run: int, now: float) -> list[Effect]:
        """The run's ops completed: wait for the commit (training) or go idle (inference).

        Raises:
            StepAborted: the run is not running any more, or was aborted while computing
                (call ``fail_run``).
        """
        if self.phase is not Phase.RUNNING or self.active_run != run:
            raise StepAborted(f"run {run} is no longer running on stage {self.name}")
        if run < self.closed_below:
            raise StepAborted(f"run {run} was aborted on stage {self.name}")
        if self.active_train:
            self.phase, self.lease_until = Phase.AWAITING_COMMIT, now + self.commit_lease_s
        else:
            self.phase = Phase.IDLE
        return []

    def fail_run(self, run: int) -> list[Effect]:
        """The run's ops failed (or it was woken by an abort): it is over here."""
        self.closed_below = max(self.closed_below, run + 1)
        if self.phase is Phase.RUNNING and self.active_run == run:
            self.phase = Phase.IDLE
            return [Effect(Do.DISCARD_GRADS), Effect(Do.CLOSE_RUNS, run=run)]
        return [Effect(Do.CLOSE_RUNS, run=run)]

    def commit(
        self, epoch: int, run: int, step: int, client: int, clip: GradClip = NO_CLIP
    ) -> list[Effect]:
        """Commits the awaiting run: one optimizer step (its gradients clipped by ``clip``).

        Raises:
            Fenced / StaleEpoch: see above.
            NotReady: ``run`` is not awaiting commit here.
        """
        self._check_client(client, f"commit of run {run}")
        if self.committed_run == run and self.committed_step == step and run:
            return []  # a retried commit whose reply was lost
        if epoch != self.epoch:
            raise StaleEpoch(f"stale epoch {epoch}: stage {self.name} is at epoch {self.epoch}")
        if self.phase is not Phase.AWAITING_COMMIT or self.active_run != run:
            raise NotReady(
                f"run {run} is not awaiting commit on stage {self.name} "
                f"(run {self.active_run} is {self.phase.value})"
            )
        if step != self.active_step:
            raise InvalidRequest(
                f"commit of run {run} names step {step}, but the run is step {self.active_step}"
            )
        return self._commit(run, step, clip)

    def _commit(self, run: int, step: int, clip: GradClip) -> list[Effect]:
        self.phase, self.lease_until = Phase.IDLE, math.inf
        self.committed_step, self.committed_run, self.committed_clip = step, run, clip
        self.closed_below = max(self.closed_below, run + 1)
        effects = [
            Effect(Do.APPLY_STEP, run=run, step=step, clip=clip),
            Effect(Do.CLOSE_RUNS, run=run),
        ]
        if self.snapshot_every and step % self.snapshot_every == 0:
            effects.append(Effect(Do.SNAPSHOT, step=step))
        return effects

    def abort(self, run: int, client: int) -> list[Effect]:
        """Discards ``run`` wherever it is (a run not started yet will never start).

        A running run is only woken here: it goes idle when its executor calls
        ``fail_run``.

        Raises:
            Fenced: an older client's abort.
            NotReady: a generation past the fence.
            InvalidRequest: a run more than ``ABORT_WINDOW`` past the newest run seen.
        """
        self._check_client(client, f"abort of run {run}")
        self.check_run(run, client, older=True)
        newest = max(self.active_run, self.committed_run, self.fence << bounds.RUN_ID_BITS)
        if run > newest + ABORT_WINDOW:
            raise InvalidRequest(
                f"abort of run {run} refused by stage {self.name}: at most {ABORT_WINDOW} "
                f"past the newest run it has seen ({newest})"
            )
        if self.committed_run == run and run:
            return []  # committed here: the decision was commit, an abort comes too late
        self.closed_below = max(self.closed_below, run + 1)
        if self.phase is Phase.RUNNING and self.active_run == run:
            return [Effect(Do.WAKE_RUN, run=run)]
        if self.phase is Phase.AWAITING_COMMIT and self.active_run == run:
            return self._abort_awaiting()
        return [Effect(Do.CLOSE_RUNS, run=run)]

    def _abort_awaiting(self) -> list[Effect]:
        run = self.active_run
        self.phase, self.lease_until = Phase.IDLE, math.inf
        self.closed_below = max(self.closed_below, run + 1)
        return [Effect(Do.DISCARD_GRADS), Effect(Do.CLOSE_RUNS, run=run)]

    def preempt(self) -> list[Effect]:
        """Ends whatever run is active (a recovery, a new job or a rollback supersedes it)."""
        if self.phase is Phase.RUNNING:
            self.closed_below = max(self.closed_below, self.active_run + 1)
            return [Effect(Do.WAKE_RUN, run=self.active_run)]
        if self.phase is Phase.AWAITING_COMMIT:
            return self._abort_awaiting()
        return []

    def fence_clients(self, client: int, holder: str = "") -> list[Effect]:
        """Refuses every request of a client generation other than ``client`` from now on
        (the coordinator's grant; an older one is ignored), held by ``holder``.

        A run of an older client that is still computing can never commit: it is woken.
        """
        if client >= self.fence:
            self.fence, self.holder = client, holder
        woken = self.active_run < self.closed_below  # already told to stop
        if self.phase is Phase.RUNNING and self.active_client < self.fence and not woken:
            self.closed_below = self.active_run + 1
            return [Effect(Do.WAKE_RUN, run=self.active_run)]
        return []

    # ---- leases --------------------------------------------------------------------

    def tick(self, now: float) -> list[Effect]:
        """Acts on the leases that ran out by ``now``."""
        effects: list[Effect] = []
        if self.phase is Phase.AWAITING_COMMIT and now >= self.lease_until:
            self.lease_until = now + self.ask_interval_s
            effects.append(Effect(Do.RESOLVE_RUN, run=self.active_run, step=self.active_step))
        frozen = self.frozen
        if frozen is not None and now >= frozen.until:
            if frozen.prepared:
                self.frozen = replace(frozen, until=now + self.ask_interval_s)
                effects.append(Effect(Do.ASK_EPOCH, epoch=frozen.epoch))
            else:
                self.frozen = None
                effects.append(Effect(Do.DROP_STAGED, epoch=frozen.epoch))
        return effects

    # ---- epochs --------------------------------------------------------------------

    def freeze(self, epoch: int, lease_s: float, now: float) -> list[Effect]:
        """Holds the step boundary for an epoch change (call at IDLE).

        Raises:
            NotReady: a run is active, or the stage is prepared for another change.
            InvalidRequest: ``epoch`` is not newer than the current one, or a bad lease.
        """
        if not 0 < lease_s <= 3600:
            raise InvalidRequest(f"freeze lease must be in (0, 3600] seconds (got {lease_s})")
        if not self.epoch < epoch <= self.epoch + bounds.MAX_EPOCHS_AHEAD:
            raise InvalidRequest(
                f"cannot freeze stage {self.name} for epoch {epoch}: it is at epoch "
                f"{self.epoch} (a new epoch is at most {bounds.MAX_EPOCHS_AHEAD} ahead)"
            )
        if self.phase is not Phase.IDLE:
            raise NotReady(
                f"stage {self.name} is in run {self.active_run} ({self.phase.value}), "
                "not at a step boundary"
            )
        effects: list[Effect] = []
        old = self.frozen
        if old is not None and old.epoch != epoch:
            if old.prepared:
                raise NotReady(
                    f"stage {self.name} is prepared for epoch {old.epoch}: that change must "
                    f"commit or abort before epoch {epoch} can start"
                )
            effects.append(Effect(Do.DROP_STAGED, epoch=old.epoch))
        if old is not None and old.epoch == epoch:
            self.frozen = replace(old, until=now + lease_s)
        else:
            self.frozen = Frozen(epoch=epoch, until=now + lease_s)
        return effects

    def extend(self, epoch: int, lease_s: float, now: float) -> None:
        """Holds an unprepared freeze at least ``lease_s`` from ``now`` (a long transfer).

        Raises:
            NotReady: not frozen for ``epoch`` (the change was abandoned), or prepared.
        """
        self.check_frozen(epoch)
        assert self.frozen is not None
        self.frozen = replace(self.frozen, until=max(self.frozen.until, now + lease_s))

    def check_frozen(self, epoch: int) -> None:
        """Checks that ``epoch``'s change holds this stage and is not yet prepared.

        Raises:
            NotReady: it does not, or it is prepared already.
        """
        if self.frozen is None or self.frozen.epoch != epoch:
            raise NotReady(f"stage {self.name} is not frozen for epoch {epoch}")
        if self.frozen.prepared:
            raise NotReady(f"stage {self.name} is already prepared for epoch {epoch}")

    def prepared(
        self,
        epoch: int,
        committed_step: int,
        now: float,
        lease_s: float,
        rollback: bool = False,
        new_history: bool = False,
        joining: bool = False,
    ) -> list[Effect]:
        """Everything of ``epoch`` is staged here.

        Args:
            epoch: the change.
            committed_step: the step the new epoch starts from: the cut of a migration
                (which a stage of the chain must have committed), or the step restored.
            now: the time, for the lease.
            lease_s: how long to wait for the outcome before asking for it.
            rollback: the new epoch restores state (``committed_step`` may be older).
            new_history: the restored state comes from outside (older snapshots are void).
            joining: the stage holds no layers before this epoch (its step is taken over).

        Raises:
            NotReady: the change was abandoned meanwhile, or a migration's cut is not
                this stage's committed step.
        """
        frozen = self.frozen
        if frozen is None or frozen.epoch != epoch:
            raise NotReady(f"epoch {epoch} was abandoned on stage {self.name} during the prepare")
        if not (rollback or joining) and committed_step != self.committed_step:
            raise NotReady(
                f"the cut of epoch {epoch} is step {committed_step}, but stage {self.name} "
                f"committed step {self.committed_step}"
            )
        self.frozen = Frozen(
            epoch=epoch,
            until=now + lease_s,
            prepared=True,
            committed_step=committed_step,
            rollback=rollback,
            new_history=new_history,
            joining=joining,
        )
        return []

    def commit_epoch(self, epoch: int, snapshot_every: int | None = None) -> list[Effect]:
        """Makes the prepared ``epoch`` current.

        Raises:
            NotReady: nothing prepared for ``epoch`` (and it is not already current).
        """
        frozen = self.frozen
        if self.epoch == epoch and (frozen is None or frozen.epoch != epoch):
            return []  # committed already: a retried CommitEpoch
        if frozen is None or frozen.epoch != epoch or not frozen.prepared:
            raise NotReady(f"nothing is prepared for epoch {epoch} on stage {self.name}")
        joined = not self.has_job
        self.epoch, self.frozen, self.has_job = epoch, None, True
        if snapshot_every is not None:
            self.snapshot_every = snapshot_every
        step_changed = frozen.committed_step != self.committed_step
        self.committed_step = frozen.committed_step
        effects = [Effect(Do.INSTALL_STAGED, epoch=epoch)]
        if frozen.rollback or frozen.joining or joined or step_changed:
            self.committed_run = 0
            effects.append(Effect(Do.RESET_RUNS))
        if frozen.rollback:
            effects.append(
                Effect(
                    Do.PRUNE_SNAPSHOTS, step=frozen.committed_step, everything=frozen.new_history
                )
            )
        elif frozen.joining or joined:  # what it holds after the step is another history's
            effects.append(Effect(Do.PRUNE_SNAPSHOTS, step=frozen.committed_step))
        # Every epoch starts with a snapshot of its first step, copied along the new chain: a
        # stage that left took its copies of its predecessor's snapshots with it.
        effects.append(Effect(Do.SNAPSHOT, step=frozen.committed_step))
        return effects

    def abort_epoch(self, epoch: int) -> list[Effect]:
        """Abandons ``epoch``'s change here; the current epoch stays in force."""
        if self.frozen is not None and self.frozen.epoch == epoch:
            self.frozen = None
            return [Effect(Do.DROP_STAGED, epoch=epoch)]
        return []
