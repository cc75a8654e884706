"""Checkpoint loads: a checkpoint (or ``init_state``) streamed in by the job's client,
taking effect on every stage at once, as one epoch change, or on none.

``begin_restore`` freezes every stage under a lease of ``RESTORE_LEASE_S``; the client
streams each layer's state to its owner; ``end_restore`` commits the load (prepare, the
store's commit point, commit) or abandons it. A load whose client lost the job, or that
ran past its lease, is abandoned by the coordinator (``expire_restore``), and a later
``EndRestore`` for it is told why.
"""

from __future__ import annotations

import time
from dataclasses import replace

from elasticpipe.coordinator import epochs, replicas
from elasticpipe.coordinator.epochs import Change
from elasticpipe.coordinator.leases import Leases
from elasticpipe.coordinator.state import Cluster
from elasticpipe.errors import (
    CommitOutcomeUnknown,
    DeadlineExceeded,
    ElasticPipeError,
    LoadForgotten,
    NotReady,
)
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition
from elasticpipe.training.job import JobConfig

__all__ = ["RESTORE_LEASE_S", "Loads"]

log = get_logger("elasticpipe.coordinator.jobs")

RESTORE_LEASE_S = 600.0
ABANDONED_KEPT = 16  # abandoned loads whose reason an EndRestore can still be told


class Loads(Leases):
    """Checkpoint loads, for the client that holds the job (its lease: ``Leases``)."""

    def __init__(self, cluster: Cluster, pause: epochs.Pause = epochs._no_pause):
        super().__init__(cluster)
        self._pause = pause
        self._restoring: tuple[Change, float, int] | None = None  # change, deadline, client
        self._abandoned: dict[int, str] = {}  # loads abandoned here, by epoch: why

    def awaits_weights(self, job: JobConfig, step: int) -> bool:
        """See ``epochs.awaits_weights``."""
        return epochs.awaits_weights(self.c, job, step)

    def wait_for_copies(self, partition: Partition, job: JobConfig, step: int) -> bool:
        """Waits until the snapshot of ``step`` has its copies everywhere (see
        ``epochs.wait_for_copies``)."""
        return epochs.wait_for_copies(self.c, partition, job, step)

    def begin_restore(self, job_id: str, client: int) -> tuple[int, Partition | Layout]:
        """Freezes every stage for a checkpoint load; the client then streams the layers.

        Returns:
            The load's epoch, and the partition (a job of several replicas: the layout)
            whose owners receive the layers: every replica's owner of a layer gets it.
        """
        with self.c.move_lock:
            _, partition = self._check_holder(job_id, client)
            epochs.check_no_change_in_progress(self.c)
            epoch = self.c.store.reserve_epoch()
            layout = self.c.layout
            change = Change(
                "restore",
                "checkpoint load",
                partition,
                partition.evolve(epoch=epoch, restore_epoch=epoch),
                rollback_step=0,
                restored_by_client=True,
                old_layout=layout,
                new_layout=_restored(layout, epoch=epoch, restore_epoch=epoch),
            )
            try:
                epochs.freeze(self.c, change, lease_s=RESTORE_LEASE_S)
            except ElasticPipeError as exc:
                epochs.abort(self.c, epoch, change.involved, str(exc))
                epochs.record_abandoned(self.c, change, str(exc))
                raise
            self._restoring = (change, time.monotonic() + RESTORE_LEASE_S, client)
        return epoch, layout or partition

    def end_restore(self, job_id: str, epoch: int, step: int, commit: bool) -> Partition | Layout:
        """Makes a streamed checkpoint take effect on every stage, or on none.

        Raises:
            LoadForgotten: no load of ``epoch`` is in progress here: another coordinator (a
                new leader, or this one before a restart) settled it from the store.
            DeadlineExceeded: this coordinator abandoned the load (it ran past its lease,
                or its client lost the job's lease); the message says which.
            ElasticPipeError: a stage did not hold every layer it owns (nothing changed).
        """
        with self.c.move_lock:
            restoring = self._restoring
            if restoring is None or restoring[0].new.epoch != epoch:
                if epoch in self._abandoned:
                    raise DeadlineExceeded(
                        f"checkpoint load of epoch {epoch} was abandoned: {self._abandoned[epoch]}"
                    )
                raise LoadForgotten(f"no checkpoint load of epoch {epoch} is in progress")
            change = restoring[0]
            job, _ = self.c.require_job()
            if job.job_id != job_id:  # (the load in progress stays)
                raise NotReady(f"job {job_id} is not the running job {job.job_id}")
            self._restoring = None
            if not commit:
                epochs.abort(self.c, epoch, change.involved, "the client abandoned the load")
                epochs.record_abandoned(self.c, change, "the client abandoned the load")
                return change.old_layout or change.old
            new = change.new.evolve(restored_step=step)
            initial = self.awaits_weights(job, step)
            change = replace(
                change,
                new=new,
                new_layout=_restored(change.new_layout, restored_step=step),
                rollback_step=step,
            )
            try:
                received = epochs.prepare(self.c, job, change, step)
                what = (
                    "initial weights (init_state) loaded"
                    if initial
                    else f"checkpoint of step {step} loaded"
                )
                loaded = epochs.MoveResult(
                    layers_moved=new.num_layers,
                    bytes_moved=received,
                    pause_s=0.0,
                    committed_step=step,
                )
                row = epochs.history_row(
                    self.c,
                    new,
                    "restore",
                    f"{what}: {new.num_layers} layers, {received} bytes streamed by the client",
                    moved=loaded,
                    restored_step=step,
                    extra=replicas.layout_record(self.c, change.new_layout)
                    if change.new_layout
                    else None,
                )
                self._pause("before_commit_point")
                self.c.store.commit_change(new, change.record("committed"), row)
            except CommitOutcomeUnknown as exc:  # perhaps committed: undoing could split them
                log.error("load_outcome_unknown", epoch=epoch, error=str(exc)[:300])
                raise
            except ElasticPipeError as exc:
                epochs.abort(self.c, epoch, change.involved, str(exc))
                epochs.record_abandoned(self.c, change, str(exc))
                raise
            self._pause("after_commit_point")
            self.c.adopt(new, change.replicated)
            epochs.commit(self.c, change)
            for chain in change.new_layout.replicas if change.new_layout else (new,):
                self.wait_for_copies(chain, job, step)
        log.info(
            "initial_weights_loaded" if initial else "checkpoint_loaded",
            job=job_id,
            step=step,
            epoch=epoch,
            bytes=received,
        )
        return change.new_layout or new

    def expire_restore(self) -> None:
        """Abandons a load whose client went silent (its lease is gone) or that ran past
        ``RESTORE_LEASE_S``."""
        restoring = self._restoring
        if restoring is None or not self._load_stale(restoring):
            return
        with self.c.move_lock:
            if self._restoring is restoring:
                self.abandon_stale_load()

    def _load_stale(self, restoring: tuple[Change, float, int]) -> bool:
        lease = self.lease()
        client_gone = lease is None or lease.client != restoring[2]
        return client_gone or time.monotonic() >= restoring[1]

    def abandon_stale_load(self) -> bool:
        """Aborts the checkpoint load in progress if its client no longer holds the job
        (or it ran past its lease), and records it as abandoned. Call under ``move_lock``.

        Returns:
            Whether no load is in progress any more.
        """
        restoring = self._restoring
        if restoring is None:
            return True
        if not self._load_stale(restoring):
            return False
        self._restoring = None
        change = restoring[0]
        why = (
            f"it ran past its {RESTORE_LEASE_S:.0f} s lease"
            if time.monotonic() >= restoring[1]
            else "the client went silent during the load (it no longer holds the job)"
        )
        self._abandoned[change.new.epoch] = why
        while len(self._abandoned) > ABANDONED_KEPT:
            del self._abandoned[min(self._abandoned)]
        log.warning("checkpoint_load_abandoned", epoch=change.new.epoch, why=why)
        epochs.abort(self.c, change.new.epoch, change.involved, why)
        epochs.record_abandoned(self.c, change, why)
        return True


def _restored(layout: Layout | None, **changes: int) -> Layout | None:
    """A job of several replicas: its layout with ``changes`` made to every replica's
    partition (the load's epoch, its restored step); None for one pipeline."""
    if layout is None:
        return None
    return Layout(tuple(p.evolve(**changes) for p in layout.replicas), layout.shares)
