"""Jobs: setup and attach, for the client that holds the job.

``setup`` starts a job on the live stages (describe the model, profile it, order the hosts
and partition, assign) or attaches a client to the running one (settle, then snapshot at
the attach point). ``Jobs`` extends ``loads.Loads`` (a checkpoint streamed in as one epoch
change), which extends ``leases.Leases`` (who holds the job, and what is done for a client
that went away): every step here checks or grants that lease.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from elasticpipe.coordinator import epochs, replicas
from elasticpipe.coordinator.epochs import Change
from elasticpipe.coordinator.laps import Laps
from elasticpipe.coordinator.loads import Loads
from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import (
    PlanError,
    estimates,
    memory,
    order_hosts,
)
from elasticpipe.coordinator.profiles import STAGE_CALL_TIMEOUT_S, profile_stages
from elasticpipe.coordinator.rendezvous import Rendezvous
from elasticpipe.coordinator.replicas import ONE_PIPELINE, Shape
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import EpochRow
from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    InvalidRequest,
    LayersLost,
    ModelError,
    StagesMissing,
)
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition, StageRef
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import job_pb2, stage_pb2
from elasticpipe.wire.structure import Value

log = get_logger(__name__)

# What must match for a client to resume a job (everything but the id).
RESUME_FIELDS = (
    "model",
    "model_kwargs",
    "seed",
    "optimizer",
    "optimizer_kwargs",
    "loss",
    "micro_batches",
    "schedule",
    "snapshot_every",
    "precision",
    "grad_scaler_kwargs",
    "scheduler",
    "scheduler_kwargs",
    "warmup_steps",
    "max_grad_norm",
    "recompute_all",
    "recompute",
    "wire_dtype",
    "collectives",
)


@dataclass(frozen=True)
class Attached:
    """What a client learns when it sets up or attaches to a job."""

    partition: Partition
    num_layers: int
    client: int
    committed_step: int
    resumed: bool
    safe_step: int
    profiled: bool
    awaits_weights: bool  # see ``Loads.awaits_weights``


def differences(a: JobConfig, b: JobConfig) -> list[str]:
    """The description fields in which two jobs differ."""
    return [f for f in RESUME_FIELDS if getattr(a, f) != getattr(b, f)]


class Jobs(Loads):
    """Job setup and attach (checkpoint loads: ``Loads``; client leases and settling:
    ``Leases``)."""

    def __init__(self, cluster: Cluster, pause: epochs.Pause = epochs._no_pause):
        super().__init__(cluster, pause)
        self._profiling = threading.Lock()  # one profile at a time (a resend waits for it)
        self.rendezvous = Rendezvous(cluster)  # collectives="gloo"/"nccl": their store
        if cluster.job is not None:  # after a restart: serve the running job's again
            cluster.job = self.rendezvous.restored(cluster.job)

    # ---- setup and attach ------------------------------------------------------------

    def setup(
        self,
        job: JobConfig,
        sample: Value | None,
        num_stages: int,
        wait_s: float,
        resume: bool,
        lease_s: float,
        holder: str,
        active: Callable[[], bool] = lambda: True,
        request: str = "",
        shape: Shape = ONE_PIPELINE,
    ) -> Attached:
        """Starts a new job, or attaches to the running one (``resume``).

        ``shape``: the replicas asked for (``replicas``; default one pipeline).

        ``active`` tells whether the caller still waits (a cancelled call stops waiting
        for stages at once). ``request`` names the call: the same request sent again
        (its reply was lost with a coordinator that died) attaches to what the first
        one set up, as it set it up (a new job stays ``resumed=False``), instead of
        being refused with JobInUse.

        Raises:
            JobInUse: a live client holds the running job.
            InvalidRequest: ``resume`` with a description unlike the running job's.
            LayersLost: ``resume`` of a job that failed beyond recovery.
            NotReady: not enough live stages within ``wait_s``.
            DeadlineExceeded: the caller went away while this waited for stages.
        """
        if not 0 < lease_s <= 3600:
            raise InvalidRequest(f"lease_s must be in (0, 3600] (got {lease_s})")
        current = self.c.job
        replayed = self.replayed(request)
        if replayed is not None and current is not None and self.c.partition is not None:
            log.info("setup_resent", job=current.job_id, client=holder, request=request)
            return self._attach(current, lease_s, holder, request, resumed=not replayed.created)
        self._check_free(current)
        if resume and current is not None and self.c.partition is not None:
            diff = differences(current, job)
            if diff:
                raise InvalidRequest(
                    f"cannot resume job {current.job_id}: its description differs in {diff} "
                    f"(running: {[getattr(current, f) for f in diff]}, "
                    f"yours: {[getattr(job, f) for f in diff]})"
                )
            if self.c.failure:
                raise self.c.failure_kind(f"cannot resume job {current.job_id}: {self.c.failure}")
            if not shape.matches(self.c.layout):
                running = [p.num_stages for p in (self.c.job_layout() or Layout((), ())).replicas]
                raise InvalidRequest(
                    f"cannot resume job {current.job_id} as replicas of {list(shape.sizes)} "
                    f"stages: it runs replicas of {running}"
                )
            return self._attach(current, lease_s, holder, request)
        return self._start(
            job,
            sample,
            shape.stages_needed(num_stages),
            wait_s,
            lease_s,
            holder,
            active,
            request,
            shape,
        )

    def _attach(
        self, job: JobConfig, lease_s: float, holder: str, request: str = "", resumed: bool = True
    ) -> Attached:
        with self.c.move_lock:
            self._check_free(job, request)
            self.abandon_stale_load()  # a load its dead client began: abort it first
            partition = self.c.require_job()[1]
            client = self._issue(holder)
            # fences every older client, on every replica's stages
            step = self.settle(self.c.job_layout() or partition, client, holder)
            awaiting = self.awaits_weights(job, step)  # (reads the job's history)
            partition, safe = self._snapshot_at(job, partition, step, holder, awaiting)
            self._grant(job.job_id, lease_s, holder, client, request, created=not resumed)
        log.info("client_attached", job=job.job_id, client=holder, step=step)
        return Attached(
            partition,
            self.c.num_layers,
            client,
            step,
            resumed,
            step if safe else self.safe_step(),
            self.c.profile is not None,
            awaiting,
        )

    def _snapshot_at(
        self, job: JobConfig, partition: Partition, step: int, holder: str, awaiting: bool
    ) -> tuple[Partition, bool]:
        """Snapshots every stage at ``step`` (the attach point) and waits for the copies:
        a new client holds no mini-batch before it, so a rollback must never go further
        back. Done as an epoch change to the same partition (every epoch starts with a
        snapshot). Under ``move_lock``, with every stage settled and idle. Not for a job
        of several replicas (no rollback of one is built yet).

        A job whose layers still wait for their ``init_state`` (``awaiting``: a script
        resumed between its set-up and its load) has nothing to snapshot: its layers are the
        empty ones the load replaces, and a stage lost before the load has them built anew
        (``epochs.unloaded``).

        Returns:
            The partition in force, and whether the snapshot of ``step`` is safe.
        """
        if not job.snapshot_every or self.c.replicas > 1 or awaiting:
            return partition, False
        # The job's history for this client starts here: no rollback goes further back,
        # and snapshots of stages that missed this epoch are of an older history.
        epoch = self.c.store.reserve_epoch()
        new = partition.evolve(epoch=epoch, restored_step=step, restore_epoch=epoch)
        reason = f"client {holder} attached at step {step}: snapshot"

        def history(result: epochs.MoveResult) -> EpochRow:
            return epochs.history_row(
                self.c, new, "attach", reason, moved=result, restored_step=step
            )

        try:
            epochs.change_epoch(
                self.c, job, Change("attach", reason, partition, new), self._pause, history
            )
        except ElasticPipeError as exc:  # recorded as abandoned; the client can still train
            log.warning("attach_snapshot_failed", step=step, error=str(exc))
            return partition, False
        return new, self.wait_for_copies(new, job, step)

    def _wait_for_stages(
        self, num_stages: int, wait_s: float, active: Callable[[], bool]
    ) -> list[Member]:
        deadline = time.monotonic() + wait_s
        need = max(num_stages, 1)
        logged = 0.0
        while True:
            live = self.c.live_members()
            if len(live) >= need:
                return live[:num_stages] if num_stages else live
            now = time.monotonic()
            if now >= deadline:
                raise StagesMissing(
                    f"need {need} live stages, have {len(live)} "
                    f"({[m.row.name for m in live]}) after waiting {wait_s:.0f}s: start "
                    f"more stages, or ask for fewer (stages={len(live)})"
                )
            if not active():
                raise DeadlineExceeded(
                    f"the caller stopped waiting for {need} live stages (have {len(live)})"
                )
            if now - logged >= 5.0:
                log.info(
                    "waiting_for_stages",
                    need=need,
                    live=len(live),
                    why=f"waiting for {need - len(live)} more stages: {len(live)} of {need} live",
                )
                logged = now
            time.sleep(0.1)

    def _start(
        self,
        job: JobConfig,
        sample: Value | None,
        num_stages: int,
        wait_s: float,
        lease_s: float,
        holder: str,
        active: Callable[[], bool],
        request: str = "",
        shape: Shape = ONE_PIPELINE,
    ) -> Attached:
        # (refused before any stage is waited for; a job of one pipeline may become one of
        # replicas with set-layout: it gets the store too)
        job = self.rendezvous.for_job(job)
        chosen = self._wait_for_stages(num_stages, wait_s, active)
        job = job.with_id()
        try:
            return self._assign(job, sample, chosen, lease_s, holder, request, shape)
        except ElasticPipeError as exc:
            log.error("job_setup_failed", model=job.model, error=str(exc))
            raise

    def _assign(
        self,
        job: JobConfig,
        sample: Value | None,
        chosen: list[Member],
        lease_s: float,
        holder: str,
        request: str = "",
        shape: Shape = ONE_PIPELINE,
    ) -> Attached:
        laps = Laps()
        with self.c.move_lock:
            self._check_free(self.c.job)  # again: another client may have come meanwhile
            epochs.check_no_change_in_progress(self.c)
            spec = job.to_proto()
            laps.lap("lock")
            described = self._describe(spec, chosen)
            laps.lap("describe")
            num_layers, param_bytes = described.num_layers, list(described.param_bytes)
            longest = max(shape.sizes) if len(shape.sizes) > 1 else len(chosen)
            if num_layers < longest and not shape.auto:
                if shape.replicated:
                    raise PlanError(
                        f"too few layers for a replica of {longest} stages (layers: "
                        f"{num_layers}): every replica holds every layer"
                    )
                raise PlanError(
                    f"too few layers for the stages (layers: {num_layers}, stages: "
                    f"{len(chosen)}): pass stages={num_layers} or fewer"
                )
            profile = profile_stages(self.c, job, sample, chosen) if sample is not None else None
            laps.lap("profile")
            costs = profile.costs if profile else estimates.fallback_costs(param_bytes)
            speeds = [profile.speeds[m.row.stage_id] if profile else 1.0 for m in chosen]
            self.c.profile = profile
            self.c.slot_shortfalls.clear()  # measured by an earlier job's chains
            # (the new model's: what the predictions below read)
            self.c.num_layers, self.c.param_bytes = num_layers, param_bytes
            layout: Layout | None = None
            if shape.replicated:
                epoch = self.c.store.reserve_epoch()
                partition, layout, ordered = replicas.lay_out(
                    self.c, job, chosen, costs, speeds, param_bytes, epoch, shape, bool(profile)
                )
                if len(layout.replicas) == 1:  # auto: one pipeline is fastest
                    layout = None
            else:
                links = self.c.links(len(speeds))
                mem = memory.terms([m.memory_bytes for m in chosen], param_bytes, profile, job)
                try:
                    order, best = order_hosts(costs, speeds, *links, *mem)
                except PlanError as exc:
                    raise PlanError(
                        f"{exc}; {memory.offers([m.row.name for m in chosen], mem)}"
                    ) from exc
                ordered = [chosen[i] for i in order]
                epoch = self.c.store.reserve_epoch()
                partition = Partition(
                    epoch=epoch,
                    job_id=job.job_id,
                    boundaries=best.boundaries,
                    stages=tuple(StageRef(m.row.stage_id, m.row.address) for m in ordered),
                    # Without a profile the costs have no unit: the step time is unknown.
                    predicted_step_s=self.c.chain_step_s(best, job)
                    if profile is not None
                    else None,
                ).validate(num_layers)
            laps.lap("order_hosts")
            assign = [
                (ref.address, stage_pb2.AssignRequest(job=spec, assignment=a))
                for ref, a in self._assignments(partition, layout)
            ]
            try:
                self.c.pool.all(assign, "Assign", STAGE_CALL_TIMEOUT_S)
            except ElasticPipeError as exc:
                reason = f"job {job.job_id} not started: {str(exc)[:300]}"
                self.c.store.add_epoch(epochs.history_row(self.c, partition, "abandoned", reason))
                raise
            store = self.c.store
            # An earlier job's profile must not outlive it (a restart would load it): gone
            # before the new job is written, so that a crash between the two leaves none.
            store.delete("profile")
            store.put("job", dict(vars(job)))
            store.put("num_layers", num_layers)
            store.put("param_bytes", param_bytes)
            store.put("factory", [described.factory_file, described.factory_sha256])
            store.delete("job_failure")
            store.delete("job_failure_kind")
            if profile:
                store.put("profile", profile.to_store())
            self.c.job, self.c.param_bytes, self.c.failure = job, param_bytes, ""
            self.c.failure_kind = LayersLost
            weights = (
                "layers built empty, their initial weights (init_state) are streamed "
                "by the client next, as a restore of step 0"
                if job.external_weights
                else f"initial weights from seed {job.seed}"
            )
            reason = f"job {job.job_id} started: {weights}"
            row = epochs.history_row(
                self.c,
                partition,
                "start",
                reason,
                extra=replicas.layout_record(self.c, layout) if layout else None,
            )
            self.c.install(partition, row, layout)
            for member in chosen:
                member.remeasure()
                member.speed = None
            self.c.last_move = time.monotonic()
            laps.lap("assign")
            # Layers built empty for the client's init_state have no snapshot to wait for:
            # the load replaces them (and waits for its own copies); a recovery before it
            # builds them anew (``epochs.unloaded``).
            if not job.external_weights:
                for chain in layout.replicas if layout is not None else (partition,):
                    self.wait_for_copies(chain, job, 0)
            laps.lap("copies")
            client = self._issue(holder)
            # the stages (of every replica) follow the new client only
            self.settle(layout or partition, client, holder)
            self._grant(job.job_id, lease_s, holder, client, request, created=True)
            laps.lap("settle")
        log.info(
            "job_started",
            job=job.job_id,
            model=job.model,
            layers=num_layers,
            boundaries=[list(p.boundaries) for p in layout.replicas]
            if layout is not None
            else list(partition.boundaries),
            shares=list(layout.shares) if layout is not None else None,
            stages=[m.row.name for m in ordered],
            epoch=epoch,
            client=holder,
            phases_s=laps.seconds,
        )
        return Attached(
            partition, num_layers, client, 0, False, 0, profile is not None, job.external_weights
        )

    def _assignments(
        self, partition: Partition, layout: Layout | None
    ) -> list[tuple[StageRef, stage_pb2.Assignment]]:
        """Every stage's assignment: in its replica's chain, with its reduction groups."""
        # (a copy's source is checked by name)
        if layout is None:
            wire = partition.assignments(self.c.names(partition.stage_ids))
            return [(ref, wire[ref.stage_id]) for ref in partition.stages]
        wire = layout.assignments(self.c.names)
        return [(ref, wire[ref.stage_id]) for chain in layout.replicas for ref in chain.stages]

    def _describe(self, spec: job_pb2.JobSpec, chosen: list[Member]) -> stage_pb2.DescribeResponse:
        """Every chosen stage's view of the model; they must agree on the factory's code.

        Raises:
            PermissionDenied / ModelError: a stage refuses the model.
            ModelError: the stages import different versions of the factory's module (a
                stage keeps the first version it imported).
        """
        replies = self.c.pool.all(
            [(m.row.address, stage_pb2.DescribeRequest(job=spec)) for m in chosen],
            "Describe",
            STAGE_CALL_TIMEOUT_S,
            retry_unreachable=True,  # the first contact: hundreds of connections open at once
        )
        versions = {(r.factory_file, r.factory_sha256, r.num_layers) for r in replies}
        if len(versions) > 1:
            seen = {
                m.row.name: f"{r.factory_file} sha256 {r.factory_sha256[:12]} "
                f"({r.num_layers} layers)"
                for m, r in zip(chosen, replies, strict=True)
            }
            raise ModelError(
                f"the stages disagree on model {spec.model!r}: {seen}; restart the stages "
                "whose module is out of date (a stage keeps the version it imported first)"
            )
        return replies[0]  # type: ignore[no-any-return]

    def profile_later(self, job_id: str, client: int, sample: Value) -> bool:
        """Profiles a job set up without a sample (a ``load`` or ``state_dict`` came first),
        unless it is profiled already: the same request sent again after a failover then
        profiles nothing twice.

        Returns:
            Whether this call profiled the job.

        Raises:
            Fenced: the caller does not hold the job.
        """
        job, _ = self._check_holder(job_id, client)
        with self._profiling:
            profiled = self.c.profile is None
            if profiled:
                every = self.c.job_stage_ids()  # of every replica
                members = [m for sid in every if (m := self.c.members.by_id(sid))]
                measured = profile_stages(self.c, job, sample, members)
                with self.c.move_lock:
                    self.c.profile = measured
                    self.c.store.put("profile", measured.to_store())
                    for member in members:  # speeds so far were in fallback units of work
                        member.forget_speeds()
            with self.c.move_lock:
                # The partition's step time was unknown (costs without a unit): now it is
                # not (also when a leader that died had stored the profile, not the time).
                current, profile = self.c.partition, self.c.profile
                if (
                    current is not None
                    and self.c.replicas == 1  # replicas are not re-timed yet
                    and profile is not None
                    and current.job_id == job.job_id
                    and (profiled or current.predicted_step_s is None)
                ):
                    speeds = self.c.speeds(current.stage_ids)
                    now = estimates.evaluate(
                        current.boundaries, profile.costs, speeds, *self.c.links(len(speeds))
                    )
                    timed = current.evolve(predicted_step_s=self.c.chain_step_s(now, job))
                    self.c.store.put_partition(timed)
                    self.c.adopt(timed)
        return profiled
