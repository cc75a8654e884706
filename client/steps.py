"""A ``Pipeline``'s steps: runs until the stages accept one, the commit, replays.

``Steps`` is the layer of ``Pipeline`` between its public methods and its ``Session``:

* ``_run`` runs one attempt after another (``driver.run``) until the stages accept the
  partition: a refused epoch (a rebalance) waits for the newer one and runs again;
* ``_train_one`` commits a run (``driver.commit``) with the clipping its gradient norms
  decide (``clipping``: max_grad_norm, fp16's skipped steps) and keeps each decision until
  a later run has told every stage (a stage that missed a ``CommitStep`` learns it then);
* ``_catch_up`` commits steps up to a target: after a rollback it first replays the
  mini-batches kept since the snapshot restored, recovering from failures on the way.

It logs as ``elasticpipe.client.pipeline``, as ``Session`` does.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

from elasticpipe.client import driver, replicas
from elasticpipe.client.driver import CommitIncomplete
from elasticpipe.client.session import (
    FIRST_RETRY_WAIT_S,
    RECOVERABLE,
    RETRY_WAIT_S,
    Session,
    _Batch,
    _RolledBack,
)
from elasticpipe.errors import CoordinatorUnavailable, ElasticPipeError, Rebalancing, StaleEpoch
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition
from elasticpipe.training import clipping, loss_scaling
from elasticpipe.v1 import stage_pb2

log = get_logger("elasticpipe.client.pipeline")

MAX_DECISIONS = 8
# Tests only: "before_commit:STEP" (or "after_commit:STEP") blocks the client there, so a
# test can kill it exactly between RunStep and CommitStep (or after a partial commit).
ENV_TEST_PAUSE = "ELASTICPIPE_TEST_PAUSE"


class Steps(Session):
    """Runs, commits and replays a ``Pipeline``'s steps on the stages."""

    # Set by Pipeline.__init__.
    _rebalance_timeout: float
    _recovery_timeout: float
    _last_reports: list[stage_pb2.StepReport]

    def _run(
        self, step: int, batch: _Batch, train: bool
    ) -> tuple[list[stage_pb2.StepReport], Partition | Layout, int, bytes, int]:
        """Runs one attempt after another until the stages accept the partition.

        A training step of a job of several replicas runs on every replica at once (each
        its share of the micro-batches); inference runs on replica 0.

        Returns:
            Reports (with replicas: every replica's, replica after replica, each in chain
            order), the partition or layout run on, the run id and its secret, and the
            attempts it took.
        """
        partition = self._ensure_job(batch.xs[0])
        deadline = time.monotonic() + self._rebalance_timeout
        refused_at: float | None = None  # the start of the first attempt refused
        refused_epoch = partition.epoch
        refusals = 0
        for attempts in itertools.count(1):
            self._check_lease()
            run_id, secret = next(self._runs), driver.new_secret()
            self._generation = self._generation or run_id  # (new after a failed run)
            attempt_at = time.monotonic()
            layout = self._layout
            ran: Partition | Layout = partition
            try:
                if train and layout is not None and len(layout.replicas) > 1:
                    ran = layout
                    replicas.check_batch(layout, len(batch.xs))  # the layout may be new
                    reports = [
                        r
                        for chain in driver.run_replicas(
                            self._clients,
                            layout,
                            run_id,
                            step,
                            batch.xs,
                            batch.ys,
                            batch.scales,
                            self._job.schedule,
                            self._step_timeout,
                            self._client,
                            list(self._decisions.values()),
                            secret=secret,
                            generation=self._generation,
                        )
                        for r in chain
                    ]
                else:
                    reports = driver.run(
                        self._clients,
                        partition,
                        run_id,
                        step,
                        batch.xs,
                        batch.ys if train else None,
                        batch.scales,
                        self._job.schedule,
                        self._step_timeout,
                        self._client,
                        list(self._decisions.values()),
                        secret=secret,
                    )
                self._decisions.clear()  # every stage heard every earlier decision
                if refused_at is not None and partition.epoch != refused_epoch:
                    self._loop_paused(partition.epoch, attempt_at - refused_at)
                return reports, ran, run_id, secret, attempts
            except (StaleEpoch, Rebalancing) as exc:
                self._generation = 0  # the stages may have given up on the process groups
                if train:
                    self._decided(run_id, step, commit=False)
                if time.monotonic() > deadline:
                    raise
                if refused_at is None:
                    refused_at, refused_epoch = attempt_at, partition.epoch
                refusals += 1
                log.info("step_retried", step=step, epoch=partition.epoch, reason=str(exc))
                wait = min(RETRY_WAIT_S, FIRST_RETRY_WAIT_S * 2 ** min(refusals - 1, 8))
                try:
                    partition = self._refresh(deadline, refused_at, wait)
                except CoordinatorUnavailable:
                    # The stages may be frozen by a coordinator that died: its restart (or
                    # their freeze lease) releases them; training needs no coordinator.
                    time.sleep(0.5)
                if self._step != (step - 1 if train else self._done):
                    raise _RolledBack() from exc  # replay first
            except ElasticPipeError:
                self._generation = 0
                if train:
                    self._decided(run_id, step, commit=False)
                raise
            except BaseException:  # an interrupt: the stages may have given up on them too
                self._generation = 0
                raise
        raise AssertionError("unreachable")

    def _decided(
        self, run: int, step: int, commit: bool, clip: clipping.GradClip = clipping.NO_CLIP
    ) -> None:
        """Keeps a decision until a later run has reached every stage."""
        self._decisions[run] = stage_pb2.StepDecision(
            run=run, step=step, commit=commit, clip=clip.to_proto()
        )
        while len(self._decisions) > MAX_DECISIONS:  # the oldest is long settled
            del self._decisions[min(self._decisions)]

    def _train_one(self, step: int, batch: _Batch) -> tuple[float, list[stage_pb2.StepReport], int]:
        """Runs and commits one step; returns its loss, reports and attempts."""
        reports, partition, run_id, _, attempts = self._run(step, batch, train=True)
        self._test_pause("before_commit", step)
        first = self._replica_0(reports)  # every replica holds the same reduced gradients
        norm, clip = self._clip(first)
        clipping.warn_if_skipped(log, step, norm, clip, loss_scaling.reported(first))
        self._decided(run_id, step, commit=True, clip=clip)
        try:
            driver.commit(self._clients, partition, run_id, step, self._client, clip)
        except CommitIncomplete as exc:
            # The decision is commit: stages that missed it learn it from the next run's
            # ``previous``, or are replaced by recovery if they are dead.
            log.warning("commit_incomplete", step=step, stages=sorted(exc.failed), error=str(exc))
            self._step = step
            self._test_pause("after_commit", step)
            self._report_failure(exc)
            return self._loss(reports, partition), reports, attempts
        self._step = step
        self._test_pause("after_commit", step)
        return self._loss(reports, partition), reports, attempts

    def _replica_0(self, reports: list[stage_pb2.StepReport]) -> list[stage_pb2.StepReport]:
        """Replica 0's reports of a run's (all of them with one pipeline)."""
        partition = self._partition
        return reports[: partition.num_stages] if partition is not None else reports

    @staticmethod
    def _loss(reports: list[stage_pb2.StepReport], ran: Partition | Layout) -> float:
        """The step's loss: every micro-batch's, in global micro-batch order (each
        replica's last stage reports its share's), summed in that order."""
        chains = ran.replicas if isinstance(ran, Layout) else (ran,)
        ends = list(itertools.accumulate(p.num_stages for p in chains))
        return float(sum(x for end in ends for x in reports[end - 1].losses))

    def _clip(self, reports: list[stage_pb2.StepReport]) -> tuple[float | None, clipping.GradClip]:
        """The global gradient norm of a run and the clipping its commit applies."""
        if not self._job.reports_grad_norm:
            return None, clipping.NO_CLIP
        sq_norms = [r.grad_sq_norm for r in reports]
        return clipping.decide(sq_norms, self._job.max_grad_norm or None)

    def _test_pause(self, point: str, step: int) -> None:
        if os.environ.get(ENV_TEST_PAUSE) == f"{point}:{step}":
            log.warning("paused_at", point=point, step=step)
            threading.Event().wait()

    def _catch_up(self, target: int, batch: _Batch | None) -> tuple[float, int, int]:
        """Commits steps until ``target``: replays kept mini-batches after a rollback,
        then ``batch`` as step ``target``. Survives failures until ``recovery_timeout``.

        Returns:
            The loss of step ``target``, the attempts it took, and the steps replayed.
        """
        deadline = time.monotonic() + self._recovery_timeout
        attempts = replayed = 0
        loss = float("nan")
        while self._step < target:
            step = self._step + 1
            current = batch if step == target and batch is not None else self._replay[step]
            try:
                loss, reports, tries = self._train_one(step, current)
                attempts += tries
            except _RolledBack:
                continue
            except RECOVERABLE as exc:
                self._recover(exc, deadline)
                continue
            if step < target:
                replayed += 1
            else:
                self._last_reports = reports
        return loss, attempts, replayed
