"""Jobs and the clients that drive them: setup, attach, leases, loads, undecided runs.

A job is driven by one client at a time. The client holds a *lease* (renewed every few
seconds, released by ``close``) and a *generation* number that its requests carry; a new
client of the same job gets a higher generation and every stage fences the older one
out, so a client that lost its lease can never commit after its successor.

When a client attaches, or when a stage's commit lease runs out while no live client
holds the job, the coordinator settles the run left undecided with the classic rule: if
any stage committed it, the decision was commit, so it commits everywhere; if none did,
it is aborted everywhere.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from elasticpipe.coordinator import concurrency, copies, epochs
from elasticpipe.coordinator.epochs import Change
from elasticpipe.coordinator.laps import Laps
from elasticpipe.coordinator.membership import Member
from elasticpipe.coordinator.planning import (
    PlanError,
    estimates,
    memory,
    order_hosts,
    predict_step_time,
)
from elasticpipe.coordinator.planning.estimates import Profile, Timing
from elasticpipe.coordinator.state import Cluster
from elasticpipe.coordinator.store import EpochRow
from elasticpipe.errors import (
    DeadlineExceeded,
    ElasticPipeError,
    Fenced,
    InvalidRequest,
    JobInUse,
    LayersLost,
    ModelError,
    NotReady,
    StagesMissing,
)
from elasticpipe.logs import get_logger
from elasticpipe.partition import Partition, StageRef
from elasticpipe.security import bounds
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import job_pb2, stage_pb2
from elasticpipe.wire import bundle
from elasticpipe.wire.structure import Value

log = get_logger(__name__)

PROFILE_REPEATS = 5
# Stages sharing a host are profiled one at a time (they would slow each other down);
# this many hosts at once.
PROFILE_HOSTS_AT_ONCE = 16
STAGE_CALL_TIMEOUT_S = 120.0
SETTLE_WAIT_S = 10.0
RESTORE_LEASE_S = 600.0
SAFE_STEP_TTL_S = 0.2
DEFAULT_LEASE_S = 15.0
SETTLED_KEPT = 1024  # decisions of settled runs kept to answer repeated questions
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
)


@dataclass
class Lease:
    """The client holding a job."""

    job_id: str
    client: int
    holder: str
    lease_s: float
    expires: float  # time.monotonic()


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


def differences(a: JobConfig, b: JobConfig) -> list[str]:
    """The description fields in which two jobs differ."""
    return [f for f in RESUME_FIELDS if getattr(a, f) != getattr(b, f)]


class Jobs:
    """Job setup and attach, client leases, checkpoint loads, and settling runs."""

    def __init__(self, cluster: Cluster, pause: epochs.Pause = epochs._no_pause):
        self.c = cluster
        self._pause = pause
        self._lock = threading.Lock()
        self._restoring: tuple[Change, float, int] | None = None  # change, deadline, client
        self._safe_cache: tuple[float, int] | None = None
        self._settled: dict[int, str] = {}  # run -> decision, of runs settled here
        # The newest client generation this coordinator issued and to whom ("": nobody),
        # from before its lease exists: what ``grant`` tells a stage that asks meanwhile.
        self._issued: tuple[int, str] = (0, "")
        self.efficiency: tuple[int, float] = (0, 0.0)  # (step, pipeline efficiency) reported
        raw = cluster.store.get("lease")
        self._lease = (
            Lease(
                raw["job_id"],
                int(raw["client"]),
                str(raw["holder"]),
                float(raw["lease_s"]),
                time.monotonic() + float(raw["lease_s"]),  # a restart grants a grace period
            )
            if raw
            else None
        )

    # ---- leases ----------------------------------------------------------------------

    def lease(self) -> Lease | None:
        """The live lease, if a client holds the job."""
        with self._lock:
            lease = self._lease
        if lease is None or time.monotonic() >= lease.expires:
            return None
        return lease

    def _check_free(self, current: JobConfig | None) -> None:
        """Raises JobInUse while a live client holds the running job."""
        lease = self.lease()
        if current is not None and lease is not None:
            raise JobInUse(
                f"job {current.job_id} ({current.model}) is held by client {lease.holder!r}: "
                "close that pipeline first, or wait until its lease runs out "
                f"({lease.lease_s:.0f}s after it stopped renewing it)"
            )

    def _issue(self, holder: str) -> int:
        """A fresh client generation (fencing every earlier client), issued to ``holder``."""
        with self._lock:
            client = self.c.store.next_client()
            self._issued = (client, holder)
        return client

    def _grant(self, job_id: str, lease_s: float, holder: str, client: int = 0) -> int:
        client = client or self._issue(holder)
        with self._lock:
            self._lease = Lease(job_id, client, holder, lease_s, time.monotonic() + lease_s)
            self.efficiency = (0, 0.0)  # the new holder reports its own
            self.c.store.put(
                "lease", {"job_id": job_id, "client": client, "holder": holder, "lease_s": lease_s}
            )
        return client

    def renew(
        self, job_id: str, client: int, release: bool, efficiency: tuple[int, float] = (0, 0.0)
    ) -> tuple[bool, int]:
        """Renews (or releases) a client's lease; keeps the pipeline efficiency of the
        client's last step (``efficiency``: step, figure; step 0 when none yet).

        Returns:
            Whether the client still holds the job, and the newest safe snapshot step.
        """
        with self._lock:
            lease = self._lease
            held = lease is not None and lease.job_id == job_id and lease.client == client
            if held and lease is not None:
                if release:
                    self._lease = None
                    self.c.store.delete("lease")
                    log.info("client_released", job=job_id, client=lease.holder)
                else:
                    lease.expires = time.monotonic() + lease.lease_s
                    if efficiency[0]:
                        self.efficiency = efficiency
                        self.c.metrics.efficiency_reported(*efficiency)
        return held, self.safe_step()

    def safe_step(self) -> int:
        """The newest step whose snapshot survives any single failure (0 if none).

        Only stages that took part in the last rollback count (their heartbeat's epoch is
        at least the partition's ``restore_epoch``): anything older may be of another
        history. Computed at most every ``SAFE_STEP_TTL_S`` (heartbeats ask for it).
        """
        now = time.monotonic()
        cached = self._safe_cache
        if cached is not None and now - cached[0] < SAFE_STEP_TTL_S:
            return cached[1]
        partition, job = self.c.partition, self.c.job
        found: int | None = 0
        if partition is not None and job is not None and job.snapshot_every:
            members = [
                m
                for m in self.c.members.members()
                if self.c.members.alive(m) and m.epoch >= partition.restore_epoch
            ]
            held = {m.row.stage_id: m.snapshots for m in members}
            need = 2 if partition.num_stages > 1 else 1
            found = copies.newest_step(
                copies.copies_by_step(held, job.job_id), partition.num_layers, held, need
            )
        self._safe_cache = (now, found or 0)
        return found or 0

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
    ) -> Attached:
        """Starts a new job, or attaches to the running one (``resume``).

        ``active`` tells whether the caller still waits (a cancelled call stops waiting
        for stages at once).

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
                raise LayersLost(f"cannot resume job {current.job_id}: {self.c.failure}")
            return self._attach(current, lease_s, holder)
        return self._start(job, sample, num_stages, wait_s, lease_s, holder, active)

    def _attach(self, job: JobConfig, lease_s: float, holder: str) -> Attached:
        with self.c.move_lock:
            self._check_free(job)
            self.abandon_stale_load()  # a load its dead client began: abort it first
            partition = self.c.require_job()[1]
            client = self._issue(holder)
            step = self.settle(partition, client, holder)  # fences every older client
            partition, safe = self._snapshot_at(job, partition, step, holder)
            self._grant(job.job_id, lease_s, holder, client)
        log.info("client_attached", job=job.job_id, client=holder, step=step)
        return Attached(
            partition,
            self.c.num_layers,
            client,
            step,
            True,
            step if safe else self.safe_step(),
            self.c.profile is not None,
        )

    def _snapshot_at(
        self, job: JobConfig, partition: Partition, step: int, holder: str
    ) -> tuple[Partition, bool]:
        """Snapshots every stage at ``step`` (the attach point) and waits for the copies:
        a new client holds no mini-batch before it, so a rollback must never go further
        back. Done as an epoch change to the same partition (every epoch starts with a
        snapshot). Under ``move_lock``, with every stage settled and idle.

        Returns:
            The partition in force, and whether the snapshot of ``step`` is safe.
        """
        if not job.snapshot_every:
            return partition, False
        # The job's history for this client starts here: no rollback goes further back,
        # and snapshots of stages that missed this epoch are of an older history.
        epoch = self.c.store.reserve_epoch()
        new = partition.evolve(epoch=epoch, restored_step=step, restore_epoch=epoch)
        reason = f"client {holder} attached at step {step}: snapshot"

        def history(result: epochs.MoveResult) -> EpochRow:
            return EpochRow(
                epoch=new.epoch,
                at=time.time(),
                reason=reason,
                boundaries=new.boundaries,
                stage_ids=new.stage_ids,
                pause_s=result.pause_s,
                kind="attach",
                job_id=new.job_id,
                stage_names=tuple(self.c.names(new.stage_ids)),
                restored_step=step,
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
    ) -> Attached:
        chosen = self._wait_for_stages(num_stages, wait_s, active)
        job = job.with_id()
        try:
            return self._assign(job, sample, chosen, lease_s, holder)
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
            if num_layers < len(chosen):
                raise PlanError(
                    f"too few layers for the stages (layers: {num_layers}, stages: "
                    f"{len(chosen)}): pass stages={num_layers} or fewer"
                )
            profile = self._profile(job, sample, chosen) if sample is not None else None
            laps.lap("profile")
            costs = profile.costs if profile else estimates.fallback_costs(param_bytes)
            speeds = [profile.speeds[m.row.stage_id] if profile else 1.0 for m in chosen]
            self.c.profile = profile
            self.c.num_layers = num_layers
            links = self.c.links(len(speeds))
            mem = memory.terms([m.memory_bytes for m in chosen], param_bytes, profile, job)
            try:
                order, best = order_hosts(costs, speeds, *links, *mem)
            except PlanError as exc:
                raise PlanError(
                    f"{exc}; {memory.offers([m.row.name for m in chosen], mem)}"
                ) from exc
            laps.lap("order_hosts")
            ordered = [chosen[i] for i in order]
            epoch = self.c.store.reserve_epoch()
            partition = Partition(
                epoch=epoch,
                job_id=job.job_id,
                boundaries=best.boundaries,
                stages=tuple(StageRef(m.row.stage_id, m.row.address) for m in ordered),
                # Without a profile the costs have no unit: the step time is unknown.
                predicted_step_s=predict_step_time(best, job.micro_batches, job.schedule)
                if profile is not None
                else None,
            ).validate(num_layers)
            names = self.c.names(partition.stage_ids)  # a copy's source is checked by name
            wire = partition.assignments(names)
            assign = [
                (ref.address, stage_pb2.AssignRequest(job=spec, assignment=wire[ref.stage_id]))
                for ref in partition.stages
            ]
            try:
                self.c.pool.all(assign, "Assign", STAGE_CALL_TIMEOUT_S)
            except ElasticPipeError as exc:
                self.c.store.add_epoch(
                    EpochRow(
                        epoch=epoch,
                        at=time.time(),
                        reason=f"job {job.job_id} not started: {str(exc)[:300]}",
                        boundaries=partition.boundaries,
                        stage_ids=partition.stage_ids,
                        kind="abandoned",
                        job_id=job.job_id,
                        stage_names=tuple(self.c.names(partition.stage_ids)),
                    )
                )
                raise
            store = self.c.store
            store.put("job", dict(vars(job)))
            store.put("num_layers", num_layers)
            store.put("param_bytes", param_bytes)
            store.put("factory", [described.factory_file, described.factory_sha256])
            store.delete("job_failure")
            if profile:
                store.put("profile", profile.to_store())
            self.c.job, self.c.param_bytes, self.c.failure = job, param_bytes, ""
            self.c.install(
                partition,
                EpochRow(
                    epoch=epoch,
                    at=time.time(),
                    reason=f"job {job.job_id} started: "
                    + (
                        "layers built empty, their initial weights (init_state) are streamed "
                        "by the client next, as a restore of step 0"
                        if job.external_weights
                        else f"initial weights from seed {job.seed}"
                    ),
                    boundaries=partition.boundaries,
                    stage_ids=partition.stage_ids,
                    kind="start",
                    job_id=job.job_id,
                    stage_names=tuple(self.c.names(partition.stage_ids)),
                ),
            )
            for member in chosen:
                member.timings, member.speed = {}, None
            self.c.last_move = time.monotonic()
            laps.lap("assign")
            self.wait_for_copies(partition, job, 0)
            laps.lap("copies")
            client = self._issue(holder)
            self.settle(partition, client, holder)  # the stages follow the new client only
            self._grant(job.job_id, lease_s, holder, client)
            laps.lap("settle")
        log.info(
            "job_started",
            job=job.job_id,
            model=job.model,
            layers=num_layers,
            boundaries=list(partition.boundaries),
            stages=[m.row.name for m in ordered],
            epoch=epoch,
            client=holder,
            phases_s=laps.seconds,
        )
        return Attached(partition, num_layers, client, 0, False, 0, profile is not None)

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

    def _profile(self, job: JobConfig, sample: Value, chosen: list[Member]) -> Profile:
        spec = job.to_proto()
        bundle.set_sample(spec, sample)
        profiles: dict[str, list[Timing]] = {}
        needs: dict[str, list[tuple[int, int]]] = {}
        request = stage_pb2.ProfileRequest(job=spec, repeats=PROFILE_REPEATS)
        replies = concurrency.by_host(
            [m.row.address for m in chosen],
            lambda address: self.c.pool.call(address, "Profile", request, STAGE_CALL_TIMEOUT_S),
            PROFILE_HOSTS_AT_ONCE,
        )
        for member, reply in zip(chosen, replies, strict=True):
            profiles[member.row.stage_id] = [
                (t.forward_s, t.backward_s, t.output_bytes, t.samples) for t in reply.timings
            ]
            needs[member.row.stage_id] = [(t.stash_bytes, t.state_bytes) for t in reply.timings]
        profile = estimates.from_profiles(profiles, needs)
        log.info(
            "stages_profiled",
            speeds={self.c.name(s): round(v, 3) for s, v in profile.speeds.items()},
        )
        return profile

    def wait_for_copies(self, partition: Partition, job: JobConfig, step: int) -> bool:
        """Waits until the snapshot of ``step`` has its copies everywhere (see
        ``epochs.wait_for_copies``)."""
        return epochs.wait_for_copies(self.c, partition, job, step)

    def profile_later(self, job_id: str, client: int, sample: Value) -> None:
        """Profiles a job set up without a sample (a ``load`` or ``state_dict`` came first).

        Raises:
            Fenced: the caller does not hold the job.
        """
        job, partition = self._check_holder(job_id, client)
        members = [m for sid in partition.stage_ids if (m := self.c.members.by_id(sid))]
        profile = self._profile(job, sample, members)
        with self.c.move_lock:
            self.c.profile = profile
            self.c.store.put("profile", profile.to_store())
            # The partition's step time was unknown (costs without a unit): now it is not.
            current = self.c.partition
            if current is not None and current.job_id == job.job_id:
                speeds = self.c.speeds(current.stage_ids)
                now = estimates.evaluate(
                    current.boundaries, profile.costs, speeds, *self.c.links(len(speeds))
                )
                timed = current.evolve(
                    predicted_step_s=predict_step_time(now, job.micro_batches, job.schedule)
                )
                self.c.store.put_partition(timed)
                self.c.adopt(timed)

    # ---- settling undecided runs -----------------------------------------------------

    def settle(self, partition: Partition, client: int, holder: str = "") -> int:
        """Makes every stage follow client generation ``client``, held by ``holder`` (the
        certificate name of the client granted the job; empty: nobody), fencing out older
        clients, and decides any undecided run.

        Returns:
            The step every stage has committed.

        Raises:
            StageUnavailable: a stage of the chain cannot be reached (recovery follows).
            NotReady: the stages disagree on the committed step.
        """
        fence = [
            (a, stage_pb2.FenceRequest(client=client, holder=holder)) for a in partition.addresses
        ]
        deadline = time.monotonic() + SETTLE_WAIT_S
        states = self.c.pool.all(fence, "Fence", 10.0)
        while any(s.phase == "running" for s in states) and time.monotonic() < deadline:
            time.sleep(0.05)  # a fenced run is being woken; it ends within a moment
            states = self.c.pool.all(fence, "Fence", 10.0)
        undecided = {(s.active_run, s.active_step) for s in states if s.phase == "awaiting_commit"}
        for run, step in undecided:
            committed = any(s.committed_run == run or s.committed_step >= step for s in states)
            if committed:
                # The clipping the committed stages applied (a run committed anywhere had
                # its decision, coefficient included, delivered there).
                clips = [s.committed_clip for s in states if s.committed_run == run]
                request = stage_pb2.CommitStepRequest(
                    epoch=partition.epoch,
                    run=run,
                    step=step,
                    client=client,
                    clip=clips[0] if clips else None,
                )
                targets = [
                    a
                    for a, s in zip(partition.addresses, states, strict=True)
                    if s.phase == "awaiting_commit" and s.active_run == run
                ]
                self.c.pool.all([(a, request) for a in targets], "CommitStep", 30.0)
            else:
                request_abort = stage_pb2.AbortStepRequest(
                    run=run, reason="settled: no stage committed it", client=client
                )
                self.c.pool.all(
                    [(a, request_abort) for a in partition.addresses], "AbortStep", 30.0
                )
            log.info("run_settled", run=run, step=step, decision="commit" if committed else "abort")
        if undecided:
            states = self.c.pool.all(fence, "Fence", 10.0)
        steps = sorted({int(s.committed_step) for s in states})
        if len(steps) != 1:
            raise NotReady(
                f"the stages of epoch {partition.epoch} committed different steps {steps}"
            )
        return steps[0]

    def resolve_run(self, stage_id: str, run: int, step: int) -> str:
        """A stage's commit lease ran out on ``run``: decide it unless a live client can.

        A run is settled once (fencing its client with a new generation); the decision is
        kept, and every later question about it -- each stage awaiting it asks, and asks
        again -- is answered from it without the lock. The lease is checked again under
        ``move_lock``: a client that attached or started a job meanwhile decides instead.

        Returns:
            "wait" (a live client holds the job), "commit" or "abort".
        """
        decided = self._settled.get(run)
        if decided is not None:
            return decided
        lease = self.lease()
        if lease is not None:
            # A live client decides; but a run committed anywhere is committed: that
            # decision can be delivered now without the client.
            return "commit" if self._deliver_commit(run, step, lease.client) else "wait"
        with self.c.move_lock:
            decided = self._settled.get(run)
            if decided is not None:
                return decided
            lease = self.lease()
            if lease is not None:  # a client attached or started a job meanwhile
                return "commit" if self._deliver_commit(run, step, lease.client) else "wait"
            _, partition = self.c.require_job()
            issued = int(self.c.store.get("client_generation") or 0)
            if stage_id not in partition.stage_ids or bounds.generation(run) > issued:
                # Not a run of the running job's chain (a stage moved out, an old job's
                # run, a generation never issued): nothing to settle, the stage drops it.
                log.info("run_resolved", stage=self.c.name(stage_id), run=run, decision="abort")
                return "abort"
            client = self._issue("")  # fences whichever client ran it
            committed = self.settle(partition, client)
            with self._lock:  # the fenced client's lease is over
                self._lease = None
                self.c.store.delete("lease")
            decision = "commit" if committed >= step else "abort"
            self._settled[run] = decision
            while len(self._settled) > SETTLED_KEPT:
                del self._settled[min(self._settled)]
        log.info("run_resolved", stage=self.c.name(stage_id), run=run, step=step, decision=decision)
        return decision

    def _deliver_commit(self, run: int, step: int, client: int) -> bool:
        """Commits ``run`` on the stages still awaiting it if some stage committed it."""
        partition = self.c.partition
        if partition is None:
            return False
        probe = stage_pb2.StatsRequest()
        results = self.c.pool.each([(a, probe) for a in partition.addresses], "GetStats", 5.0)
        states = [
            (a, r.state)
            for a, r in zip(partition.addresses, results, strict=True)
            if not isinstance(r, ElasticPipeError)
        ]
        clips = [st.committed_clip for _, st in states if st.committed_run == run]
        if not clips:
            return False
        request = stage_pb2.CommitStepRequest(
            epoch=partition.epoch, run=run, step=step, client=client, clip=clips[0]
        )
        waiting = [a for a, st in states if st.phase == "awaiting_commit" and st.active_run == run]
        self.c.pool.each([(a, request) for a in waiting], "CommitStep", 30.0)
        return True

    def grant(self) -> tuple[str, int, str]:
        """The running job, the newest client generation granted (which the stages
        follow) and its holder ("" when no client holds the job)."""
        job = self.c.job
        with self._lock:
            lease, (issued_to_gen, issued_to) = self._lease, self._issued
            issued = int(self.c.store.get("client_generation") or 0)
        if job is None:
            return "", 0, ""
        if lease is not None and lease.job_id == job.job_id and lease.client == issued:
            return job.job_id, lease.client, lease.holder
        # A generation issued but not yet leased (a client being attached or started: the
        # stages are being fenced to it) names its holder, so a stage that asks in between
        # does not lock that client out.
        return job.job_id, issued, issued_to if issued_to_gen == issued else ""

    # ---- checkpoint loads ------------------------------------------------------------

    def _check_holder(self, job_id: str, client: int) -> tuple[JobConfig, Partition]:
        job, partition = self.c.require_job()
        lease = self.lease()
        if job.job_id != job_id or lease is None or lease.client != client:
            raise Fenced(
                f"client generation {client} does not hold job {job_id} "
                f"(holder: {lease.holder if lease else 'nobody'})"
            )
        return job, partition

    def begin_restore(self, job_id: str, client: int) -> tuple[int, Partition]:
        """Freezes every stage for a checkpoint load; the client then streams the layers.

        Returns:
            The load's epoch, and the partition whose owners receive the layers.
        """
        with self.c.move_lock:
            _, partition = self._check_holder(job_id, client)
            epochs.check_no_change_in_progress(self.c)
            epoch = self.c.store.reserve_epoch()
            new = partition.evolve(epoch=epoch, restore_epoch=epoch)
            change = Change(
                "restore",
                "checkpoint load",
                partition,
                new,
                rollback_step=0,
                restored_by_client=True,
            )
            try:
                epochs.freeze(self.c, change, lease_s=RESTORE_LEASE_S)
            except ElasticPipeError as exc:
                epochs.abort(self.c, epoch, change.involved, str(exc))
                epochs.record_abandoned(self.c, change, str(exc))
                raise
            self._restoring = (change, time.monotonic() + RESTORE_LEASE_S, client)
        return epoch, partition

    def end_restore(self, job_id: str, epoch: int, step: int, commit: bool) -> Partition:
        """Makes a streamed checkpoint take effect on every stage, or on none.

        Raises:
            NotReady: no load of ``epoch`` is in progress.
            ElasticPipeError: a stage did not hold every layer it owns (nothing changed).
        """
        with self.c.move_lock:
            restoring, self._restoring = self._restoring, None
            if restoring is None or restoring[0].new.epoch != epoch:
                raise NotReady(f"no checkpoint load of epoch {epoch} is in progress")
            change = restoring[0]
            job, _ = self.c.require_job()
            if job.job_id != job_id:
                raise NotReady(f"job {job_id} is not the running job {job.job_id}")
            if not commit:
                epochs.abort(self.c, epoch, change.involved, "the client abandoned the load")
                epochs.record_abandoned(self.c, change, "the client abandoned the load")
                return change.old
            new = change.new.evolve(restored_step=step)
            # A job started from init_state loads it first, before any rollback or step.
            initial = job.external_weights and change.old.restore_epoch == 0 and step == 0
            change = replace(change, new=new, rollback_step=step)
            try:
                received = epochs.prepare(self.c, job, change, step)
                what = (
                    "initial weights (init_state) loaded"
                    if initial
                    else f"checkpoint of step {step} loaded"
                )
                row = EpochRow(
                    epoch=epoch,
                    at=time.time(),
                    reason=f"{what}: {new.num_layers} layers, {received} bytes streamed by "
                    "the client",
                    boundaries=new.boundaries,
                    stage_ids=new.stage_ids,
                    layers_moved=new.num_layers,
                    bytes_moved=received,
                    kind="restore",
                    job_id=new.job_id,
                    stage_names=tuple(self.c.names(new.stage_ids)),
                    restored_step=step,
                )
                self.c.store.commit_change(new, change.record("committed"), row)
            except ElasticPipeError as exc:
                epochs.abort(self.c, epoch, change.involved, str(exc))
                epochs.record_abandoned(self.c, change, str(exc))
                raise
            self.c.adopt(new)
            epochs.commit(self.c, change)
            self.wait_for_copies(new, job, step)
        log.info(
            "initial_weights_loaded" if initial else "checkpoint_loaded",
            job=job_id,
            step=step,
            epoch=epoch,
            bytes=received,
        )
        return new

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
        why = "the client went silent during the load"
        log.warning("checkpoint_load_abandoned", epoch=change.new.epoch, why=why)
        epochs.abort(self.c, change.new.epoch, change.involved, why)
        epochs.record_abandoned(self.c, change, why)
        return True
