"""A fake stage server for the control-plane benches: a real gRPC ``StageService`` with no
compute, and the membership loop of a real stage server.

``bench/scale.py`` runs hundreds of these against a real coordinator and client (its
docstring says what a fake keeps of a stage's protocols and what it drops). The fake
implements every RPC of ``elasticpipe.v1.StageService`` itself: ``FakeStage`` checks at
construction that it does, against the service descriptor, and raises ``TypeError``
naming each RPC it lacks. A new RPC in the .proto then fails the bench, and its test,
at once (tests/unit/test_fake_stage.py), instead of crashing deep inside a child process
of the bench at ``serve()``.
"""

from __future__ import annotations

import functools
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from fake_epochs import BLOB, KEEP_SNAPSHOTS, EpochChange  # bench/fake_epochs.py, beside

from elasticpipe import models
from elasticpipe.errors import (
    ElasticPipeError,
    Fenced,
    InvalidRequest,
    NotReady,
    Rebalancing,
    StageUnavailable,
    StaleEpoch,
    StepAborted,
)
from elasticpipe.partition import Placement
from elasticpipe.stage_server import transfers
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc, serving
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc, stage_pb2
from elasticpipe.wire import codec, layer_state

SERVICE = stage_pb2.DESCRIPTOR.services_by_name["StageService"]
MICRO_BATCHES = 4
BATCH = 8
WIDTH = 4
REGISTER_TIMEOUT_S = 5.0
BACKOFF_START_S, BACKOFF_MAX_S = 0.2, 2.0


def missing_rpcs(servicer: type) -> list[str]:
    """The RPCs of ``StageService`` that ``servicer`` (a class) does not define, in the
    .proto's order."""
    return [m.name for m in SERVICE.methods if not callable(getattr(servicer, m.name, None))]


def layer_cost(layer: int) -> float:
    """Seconds of forward + backward of one micro-batch through ``layer`` on a speed-1 stage."""
    return 1e-3 * (1.0 + (layer % 5) / 4)


def loopback_host(index: int) -> str:
    """Fake ``index``'s own host: a loopback address of its own (127.0.0.2, ...), as each
    real stage has its host (the coordinator profiles hosts at once, a host's stages in
    turn)."""
    return f"127.0.{index // 250 % 256}.{index % 250 + 2}"


def stage_speed(index: int) -> float:
    """A fake's speed: distinct per stage, between 0.7 and 1.3."""
    return 0.7 + 0.6 * ((index * 37) % 101) / 100


_DESCRIBING = threading.Lock()


def describe(model: str, kwargs_json: str) -> tuple[int, tuple[int, ...], str, str]:
    """The real model description (``models.describe``/``factory_source``), once per
    process: S real stages would each compute it on their own host, in parallel. The
    lock keeps S concurrent Describe calls from all computing it at once on one GIL."""
    with _DESCRIBING:
        return _describe(model, kwargs_json)


@functools.cache
def _describe(model: str, kwargs_json: str) -> tuple[int, tuple[int, ...], str, str]:
    num_layers, sizes = models.describe(model, json.loads(kwargs_json))
    path, digest = models.factory_source(model)
    return num_layers, tuple(sizes), path, digest


# ---- the fake stage ------------------------------------------------------------------


class Counters:
    """What the fakes' membership threads saw (shared by all fakes of the process)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.heartbeats = 0
        self.heartbeat_latency: list[float] = []
        self.register_latency: list[float] = []
        self.errors: Counter[str] = Counter()
        self.max_gap = 0.0
        self.reregistered = 0
        self.dead = 0
        self.calls: Counter[str] = Counter()  # RPCs served by the fakes, by method
        self.max_lag = 0.0  # the worst oversleep of a 50 ms sleep in the fakes' process

    def take(self) -> dict[str, Any]:
        """A snapshot of the counters; resets the latency lists and the largest gap."""
        with self.lock:
            out = {
                "heartbeats": self.heartbeats,
                "heartbeat_latency": self.heartbeat_latency,
                "register_latency": self.register_latency,
                "errors": dict(self.errors),
                "max_gap": self.max_gap,
                "reregistered": self.reregistered,
                "dead": self.dead,
                "calls": dict(self.calls),
                "max_lag": self.max_lag,
            }
            self.heartbeat_latency, self.register_latency, self.max_gap = [], [], 0.0
            self.calls, self.max_lag = Counter(), 0.0
        return out

    def watch(self, stop: threading.Event, period: float = 0.05) -> None:
        """Measures how late this process's threads get to run (GIL and CPU starvation)."""
        while True:
            started = time.monotonic()
            if stop.wait(period):
                return
            lag = time.monotonic() - started - period
            with self.lock:
                self.max_lag = max(self.max_lag, lag)


class Counted:
    """A fake stage's servicer as gRPC sees it: every call counted by method."""

    def __init__(self, fake: FakeStage):
        self._fake = fake

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._fake, name)
        counters = self._fake.counters

        def call(request: Any, context: Any) -> Any:
            with counters.lock:
                counters.calls[name] += 1
            return method(request, context)

        return call


class FakeStage(EpochChange):
    """A StageService with no compute, and the membership loop of a real stage server (the
    epoch change's RPCs are ``EpochChange``'s, bench/fake_epochs.py)."""

    def __init__(self, name: str, index: int, coordinator: str, counters: Counters):
        missing = missing_rpcs(type(self))
        if missing:  # the service gained an RPC the fake does not know of yet
            raise TypeError(
                f"{type(self).__name__} does not implement {SERVICE.full_name}'s "
                f"{', '.join(missing)}: a fake stage must answer every RPC of the service "
                "(bench/fake_stage.py)"
            )
        self.name = name
        self.host = loopback_host(index)
        self.speed = stage_speed(index)
        self.coordinator = coordinator
        self.counters = counters
        self.cond = threading.Condition()
        self.pool = rpc.StagePool()
        # protocol state, as stage_server.protocol.StepMachine keeps it
        self.job: JobConfig | None = None
        self.placement: Placement | None = None
        self.epoch = self.committed_step = self.committed_run = 0
        self.phase = "idle"
        self.active_run = self.active_step = self.active_client = 0
        self.fence = self.closed_below = 0
        self.frozen_for, self.prepared, self.prepared_step = 0, False, 0
        self.staged: Placement | None = None
        self.staged_job: JobConfig | None = None
        self.prepared_rollback = False
        self.timings: dict[int, list[float]] = {}  # layer -> [forward, backward, bytes, n]
        self.inbox: dict[tuple[int, int], set[int]] = {}  # (run, slot) -> micro-batches
        self.own: dict[int, tuple[int, ...]] = {}  # step -> layers
        self.copies: dict[str, dict[int, tuple[int, ...]]] = {}  # source -> step -> layers
        self.stage_id = ""
        self.registered = threading.Event()
        self._stop = threading.Event()
        self._server: serving.RunningServer | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------

    def serve(self) -> str:
        self._server = serving.start_server(
            f"{self.host}:0",
            [(stage_pb2.DESCRIPTOR.services_by_name["StageService"], Counted(self))],
        )
        return self._server.address

    @property
    def address(self) -> str:
        assert self._server is not None
        return self._server.address

    def join_cluster(self) -> None:
        self._thread = threading.Thread(target=self._membership, name="membership", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._server is not None:
            self._server.stop(grace=0.1)
        self.pool.close()

    # ---- membership (as stage_server/server.py) -------------------------------------

    def _membership(self) -> None:
        backoff, interval = BACKOFF_START_S, 1.0
        last_sent = 0.0
        with rpc.channel(self.coordinator) as chan:
            stub = coordinator_pb2_grpc.CoordinatorServiceStub(chan)
            while not self._stop.is_set():
                try:
                    if not self.stage_id:
                        interval = self._register(stub)
                        backoff = BACKOFF_START_S
                    else:
                        now = time.monotonic()
                        if last_sent:
                            with self.counters.lock:
                                self.counters.max_gap = max(self.counters.max_gap, now - last_sent)
                        last_sent = now
                        self._heartbeat(stub, interval)
                    self._stop.wait(interval)
                except ElasticPipeError as exc:
                    with self.counters.lock:
                        self.counters.errors[f"{type(exc).__name__}: {str(exc)[:60]}"] += 1
                    self._stop.wait(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _register(self, stub: coordinator_pb2_grpc.CoordinatorServiceStub) -> float:
        started = time.perf_counter()
        reply = rpc.call(
            self.coordinator,
            stub.Register,
            coordinator_pb2.RegisterRequest(name=self.name, address=self.address, device="fake"),
            timeout=REGISTER_TIMEOUT_S,
        )
        with self.counters.lock:
            self.counters.register_latency.append(time.perf_counter() - started)
        self.stage_id = reply.stage_id
        self.registered.set()
        return reply.heartbeat_interval_s or 1.0

    def _heartbeat(
        self, stub: coordinator_pb2_grpc.CoordinatorServiceStub, interval: float
    ) -> None:
        with self.cond:
            request = coordinator_pb2.HeartbeatRequest(
                stage_id=self.stage_id,
                epoch=self.epoch,
                timings=self._timings(),
                committed_step=self.committed_step,
                slowdown=1.0,
                state=self._state(),
                snapshots=self._holdings(),
            )
        started = time.perf_counter()
        reply = rpc.call(self.coordinator, stub.Heartbeat, request, timeout=max(1.0, interval * 2))
        with self.counters.lock:
            self.counters.heartbeats += 1
            self.counters.heartbeat_latency.append(time.perf_counter() - started)
        if reply.dead:
            with self.cond:
                self.job = self.placement = None
            with self.counters.lock:
                self.counters.dead += 1
        if reply.reregister:
            self.stage_id = ""
            with self.counters.lock:
                self.counters.reregistered += 1

    # ---- state in wire form (lock held) ----------------------------------------------

    def _timings(self) -> list[stage_pb2.LayerTiming]:
        return [
            stage_pb2.LayerTiming(
                layer=i, forward_s=t[0], backward_s=t[1], output_bytes=int(t[2]), samples=int(t[3])
            )
            for i, t in sorted(self.timings.items())
        ]

    def _state(self) -> stage_pb2.RunState:
        return stage_pb2.RunState(
            phase=self.phase,
            epoch=self.epoch,
            committed_step=self.committed_step,
            committed_run=self.committed_run,
            active_run=self.active_run,
            active_step=self.active_step,
            fence=self.fence,
            frozen_for=self.frozen_for,
            prepared=self.prepared,
        )

    def _holdings(self) -> list[stage_pb2.SnapshotHolding]:
        job = self.job.job_id if self.job else ""
        out = [
            stage_pb2.SnapshotHolding(job_id=job, step=step, layers=layers, peer_copy=False)
            for step, layers in sorted(self.own.items())
        ]
        for held in self.copies.values():
            out += [
                stage_pb2.SnapshotHolding(job_id=job, step=step, layers=layers, peer_copy=True)
                for step, layers in sorted(held.items())
            ]
        return out

    # ---- checks (lock held) -----------------------------------------------------------

    def _check_epoch(self, epoch: int) -> None:
        if self.job is None or self.placement is None:
            raise NotReady(f"stage {self.name} has no job assigned")
        if epoch != self.epoch:
            raise StaleEpoch(f"stale epoch {epoch}: stage {self.name} is at epoch {self.epoch}")
        if self.frozen_for:
            raise Rebalancing(f"rebalancing from epoch {self.epoch} to {self.frozen_for}")

    def _check_client(self, client: int) -> None:
        if client < self.fence:
            raise Fenced(f"client {client} fenced by stage {self.name} (fence {self.fence})")

    def _owned(self) -> range:
        return self.placement.layers if self.placement is not None else range(0)

    # ---- snapshots --------------------------------------------------------------------

    def _capture(self, step: int) -> None:
        """Records this stage's snapshot of ``step`` and pushes a copy (lock held)."""
        job, placement = self.job, self.placement
        if job is None or placement is None or not job.snapshot_every or not placement.in_chain:
            return
        self.own[step] = tuple(placement.layers)
        for old in sorted(self.own)[:-KEEP_SNAPSHOTS]:
            del self.own[old]
        peer = placement.snapshot_peer
        if peer:
            args = (peer, job.job_id, step, tuple(placement.layers), self.stage_id)
            threading.Thread(target=self._push, args=args, daemon=True).start()

    def _push(self, peer: str, job_id: str, step: int, layers: Sequence[int], me: str) -> None:
        def messages() -> Iterator[stage_pb2.SnapshotChunk]:
            yield stage_pb2.SnapshotChunk(job_id=job_id, step=step, source=me)
            for layer in layers:
                for chunk in layer_state.messages(layer, BLOB, checked_chunks=False):
                    yield stage_pb2.SnapshotChunk(chunk=chunk)

        unreachable = 0
        for attempt in range(transfers.PUSH_RETRIES):  # retried as transfers.push_snapshot (a
            # thread per capture here: nothing queues behind a push, so none is given up)
            try:
                rpc.call(peer, self.pool.stub(peer).PushSnapshot, messages(), timeout=60.0)
                return
            except (NotReady, StageUnavailable) as exc:  # no job yet, or not reached
                unreachable += isinstance(exc, StageUnavailable)
                if unreachable > transfers.UNREACHABLE_RETRIES:
                    with self.counters.lock:
                        self.counters.errors["push: StageUnavailable"] += 1
                    return
                pause = transfers.UNREACHABLE_PAUSE_S if unreachable else 0.02 * (attempt + 1)
                time.sleep(min(pause, 0.5))
            except ElasticPipeError as exc:
                with self.counters.lock:
                    self.counters.errors[f"push: {type(exc).__name__}"] += 1
                return

    # ---- data path --------------------------------------------------------------------

    def _accept(self, slot: int, header: stage_pb2.DataHeader, chunks: Iterator[bytes]) -> None:
        codec.check_meta(header.meta, codec.DEFAULT_MAX_TENSOR_BYTES)
        with self.cond:
            self._check_epoch(header.epoch)
        assembler = codec.TensorAssembler(header.meta)
        for data in chunks:
            assembler.add(data)
        assembler.finish()
        with self.cond:
            self._check_epoch(header.epoch)
            if header.run >= self.closed_below:
                self.inbox.setdefault((header.run, slot), set()).add(header.micro_batch)
                self.cond.notify_all()

    def _stream(
        self, slot: int, chunks: Iterator[stage_pb2.DataChunk], ctx: Any = None
    ) -> stage_pb2.Ack:
        first = next(chunks, None)
        if first is None or first.WhichOneof("part") != "header":
            raise InvalidRequest("a data stream must start with a DataHeader")
        self._accept(slot, first.header, (c.data for c in chunks))
        return stage_pb2.Ack()

    # the data streams, one per slot: (chunks, ctx) -> Ack
    Forward = functools.partialmethod(_stream, stage_pb2.INPUT)
    Backward = functools.partialmethod(_stream, stage_pb2.GRAD)
    Targets = functools.partialmethod(_stream, stage_pb2.TARGET)
    Reduce = functools.partialmethod(_stream, stage_pb2.REDUCE)

    def Deliver(self, msg: stage_pb2.DataMessage, ctx: Any) -> stage_pb2.Ack:
        self._accept(msg.slot, msg.header, iter([msg.data]))
        return stage_pb2.Ack()

    def OpenBulk(self, req: stage_pb2.OpenBulkRequest, ctx: Any) -> stage_pb2.OpenBulkReply:
        return stage_pb2.OpenBulkReply()  # port 0: no bulk channel, senders use gRPC

    def RunStep(self, req: stage_pb2.RunStepRequest, ctx: Any) -> stage_pb2.StepReport:
        started = time.perf_counter()
        remaining = ctx.time_remaining()
        deadline = time.monotonic() + min(req.timeout_s, remaining or req.timeout_s)
        train = req.mode == stage_pb2.TRAIN
        with self.cond:
            self._check_client(req.client)
            self._check_epoch(req.epoch)
            for d in req.previous:  # a decision the client could not deliver earlier
                if self.phase == "awaiting_commit" and d.run == self.active_run:
                    if d.commit:
                        self._commit(d.run, d.step)
                    else:
                        self._abort_awaiting()
            if self.phase != "idle":
                raise NotReady(f"stage {self.name} is busy with run {self.active_run}")
            if req.run < self.closed_below:
                raise StepAborted(f"run {req.run} was aborted before it started")
            if train and req.step != self.committed_step + 1:
                raise NotReady(f"step {req.step} is not the next step of stage {self.name}")
            self.fence = max(self.fence, req.client)
            self.phase, self.active_run, self.active_step = "running", req.run, req.step
            self.active_client = req.client
            for msg in req.inline:  # inputs and targets the RunStep carries (small ones)
                self.inbox.setdefault((req.run, msg.slot), set()).add(msg.header.micro_batch)
            placement = self.placement
            assert placement is not None
            wanted = []
            if placement.index == 0:
                wanted.append(stage_pb2.INPUT)
            if placement.index == placement.num_stages - 1 and train:
                wanted.append(stage_pb2.TARGET)

            def arrived() -> bool:
                if self.closed_below > req.run or self.active_run != req.run:
                    return True
                return all(
                    len(self.inbox.get((req.run, slot), ())) >= req.micro_batches for slot in wanted
                )

            if not self.cond.wait_for(arrived, max(0.0, deadline - time.monotonic())):
                self._fail_run(req.run)
                raise StepAborted(f"run {req.run}: the client's data did not arrive in time")
            if self.closed_below > req.run or self.phase != "running":
                self._fail_run(req.run)
                raise StepAborted(f"run {req.run} aborted on stage {self.name}")
            self.phase = "awaiting_commit" if train else "idle"
            compute = 0.0
            for layer in placement.layers:
                seconds = layer_cost(layer) / self.speed
                t = self.timings.setdefault(layer, [0.0, 0.0, 0.0, 0.0])
                t[0], t[1], t[2], t[3] = seconds / 3, 2 * seconds / 3, BATCH * WIDTH, t[3] + 1
                compute += seconds * req.micro_batches
            last = placement.index == placement.num_stages - 1
            return stage_pb2.StepReport(
                run=req.run,
                losses=[0.0] * req.micro_batches if last and train else [],
                compute_s=compute,
                wall_s=time.perf_counter() - started,
                timings=self._timings(),
            )

    def _fail_run(self, run: int) -> None:
        self.closed_below = max(self.closed_below, run + 1)
        if self.active_run == run and self.phase == "running":
            self.phase = "idle"
        self._drop_inbox()

    def _drop_inbox(self) -> None:
        for key in [k for k in self.inbox if k[0] < self.closed_below]:
            del self.inbox[key]

    def _commit(self, run: int, step: int) -> None:
        self.phase = "idle"
        self.committed_step, self.committed_run = step, run
        self.closed_below = max(self.closed_below, run + 1)
        self._drop_inbox()
        job = self.job
        if job is not None and job.snapshot_every and step % job.snapshot_every == 0:
            self._capture(step)

    def _abort_awaiting(self) -> None:
        self.phase = "idle"
        self.closed_below = max(self.closed_below, self.active_run + 1)
        self._drop_inbox()

    def FetchOutput(
        self, req: stage_pb2.FetchOutputRequest, ctx: Any
    ) -> Iterator[stage_pb2.DataChunk]:
        raise NotReady(f"stage {self.name} is a fake: it keeps no inference output")
        yield stage_pb2.DataChunk()  # unreachable: makes this a generator

    def CommitStep(
        self, req: stage_pb2.CommitStepRequest, ctx: Any
    ) -> stage_pb2.CommitStepResponse:
        with self.cond:
            self._check_client(req.client)
            if not (self.committed_run == req.run and self.committed_step == req.step):
                if req.epoch != self.epoch:
                    raise StaleEpoch(
                        f"stale epoch {req.epoch}: stage {self.name} is at {self.epoch}"
                    )
                if self.phase != "awaiting_commit" or self.active_run != req.run:
                    raise NotReady(f"run {req.run} is not awaiting commit on stage {self.name}")
                self._commit(req.run, req.step)
            self.cond.notify_all()
            return stage_pb2.CommitStepResponse(committed_step=self.committed_step)

    def AbortStep(self, req: stage_pb2.AbortStepRequest, ctx: Any) -> stage_pb2.Ack:
        with self.cond:
            self._check_client(req.client)
            if not (self.committed_run == req.run and req.run):
                if self.active_run == req.run and self.phase == "awaiting_commit":
                    self._abort_awaiting()
                else:
                    self.closed_below = max(self.closed_below, req.run + 1)
                    self._drop_inbox()
            self.cond.notify_all()
        return stage_pb2.Ack()

    def Fence(self, req: stage_pb2.FenceRequest, ctx: Any) -> stage_pb2.RunState:
        with self.cond:
            self.fence = max(self.fence, req.client)
            if self.phase == "running" and self.active_client < self.fence:
                self.closed_below = max(self.closed_below, self.active_run + 1)
                self.cond.notify_all()
            return self._state()

    # ---- control ----------------------------------------------------------------------

    def Describe(self, req: stage_pb2.DescribeRequest, ctx: Any) -> stage_pb2.DescribeResponse:
        num_layers, sizes, path, digest = describe(req.job.model, req.job.model_kwargs_json)
        return stage_pb2.DescribeResponse(
            num_layers=num_layers, param_bytes=sizes, factory_file=path, factory_sha256=digest
        )

    def Profile(self, req: stage_pb2.ProfileRequest, ctx: Any) -> stage_pb2.ProfileResponse:
        num_layers = describe(req.job.model, req.job.model_kwargs_json)[0]
        return stage_pb2.ProfileResponse(
            timings=[
                stage_pb2.LayerTiming(
                    layer=i,
                    forward_s=layer_cost(i) / self.speed / 3,
                    backward_s=2 * layer_cost(i) / self.speed / 3,
                    output_bytes=BATCH * WIDTH * 4 // MICRO_BATCHES,
                    samples=req.repeats,
                )
                for i in range(num_layers)
            ]
        )

    def GetTrace(self, req: stage_pb2.TraceRequest, ctx: Any) -> stage_pb2.TraceResponse:
        return stage_pb2.TraceResponse()  # no ops, no spans

    def GetStats(self, req: stage_pb2.StatsRequest, ctx: Any) -> stage_pb2.StageStats:
        with self.cond:
            owned = self._owned()
            return stage_pb2.StageStats(
                stage_id=self.stage_id,
                name=self.name,
                epoch=self.epoch,
                layer_lo=owned.start if owned else 0,
                layer_hi=owned.stop if owned else 0,
                committed_step=self.committed_step,
                slowdown=1.0,
                timings=self._timings(),
                device="fake",
                frozen=bool(self.frozen_for),
                state=self._state(),
                snapshots=self._holdings(),
            )

    def SetSlowdown(self, req: stage_pb2.SlowdownRequest, ctx: Any) -> stage_pb2.Ack:
        return stage_pb2.Ack()

    def InjectFault(self, req: stage_pb2.FaultRequest, ctx: Any) -> stage_pb2.Ack:
        raise InvalidRequest("fault injection is off on fake stages")
