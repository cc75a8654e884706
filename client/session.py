"""A ``Pipeline``'s session with its job: setup and attach, the lease, the partition, recovery.

``Session`` is the base class of ``Pipeline`` that talks to the coordinator for it:

* **the job**: ``SetupJob`` starts the job or, with ``resume=True``, attaches to it (waiting
  out a dead predecessor's lease); ``init_state`` and ``load`` replace every layer's state in
  one ``BeginRestore``/``EndRestore`` transaction;
* **the lease**: renewed in the background every ``lease_s / 3`` seconds and released by
  ``close``; a pipeline that lost it is ``Fenced``;
* **the partition**: after a refusal (a rebalance), wait for a newer one and adopt it;
* **recovery**: report a failure, wait until the coordinator has replaced or dropped the dead
  stage, and notice a rollback (``Steps._catch_up`` then replays the mini-batches kept in
  ``_replay``).

``Pipeline`` (the public methods) derives from ``Steps`` (``client/steps.py``), which derives
from ``Session``: one object, whose state ``_open`` sets up and the classes declare. It logs
as ``elasticpipe.client.pipeline``: these are the Pipeline's events, on the logger
applications filter on.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elasticpipe.client import initial, streaming
from elasticpipe.client.driver import StageClients
from elasticpipe.client.initial import InitialWeights
from elasticpipe.client.repeats import Repeats, Waiting
from elasticpipe.client.replicas import Asked
from elasticpipe.errors import (
    CONTINUE_FROM_SAVE,
    CommitOutcomeUnknown,
    CoordinatorUnavailable,
    DeadlineExceeded,
    ElasticPipeError,
    Fenced,
    InvalidRequest,
    JobInUse,
    LayersLost,
    LoadForgotten,
    NotReady,
    PipelineClosed,
    Rebalancing,
    StagesMissing,
    StageUnavailable,
    StepAborted,
    TransferError,
)
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition
from elasticpipe.security import bounds
from elasticpipe.security.tls import TLS
from elasticpipe.training.job import JobConfig
from elasticpipe.transport.coordinators import Coordinators
from elasticpipe.v1 import coordinator_pb2, stage_pb2
from elasticpipe.wire import bundle
from elasticpipe.wire.structure import Value

if TYPE_CHECKING:
    from elasticpipe.client.pipeline import StepStats

log = get_logger("elasticpipe.client.pipeline")

RETRY_WAIT_S = 2.0  # how long one wait for a newer partition may take
# The first wait after a refused epoch; each further refusal of the same step doubles it, up
# to RETRY_WAIT_S. A refusal often comes from a stage that has not yet committed the epoch
# the client already holds (no newer one is coming): the step is tried again as soon as that
# stage may have caught up, not after a whole wait for an epoch that will not come.
FIRST_RETRY_WAIT_S = 0.02
SETUP_POLL_S = 5.0  # how long the coordinator waits for stages before the client reports
RESTORE_ATTEMPTS = 3  # loads streamed at most this often when coordinators forget them
RUN_ID_BITS = 40  # run ids are (client generation << 40) + n: they grow across clients
# Failures after which the step is retried once the job has recovered.
RECOVERABLE = (StageUnavailable, DeadlineExceeded, StepAborted, TransferError, NotReady)


class _LoadLost(Exception):
    """The coordinator no longer held load ``epoch`` (``forgotten``): ``_restore`` reads
    how its successor settled it."""

    def __init__(self, forgotten: LoadForgotten, epoch: int):
        super().__init__(str(forgotten))
        self.forgotten = forgotten
        self.epoch = epoch


@dataclass
class _Batch:
    xs: list[Value]
    ys: list[torch.Tensor]
    scales: list[float]


class _RolledBack(Exception):
    """The job was rolled back while a step waited: catch up from the step restored."""


class Session:
    """The coordinator side of a ``Pipeline``: its job, lease, partition and recovery."""

    # Set by Pipeline: its arguments, its last step, close().
    _job: JobConfig
    _num_stages: int
    _asked: Asked
    _resume: bool
    _step_timeout: float
    _setup_timeout: float
    _recovery_timeout: float
    _lease_s: float
    _init: InitialWeights | None
    _init_source: Any  # with ``resume``: the init_state, opened only if the job awaits it
    _last_step: StepStats
    _closed: bool

    def _open(self, coordinator: str | Sequence[str], tls: TLS | None) -> None:
        """Checks the coordinator's address and opens the channels; no job yet."""
        self._repeats = Repeats()
        self._tls = tls or TLS.from_env()
        self._coordinators = Coordinators(coordinator, self._tls)
        self.coordinator = str(self._coordinators)  # every address given, comma-separated
        self._clients = StageClients(tls=self._tls)
        self._failure: LayersLost | None = None  # the job failed, as RenewLease said
        self._partition: Partition | None = None  # replica 0's, with replicas
        self._layout: Layout | None = None  # every replica's (one: the partition)
        self._client = 0
        self._runs: Iterator[int] = itertools.count(1)
        self._step = 0  # committed on the stages (drops when the job is rolled back)
        self._done = 0  # steps train_step has returned (the script's view; never drops)
        self._restore_epoch = 0
        # Decisions on runs that some stage may not have heard yet (a lost CommitStep or
        # AbortStep): every RunStep carries them until a run reaches every stage.
        self._decisions: dict[int, stage_pb2.StepDecision] = {}
        self._generation = 0  # collectives: the run that opened the process groups in use
        self._replay: dict[int, _Batch] = {}
        self._safe_step = 0
        self._lease_lost = False
        self._profiled = True
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        # What epoch changes cost the training loop (epoch -> seconds), until a lease
        # renewal reports them; ``_renew_now`` sends them without waiting out the interval.
        self._loop_pauses: dict[int, float] = {}
        self._pauses_lock = threading.Lock()
        self._renew_now = threading.Event()
        self._num_layers = 0

    def _check_open(self) -> None:
        """Raises ``PipelineClosed`` once ``close`` was called: the job is no longer ours."""
        if self._closed:
            held = self._partition
            what = f"it released job {held.job_id}" if held else "it never held a job"
            raise PipelineClosed(
                f"this Pipeline is closed ({what}); make a new Pipeline to train on "
                "(resume=True attaches to the running job)"
            )

    def _coordinator_call(self, method: str, request: Any, timeout: float) -> Any:
        return self._coordinators.call(method, request, timeout)

    # ---- job, lease and partition --------------------------------------------------------

    def _ensure_job(self, sample: Value | None) -> Partition:
        self._check_open()
        if self._partition is not None:
            if self._init is not None:  # its streaming failed: no step before it is in
                self._apply_init()
            return self._partition
        spec = self._job.to_proto()
        if sample is not None:
            bundle.set_sample(spec, sample)
        request = coordinator_pb2.SetupJobRequest(
            job=spec,
            num_stages=self._num_stages,
            wait_s=min(self._setup_timeout, SETUP_POLL_S),
            resume=self._resume,
            lease_s=self._lease_s,
            client_name=f"{socket.gethostname()}:{os.getpid()}",
            # The same setup sent again after a failover gets what it set up, not JobInUse.
            request_id=secrets.token_hex(8),
            replica_stages=self._asked.replica_stages,
            auto_replicas=self._asked.auto,
        )
        deadline = time.monotonic() + self._setup_timeout
        lease_wait = Waiting("waiting_for_lease")
        while True:
            try:
                reply = self._coordinator_call(
                    "SetupJob", request, timeout=self._setup_timeout + 120.0
                )
                break
            except (StageUnavailable, Rebalancing) as exc:
                # Attaching while a stage died: the coordinator recovers it first.
                if time.monotonic() > deadline:
                    raise
                log.info("setup_retried", reason=str(exc))
                time.sleep(0.5)
            except JobInUse as exc:
                # A restarted script resumes once its dead predecessor's lease runs out.
                if not self._resume or time.monotonic() > deadline:
                    raise
                lease_wait.still(reason=str(exc))
                time.sleep(1.0)
            except StagesMissing as exc:
                if time.monotonic() > deadline:
                    raise
                waited = time.monotonic() - (deadline - self._setup_timeout)
                # Quiet at first (stages are often still starting), then a warning.
                (log.warning if waited > 10 else log.info)("waiting_for_stages", why=str(exc))
            except CoordinatorUnavailable as exc:
                raise CoordinatorUnavailable(
                    f"cannot reach the coordinator at {self.coordinator}: is it running, and "
                    f"is that its --listen/--advertise address? ({exc})"
                ) from exc
        self._num_layers = reply.num_layers
        beyond = [i for i in self._job.recompute if i >= reply.num_layers]
        if beyond:
            raise InvalidRequest(
                f"recompute names layers {beyond}, but the model has {reply.num_layers} "
                f"(0 to {reply.num_layers - 1})"
            )
        self._client = reply.client
        self._runs = itertools.count((reply.client << RUN_ID_BITS) + 1)
        self._step = self._done = reply.committed_step
        self._safe_step = reply.safe_step
        self._profiled = reply.profiled
        self._adopt(reply.partition)
        partition = self._partition
        assert partition is not None
        try:
            self._choose_weights(reply, partition.job_id)
        except BaseException:  # refused: the lease goes back, and the next call sets up again
            self._release_lease()
            self._stop.clear()
            self._renew_now.clear()
            self._partition = None
            raise
        self._restore_epoch = partition.restore_epoch
        self._renewer = threading.Thread(target=self._renew_loop, name="lease", daemon=True)
        self._renewer.start()
        weights = "resumed" if reply.resumed else "seed"
        if self._init is not None:
            self._apply_init()  # an epoch change of its own: the start's epoch, then this one
            weights = "init_state"
        partition = self._partition
        assert partition is not None
        log.info(
            "pipeline_attached" if reply.resumed else "pipeline_ready",
            job=partition.job_id,
            model=self._job.model,
            layers=self._num_layers,
            boundaries=list(partition.boundaries),
            epoch=partition.epoch,  # the one in force now (after init_state's load)
            stages=partition.num_stages,
            step=self._step,
            weights=weights,
        )
        return partition

    def _choose_weights(self, reply: coordinator_pb2.SetupJobResponse, job_id: str) -> None:
        """Whether this script streams its ``init_state``: for a new job, and for one
        resumed that still awaits it (the script that set it up died before it streamed);
        a job that has its weights (a step or a load committed) keeps them.

        Raises:
            InvalidRequest: the job awaits its initial weights and this script has none
                (or they do not fit the model).
        """
        if (reply.resumed and not reply.awaits_weights) or reply.committed_step:
            if self._init is not None:
                self._init.close()
            self._init = None
        elif reply.awaits_weights and self._init is None:
            if self._init_source is None:
                raise InvalidRequest(
                    f"job {job_id} still waits for its initial weights: the script that set "
                    "it up died before its init_state streamed; resume with init_state"
                )
            self._init = initial.check(self._job, self._init_source)

    def _apply_init(self) -> None:
        """Streams ``init_state`` to the stages (at job setup; again after a failure)."""
        init = self._init
        assert init is not None
        self._restore(0, init.layer_state, "")
        self._init = None
        init.close()

    def _profile(self, sample: Value) -> None:
        """Sends the first micro-batch for profiling if the job was set up without one
        (``load`` or ``state_dict`` before the first step): the partition then follows the
        measured costs and speeds."""
        if self._profiled:
            return
        partition = self._partition
        assert partition is not None
        request = coordinator_pb2.ProfileJobRequest(job_id=partition.job_id, client=self._client)
        bundle.set_sample(request, sample)
        reply = self._coordinator_call("ProfileJob", request, timeout=self._setup_timeout + 120.0)
        self._profiled = True
        self._adopt(reply)

    def _loop_paused(self, epoch: int, pause_s: float) -> None:
        """The training loop stood still ``pause_s`` for the change to ``epoch``: tell the
        coordinator (its epoch history and metrics) at once."""
        with self._pauses_lock:
            self._loop_pauses[epoch] = round(pause_s, 6)
            while len(self._loop_pauses) > bounds.MAX_LOOP_PAUSES:  # the coordinator is away
                del self._loop_pauses[min(self._loop_pauses)]
        self._renew_now.set()

    def _lease_request(
        self, partition: Partition, release: bool
    ) -> tuple[coordinator_pb2.LeaseRequest, list[int]]:
        """A renewal (or the release) of the lease with what it reports, and the epochs of
        the loop pauses it carries."""
        with self._pauses_lock:
            pauses = dict(self._loop_pauses)
        request = coordinator_pb2.LeaseRequest(
            job_id=partition.job_id,
            client=self._client,
            release=release,
            last_step=self._last_step.step,
            efficiency=self._last_step.efficiency,
            loop_pauses=[coordinator_pb2.LoopPause(epoch=e, pause_s=p) for e, p in pauses.items()],
        )
        return request, list(pauses)

    def _loop_pauses_sent(self, epochs: list[int]) -> None:
        with self._pauses_lock:
            for epoch in epochs:
                self._loop_pauses.pop(epoch, None)

    def _renew_loop(self) -> None:
        interval = self._lease_s / 3
        while not self._stop.is_set():
            self._renew_now.wait(interval)
            self._renew_now.clear()
            partition = self._partition
            if partition is None or self._stop.is_set():
                continue
            request, pauses = self._lease_request(partition, release=False)
            try:
                reply = self._coordinator_call("RenewLease", request, timeout=interval)
            except LayersLost as exc:  # the job failed (its stages may still run): stop
                self._failure = exc
                log.error("job_failed", job=partition.job_id, error=str(exc))
                return
            except ElasticPipeError as exc:
                log.debug("lease_not_renewed", error=str(exc))
                continue
            self._loop_pauses_sent(pauses)
            if not reply.held:
                self._lease_lost = True
                log.warning("lease_lost", job=partition.job_id)
                return
            self._safe_step = max(self._safe_step, reply.safe_step)

    def _adopt(self, message: coordinator_pb2.Partition) -> None:
        """Takes the coordinator's partition (with every replica, if several)."""
        layout = Layout.from_proto(message, self._job.micro_batches)
        self._partition, self._layout = layout.replicas[0].validate(), layout

    def _refresh(
        self, deadline: float, since: float | None = None, wait: float = RETRY_WAIT_S
    ) -> Partition:
        """Waits (until ``deadline``, ``wait`` at most) for a partition newer than ours and
        adopts it; keeps ours if none comes in that time."""
        old = self._partition
        assert old is not None
        started = time.monotonic()
        wait = min(wait, RETRY_WAIT_S, max(0.0, deadline - started))
        reply = self._coordinator_call(
            "GetPartition",
            coordinator_pb2.GetPartitionRequest(newer_than=old.epoch, timeout_s=wait),
            timeout=wait + 10.0,
        )
        self._adopt(reply)
        new = self._partition
        assert new is not None
        if new.epoch != old.epoch:
            log.info(
                "partition_changed",
                old_epoch=old.epoch,
                new_epoch=new.epoch,
                old=list(old.boundaries),
                new=list(new.boundaries),
                pause_s=round(time.monotonic() - (since or started), 3),
            )
        if new.restore_epoch > self._restore_epoch:
            self._rolled_back(new)
        return new

    def _rolled_back(self, partition: Partition) -> None:
        """The job was rolled back to ``partition.restored_step``: replay from there."""
        self._restore_epoch = partition.restore_epoch
        restored = partition.restored_step
        missing = [s for s in range(restored + 1, self._done + 1) if s not in self._replay]
        if missing:
            raise LayersLost(
                f"the job was rolled back to step {restored}, but this pipeline no longer "
                f"holds the mini-batches of steps {missing[:5]}... to replay; "
                f"{CONTINUE_FROM_SAVE}"
            )
        log.warning(
            "pipeline_rolled_back",
            to_step=restored,
            from_step=self._step,
            replay=max(0, self._done - restored),
        )
        # Ahead of us only after a checkpoint load whose answer this client missed.
        self._done = max(self._done, restored)
        self._step = restored
        self._safe_step = min(self._safe_step, restored)
        self._decisions.clear()

    def _check_lease(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._lease_lost:
            raise Fenced(
                "this pipeline lost the job's lease (another client took the job over, or "
                "this one stopped renewing it for too long)"
            )

    def _release_lease(self) -> None:
        """Stops renewing the lease and gives it back (``close``)."""
        self._stop.set()
        self._renew_now.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if self._partition is not None and not self._lease_lost:
            request, _ = self._lease_request(self._partition, release=True)
            try:
                self._coordinator_call("RenewLease", request, timeout=5.0)
            except ElasticPipeError as exc:
                log.debug("lease_not_released", error=str(exc))

    # ---- recovery ----------------------------------------------------------------------

    def _report_failure(self, exc: ElasticPipeError) -> list[str]:
        """Tells the coordinator; returns the stages it declared dead."""
        partition = self._partition
        assert partition is not None
        try:
            ack = self._coordinator_call(
                "ReportFailure",
                coordinator_pb2.FailureReport(
                    job_id=partition.job_id,
                    epoch=partition.epoch,
                    suspects=list(partition.addresses),
                    error=str(exc)[:1000],
                ),
                timeout=15.0,
            )
        except CoordinatorUnavailable as unreachable:
            self._repeats.warn("failure_not_reported", str(unreachable))
            return []
        return list(ack.dead)

    def _recover(self, exc: ElasticPipeError, deadline: float) -> None:
        """After a failed attempt: reports it and waits for the job to recover."""
        if isinstance(exc, Fenced | LayersLost | PipelineClosed):
            raise exc
        if time.monotonic() > deadline:
            raise exc
        dead = self._report_failure(exc)
        repeats = self._repeats.warn("step_failed", str(exc)[:300], step=self._step + 1, dead=dead)
        partition = self._partition
        assert partition is not None
        if not dead:  # nobody died: a transient failure, try again (backing off if it stays)
            time.sleep(min(2.0, 0.2 * 2 ** min(repeats - 1, 4)))
            with contextlib.suppress(CoordinatorUnavailable):
                self._refresh(time.monotonic() + 0.1)
            return
        while self._partition is not None and self._partition.epoch == partition.epoch:
            if time.monotonic() > deadline:
                raise exc
            try:
                self._refresh(deadline)
            except CoordinatorUnavailable:
                time.sleep(0.5)

    # ---- restoring every layer (init_state, load) ---------------------------------------

    def _restore(self, step: int, state_of: Callable[[int], Any], overrides_json: str) -> None:
        """Streams every layer's state (``state_of(layer)``, read one at a time) to its
        owner and makes it take effect at ``step`` on every stage or on none.

        A load that its coordinator lost midway (a standby took over, or it restarted) was
        settled by its successor from the store: kept if it reached its commit point, else
        undone and streamed again (``RESTORE_ATTEMPTS`` in all)."""
        for attempt in itertools.count(1):
            try:
                new = self._restore_once(step, state_of, overrides_json)
                break
            except _LoadLost as exc:
                settled = Layout.from_proto(
                    self._coordinator_call(
                        "GetPartition", coordinator_pb2.GetPartitionRequest(), timeout=30.0
                    ),
                    self._job.micro_batches,
                )
                first = settled.replicas[0]
                if first.restore_epoch == exc.epoch and first.restored_step == step:
                    log.info("load_settled_by_coordinator", epoch=exc.epoch, step=step)
                    new = settled
                    break
                if attempt >= RESTORE_ATTEMPTS:
                    raise exc.forgotten from None
                log.warning("load_streamed_again", epoch=exc.epoch, attempt=attempt + 1)
        self._adopt(new.to_proto())
        self._restore_epoch = new.replicas[0].restore_epoch
        self._step = self._done = step
        self._safe_step = step
        self._decisions.clear()
        self._replay.clear()

    def _restore_once(
        self, step: int, state_of: Callable[[int], Any], overrides_json: str
    ) -> Layout:
        """One load: ``BeginRestore``, the layers streamed to their owners (every replica's
        owner of a layer gets it), ``EndRestore``.

        Raises:
            _LoadLost: the coordinator no longer held the load (see ``_restore``).
        """
        partition = self._partition
        assert partition is not None
        self._check_lease()
        begun = self._coordinator_call(
            "BeginRestore",
            coordinator_pb2.RestoreBeginRequest(job_id=partition.job_id, client=self._client),
            timeout=120.0,
        )
        owners = Layout.from_proto(begun.partition, self._job.micro_batches)
        ended = False
        try:
            streaming.stream(
                self._clients,
                [
                    (c.addresses[s], c.layers_of(s))
                    for c in owners.replicas
                    for s in range(c.num_stages)
                ],
                state_of,
                streaming.Load(begun.epoch, step, overrides_json),
                self._step_timeout,
            )
            ended = True  # whatever EndRestore answers, the coordinator decided the load
            reply = self._end_restore(partition.job_id, begun.epoch, step, commit=True)
        except BaseException as failure:  # an interrupt too: the stages must not stay frozen
            if not ended:  # streaming failed: abandon the load (unless it is gone already)
                try:
                    self._end_restore(partition.job_id, begun.epoch, step, commit=False)
                except _LoadLost:
                    if isinstance(failure, ElasticPipeError):
                        raise  # settled by another coordinator: ``_restore`` reads how
                except ElasticPipeError as exc:
                    log.warning("load_not_abandoned", error=str(exc))
            raise
        return Layout.from_proto(reply, self._job.micro_batches)

    def _end_restore(self, job_id: str, epoch: int, step: int, commit: bool) -> Any:
        """Commits or abandons load ``epoch``; ``_LoadLost`` if the coordinator forgot it.

        A commit whose coordinator went away mid-call is sent again until one answers
        (within ``recovery_timeout``): the one that settled the load says it forgot it, and
        the partition then tells whether the load took effect."""
        request = coordinator_pb2.RestoreEndRequest(
            job_id=job_id, epoch=epoch, step=step, commit=commit
        )
        deadline = time.monotonic() + self._recovery_timeout
        while True:
            try:
                return self._coordinator_call(
                    "EndRestore", request, timeout=300.0 if commit else 60.0
                )
            except LoadForgotten as exc:
                raise _LoadLost(exc, epoch) from exc
            except (CoordinatorUnavailable, CommitOutcomeUnknown) as exc:
                if not commit or time.monotonic() >= deadline:
                    raise
                log.warning("load_outcome_unknown", epoch=epoch, error=str(exc)[:200])
                time.sleep(0.5)
