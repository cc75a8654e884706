"""The StageService adapter: protobuf in, ``Stage`` domain calls, protobuf out."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence

import grpc

from elasticpipe.errors import InvalidRequest
from elasticpipe.partition import Placement
from elasticpipe.security import bounds
from elasticpipe.stage_server import callers, inline
from elasticpipe.stage_server.bulk import BulkListener
from elasticpipe.stage_server.faults import Fault
from elasticpipe.stage_server.mailbox import Slot
from elasticpipe.stage_server.protocol import Decision, RunState
from elasticpipe.stage_server.slicestate import LayerTiming
from elasticpipe.stage_server.snapshots import Holding, receive_copy
from elasticpipe.stage_server.stage import Admitted, Stage
from elasticpipe.stage_server.tracing import MAX_TRACE_SPANS, SpanKind
from elasticpipe.training.clipping import GradClip
from elasticpipe.training.job import JobConfig, json_object
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import bundle, layer_state

_SCHEDULES = {
    stage_pb2.GPIPE: "gpipe",
    stage_pb2.ONE_F_ONE_B: "1f1b",
    stage_pb2.ZB_H1: "zb-h1",
}
_SLOTS: dict[int, Slot] = {
    stage_pb2.INPUT: Slot.INPUT,
    stage_pb2.GRAD: Slot.GRAD,
    stage_pb2.TARGET: Slot.TARGET,
    stage_pb2.REDUCE: Slot.REDUCE,
}
MAX_STEP_TIMEOUT_S = bounds.MAX_TIMEOUT_S


def timings_to_proto(timings: dict[int, LayerTiming]) -> list[stage_pb2.LayerTiming]:
    """Per-layer measurements in wire form."""
    return [
        stage_pb2.LayerTiming(
            layer=i,
            forward_s=t.forward_s,
            backward_s=t.backward_s,
            output_bytes=t.output_bytes,
            samples=t.samples,
            stash_bytes=t.stash_bytes,
            state_bytes=t.state_bytes,
        )
        for i, t in sorted(timings.items())
    ]


def _clip(msg: stage_pb2.GradClip) -> GradClip:
    """A commit's clipping from the wire.

    Raises:
        InvalidRequest: a coefficient outside [0, 1].
    """
    try:
        return GradClip.from_proto(msg)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


def state_to_proto(state: RunState) -> stage_pb2.RunState:
    """The step/epoch protocol state in wire form."""
    return stage_pb2.RunState(
        phase=state.phase.value,
        epoch=state.epoch,
        committed_step=state.committed_step,
        committed_run=state.committed_run,
        active_run=state.active_run,
        active_step=state.active_step,
        fence=state.fence,
        frozen_for=state.frozen_for,
        prepared=state.prepared,
        committed_clip=state.committed_clip.to_proto(),
    )


def holdings_to_proto(holdings: list[Holding]) -> list[stage_pb2.SnapshotHolding]:
    """Snapshot holdings in wire form."""
    return [
        stage_pb2.SnapshotHolding(
            job_id=h.job_id,
            step=h.step,
            layers=list(h.layers),
            peer_copy=h.peer_copy,
            digests=list(h.digests),
            taken_epoch=h.taken_epoch,
        )
        for h in holdings
    ]


def _shares(shares: Sequence[int]) -> list[int]:
    """A RunStep's replicas' shares, bounded (their sum is a step's micro-batch count).

    Raises:
        InvalidRequest: too many, or a step of too many micro-batches.
    """
    bounds.count(shares, "shares", bounds.MAX_STAGES)
    bounds.number(sum(shares), "the sum of shares", 0, bounds.MAX_MICRO_BATCHES)
    return list(shares)


def _slot(value: int) -> Slot:
    """A data message's slot from the wire.

    Raises:
        InvalidRequest: a slot that is not INPUT, GRAD, TARGET or REDUCE.
    """
    slot = _SLOTS.get(value)
    if slot is None:
        raise InvalidRequest(f"unknown slot {value} (expected INPUT, GRAD, TARGET or REDUCE)")
    return slot


def _lease(value: float, what: str) -> float:
    if not 0 < value <= MAX_STEP_TIMEOUT_S:
        raise InvalidRequest(f"{what} must be in (0, {MAX_STEP_TIMEOUT_S}] seconds (got {value})")
    return value


class StageServicer:
    """Implements elasticpipe.v1.StageService on top of a ``Stage``."""

    def __init__(self, stage: Stage):
        self.stage = stage
        self.gate = callers.ClientGate(stage)  # the client granted the job, nobody else
        self.bulk: BulkListener | None = None  # the bulk channel's listener, if any

    def _admit(
        self, header: stage_pb2.DataHeader, nbytes: int | None, slot: Slot
    ) -> tuple[bundle.Assembler, Admitted]:
        """Checks the declared tensor(s) (unless ``nbytes`` says it was done), the caller,
        the secret's length, the epoch, the run and the room left, and reserves the room,
        before anything is allocated (every data path comes here: ``Deliver``, the
        streams, the bulk channel); and the assembler of the bytes to come."""
        limit = self.stage.config.max_tensor_bytes
        if nbytes is None:
            nbytes = bundle.declared_bytes(header, limit)
        return bundle.assembler(header, limit), self._reserve(header, nbytes, slot)

    def _reserve(self, header: stage_pb2.DataHeader, nbytes: int, slot: Slot) -> Admitted:
        """``_admit``'s checks past the declared tensors, which the caller checked and
        counted (``nbytes``), and the room reserved."""
        self.gate.check(f"data of run {header.run}")
        bounds.run_secret(header.secret, "DataHeader.secret")  # held as a key: never unbounded
        return self.stage.admit(header.epoch, header.run, header.micro_batch, nbytes, slot)

    def admit_data(
        self, slot: int, header: stage_pb2.DataHeader, nbytes: int
    ) -> tuple[Slot, Admitted]:
        """``_admit`` for a bulk message whose declared tensors its caller checked
        (``bundle.declared``) and counted (``nbytes``): its slot checked too; the room
        reserved."""
        kind = _slot(slot)
        return kind, self._reserve(header, nbytes, kind)

    def _receive(
        self,
        slot: Slot,
        header: stage_pb2.DataHeader,
        nbytes: int | None,
        parts: Iterator[bytes],
    ) -> stage_pb2.Ack:
        """Admits ``header`` (``_admit``), assembles its tensor from ``parts`` and delivers it
        to ``slot``; the room reserved is given back if the bytes do not make the tensor."""
        assembler, admitted = self._admit(header, nbytes, slot)
        try:
            for part in parts:
                assembler.add(part)
            tensor = assembler.finish()
        except BaseException:
            admitted.mailbox.release(admitted.reservation)
            raise
        self.stage.deliver(
            admitted,
            slot,
            header.run,
            header.micro_batch,
            tensor,
            header.loss_scale,
            secret=header.secret,
        )
        return stage_pb2.Ack()

    def _deliver(self, slot: Slot, chunks: Iterator[stage_pb2.DataChunk]) -> stage_pb2.Ack:
        first = next(chunks, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidRequest("a data stream must start with a DataHeader")
        header = first.header

        def data() -> Iterator[bytes]:
            for chunk in chunks:
                if chunk.WhichOneof("part") != "data":
                    raise InvalidRequest(
                        f"second DataHeader in the stream of micro-batch {header.micro_batch}"
                    )
                yield chunk.data

        return self._receive(slot, header, None, data())

    # ---- data path -------------------------------------------------------------------

    def Forward(
        self, chunks: Iterator[stage_pb2.DataChunk], ctx: grpc.ServicerContext
    ) -> stage_pb2.Ack:
        return self._deliver(Slot.INPUT, chunks)

    def Backward(
        self, chunks: Iterator[stage_pb2.DataChunk], ctx: grpc.ServicerContext
    ) -> stage_pb2.Ack:
        return self._deliver(Slot.GRAD, chunks)

    def Targets(
        self, chunks: Iterator[stage_pb2.DataChunk], ctx: grpc.ServicerContext
    ) -> stage_pb2.Ack:
        return self._deliver(Slot.TARGET, chunks)

    def Reduce(
        self, chunks: Iterator[stage_pb2.DataChunk], ctx: grpc.ServicerContext
    ) -> stage_pb2.Ack:
        return self._deliver(Slot.REDUCE, chunks)

    def Deliver(self, msg: stage_pb2.DataMessage, ctx: grpc.ServicerContext) -> stage_pb2.Ack:
        slot = _slot(msg.slot)
        declared = bundle.declared_bytes(msg.header, self.stage.config.max_tensor_bytes)
        if len(msg.data) != declared:
            raise InvalidRequest(
                f"received {len(msg.data)} bytes for a tensor declared as {declared} bytes"
            )
        return self._receive(slot, msg.header, declared, iter((msg.data,)))

    def OpenBulk(
        self, req: stage_pb2.OpenBulkRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.OpenBulkReply:
        if self.bulk is None:
            return stage_pb2.OpenBulkReply()  # port 0: send over gRPC
        self.gate.check("a bulk channel")  # a client other than the job's holder: refused
        return stage_pb2.OpenBulkReply(port=self.bulk.port, token=self.bulk.grant())

    def RunStep(
        self, req: stage_pb2.RunStepRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.StepReport:
        return self.run_step(req, ctx.time_remaining())

    def run_step(
        self, req: stage_pb2.RunStepRequest, remaining: float | None
    ) -> stage_pb2.StepReport:
        """``RunStep``, over gRPC or the bulk channel (``bulk_calls``); ``remaining``:
        the seconds left of the call's own deadline, if it has one."""
        if req.mode not in (stage_pb2.TRAIN, stage_pb2.INFER):
            raise InvalidRequest(f"unknown run mode {req.mode}")
        train = req.mode == stage_pb2.TRAIN
        if train and req.schedule not in _SCHEDULES:
            raise InvalidRequest(f"unknown schedule {req.schedule}")
        bounds.number(req.timeout_s, "timeout_s", 0, bounds.MAX_TIMEOUT_S, lo_open=True)
        bounds.number(req.micro_batches, "micro_batches", 1, bounds.MAX_MICRO_BATCHES)
        timeout = min(req.timeout_s, remaining) if remaining is not None else req.timeout_s
        bounds.count(req.previous, "previous", bounds.MAX_DECISIONS)
        self.gate.check(f"RunStep of run {req.run}", req.client)
        bounds.run_secret(req.secret)
        previous = [Decision(d.run, d.step, d.commit, _clip(d.clip)) for d in req.previous]
        carried = inline.decode(req, self.stage.config.max_tensor_bytes)
        result = self.stage.run_step(
            req.epoch,
            req.run,
            req.step,
            req.micro_batches,
            _SCHEDULES.get(req.schedule, "gpipe"),
            train,
            timeout,
            req.client,
            previous,
            secret=req.secret,
            shares=_shares(req.shares),
            generation=req.reduce_generation,
            inline=carried,
        )
        return stage_pb2.StepReport(
            run=result.run,
            losses=result.losses,
            peak_stashed=result.peak_stashed,
            peak_stashed_bytes=result.peak_stashed_bytes,
            compute_s=result.compute_s,
            wall_s=result.wall_s,
            timings=timings_to_proto(self.stage.timings()),
            forward_s=[result.forward_s[i] for i in sorted(result.forward_s)],
            backward_s=[result.backward_s[i] for i in sorted(result.backward_s)],
            weight_s=[result.weight_s[i] for i in sorted(result.weight_s)],
            grad_sq_norm=result.grad_sq_norm,
            lr=result.lr,
            loss_scale=result.loss_scale,
        )

    def FetchOutput(
        self, req: stage_pb2.FetchOutputRequest, ctx: grpc.ServicerContext
    ) -> Iterator[stage_pb2.DataChunk]:
        self.gate.check(f"FetchOutput of run {req.run}")
        bounds.integer(req.micro_batch, "micro_batch", 0, bounds.MAX_MICRO_BATCHES - 1)
        value = self.stage.fetch_output(req.run, req.micro_batch, req.secret)
        head = stage_pb2.DataHeader(
            epoch=self.stage.epoch, run=req.run, micro_batch=req.micro_batch
        )
        bundle.describe(head, value)
        yield stage_pb2.DataChunk(header=head)
        for chunk in bundle.chunks(value):
            yield stage_pb2.DataChunk(data=chunk)

    def CommitStep(
        self, req: stage_pb2.CommitStepRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.CommitStepResponse:
        return self.commit(req)

    def commit(self, req: stage_pb2.CommitStepRequest) -> stage_pb2.CommitStepResponse:
        """``CommitStep``, over gRPC or the bulk channel (``bulk_calls``)."""
        self.gate.check(f"CommitStep of run {req.run}", req.client, coordinator_may=True)
        bounds.epoch(req.epoch, self.stage.epoch)
        bounds.run(req.run)
        bounds.step(req.step)
        committed = self.stage.commit_step(
            req.epoch, req.run, req.step, req.client, _clip(req.clip)
        )
        return stage_pb2.CommitStepResponse(committed_step=committed)

    def AbortStep(
        self, req: stage_pb2.AbortStepRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.Ack:
        self.gate.check(f"AbortStep of run {req.run}", req.client, coordinator_may=True)
        self.stage.abort_step(req.run, req.reason[:500] or "aborted by the client", req.client)
        return stage_pb2.Ack()

    def Fence(self, req: stage_pb2.FenceRequest, ctx: grpc.ServicerContext) -> stage_pb2.RunState:
        bounds.text(req.holder, "holder")
        return state_to_proto(self.stage.fence(req.client, req.holder))

    # ---- control ---------------------------------------------------------------------

    def Describe(
        self, req: stage_pb2.DescribeRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.DescribeResponse:
        num_layers, param_bytes, path, digest = self.stage.describe(JobConfig.from_proto(req.job))
        return stage_pb2.DescribeResponse(
            num_layers=num_layers,
            param_bytes=param_bytes,
            factory_file=path,
            factory_sha256=digest,
        )

    def Profile(
        self, req: stage_pb2.ProfileRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.ProfileResponse:
        if not 0 < req.repeats <= 100:  # before the job and its sample are decoded
            raise InvalidRequest(f"repeats must be in [1, 100] (got {req.repeats})")
        job = JobConfig.from_proto(req.job)
        sample = bundle.get_sample(req.job, self.stage.config.max_tensor_bytes)
        if sample is None:
            raise InvalidRequest("Profile needs job.sample_input (one micro-batch of inputs)")
        timings = self.stage.profile(job, sample, req.repeats)
        return stage_pb2.ProfileResponse(timings=timings_to_proto(dict(enumerate(timings))))

    def Assign(
        self, req: stage_pb2.AssignRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.AssignResponse:
        job = JobConfig.from_proto(req.job)
        placement = Placement.from_proto(req.assignment)
        return stage_pb2.AssignResponse(num_layers=self.stage.assign(job, placement))

    # ---- migration -------------------------------------------------------------------

    def Freeze(
        self, req: stage_pb2.EpochRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.FreezeResponse:
        remaining = ctx.time_remaining() or 30.0
        lease = _lease(req.lease_s or 60.0, "lease_s")
        with self.stage.tracer.span(SpanKind.FREEZE, epoch=req.epoch):
            committed = self.stage.freeze(
                req.epoch, max(0.0, remaining - 0.5), lease, req.abort_running
            )
        return stage_pb2.FreezeResponse(committed_step=committed)

    def PrepareEpoch(
        self, req: stage_pb2.PrepareEpochRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.PrepareEpochResponse:
        job = JobConfig.from_proto(req.job)
        placement = Placement.from_proto(req.assignment)
        if placement.epoch != req.epoch:
            raise InvalidRequest(
                f"assignment epoch {placement.epoch} differs from request epoch {req.epoch}"
            )
        if job.rendezvous:  # the leader's now (a new leader's, before its first heartbeat)
            self.stage.rendezvous = job.rendezvous
        incoming = [(src.layer, src.address) for src in req.incoming]
        remaining = ctx.time_remaining() or req.timeout_s or 60.0
        with self.stage.tracer.span(SpanKind.PREPARE, epoch=req.epoch):
            received, seconds = self.stage.prepare_epoch(
                req.epoch,
                placement,
                job,
                incoming,
                req.committed_step,
                req.source_epoch,
                req.rollback,
                req.restored_by_client,
                _lease(req.lease_s or 60.0, "lease_s"),
                max(0.1, remaining - 0.5),
                req.fresh,
            )
        return stage_pb2.PrepareEpochResponse(
            committed_step=self.stage.committed_step, bytes_received=received, transfer_s=seconds
        )

    def CommitEpoch(
        self, req: stage_pb2.EpochRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.EpochResponse:
        with self.stage.tracer.span(SpanKind.EPOCH_COMMIT, epoch=req.epoch):
            epoch = self.stage.commit_epoch(req.epoch)
        return stage_pb2.EpochResponse(epoch=epoch)

    def AbortEpoch(
        self, req: stage_pb2.EpochRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.EpochResponse:
        return stage_pb2.EpochResponse(epoch=self.stage.abort_epoch(req.epoch))

    def ExportLayers(
        self, req: stage_pb2.ExportLayersRequest, ctx: grpc.ServicerContext
    ) -> Iterator[stage_pb2.LayerChunk]:
        bounds.count(req.layers, "layers", bounds.MAX_LAYERS)
        self.gate.check("ExportLayers")  # a client's export: the holder's state_dict only
        bounds.step(req.snapshot_step, "snapshot_step")
        snapshot = (req.job_id, req.snapshot_step) if req.from_snapshot else None
        for layer, packed in self.stage.export_layers(
            req.epoch, list(req.layers), req.include_optimizer, snapshot
        ):
            # no CRC-32 per chunk: the layer's digest checks it whole (as a snapshot copy's)
            yield from layer_state.messages(
                layer, packed, self.stage.config.transfer_chunk_bytes, checked_chunks=False
            )

    def RestoreLayers(
        self, chunks: Iterator[stage_pb2.RestoreChunk], ctx: grpc.ServicerContext
    ) -> stage_pb2.RestoreResponse:
        self.gate.check("RestoreLayers")
        first = next(chunks, None)
        if first is None:
            raise InvalidRequest("empty restore stream")
        builder = self.stage.check_restore(first.epoch)  # before a single layer is read
        overrides = json_object(first.optimizer_overrides_json, "optimizer_overrides_json")
        pieces = callers.first_pieces(
            itertools.chain([first.chunk], (message.chunk for message in chunks)),
            self.stage.check_restored_layer,  # ownership, before the layer is assembled
        )
        layers = []
        limits = (self.stage.config.max_tensor_bytes, self.stage.config.max_layer_bytes)
        into = functools.partial(self.stage.restore_into, builder=builder)  # on each header
        for got in layer_state.receive(pieces, *limits, into):
            self.stage.stage_restored(first.epoch, got, builder, overrides)
            layers.append(got.layer)
        return stage_pb2.RestoreResponse(layers=layers)

    def PushSnapshot(
        self, chunks: Iterator[stage_pb2.SnapshotChunk], ctx: grpc.ServicerContext
    ) -> stage_pb2.Ack:
        first = next(chunks, None)
        if first is None or not first.source:
            raise InvalidRequest("a snapshot stream must start with its job, step and source")
        generation = self.stage.snapshots.generation
        layers = self.stage.check_copy_source(first.job_id, first.source)  # before any layer
        check = callers.in_source_range(layers, first.source, self.stage.frozen)
        pieces = callers.first_pieces((m.chunk for m in chunks), check)
        limits = (self.stage.config.max_tensor_bytes, self.stage.config.max_layer_bytes)
        blobs = receive_copy(pieces, limits)
        self.stage.keep_copy(first.job_id, first.step, first.source, blobs, generation)
        return stage_pb2.Ack()

    # ---- stats and admin -------------------------------------------------------------

    def GetStats(
        self, req: stage_pb2.StatsRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.StageStats:
        stage = self.stage
        placement = stage.placement
        return stage_pb2.StageStats(
            stage_id=stage.stage_id,  # which incarnation answers (the coordinator's probe)
            name=stage.config.name,
            epoch=stage.epoch,
            layer_lo=placement.lo if placement else 0,
            layer_hi=placement.hi if placement else 0,
            committed_step=stage.committed_step,
            slowdown=stage.slowdown.factor,
            peak_stashed=stage.last_peak[0],
            peak_stashed_bytes=stage.last_peak[1],
            timings=timings_to_proto(stage.timings()),
            device=str(stage.device),
            frozen=stage.frozen,
            state=state_to_proto(stage.state()),
            snapshots=holdings_to_proto(stage.holdings()),
        )

    def GetTrace(
        self, req: stage_pb2.TraceRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.TraceResponse:
        self.stage.settle()  # a step committed before this call shows its optimizer step
        tracer = self.stage.tracer
        now = tracer.now_ns()
        steps = int(bounds.number(req.steps, "steps", 0, tracer.steps_kept))
        spans, truncated = tracer.last(steps, MAX_TRACE_SPANS)
        return stage_pb2.TraceResponse(
            now_ns=now,
            name=self.stage.config.name,
            spans=[s.to_proto() for s in spans],
            truncated=truncated,
            steps_kept=tracer.steps_kept,
        )

    def SetSlowdown(
        self, req: stage_pb2.SlowdownRequest, ctx: grpc.ServicerContext
    ) -> stage_pb2.Ack:
        self.stage.slowdown.set(bounds.number(req.factor, "factor", 1.0, bounds.MAX_SLOWDOWN))
        return stage_pb2.Ack()

    def InjectFault(self, req: stage_pb2.FaultRequest, ctx: grpc.ServicerContext) -> stage_pb2.Ack:
        try:
            fault = Fault(req.fault)
        except ValueError:
            raise InvalidRequest(f"unknown fault {req.fault}") from None
        self.stage.inject_fault(fault, req.point)
        return stage_pb2.Ack()
