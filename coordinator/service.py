"""The CoordinatorService adapter: protobuf in, ``Coordinator`` calls, protobuf out."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from elasticpipe import codec
from elasticpipe.coordinator.coordinator import Coordinator, MoveOutcome
from elasticpipe.coordinator.store import PartitionRow
from elasticpipe.errors import InvalidRequest
from elasticpipe.job import JobConfig
from elasticpipe.v1 import coordinator_pb2

MAX_WAIT_S = 600.0


def partition_to_proto(p: PartitionRow | None) -> coordinator_pb2.Partition:
    """Wire form of a partition (empty when there is none)."""
    if p is None:
        return coordinator_pb2.Partition()
    return coordinator_pb2.Partition(
        epoch=p.epoch,
        job_id=p.job_id,
        boundaries=list(p.boundaries),
        stage_ids=list(p.stage_ids),
        addresses=list(p.addresses),
        predicted_step_s=p.predicted_step_s,
    )


def _outcome(o: MoveOutcome) -> coordinator_pb2.RebalanceResponse:
    return coordinator_pb2.RebalanceResponse(
        changed=o.changed,
        partition=partition_to_proto(o.partition),
        decision=o.decision,
        predicted_gain=o.gain,
        bytes_moved=o.bytes_moved,
        pause_s=o.pause_s,
    )


def _bounded(value: float, what: str) -> float:
    if not 0 <= value <= MAX_WAIT_S:
        raise InvalidRequest(f"{what} must be in [0, {MAX_WAIT_S}] (got {value})")
    return value


class CoordinatorServicer:
    """Implements elasticpipe.v1.CoordinatorService on top of a ``Coordinator``."""

    def __init__(self, coordinator: Coordinator):
        self.c = coordinator

    def Register(
        self, req: coordinator_pb2.RegisterRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RegisterResponse:
        return coordinator_pb2.RegisterResponse(
            stage_id=self.c.register(req.name, req.address, req.device),
            heartbeat_interval_s=self.c.heartbeat_interval_s,
        )

    def Heartbeat(
        self, req: coordinator_pb2.HeartbeatRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.HeartbeatResponse:
        timings = {
            t.layer: (t.forward_s, t.backward_s, t.output_bytes, t.samples) for t in req.timings
        }
        known = self.c.heartbeat(req.stage_id, req.epoch, timings, req.committed_step, req.slowdown)
        return coordinator_pb2.HeartbeatResponse(reregister=not known)

    def SetupJob(
        self, req: coordinator_pb2.SetupJobRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.SetupJobResponse:
        job = JobConfig.from_proto(req.job)
        sample = (
            codec.from_proto(req.job.sample_input) if req.job.HasField("sample_input") else None
        )
        partition = self.c.setup_job(job, sample, req.num_stages, _bounded(req.wait_s, "wait_s"))
        return coordinator_pb2.SetupJobResponse(
            partition=partition_to_proto(partition), num_layers=self.c.num_layers
        )

    def GetPartition(
        self, req: coordinator_pb2.GetPartitionRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.Partition:
        timeout = _bounded(req.timeout_s, "timeout_s")
        remaining = ctx.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(0.0, remaining - 0.1))
        return partition_to_proto(self.c.get_partition(req.newer_than, timeout))

    def WatchPartition(
        self, req: coordinator_pb2.GetPartitionRequest, ctx: grpc.ServicerContext
    ) -> Iterator[coordinator_pb2.Partition]:
        seen = req.newer_than
        while ctx.is_active():
            partition = self.c.get_partition(seen, 1.0)
            if partition.epoch > seen:
                seen = partition.epoch
                yield partition_to_proto(partition)

    def Status(
        self, req: coordinator_pb2.StatusRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.StatusResponse:
        c = self.c
        p = c.partition
        stages = []
        for m in c.members.members():
            index, lo, hi = -1, 0, 0
            if p is not None and m.row.stage_id in p.stage_ids:
                index = p.stage_ids.index(m.row.stage_id)
                lo, hi = p.boundaries[index], p.boundaries[index + 1]
            speed = c.speed_of(m) if c.job is not None else None
            stages.append(
                coordinator_pb2.StageInfo(
                    stage_id=m.row.stage_id,
                    name=m.row.name,
                    address=m.row.address,
                    device=m.row.device,
                    speed=speed or 0.0,
                    alive=c.members.alive(m),
                    last_heartbeat_unix=m.last_seen_unix,
                    index=index,
                    layer_lo=lo,
                    layer_hi=hi,
                    committed_step=m.committed_step,
                    slowdown=m.slowdown,
                )
            )
        history = [
            coordinator_pb2.EpochRecord(
                epoch=r.epoch,
                at_unix=r.at,
                reason=r.reason,
                boundaries=list(r.boundaries),
                layers_moved=r.layers_moved,
                bytes_moved=r.bytes_moved,
                pause_s=r.pause_s,
            )
            for r in c.store.epochs()
        ]
        return coordinator_pb2.StatusResponse(
            stages=stages,
            partition=partition_to_proto(p),
            history=history,
            job_model=c.job.model if c.job else "",
            num_layers=c.num_layers,
            auto_rebalance=c.policy.enabled,
        )

    def Plan(
        self, req: coordinator_pb2.PlanRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.PlanResponse:
        view = self.c.plan_view()
        return coordinator_pb2.PlanResponse(
            current=partition_to_proto(view.current),
            optimal_boundaries=list(view.optimal.boundaries),
            current_step_s=view.current_step_s,
            optimal_step_s=view.optimal_step_s,
            stage_speeds=view.speeds,
            layer_costs=list(view.costs),
            bytes_to_move=view.bytes_to_move,
        )

    def Rebalance(
        self, req: coordinator_pb2.RebalanceRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        return _outcome(self.c.rebalance(req.dry_run, req.reason or "admin rebalance"))

    def SetPartition(
        self, req: coordinator_pb2.SetPartitionRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        return _outcome(
            self.c.set_partition(list(req.boundaries), list(req.stage_ids), "admin set-partition")
        )

    def Drain(
        self, req: coordinator_pb2.DrainRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        return _outcome(self.c.drain(req.stage))

    def Undrain(
        self, req: coordinator_pb2.DrainRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.RebalanceResponse:
        return _outcome(self.c.undrain(req.stage))

    def Slowdown(
        self, req: coordinator_pb2.AdminSlowdownRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.AdminAck:
        return coordinator_pb2.AdminAck(message=self.c.slowdown(req.stage, req.factor))

    def SetAutoRebalance(
        self, req: coordinator_pb2.AutoRebalanceRequest, ctx: grpc.ServicerContext
    ) -> coordinator_pb2.AdminAck:
        return coordinator_pb2.AdminAck(message=self.c.set_auto(req.enabled))
