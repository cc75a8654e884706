"""The CoordinatorService adapter: protobuf in, ``Coordinator`` calls, protobuf out."""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Iterator

import grpc

from elasticpipe.coordinator import epochs, replica_changes, replica_options
from elasticpipe.coordinator.claims import Claims
from elasticpipe.coordinator.coordinator import Coordinator
from elasticpipe.coordinator.leases import DEFAULT_LEASE_S
from elasticpipe.coordinator.membership import Heard, Member
from elasticpipe.coordinator.rebalancing import MoveOutcome
from elasticpipe.coordinator.replicas import Shape
from elasticpipe.errors import InvalidRequest, TooLarge
from elasticpipe.layout import Layout
from elasticpipe.logs import get_logger
from elasticpipe.partition import MAX_REPLICAS, Partition, StageRef
from elasticpipe.security import authz, bounds
from elasticpipe.security.admission import Limits
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import coordinator_pb2
from elasticpipe.wire import bundle

log = get_logger(__name__)

MAX_WAIT_S = bounds.MAX_WAIT_S
MAX_LONG_POLLS = 8  # of the server's 32 workers


def partition_to_proto(p: Partition | Layout | None) -> coordinator_pb2.Partition:
    """Wire form of a partition or layout (empty when there is none)."""
    return coordinator_pb2.Partition() if p is None else p.to_proto()


def _outcome(o: MoveOutcome) -> coordinator_pb2.RebalanceResponse:
    return coordinator_pb2.RebalanceResponse(
        changed=o.changed,
        partition=partition_to_proto(o.partition),
        decision=o.decision,
        predicted_gain=o.gain,
        bytes_moved=o.bytes_moved,
        pause_s=o.pause_s,
        target=partition_to_proto(o.target),
    )


def _bounded(value: float, what: str) -> float:
    if not 0 <= value <= MAX_WAIT_S:
        raise InvalidRequest(f"{what} must be in [0, {MAX_WAIT_S}] (got {value})")
    return value


def _holder(named: str) -> str:
    """Who holds a job: with TLS the client's certificate name (the stages accept the
    job's steps from that certificate only), else the name the client gave."""
    identity = authz.caller()
    return identity[0] if identity is not None else named


def _within_deadline(wait_s: float, ctx: grpc.ServicerContext) -> float:
    """A wait no longer than the caller's deadline (nobody would hear the answer)."""
    remaining = ctx.time_remaining()
    return wait_s if remaining is None else min(wait_s, max(0.0, remaining - 0.1))


class CoordinatorServicer:
    """Implements elasticpipe.v1.CoordinatorService on top of a ``Coordinator``."""

    def __init__(self, coordinator: Coordinator):
        self.c = coordinator
        self._polls = threading.BoundedSemaphore(MAX_LONG_POLLS)
        self._claims = Claims(coordinator.members)
        self._watch_s = Limits.from_env().watch_s
        self._learned_at = -math.inf  # when _learn_overheads last ran (monotonic)

    def _epoch(self) -> int:
        """The current epoch, against which requests' epochs are bounded."""
        p = self.c.cluster.partition
        return p.epoch if p is not None else 0

    # ---- stages ----------------------------------------------------------------------

    def Register(
        self, req: coordinator_pb2.RegisterRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        for what, value in (("name", req.name), ("address", req.address), ("device", req.device)):
            bounds.text(value, what)
        authz.check_name(req.name)  # with TLS, a stage is its certificate's name
        self._claims.check_register(req.name)  # a family never takes over an individual
        pin = bounds.text(req.replica, "replica", bounds.MAX_NAME)
        stage_id = self.c.register(req.name, req.address, req.device, req.memory_bytes)
        if (member := self.c.members.by_id(stage_id)) is not None:
            member.replica_pin = pin
        self._claims.spoke(stage_id)
        return coordinator_pb2.RegisterResponse(
            stage_id=stage_id, heartbeat_interval_s=self.c.heartbeat_interval_s
        )

    def _check_stage(self, stage_id: str) -> None:
        """With TLS, a stage speaks only for the incarnations of its own name."""
        member = self.c.members.by_id(stage_id)
        if member is not None:
            authz.check_name(member.row.name, "speak for")
            self._claims.spoke(stage_id)

    def _learn_overheads(self) -> None:
        """A stage measured a new pipeline time or wait between runs: the planner's
        overheads per slot and per step learn from them (``replica_options.note_overheads``),
        once a heartbeat interval at most
        (it plans every chain: after each heartbeat, a job of S stages would cost S times
        that); a failure to is logged, never the heartbeat's."""
        now = time.monotonic()
        if now - self._learned_at < self.c.cluster.heartbeat_interval_s:
            return
        before, self._learned_at = self._learned_at, now  # (heartbeats meanwhile: none)
        try:
            if not replica_options.note_overheads(self.c.cluster):
                self._learned_at = before  # (a stage not measured yet: the next heartbeat)
        except Exception as exc:  # (a partition changing under it, say: learn next time)
            log.info("overheads_not_learned", error=repr(exc))

    def Heartbeat(
        self, req: coordinator_pb2.HeartbeatRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        self._check_stage(req.stage_id)
        bounds.count(req.timings, "timings", bounds.MAX_LAYERS)
        for t in req.timings:
            bounds.timing(t.layer, t.forward_s, t.backward_s, t.output_bytes, t.samples)
        timings = {
            t.layer: (t.forward_s, t.backward_s, t.output_bytes, t.samples) for t in req.timings
        }
        pipeline_s = bounds.number(req.pipeline_s, "pipeline_s", 0.0, bounds.MAX_TIMING_S)
        reduce_rate = bounds.number(
            req.reduce_bytes_per_s, "reduce_bytes_per_s", 0.0, bounds.MAX_BYTES_PER_S
        )
        optimizer_rate = bounds.number(
            req.optimizer_bytes_per_s, "optimizer_bytes_per_s", 0.0, bounds.MAX_BYTES_PER_S
        )
        between = bounds.number(req.between_runs_s, "between_runs_s", 0.0, bounds.MAX_TIMING_S)
        replica = bounds.text(req.replica, "replica", bounds.MAX_NAME)
        committed_step = bounds.step(req.committed_step, "committed_step")
        heard = self.c.heartbeat(
            req.stage_id,
            bounds.epoch(req.epoch, self._epoch()),
            timings,
            committed_step,
            bounds.slowdown_report(req.slowdown),
            req.state if req.HasField("state") else None,
            list(req.snapshots),
        )
        if heard is Heard.OK and (member := self.c.members.by_id(req.stage_id)) is not None:
            member.memory_bytes = req.memory_bytes
            measured = (req.epoch, pipeline_s) if pipeline_s else None
            waited = (req.epoch, between) if between else None
            learn = (measured, waited) != (member.pipeline_s, member.between_runs)
            member.pipeline_s, member.between_runs = measured, waited
            member.reduce_rate = reduce_rate or member.reduce_rate  # (kept across jobs)
            member.optimizer_rate = optimizer_rate or member.optimizer_rate
            if learn and measured is not None:
                self._learn_overheads()
            member.replica_pin = replica
        return coordinator_pb2.HeartbeatResponse(
            reregister=heard is not Heard.OK,
            dead=heard is Heard.DEAD,
            safe_step=self.c.jobs.safe_step(),
            rendezvous=job.rendezvous if (job := self.c.cluster.job) is not None else "",
            report_after_step=heard is Heard.OK and self.c.rebalancer.confirming(committed_step),
        )

    def ResolveRun(
        self, req: coordinator_pb2.ResolveRunRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.ResolveRunResponse:
        self._check_stage(req.stage_id)
        return coordinator_pb2.ResolveRunResponse(
            decision=self.c.jobs.resolve_run(
                req.stage_id, bounds.run(req.run), bounds.step(req.step)
            )
        )

    def JobClient(
        self, req: coordinator_pb2.JobClientRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.JobClientResponse:
        self._check_stage(req.stage_id)
        job_id, client, holder = self.c.jobs.grant()
        return coordinator_pb2.JobClientResponse(job_id=job_id, client=client, holder=holder)

    def EpochOutcome(
        self, req: coordinator_pb2.EpochOutcomeRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.EpochOutcomeResponse:
        return coordinator_pb2.EpochOutcomeResponse(
            outcome=epochs.outcome(self.c.cluster, bounds.epoch(req.epoch, self._epoch()))
        )

    def Leave(
        self, req: coordinator_pb2.LeaveRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        self._check_stage(req.stage_id)
        timeout = _within_deadline(_bounded(req.timeout_s, "timeout_s"), ctx)
        with self._long_poll("Leave"):  # it waits for the layers to move off
            return _outcome(self.c.leave(req.stage_id, timeout))

    # ---- clients ---------------------------------------------------------------------

    def SetupJob(
        self, req: coordinator_pb2.SetupJobRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.SetupJobResponse:
        job = JobConfig.from_proto(req.job)
        bounds.number(req.num_stages, "num_stages", 0, bounds.MAX_STAGES)
        bounds.count(req.replica_stages, "replica_stages", MAX_REPLICAS)
        shape = Shape.parse(req.replica_stages, req.auto_replicas, req.num_stages)
        bounds.number(sum(shape.sizes), "the sum of replica_stages", 0, bounds.MAX_STAGES)
        sample = bundle.get_sample(req.job)
        wait_s = _within_deadline(_bounded(req.wait_s, "wait_s"), ctx)
        with self._long_poll("SetupJob"):  # it may wait for stages to register
            attached = self.c.jobs.setup(
                job,
                sample,
                req.num_stages,
                wait_s,
                req.resume,
                req.lease_s or DEFAULT_LEASE_S,
                _holder(req.client_name[:200] or ctx.peer()),
                ctx.is_active,  # a cancelled call gives its place back at once
                bounds.text(req.request_id, "request_id", 64),
                shape,
            )
        return coordinator_pb2.SetupJobResponse(
            partition=self._wire(attached.partition),
            num_layers=attached.num_layers,
            client=attached.client,
            committed_step=attached.committed_step,
            resumed=attached.resumed,
            safe_step=attached.safe_step,
            profiled=attached.profiled,
            awaits_weights=attached.awaits_weights,
        )

    def ProfileJob(
        self, req: coordinator_pb2.ProfileJobRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.Partition:
        bounds.client(req.client)
        sample = bundle.get_sample(req)
        if sample is None:
            raise InvalidRequest("ProfileJob needs sample_input (one micro-batch of inputs)")
        self.c.profile_job(req.job_id, req.client, sample)
        return self._wire(self.c.cluster.partition)

    def RenewLease(
        self, req: coordinator_pb2.LeaseRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.LeaseResponse:
        figure = bounds.number(req.efficiency, "efficiency", 0.0, 1.0)
        bounds.client(req.client)
        bounds.step(req.last_step, "last_step")
        bounds.count(req.loop_pauses, "loop_pauses", bounds.MAX_LOOP_PAUSES)
        pauses = [
            (
                bounds.integer(p.epoch, f"loop_pauses[{i}].epoch", 0, bounds.MAX_STEP),
                bounds.number(p.pause_s, f"loop_pauses[{i}].pause_s", 0.0, bounds.MAX_TIMING_S),
            )
            for i, p in enumerate(req.loop_pauses)
        ]
        held, safe = self.c.jobs.renew(
            req.job_id, req.client, req.release, (req.last_step, figure), pauses
        )
        return coordinator_pb2.LeaseResponse(held=held, safe_step=safe)

    def ReportFailure(
        self, req: coordinator_pb2.FailureReport, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.FailureAck:
        bounds.count(req.suspects, "suspects", bounds.MAX_STAGES)
        dead = self.c.recovery.report(list(req.suspects), req.error[:1000])
        return coordinator_pb2.FailureAck(dead=dead)

    def BeginRestore(
        self, req: coordinator_pb2.RestoreBeginRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RestoreBeginResponse:
        epoch, partition = self.c.jobs.begin_restore(req.job_id, bounds.client(req.client))
        return coordinator_pb2.RestoreBeginResponse(
            epoch=epoch, partition=partition_to_proto(partition)
        )

    def EndRestore(
        self, req: coordinator_pb2.RestoreEndRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.Partition:
        return partition_to_proto(
            self.c.jobs.end_restore(
                req.job_id,
                bounds.epoch(req.epoch, self._epoch()),
                bounds.step(req.step),
                req.commit,
            )
        )

    def GetPartition(
        self, req: coordinator_pb2.GetPartitionRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.Partition:
        timeout = bounds.number(req.timeout_s, "timeout_s", 0, bounds.MAX_LONG_POLL_S)
        remaining = ctx.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(0.0, remaining - 0.1))
        if timeout <= 0:
            return self._wire(self.c.cluster.get_partition(req.newer_than, 0.0))
        with self._long_poll("GetPartition"):
            return self._wire(self.c.cluster.get_partition(req.newer_than, timeout))

    def WatchPartition(
        self, req: coordinator_pb2.GetPartitionRequest, ctx: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.Partition]:
        seen = req.newer_than
        ends = time.monotonic() + self._watch_s  # the watcher calls again: no call is forever
        with self._long_poll("WatchPartition"):
            while ctx.is_active() and time.monotonic() < ends:
                partition = self.c.cluster.get_partition(seen, 1.0)
                if partition.epoch > seen:
                    seen = partition.epoch
                    yield self._wire(partition)

    @contextlib.contextmanager
    def _long_poll(self, method: str) -> Iterator[None]:
        """A place among the few calls that may wait long (for a newer partition, for
        stages to register, for layers to move): the server's workers stay free for the
        rest.

        Raises:
            TooLarge: every place is taken.
        """
        if not self._polls.acquire(blocking=False):
            raise TooLarge(
                f"{method} refused: {MAX_LONG_POLLS} calls already wait (partition long "
                "polls, SetupJob, Leave: at most "
                f"{MAX_LONG_POLLS} at once); retry shortly"
            )
        try:
            yield
        finally:
            self._polls.release()

    # ---- admin -----------------------------------------------------------------------

    def _wire(self, p: Partition | None) -> coordinator_pb2.Partition:
        """A partition's wire form: with every replica when it is the job's replica 0."""
        layout = self.c.cluster.layout
        if p is not None and layout is not None and layout.epoch == p.epoch:
            return layout.to_proto()
        return partition_to_proto(p)

    def _stage_info(self, m: Member) -> coordinator_pb2.StageInfo:
        cluster = self.c.cluster
        layout = cluster.job_layout()
        replica = layout.replica_of_stage(m.row.stage_id) if layout is not None else None
        p = layout.replicas[replica] if layout is not None and replica is not None else None
        index = p.index_of(m.row.stage_id) if p is not None else None
        lo = hi = 0
        if p is not None and index is not None:
            lo, hi = p.boundaries[index], p.boundaries[index + 1]
        alive = cluster.members.alive(m)
        state = cluster.members.state(m, index is not None)
        speed = cluster.speed_of(m) if cluster.job is not None and index is not None else None
        return coordinator_pb2.StageInfo(
            stage_id=m.row.stage_id,
            name=m.row.name,
            address=m.row.address,
            device=m.row.device,
            speed=speed or 0.0,
            alive=alive,
            last_heartbeat_unix=m.last_seen_unix,
            index=-1 if index is None else index,
            layer_lo=lo,
            layer_hi=hi,
            committed_step=m.committed_step,
            slowdown=m.slowdown,
            state=state,
            incarnation=m.row.incarnation,
            memory_bytes=m.memory_bytes,
            replica=-1 if replica is None else replica,
            pinned_replica=m.replica_pin,
        )

    def Status(
        self, req: coordinator_pb2.StatusRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.StatusResponse:
        cluster = self.c.cluster
        p, job = cluster.partition, cluster.job
        job_id = None if req.all_jobs or job is None else job.job_id
        history = [
            coordinator_pb2.EpochRecord(
                epoch=r.epoch,
                at_unix=r.at,
                reason=r.reason,
                boundaries=list(r.boundaries),
                layers_moved=r.layers_moved,
                bytes_moved=r.bytes_moved,
                pause_s=r.pause_s,
                kind=r.kind,
                stages=list(r.stage_names),
                restored_step=r.restored_step,
                lost_steps=r.lost_steps,
                job_id=r.job_id,
                detected_unix=r.detected_at,
                loop_pause_s=r.loop_pause_s,
            )
            for r in cluster.store.epochs(job_id=job_id)
        ]
        lease = self.c.jobs.lease()
        factory = cluster.store.get("factory") or ["", ""]
        steps = [
            m.committed_step
            for sid in cluster.job_stage_ids()
            if (m := cluster.members.by_id(sid)) is not None
        ]
        return coordinator_pb2.StatusResponse(
            stages=[self._stage_info(m) for m in cluster.members.members()],
            partition=self._wire(p),
            history=history,
            job_model=job.model if job else "",
            num_layers=cluster.num_layers,
            auto_rebalance=self.c.rebalancer.policy.enabled,
            job_id=job.job_id if job else "",
            client=lease.holder if lease else "",
            committed_step=min(steps, default=0),
            job_failure=cluster.failure,
            factory_file=factory[0],
            efficiency=self.c.jobs.efficiency[1],
            efficiency_step=self.c.jobs.efficiency[0],
            factory_sha256=factory[1],
            leader=cluster.address,
            term=cluster.term(),
        )

    def Plan(
        self, req: coordinator_pb2.PlanRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.PlanResponse:
        view = self.c.rebalancer.plan_view()
        cluster = self.c.cluster
        stage_ids, candidates = replica_changes.layout_candidates(cluster)
        timed = cluster.in_seconds(stage_ids)
        refs = [
            StageRef(sid, m.row.address if (m := cluster.members.by_id(sid)) else "")
            for sid in stage_ids
        ]
        layouts = [
            coordinator_pb2.LayoutCandidate(
                replicas=[
                    Partition(
                        0, view.current.job_id, plan.boundaries, tuple(refs[h] for h in hosts)
                    ).to_proto()
                    for hosts, plan in zip(c.replicas, c.plans, strict=True)
                ],
                shares=list(c.shares),
                step_s=c.step_s,
                reduce_s=c.reduce_s,
                in_seconds=view.in_seconds,
                per_step_s=c.per_step_s,
            )
            for c in candidates
        ]
        return coordinator_pb2.PlanResponse(
            layouts=layouts,
            # (what the candidates were planned with: over the job's stages and the spares)
            reduce_bytes_per_s=cluster.reduce_bandwidth(timed) or 0.0,
            slot_overhead_s=cluster.slot_overhead(timed),
            step_overhead_s=(per_step := cluster.per_step(timed)).fixed_s,
            optimizer_bytes_per_s=per_step.optimizer_rate or 0.0,
            current=self._wire(view.current),
            optimal_boundaries=list(view.optimal.boundaries),
            current_step_s=view.current_step_s if view.in_seconds else None,
            optimal_step_s=view.optimal_step_s if view.in_seconds else None,
            stage_speeds=view.speeds,
            layer_costs=list(view.costs),
            bytes_to_move=view.bytes_to_move,
            stage_names=self.c.cluster.names(view.current.stage_ids),
            stage_speed_spreads=view.speed_spreads,
        )

    def Rebalance(
        self, req: coordinator_pb2.RebalanceRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        return _outcome(
            self.c.rebalancer.rebalance(req.dry_run, req.reason[:200] or "admin rebalance")
        )

    def SetPartition(
        self, req: coordinator_pb2.SetPartitionRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        bounds.count(req.boundaries, "boundaries", bounds.MAX_LAYERS + 1)
        bounds.count(req.stage_ids, "stage_ids", bounds.MAX_STAGES)
        return _outcome(
            self.c.rebalancer.set_partition(
                list(req.boundaries), list(req.stage_ids), "admin set-partition"
            )
        )

    def SetLayout(
        self, req: coordinator_pb2.SetLayoutRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        bounds.count(req.replicas, "replicas", MAX_REPLICAS)
        bounds.count(req.shares, "shares", MAX_REPLICAS)
        for r, spec in enumerate(req.replicas):
            bounds.count(spec.boundaries, f"replicas[{r}].boundaries", bounds.MAX_LAYERS + 1)
            bounds.count(spec.stage_ids, f"replicas[{r}].stage_ids", bounds.MAX_STAGES)
        chains = [(list(s.boundaries), list(s.stage_ids)) for s in req.replicas]
        outcome = self.c.rebalancer.set_layout(chains, list(req.shares), "admin set-layout")
        return _outcome(outcome)

    def Drain(
        self, req: coordinator_pb2.DrainRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        return _outcome(self.c.rebalancer.drain(req.stage))

    def Undrain(
        self, req: coordinator_pb2.DrainRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        return _outcome(self.c.rebalancer.undrain(req.stage))

    def Slowdown(
        self, req: coordinator_pb2.AdminSlowdownRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.AdminAck:
        bounds.number(req.factor, "factor", 1.0, bounds.MAX_SLOWDOWN)
        return coordinator_pb2.AdminAck(message=self.c.slowdown(req.stage, req.factor))

    def SetAutoRebalance(
        self, req: coordinator_pb2.AutoRebalanceRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.AdminAck:
        return coordinator_pb2.AdminAck(message=self.c.rebalancer.set_auto(req.enabled))

    def Forget(
        self, req: coordinator_pb2.DrainRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.AdminAck:
        return coordinator_pb2.AdminAck(message=self.c.forget(req.stage))
