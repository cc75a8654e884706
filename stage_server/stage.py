"""One stage's domain logic: its job, layers, runs and snapshot copies, behind one lock.

The rules of the step and epoch protocols live in ``protocol.StepMachine``; this class
feeds it events, carries out the effects it returns (optimizer steps, mailbox closes,
installs, snapshots), runs the ops of a step (``executor``), and moves layer state
(``epochs``, ``copies``). A ticker thread drives the machine's leases and asks the
coordinator whatever a lease that ran out leaves undecided. The epoch change and restore
are a base class's (``epochs.EpochChanges``), and so are the snapshots it takes and the
copies it keeps (``copies.SnapshotCopies``); its configuration is ``config.StageConfig``
(importable from here too). A replica's gradient reduction runs from ``run_step`` between
the ops and the report (``reducing``).

Longer than 600 lines: the run and the data it admits share the one lock and the
machine; the snapshot copies (``copies.SnapshotCopies``) and the epoch change
(``epochs.EpochChanges``) left as base classes, and the next piece to leave is the data's
admission (``admit``, ``deliver``).

``torch._dynamo`` is imported here, when the stage starts: torch imports it the first time
any optimizer is made, and that took 0.9 s of a job's set-up (``Describe`` checks the
job's optimizer) instead of the stage's start.
"""

from __future__ import annotations

import hmac
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch._dynamo  # see the module's docstring
from torch import nn

from elasticpipe import models
from elasticpipe.errors import (
    ElasticPipeError,
    InvalidRequest,
    NotReady,
    PermissionDenied,
    StageUnavailable,
    StepAborted,
)
from elasticpipe.logs import get_logger
from elasticpipe.observe.metrics import StageMetrics, StageView
from elasticpipe.partition import Placement
from elasticpipe.security import authz, bounds
from elasticpipe.stage_server import (
    collectives,
    devicepath,
    devicetime,
    measures,
    memory,
    reducing,
    reduction,
)
from elasticpipe.stage_server.config import StageConfig
from elasticpipe.stage_server.copies import SnapshotCopies
from elasticpipe.stage_server.deferral import Deferral
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.epochs import EpochChanges
from elasticpipe.stage_server.executor import RunContext, StashMeter, StepResult, execute
from elasticpipe.stage_server.faults import Fault, Faults
from elasticpipe.stage_server.inline import Inline
from elasticpipe.stage_server.inline import deliver as deliver_inline
from elasticpipe.stage_server.layers import LayerSlice
from elasticpipe.stage_server.links import Link
from elasticpipe.stage_server.mailbox import Mailbox, Reservation, Slot
from elasticpipe.stage_server.profiling import profile_layers
from elasticpipe.stage_server.protocol import Decision, Do, Effect, Phase, RunState, StepMachine
from elasticpipe.stage_server.slicestate import LayerTiming
from elasticpipe.stage_server.snapshots import SnapshotStore, Snapshotter
from elasticpipe.stage_server.tracing import SpanKind, Tracer
from elasticpipe.training.clipping import NO_CLIP, GradClip
from elasticpipe.training.job import JobConfig
from elasticpipe.training.objectives import check_job
from elasticpipe.training.schedule import forward_ops, stage_ops
from elasticpipe.transport import rpc
from elasticpipe.wire import structure
from elasticpipe.wire.structure import Value

__all__ = ["Admitted", "Stage", "StageConfig"]  # StageConfig: re-exported from config.py

log = get_logger(__name__)

TICK_S = 0.25
ABORT_WAIT_S = 10.0


@dataclass(frozen=True)
class Admitted:
    """Room reserved in a mailbox for one incoming message."""

    mailbox: Mailbox
    reservation: Reservation


def _clock(timer: str, device: torch.device) -> Callable[[], float]:
    if timer not in devicetime.TIMERS:
        raise InvalidRequest(
            f"unknown timer {timer!r} (choose from {', '.join(devicetime.TIMERS)})"
        )
    if timer == "fastest" and device.type != "cpu":
        raise InvalidRequest(f"timer 'fastest' emulates a device on a CPU stage, not on {device}")
    if timer in ("cpu", "fastest") or (timer == "auto" and device.type == "cpu"):
        return time.thread_time
    return time.perf_counter


Asker = Callable[[Effect], None]


class Stage(EpochChanges, SnapshotCopies):
    """A stage server's domain logic, independent of gRPC's server side (its epoch changes
    and restores: ``EpochChanges``; its snapshots and the copies it keeps:
    ``SnapshotCopies``)."""

    def __init__(self, config: StageConfig):
        self.config = config
        self.device = torch.device(config.device)
        events = devicetime.event_clock(config.timer, self.device)  # CUDA: event timing
        clock = _clock(config.timer, self.device)
        fastest = devicetime.FastestTimes() if config.timer == "fastest" else None
        self.slowdown = Slowdown(config.slowdown, clock, events, fastest)
        self.path = devicepath.for_device(self.device)  # pinned copies on a stream (CUDA)
        self.memory_bytes = memory.detect(self.device, config.memory_bytes)
        self.machine = StepMachine(config.name, config.commit_lease_s)
        self.faults = Faults(config.name, config.enable_fault_injection)
        self.snapshots = SnapshotStore()
        self.tracer = Tracer()
        self.stage_id = ""  # this incarnation's id, once registered
        self.job: JobConfig | None = None
        self.slice: LayerSlice | None = None
        self.placement: Placement | None = None
        self.last_peak = (0, 0)
        self._stash_meter = StashMeter()  # which runs count their stashed bytes
        self.asker: Asker | None = None  # set by the server: asks the coordinator
        self.poisoned = ""  # why this incarnation must be replaced (then re-registers)
        self._cond = Deferral(self._apply, config.name)  # a commit's step runs after its reply
        self._mailbox = self._new_mailbox()
        self.committed = threading.Event()  # set at each step applied
        self.pipeline_time = measures.EpochTime()  # this epoch's training runs' pipeline
        self.reduce_rate = measures.Rate()  # replicas: bytes/s of the reductions
        self.optimizer_rate = measures.Rate()  # parameter bytes/s of the optimizer steps
        self.between_runs = measures.EpochMedian()  # from a training run's end to the next's start
        self._run_ended = (-1, 0.0)  # (epoch, time.monotonic()) of the last training run's end
        self._groups = collectives.ProcessGroups()  # collectives="gloo": the reduction's
        self.rendezvous = ""  # the coordinator's rendezvous now (heartbeats; "": the job's)
        self._links: dict[str, Link] = {}
        self._peers = rpc.StagePool(tls=config.tls)
        self._outputs: tuple[int, bytes, dict[int, Value]] = (0, b"", {})
        self._staged = None  # what an epoch change holds aside (``EpochChanges``)
        self._restoring = None  # a load in progress
        self._empty: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # (``EpochChanges``)
        self._questions: list[Effect] = []
        self._snapshotter = Snapshotter(
            self.snapshots, self._push_copy, lambda: self.faults.point("snapshot")
        )
        self.metrics = StageMetrics(self._metrics_view)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="leases", daemon=True)
        self._ticker.start()

    # ---- effects ---------------------------------------------------------------------

    def _apply(self, effects: Iterable[Effect]) -> None:
        """Carries out what the machine decided (the lock is held)."""
        for e in effects:
            if e.do is Do.APPLY_STEP:
                assert self.slice is not None
                try:
                    with self.tracer.span(SpanKind.COMMIT, e.step, e.run, self.machine.epoch):
                        self.optimizer_rate.note(self.epoch, self.slice.timed_step(e.clip))
                    self.committed.set()  # (the heartbeat may report at once: ``server``)
                except Exception as exc:
                    # Some layers may have stepped and others not: this stage's state is
                    # no longer any step's. It gives up its job; recovery rolls back.
                    self._poison(f"the optimizer step of step {e.step} failed: {exc!r}")
                    raise StageUnavailable(
                        f"stage {self.config.name} failed to apply step {e.step} ({exc!r}); "
                        "it drops its layers so that recovery restores them"
                    ) from exc
            elif e.do is Do.DISCARD_GRADS:
                if self.slice is not None:
                    self.slice.zero_grad()
            elif e.do is Do.CLOSE_RUNS:
                self._mailbox.close_through(e.run)
            elif e.do is Do.WAKE_RUN:
                self._mailbox.abort(e.run, f"aborted on stage {self.config.name}")
            elif e.do is Do.RESET_RUNS:
                self._mailbox = self._new_mailbox()
                self._outputs = (0, b"", {})
            elif e.do is Do.DROP_STAGED:
                if self._staged is not None and self._staged.epoch == e.epoch:
                    self._staged = None
                if self._restoring is not None and self._restoring[0] == e.epoch:
                    self._restoring = None
                log.warning("epoch_abandoned", epoch=e.epoch, kept=self.machine.epoch)
            elif e.do is Do.INSTALL_STAGED:
                self._install(e.epoch)
            elif e.do is Do.SNAPSHOT:
                self._capture(e.step)
            elif e.do is Do.PRUNE_SNAPSHOTS:
                self.snapshots.prune(None if e.everything else e.step)
            elif e.do in (Do.RESOLVE_RUN, Do.ASK_EPOCH):
                self._questions.append(e)
        self._cond.notify_all()

    def _poison(self, why: str) -> None:
        """This incarnation's state is unusable: forget the job and ask to be replaced."""
        log.error("stage_poisoned", why=why)
        self._apply(self.machine.drop_job())
        self.job, self.slice, self.placement = None, None, None
        self.poisoned = why

    def _tick_loop(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                with self._cond:
                    self._apply(self.machine.tick(time.monotonic()))
                    questions, self._questions = self._questions, []
                for question in questions:
                    if self.asker is not None:
                        self.asker(question)
            except ElasticPipeError as exc:
                log.warning("coordinator_unanswered", error=str(exc))
            except Exception as exc:  # the leases must outlive any one failure
                log.error("lease_tick_failed", error=repr(exc), exc_info=exc)

    # ---- job -------------------------------------------------------------------------

    def describe(self, job: JobConfig) -> tuple[int, list[int], str, str]:
        """Number of layers and bytes of each, and the factory's module file and hash,
        checking the model, loss and optimizer are allowed here."""
        num_layers, sizes = models.describe(job.model, job.model_kwargs, self.config.allow_models)
        check_job(job.loss, job.optimizer, job.optimizer_kwargs, self.config.allow_models)
        path, digest = models.factory_source(job.model, self.config.allow_models)
        if job.collectives and self.config.tls is not None:
            raise InvalidRequest(
                f"collectives={job.collectives!r}: stage {self.config.name} requires mutual "
                "TLS, and process groups are unauthenticated; use the default engine"
            )
        return num_layers, sizes, path, digest

    def assign(self, job: JobConfig, placement: Placement) -> int:
        """Starts a job on this stage: builds layers [lo, hi) fresh, at step 0."""
        new_slice = self._new_slice(job)
        new_slice.build(placement.lo, placement.hi, draw=not job.external_weights)
        if placement.num_replicas > 1:
            reducing.refuse_running_stats({i: new_slice.layers[i] for i in placement.layers})
        with self._cond:
            self.job, self.slice = job, new_slice
            self._staged, self._restoring, self.loaded_job = None, None, None
            # the layers an init_state load may write into where they lie (``restore_into``)
            empty = new_slice.layers.values() if job.external_weights else ()
            self._empty = weakref.WeakSet(empty)
            self._set_placement(placement)
            self._apply(
                self.machine.assign(placement.epoch, job.snapshot_every, job.external_weights)
            )
        log.info(
            "job_assigned",
            job=job.job_id,
            epoch=placement.epoch,
            lo=placement.lo,
            hi=placement.hi,
            index=placement.index,
        )
        return placement.hi - placement.lo

    def drop_job(self, reason: str) -> None:
        """Forgets the job (this incarnation was declared dead; it comes back as a spare)."""
        with self._cond:
            self._apply(self.machine.drop_job())
            self.job, self.slice, self.placement = None, None, None
            self._staged, self._restoring = None, None
        log.warning("job_dropped", reason=reason)

    def _new_slice(self, job: JobConfig) -> LayerSlice:
        return LayerSlice(job, self.device, self.slowdown, self.config.allow_models)

    def profile(self, job: JobConfig, sample: Value, repeats: int) -> list[LayerTiming]:
        """Times forward and backward of every layer of the whole model on this device, one
        layer resident at a time (``profiling.profile_layers``), with its memory needs.

        With ``--timer fastest`` every op's time is the fastest of its last
        ``devicetime.WINDOW`` runs in training, so the profile runs a quick layer that many
        times too (within ``profiling.LAYER_BUDGET_S``): with the coordinator's five, a
        GPT's blocks profiled 15% slower than they then trained, and 25% apart from one
        job's profile to the next on the same host. An emulated device (``--slowdown``)
        reports its times but waits for none of them (``Slowdown.unpaid``)."""
        if self.slowdown.fastest is not None:
            repeats = max(repeats, devicetime.WINDOW)
        return profile_layers(
            job, sample, self.device, self.slowdown.unpaid(), self.config.allow_models, repeats
        )

    def _set_placement(self, placement: Placement) -> None:
        self.placement = placement
        wanted = {a for a in (placement.prev, placement.next) if a}
        if placement.groups:  # the holders it reduces with, in the other replicas
            own = placement.chain[placement.index].address if placement.chain else ""
            wanted |= {h.address for g in placement.groups for h in g.holders} - {own}
        for address in list(self._links):
            if address not in wanted:
                # Closing waits for the link's thread: not under the lock (heartbeats and
                # probes must not stall behind it).
                link = self._links.pop(address)
                threading.Thread(target=link.close, name="link-close", daemon=True).start()
        for address in wanted:
            if address not in self._links:
                self._links[address] = Link(
                    address,
                    self._fail_run,
                    self.config.send_timeout_s,
                    self.config.tls,
                    self.metrics.sent,
                    self.tracer,
                    use_bulk=self.config.bulk_port is not None,
                )

    def _new_mailbox(self) -> Mailbox:
        """An empty mailbox; every message it drops is counted in ``data_refused``."""
        return Mailbox(self.config.mailbox_bytes, on_refused=self._count_refused)

    def _count_refused(self, n: int) -> None:
        self.metrics.data_refused.inc(n)

    def _fail_run(self, run: int, error: ElasticPipeError) -> None:
        self._mailbox.fail(run, error)

    # ---- data path -------------------------------------------------------------------

    def admit(
        self, epoch: int, run: int, micro_batch: int, nbytes: int, slot: Slot = Slot.INPUT
    ) -> Admitted:
        """Checks a data message's epoch, run and size (a reduction piece: its key, and that
        a stage sent it), and reserves room for it, before anything is allocated for it.

        Raises:
            StaleEpoch / Rebalancing / NotReady: see ``StepMachine.check_epoch``.
            InvalidRequest: a run id of an implausible client, or a micro-batch index (a
                piece's key) out of range.
            PermissionDenied: a reduction piece from a certificate that is not a stage's.
            TooLarge: no room (the mailbox's byte or message limit).
        """
        most = reduction.MAX_KEYS if slot is Slot.REDUCE else bounds.MAX_MICRO_BATCHES
        if not 0 <= micro_batch < most:
            raise InvalidRequest(f"micro_batch must be in [0, {most}) (got {micro_batch})")
        if slot is Slot.REDUCE:
            caller = authz.caller()
            if caller is not None and caller[1] != authz.STAGE:
                raise PermissionDenied(
                    f"a reduction piece from {caller[0]!r} ({caller[1]}): only stages send them"
                )
        with self._cond:
            self.machine.check_epoch(epoch)
            self.machine.check_run(run)
            mailbox = self._mailbox
        return Admitted(mailbox, mailbox.reserve(nbytes))

    def deliver(
        self,
        admitted: Admitted,
        slot: Slot,
        run: int,
        micro_batch: int,
        tensor: Value,
        loss_scale: float = 0.0,
        *,
        secret: bytes,
    ) -> bool:
        """Accepts an activation, gradient or target for a run (maybe before its RunStep)
        into the room ``admit`` reserved (given back if anything fails); one without the
        run's ``secret`` is dropped and counted (``Mailbox.put``), never used.

        Returns:
            False if it was dropped for its secret.

        Raises:
            InvalidRequest: targets without a loss scale in (0, 1], or not one tensor.
            TooLarge: early data (before its RunStep) that nothing held early may give way
                to (``Mailbox.put``).
        """
        try:
            if slot is Slot.TARGET and not (loss_scale > 0.0 and loss_scale <= 1.0):
                raise InvalidRequest(
                    f"targets of micro-batch {micro_batch} need a loss_scale in (0, 1] "
                    f"(got {loss_scale})"
                )
            if slot is Slot.TARGET and not isinstance(tensor, torch.Tensor):
                raise InvalidRequest(f"targets of micro-batch {micro_batch} must be one tensor")
            value = (tensor, loss_scale) if slot is Slot.TARGET else tensor
            nbytes = structure.nbytes(tensor)
            mailbox = admitted.mailbox
            if not mailbox.put(run, slot, micro_batch, value, nbytes, admitted.reservation, secret):
                return False  # counted in data_refused by the mailbox
            placement = self.placement
            peers = {Slot.INPUT: placement.prev, Slot.GRAD: placement.next} if placement else {}
            self.metrics.received(peers.get(slot) or "client", nbytes)
            return True
        finally:
            admitted.mailbox.release(admitted.reservation)

    def run_step(
        self,
        epoch: int,
        run: int,
        step: int,
        micro_batches: int,
        schedule: str,
        train: bool,
        timeout: float,
        client: int = 0,
        previous: Sequence[Decision] = (),
        *,
        secret: bytes,
        shares: Sequence[int] = (),
        generation: int = 0,
        inline: Sequence[Inline] = (),
    ) -> StepResult:
        """Runs this stage's ops of one step (or inference pass) and reports; it takes
        only data that carries the run's ``secret``, and ``inline`` (the inputs and targets
        its RunStep carried). With replicas, ``shares`` are every replica's micro-batches:
        this one runs its share, then reduces its gradients with the other replicas'
        holders (``reducing``; with collectives, on the process groups of ``generation``)."""
        if micro_batches < 1:
            raise InvalidRequest(f"micro_batches must be >= 1 (got {micro_batches})")
        with self._cond:
            replicated = train and self.placement is not None and self.placement.num_replicas > 1
            if train and (replicated or shares):
                self.machine.check_epoch(epoch)  # a stale client gets the retryable refusal
                if not replicated:
                    raise InvalidRequest(
                        f"shares {list(shares)} sent to a stage of one pipeline (no replicas)"
                    )
            share = (  # checked before the run begins: a refusal leaves nothing behind
                reducing.share_of(self.placement, shares, micro_batches)  # type: ignore[arg-type]
                if replicated
                else range(micro_batches)
            )
            effects = self.machine.begin_run(epoch, run, step, client, train, previous)
            try:  # a lost commit's decision in ``previous`` applies its step here
                self._apply(effects)
            except BaseException:
                self._apply(self.machine.fail_run(run))  # that step failed: the run never began
                raise
            assert self.slice is not None and self.placement is not None
            self._mailbox.expect(run, secret)  # drops (and counts) the data not the run's
            ctx = RunContext(
                placement=self.placement,
                layers=self.slice,
                mailbox=self._mailbox,
                links=dict(self._links),
                device=self.device,
                run=run,
                secret=secret,
                step=step,
                train=train,
                deadline=time.monotonic() + timeout,
                tracer=self.tracer,
                path=self.path,
                stash_meter=self._stash_meter,
                first_micro_batch=share.start,
            )
            ended, self._run_ended = self._run_ended, (-1, 0.0)  # (an inference run ends it)
            if train:
                self.slice.begin_grads(sum(shares) if replicated else micro_batches, share)
                if ended[0] == self.placement.epoch:
                    self.between_runs.note(ended[0], time.monotonic() - ended[1])
        self.faults.point("run_started")
        placement = ctx.placement
        ops = (
            stage_ops(schedule, placement.num_stages, placement.index, micro_batches)
            if train
            else forward_ops(micro_batches)
        )
        reductions: reducing.Reductions | None = None
        try:
            deliver_inline(self, epoch, run, secret, inline)
            if replicated:  # each group's reduction starts once its last backward is done
                ids = reducing.RunIds(placement.epoch, run, step, secret, ctx.deadline)
                reductions = reducing.Reductions(
                    ctx.layers,
                    placement,
                    shares,
                    ctx.links,
                    ctx.mailbox,
                    ids,
                    self._groups,
                    generation,
                    self.rendezvous,
                    self.tracer,
                )
                ctx = replace(ctx, layer_done=reductions.layer_done)
            result = execute(ops, ctx)
            if train:
                self.pipeline_time.note(placement.epoch, time.monotonic() - ctx.deadline + timeout)
            if reductions is not None:
                self.faults.point("reducing")  # tests: killed as its replicas reduce
                reductions.finish()
                self.reduce_rate.note(placement.epoch, reductions.rate())
        except BaseException as exc:
            if reductions is not None:
                reductions.abandon(f"run {run} failed on stage {self.config.name}")
            with self._cond:
                self._apply(self.machine.fail_run(run))
            if not isinstance(exc, ElasticPipeError):
                log.error("step_crashed", run=run, error=repr(exc))
            raise
        with self._cond:
            try:
                # the gradients first: a run whose sums cannot be finished is no run to commit
                sq_norm = self.slice.finish_backward() if train else None
                self._apply(self.machine.finish_run(run, time.monotonic()))
            except (ElasticPipeError, ValueError) as exc:
                self._apply(self.machine.fail_run(run))
                if isinstance(exc, ValueError):
                    raise StepAborted(f"run {run}: its gradients are incomplete: {exc}") from exc
                raise
            self.last_peak = (result.peak_stashed, result.peak_stashed_bytes)
            if train:
                result.lr = self.slice.lr()
                if sq_norm is not None:
                    result.grad_sq_norm = sq_norm  # of the unscaled gradients (fp16)
                if self.slice.scales:
                    result.loss_scale = self.slice.loss_scale()
                self._run_ended = (placement.epoch, time.monotonic())
            if not train:
                self._outputs = (run, secret, result.outputs)
        self.metrics.ran(train, result.wall_s, result.op_seconds)
        memory.bound()  # freed activations kept for reuse, up to a bound
        self.faults.point("awaiting_commit")
        return result

    def fetch_output(self, run: int, micro_batch: int, secret: bytes) -> Value:
        """An inference output kept by the last stage, for whoever knows its run's secret."""
        with self._cond:
            kept_run, kept_secret, outputs = self._outputs
            if kept_run == run and not hmac.compare_digest(secret, kept_secret):
                raise PermissionDenied(
                    f"output of run {run} refused: the request does not carry the run's secret"
                )
            if kept_run != run or micro_batch not in outputs:
                raise NotReady(
                    f"no output of run {run}, micro-batch {micro_batch} here "
                    f"(last inference run: {kept_run})"
                )
            return outputs[micro_batch]

    def commit_step(
        self, epoch: int, run: int, step: int, client: int = 0, clip: GradClip = NO_CLIP
    ) -> int:
        """Commits the run: records the decision and returns; the optimizer step from the
        run's accumulated gradients (clipped by ``clip``) runs after, before anything else
        takes the lock (``deferral``)."""
        if self.faults.drops_commit(run):
            raise StageUnavailable(f"commit of run {run} lost on the way (injected fault)")
        self.faults.point("commit")
        with self._cond:
            effects = self.machine.commit(epoch, run, step, client, clip)
            if any(e.do is Do.APPLY_STEP for e in effects):
                self._cond.defer(effects)  # decided: the reply need not wait for the step
                self._cond.notify_all()
            else:
                self._apply(effects)
            return self.machine.committed_step

    def settle(self) -> None:
        """Runs a committed step's optimizer step now if it has not run yet (``deferral``)."""
        with self._cond:
            pass  # taking the lock settles

    def abort_step(self, run: int, reason: str, client: int = 0) -> None:
        """Discards a run wherever it is; returns once the run stopped computing (or after
        ``ABORT_WAIT_S``: its executor then ends it at its next op)."""
        with self._cond:
            self._apply(self.machine.abort(run, client))
            self._cond.wait_for(
                lambda: (
                    not (self.machine.phase is Phase.RUNNING and self.machine.active_run == run)
                ),
                ABORT_WAIT_S,
            )
        log.debug("run_aborted", run=run, reason=reason)

    def fence(self, client: int, holder: str = "") -> RunState:
        """Follows client generation ``client``, held by ``holder`` (the coordinator's
        grant), and refuses older clients from now on; says where the stage is."""
        with self._cond:
            self._apply(self.machine.fence_clients(client, holder))
            return self.machine.state()

    # ---- faults and stats -------------------------------------------------------------

    def inject_fault(self, fault: Fault, point: str = "") -> None:
        """Arms a fault (tests only; refused unless enabled)."""
        self.faults.arm(fault, point)

    def timings(self) -> dict[int, LayerTiming]:
        """A snapshot of the per-layer measurements."""
        with self._cond:
            if self.slice is None:
                return {}
            return {i: t.snapshot() for i, t in self.slice.timings.items()}

    def _metrics_view(self) -> StageView:
        """What a scrape of the metrics reports about this stage's state."""
        placement, timings = self.placement, self.timings()
        mailbox_bytes, mailbox_entries = self._mailbox.usage()
        return StageView(
            epoch=self.epoch,
            layer_lo=placement.lo if placement else 0,
            layer_hi=placement.hi if placement else 0,
            committed_step=self.committed_step,
            mailbox_bytes=mailbox_bytes,
            mailbox_entries=mailbox_entries,
            stashed_bytes=self.last_peak[1],
            stashed_micro_batches=self.last_peak[0],
            slowdown=self.slowdown.factor,
            device_memory=devicepath.memory_stats(self.device),
            layer_seconds={
                (i, d): getattr(t, f"{d}_s")
                for i, t in timings.items()
                for d in ("forward", "backward")
            },
        )

    def state(self) -> RunState:
        """Where the stage is in its protocols."""
        with self._cond:
            return self.machine.state()

    @property
    def epoch(self) -> int:
        """The epoch in force here."""
        return self.machine.epoch

    @property
    def committed_step(self) -> int:
        """The last step committed here."""
        return self.machine.committed_step

    @property
    def frozen(self) -> bool:
        """Whether an epoch change is in progress here."""
        return self.machine.frozen is not None

    def close(self) -> None:
        """Stops the lease ticker, the applier and the snapshot thread (after a deferred
        snapshot: ``deferral``); closes the links."""
        self._stop.set()
        self._ticker.join(timeout=5)
        self._cond.close()
        with self._cond:  # (what the applier left runs first)
            for link in self._links.values():
                link.close()
            self._links.clear()
        self._snapshotter.close()
        self._peers.close()
        self.path.close()
