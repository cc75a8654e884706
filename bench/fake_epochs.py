"""The fake stage's side of an epoch change: assign, freeze, prepare, commit, abort, export,
restore and snapshot pushes, as ``stage_server.protocol`` orders them, with no tensors.

A mix-in of ``FakeStage`` (bench/fake_stage.py), whose state (``cond``, ``epoch``,
``placement``, ``staged``, ``own``, ``copies``, ...) these methods read and change.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch

from elasticpipe.errors import (
    InvalidRequest,
    NotReady,
)
from elasticpipe.partition import Placement
from elasticpipe.stage_server import transfers
from elasticpipe.training.job import JobConfig
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec, layer_state

PARAM_FLOATS = 256  # each layer's state blob: 1 KiB of weights (msgpack)
KEEP_SNAPSHOTS = 2
BLOB = layer_state.pack({"model": {"weight": torch.zeros(PARAM_FLOATS)}, "optimizer": None})


class EpochChange:
    """The epoch-change RPCs of ``FakeStage``."""

    def Assign(self, req: stage_pb2.AssignRequest, ctx: Any) -> stage_pb2.AssignResponse:
        job = JobConfig.from_proto(req.job)
        placement = Placement.from_proto(req.assignment)
        with self.cond:
            if self.phase == "running":
                self.closed_below = max(self.closed_below, self.active_run + 1)
            self.job, self.placement, self.epoch = job, placement, placement.epoch
            self.committed_step = self.committed_run = 0
            self.phase, self.frozen_for, self.prepared, self.staged = "idle", 0, False, None
            self.inbox.clear()
            self.timings = {i: [0.0, 0.0, 0.0, 0.0] for i in placement.layers}
            self.own.clear()
            self.copies.clear()
            self._capture(0)
            self.cond.notify_all()
        return stage_pb2.AssignResponse(num_layers=placement.hi - placement.lo)

    def Freeze(self, req: stage_pb2.EpochRequest, ctx: Any) -> stage_pb2.FreezeResponse:
        timeout = max(0.0, (ctx.time_remaining() or 30.0) - 0.5)
        with self.cond:
            if req.epoch <= self.epoch:
                raise InvalidRequest(f"cannot freeze for epoch {req.epoch} at epoch {self.epoch}")
            if req.abort_running and self.phase == "running":
                self._fail_run(self.active_run)
            if not self.cond.wait_for(lambda: self.phase == "idle", timeout):
                raise NotReady(f"stage {self.name} did not reach a step boundary")
            if self.frozen_for != req.epoch:
                self.frozen_for, self.prepared, self.staged = req.epoch, False, None
            return stage_pb2.FreezeResponse(committed_step=self.committed_step)

    def PrepareEpoch(
        self, req: stage_pb2.PrepareEpochRequest, ctx: Any
    ) -> stage_pb2.PrepareEpochResponse:
        started = time.perf_counter()
        placement = Placement.from_proto(req.assignment)
        deadline = time.monotonic() + (ctx.time_remaining() or req.timeout_s or 60.0) - 0.5
        with self.cond:
            if self.frozen_for != req.epoch:
                raise NotReady(f"epoch {req.epoch} was abandoned on stage {self.name}")
        received = 0
        if req.rollback:  # a recovery: every owned layer from the snapshot of committed_step
            sources = {src.layer: src.address for src in req.incoming}
            with self.cond:
                held = set(self.own.get(req.committed_step, ()))
                for copy in self.copies.values():
                    held |= set(copy.get(req.committed_step, ()))
            wanted = [
                (
                    layer,
                    stage_pb2.ExportLayersRequest(
                        layers=[layer],
                        include_optimizer=True,
                        from_snapshot=True,
                        snapshot_step=req.committed_step,
                        job_id=req.job.job_id,
                    ),
                )
                for layer in placement.layers
                if layer not in held
            ]
        else:
            sources = {src.layer: src.address for src in req.incoming}
            wanted = [
                (
                    src.layer,
                    stage_pb2.ExportLayersRequest(
                        epoch=req.source_epoch, layers=[src.layer], include_optimizer=True
                    ),
                )
                for src in req.incoming
            ]
        for layer, request in wanted:
            if not sources.get(layer):
                raise NotReady(f"layer {layer}: no source and no snapshot on {self.name}")
            limits = (codec.DEFAULT_MAX_TENSOR_BYTES, codec.DEFAULT_MAX_LAYER_BYTES)
            got = transfers.pull_layer(
                self.pool, sources[layer], request, deadline, limits, layer_state.Destination()
            )
            received += got.packed.nbytes
        with self.cond:
            if self.frozen_for != req.epoch:
                raise NotReady(f"epoch {req.epoch} was abandoned on stage {self.name}")
            self.staged, self.prepared, self.prepared_step = placement, True, req.committed_step
            self.prepared_rollback = req.rollback
            self.staged_job = JobConfig.from_proto(req.job)
            return stage_pb2.PrepareEpochResponse(
                committed_step=self.committed_step,
                bytes_received=received,
                transfer_s=time.perf_counter() - started,
            )

    def CommitEpoch(self, req: stage_pb2.EpochRequest, ctx: Any) -> stage_pb2.EpochResponse:
        with self.cond:
            if self.epoch == req.epoch and self.frozen_for != req.epoch:
                return stage_pb2.EpochResponse(epoch=self.epoch)
            if self.frozen_for != req.epoch or not self.prepared or self.staged is None:
                raise NotReady(f"nothing is prepared for epoch {req.epoch} on {self.name}")
            self.epoch, self.placement = req.epoch, self.staged
            self.committed_step = self.prepared_step
            self.frozen_for, self.prepared, self.staged = 0, False, None
            if self.job is None or self.prepared_rollback:
                self.job = self.staged_job
            if self.prepared_rollback:  # as StepMachine.commit_epoch: prune, then snapshot
                self.committed_run = 0
                self.inbox.clear()
                self.own = {k: v for k, v in self.own.items() if k <= self.committed_step}
                for held in self.copies.values():
                    for k in [k for k in held if k > self.committed_step]:
                        del held[k]
                self._capture(self.committed_step)
            self.timings = {
                i: self.timings.get(i, [0.0, 0.0, 0.0, 0.0]) for i in self.placement.layers
            }
            self.cond.notify_all()
            return stage_pb2.EpochResponse(epoch=self.epoch)

    def AbortEpoch(self, req: stage_pb2.EpochRequest, ctx: Any) -> stage_pb2.EpochResponse:
        with self.cond:
            if self.frozen_for == req.epoch:
                self.frozen_for, self.prepared, self.staged = 0, False, None
                self.cond.notify_all()
            return stage_pb2.EpochResponse(epoch=self.epoch)

    def ExportLayers(
        self, req: stage_pb2.ExportLayersRequest, ctx: Any
    ) -> Iterator[stage_pb2.LayerChunk]:
        with self.cond:
            if req.from_snapshot:
                held = set(self.own.get(req.snapshot_step, ()))
                for copy in self.copies.values():
                    held |= set(copy.get(req.snapshot_step, ()))
            else:
                if req.epoch and req.epoch != self.epoch:
                    self._check_epoch(req.epoch)
                held = set(self._owned())
            missing = [i for i in req.layers if i not in held]
        if missing:
            raise NotReady(f"stage {self.name} does not hold layers {missing}")
        for layer in req.layers:
            yield from layer_state.messages(layer, BLOB, checked_chunks=False)  # as a stage's

    def RestoreLayers(
        self, chunks: Iterator[stage_pb2.RestoreChunk], ctx: Any
    ) -> stage_pb2.RestoreResponse:
        pieces = (message.chunk for message in chunks)
        limits = (codec.DEFAULT_MAX_TENSOR_BYTES, codec.DEFAULT_MAX_LAYER_BYTES)
        layers = [got.layer for got in layer_state.receive(pieces, *limits)]
        return stage_pb2.RestoreResponse(layers=layers)

    def PushSnapshot(self, chunks: Iterator[stage_pb2.SnapshotChunk], ctx: Any) -> stage_pb2.Ack:
        first = next(chunks, None)
        if first is None or not first.source:
            raise InvalidRequest("a snapshot stream must start with its job, step and source")
        pieces = (message.chunk for message in chunks)
        limits = (codec.DEFAULT_MAX_TENSOR_BYTES, codec.DEFAULT_MAX_LAYER_BYTES)
        blobs = {got.layer: got.packed for got in layer_state.receive(pieces, *limits)}
        with self.cond:
            if self.job is None or self.job.job_id != first.job_id:
                raise NotReady(f"stage {self.name} does not run job {first.job_id!r} (yet)")
            held = self.copies.setdefault(first.source, {})
            held[first.step] = tuple(sorted(blobs))
            for old in sorted(held)[:-KEEP_SNAPSHOTS]:
                del held[old]
        return stage_pb2.Ack()
