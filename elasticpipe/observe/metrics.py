"""Prometheus metrics of a stage and of the coordinator, and the HTTP endpoint serving them.

Each process object (a ``Stage``, a coordinator's ``Cluster``) owns one ``CollectorRegistry``
-- never the global one -- so that several of them in one process (tests) do not collide.
Events (a step ran, a tensor was sent, an epoch changed) update counters and histograms
through a few calls from the hot paths; state (epoch, layer range, mailbox, members) is
read when Prometheus scrapes, through a ``read`` callable that returns a frozen view.
``docs/metrics.md`` lists every metric; ``deploy/grafana`` has a dashboard of them.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from elasticpipe.errors import InvalidRequest
from elasticpipe.logs import get_logger

log = get_logger(__name__)

# Step and op times span a millisecond (a tiny CPU model) to minutes (a big model on a slow
# device); migration pauses from a few milliseconds to minutes.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
OP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0)
MEASURED_STEPS_WINDOW = 10  # heartbeats that saw the committed step advance


# ---- the RPC error counter (a server interceptor) ---------------------------------------


if TYPE_CHECKING:  # grpc-stubs makes it generic; grpcio's class is not subscriptable
    _Interceptor = grpc.ServerInterceptor[Any, Any]
else:
    _Interceptor = grpc.ServerInterceptor


class RpcErrorCounter(_Interceptor):
    """Counts the calls a server answers with an error status, by method and code.

    The method is "Service/Method" (``StageService/RunStep``); a call to a method the server
    does not have counts as ``unknown`` with ``UNIMPLEMENTED`` (its name is the caller's
    choice: it must not become a label value). A reply stream its caller abandoned
    (cancelled, or past its deadline) counts as ``CANCELLED`` or ``DEADLINE_EXCEEDED``, and
    is logged (``rpc_stream_abandoned``): gRPC sets no code for it.
    """

    def __init__(self, counter: Counter):
        self._counter = counter

    def _record(self, method: str, context: grpc.ServicerContext) -> None:
        # Set by abort(); None if the handler died otherwise. (grpc-stubs lacks code().)
        code = getattr(context, "code", lambda: None)()
        name = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
        if name != "OK":
            self._counter.labels(method=method, code=name).inc()

    def intercept_service(
        self, continuation: Callable[[Any], Any], handler_call_details: Any
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            self._counter.labels(method="unknown", code="UNIMPLEMENTED").inc()
            return None
        method = str(handler_call_details.method).rsplit(".", 1)[-1]  # "StageService/X"
        record = self._record

        def unary(behaviour: Callable[[Any, grpc.ServicerContext], Any]) -> Any:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                try:
                    return behaviour(request, context)
                except BaseException:
                    record(method, context)
                    raise

            return run

        def streaming(behaviour: Callable[[Any, grpc.ServicerContext], Iterator[Any]]) -> Any:
            def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                sent = 0
                try:
                    for reply in behaviour(request, context):
                        yield reply
                        sent += 1
                except GeneratorExit:
                    # gRPC stops iterating a stream whose caller went away (cancelled it,
                    # or its deadline passed): no code is set, and it is no UNKNOWN failure.
                    remaining = context.time_remaining()
                    code = (
                        "DEADLINE_EXCEEDED"
                        if remaining is not None and remaining <= 0
                        else ("CANCELLED")
                    )
                    self._counter.labels(method=method, code=code).inc()
                    log.info(
                        "rpc_stream_abandoned",
                        method=method,
                        peer=context.peer(),
                        sent=sent,
                        code=code,
                    )
                    raise
                except BaseException:
                    record(method, context)
                    raise

            return run

        if handler.unary_unary is not None:
            return handler._replace(unary_unary=unary(handler.unary_unary))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=unary(handler.stream_unary))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=streaming(handler.unary_stream))
        return handler._replace(stream_stream=streaming(handler.stream_stream))


def _rpc_errors(component: str, registry: CollectorRegistry) -> Counter:
    return Counter(
        f"elasticpipe_{component}_rpc_errors",
        "Calls this server answered with an error status, by method and gRPC code",
        ["method", "code"],
        registry=registry,
    )


# ---- scrape-time views ------------------------------------------------------------------


class _ViewCollector(Collector):
    """Turns a frozen view, read at scrape time, into gauge families."""

    def __init__(self, families: Callable[[], Iterable[Metric]]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return list(self._families())

    def describe(self) -> Iterable[Metric]:
        return []  # the families depend on the view: not checked at registration


def _gauge(name: str, doc: str, value: float | None) -> Iterator[Metric]:
    if value is not None and not math.isnan(value):
        yield GaugeMetricFamily(name, doc, value=value)


@dataclass(frozen=True)
class StageView:
    """A stage's state at one scrape."""

    epoch: int
    layer_lo: int  # [lo, hi); lo == hi: no layers (a spare)
    layer_hi: int
    committed_step: int
    mailbox_bytes: int
    mailbox_entries: int
    stashed_bytes: int  # the peak of the last step
    stashed_micro_batches: int
    slowdown: float
    layer_seconds: dict[tuple[int, str], float] = field(default_factory=dict)  # (layer, dir)
    device_memory: tuple[int, int] | None = None  # CUDA: (allocated, peak allocated) bytes


# ---- stage ----------------------------------------------------------------------------


class StageMetrics:
    """A stage's metrics (``elasticpipe_stage_*``) in their own registry."""

    def __init__(self, read: Callable[[], StageView]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.step_seconds = Histogram(
            "elasticpipe_stage_step_seconds",
            "Wall time of this stage's ops of one run, receive waits included (mode: train "
            "or infer)",
            ["mode"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.op_seconds = Histogram(
            "elasticpipe_stage_op_seconds",
            "Compute time of one op: a micro-batch through this stage's layers (kind: forward, "
            "backward, or with ZB-H1 weight: the weights' gradients, backward the input's)",
            ["kind"],
            buckets=OP_BUCKETS,
            registry=r,
        )
        self.sent_bytes = Counter(
            "elasticpipe_stage_sent_bytes",
            "Tensor bytes sent to a neighbouring stage (peer: its address)",
            ["peer"],
            registry=r,
        )
        self.received_bytes = Counter(
            "elasticpipe_stage_received_bytes",
            "Tensor bytes received from a neighbouring stage (peer: its address, or 'client')",
            ["peer"],
            registry=r,
        )
        self.bulk_received_bytes = Counter(
            "elasticpipe_stage_bulk_received_bytes",
            "Of the tensor bytes received, those that came over the bulk channel "
            "(elasticpipe/transport/bulk.py: tensors over 1 MiB)",
            registry=r,
        )
        self.data_refused = Counter(
            "elasticpipe_stage_data_refused",
            "Data messages dropped because they did not carry their run's secret (not "
            "from the job's holder or its stages), or came early for a run outside the "
            "window or the early caps of the mailbox",
            registry=r,
        )
        self.rpc_errors = _rpc_errors("stage", r)
        self._read = read
        r.register(_ViewCollector(self._families))

    def interceptor(self) -> RpcErrorCounter:
        """The server interceptor counting this stage's failed calls."""
        return RpcErrorCounter(self.rpc_errors)

    def ran(self, train: bool, wall_s: float, ops: Iterable[tuple[str, float]]) -> None:
        """One run of this stage's ops succeeded: its wall time and each op's compute time."""
        self.step_seconds.labels(mode="train" if train else "infer").observe(wall_s)
        for kind, seconds in ops:
            self.op_seconds.labels(kind=kind).observe(seconds)

    def sent(self, peer: str, nbytes: int) -> None:
        """A tensor of ``nbytes`` reached ``peer``."""
        self.sent_bytes.labels(peer=peer).inc(nbytes)

    def received(self, peer: str, nbytes: int) -> None:
        """A tensor of ``nbytes`` arrived from ``peer``."""
        self.received_bytes.labels(peer=peer).inc(nbytes)

    def _families(self) -> Iterator[Metric]:
        v = self._read()
        yield GaugeMetricFamily(
            "elasticpipe_stage_epoch", "Partition epoch in force on this stage", value=v.epoch
        )
        yield GaugeMetricFamily(
            "elasticpipe_stage_layers", "Layers this stage owns", value=v.layer_hi - v.layer_lo
        )
        if v.layer_hi > v.layer_lo:
            yield GaugeMetricFamily(
                "elasticpipe_stage_first_layer", "First layer this stage owns", value=v.layer_lo
            )
            yield GaugeMetricFamily(
                "elasticpipe_stage_last_layer",
                "Last layer this stage owns (inclusive)",
                value=v.layer_hi - 1,
            )
        yield GaugeMetricFamily(
            "elasticpipe_stage_committed_step",
            "Last optimizer step committed here",
            value=v.committed_step,
        )
        yield GaugeMetricFamily(
            "elasticpipe_stage_mailbox_bytes",
            "Bytes held or reserved by messages waiting in the mailbox",
            value=v.mailbox_bytes,
        )
        yield GaugeMetricFamily(
            "elasticpipe_stage_mailbox_entries",
            "Messages waiting (or reserved) in the mailbox",
            value=v.mailbox_entries,
        )
        yield GaugeMetricFamily(
            "elasticpipe_stage_stashed_bytes",
            "Peak bytes of activations kept for backward during the last step",
            value=v.stashed_bytes,
        )
        yield GaugeMetricFamily(
            "elasticpipe_stage_stashed_micro_batches",
            "Peak micro-batches kept for backward during the last step",
            value=v.stashed_micro_batches,
        )
        yield GaugeMetricFamily(
            "elasticpipe_stage_slowdown", "Emulated slowdown factor (1: none)", value=v.slowdown
        )
        if v.device_memory is not None:  # a CUDA stage: its caching allocator's figures
            yield GaugeMetricFamily(
                "elasticpipe_stage_device_allocated_bytes",
                "Bytes of device memory held by tensors (torch.cuda.memory_allocated)",
                value=v.device_memory[0],
            )
            yield GaugeMetricFamily(
                "elasticpipe_stage_device_peak_bytes",
                "Peak bytes of device memory held by tensors since the stage started "
                "(torch.cuda.max_memory_allocated)",
                value=v.device_memory[1],
            )
        layers = GaugeMetricFamily(
            "elasticpipe_stage_layer_seconds",
            "Smoothed time of one micro-batch through one layer (direction: forward or "
            "backward), what the stage reports to the planner",
            labels=["layer", "direction"],
        )
        for (layer, direction), seconds in sorted(v.layer_seconds.items()):
            layers.add_metric([str(layer), direction], seconds)
        yield layers


# ---- coordinator ------------------------------------------------------------------------


@dataclass(frozen=True)
class CoordinatorView:
    """The coordinator's state at one scrape."""

    members: dict[str, int]  # state -> count, every state of MEMBER_STATES present
    epoch: int | None  # None: no job yet
    chain_length: int
    predicted_step_s: float | None  # the partition's prediction when it was made


MEMBER_STATES = ("chain", "spare", "drained", "dead", "left")


class CoordinatorMetrics:
    """The coordinator's metrics (``elasticpipe_coordinator_*``) in their own registry."""

    def __init__(self, read: Callable[[], CoordinatorView]):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.migrations = Counter(
            "elasticpipe_coordinator_migrations",
            "Epoch changes committed (kind: move, scale-out, recovery, ...)",
            ["kind"],
            registry=r,
        )
        self.migration_bytes = Counter(
            "elasticpipe_coordinator_migration_bytes",
            "Bytes of layer state moved by committed epoch changes",
            ["kind"],
            registry=r,
        )
        self.migration_pause = Histogram(
            "elasticpipe_coordinator_migration_pause_seconds",
            "How long training stood still for an epoch change (frozen to committed)",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.loop_pause = Histogram(
            "elasticpipe_coordinator_loop_pause_seconds",
            "What an epoch change cost the training loop, as its client saw: from the first "
            "attempt the stages refused to the first they accepted in the new epoch",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.migrations_aborted = Counter(
            "elasticpipe_coordinator_migrations_aborted",
            "Epoch changes abandoned (the old epoch stayed in force)",
            ["kind"],
            registry=r,
        )
        self.decisions = Counter(
            "elasticpipe_coordinator_policy_decisions",
            "Rebalancing decisions by outcome (move, forced, optimal, below_threshold, "
            "no_payback, cooldown, unconfirmed, disabled)",
            ["outcome"],
            registry=r,
        )
        self.rpc_errors = _rpc_errors("coordinator", r)
        self._read = read
        self._lock = threading.Lock()
        self._predicted: float | None = None  # the policy's latest, at live speeds
        self._efficiency: tuple[int, float] | None = None  # (step, figure) the client reported
        self._progress: deque[tuple[float, int]] = deque(maxlen=MEASURED_STEPS_WINDOW)
        r.register(_ViewCollector(self._families))

    def efficiency_reported(self, step: int, figure: float) -> None:
        """The client's pipeline efficiency of ``step`` (sent with its lease renewal)."""
        with self._lock:
            self._efficiency = (step, figure)

    def interceptor(self) -> RpcErrorCounter:
        """The server interceptor counting the coordinator's failed calls."""
        return RpcErrorCounter(self.rpc_errors)

    def epoch_changed(self, kind: str, nbytes: int, pause_s: float) -> None:
        """An epoch change committed, moving ``nbytes`` with training paused ``pause_s``."""
        self.migrations.labels(kind=kind).inc()
        self.migration_bytes.labels(kind=kind).inc(nbytes)
        self.migration_pause.labels(kind=kind).observe(pause_s)
        with self._lock:
            self._predicted = None  # until the policy predicts the new partition again
            self._progress.clear()  # the pause is not a step time

    def loop_paused(self, pause_s: float) -> None:
        """The client reported what an epoch change cost its training loop."""
        self.loop_pause.observe(pause_s)

    def epoch_change_aborted(self, kind: str) -> None:
        """An epoch change was abandoned."""
        self.migrations_aborted.labels(kind=kind).inc()

    def decided(self, outcome: str, current_step_s: float | None) -> None:
        """The policy decided (``outcome``), predicting ``current_step_s`` for the current
        partition at the live speeds (None: unknown, nothing profiled or measured yet)."""
        self.decisions.labels(outcome=outcome).inc()
        with self._lock:
            self._predicted = current_step_s

    def heard(self, committed_step: int, now: float | None = None) -> None:
        """A stage reported ``committed_step``: the newest step seen times the steps."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if not self._progress or committed_step > self._progress[-1][1]:
                self._progress.append((now, committed_step))

    def measured_step_s(self) -> float | None:
        """Seconds per committed step over the last heartbeats that saw progress."""
        with self._lock:
            if len(self._progress) < 2:
                return None
            (t0, s0), (t1, s1) = self._progress[0], self._progress[-1]
        return (t1 - t0) / (s1 - s0)

    def _families(self) -> Iterator[Metric]:
        v = self._read()
        members = GaugeMetricFamily(
            "elasticpipe_coordinator_members",
            "Stage incarnations by state (chain, spare, drained, dead, left)",
            labels=["state"],
        )
        for state in MEMBER_STATES:
            members.add_metric([state], v.members.get(state, 0))
        yield members
        yield from _gauge(
            "elasticpipe_coordinator_epoch",
            "Epoch of the partition in force",
            None if v.epoch is None else float(v.epoch),
        )
        with self._lock:
            predicted = self._predicted
        yield from _gauge(
            "elasticpipe_coordinator_predicted_step_seconds",
            "The planner's step time for the current partition (live speeds)",
            predicted if predicted is not None else v.predicted_step_s,
        )
        yield from _gauge(
            "elasticpipe_coordinator_measured_step_seconds",
            "Seconds per committed step, from the steps stages report in heartbeats",
            self.measured_step_s(),
        )
        with self._lock:
            efficiency = self._efficiency
        yield from _gauge(
            "elasticpipe_coordinator_pipeline_efficiency_ratio",
            "The last reported step's ideal time (critical path of its measured ops, free "
            "communication) over its measured time",
            efficiency[1] if efficiency else None,
        )
        yield from _gauge(
            "elasticpipe_coordinator_pipeline_efficiency_step",
            "The step the pipeline efficiency figure is of",
            float(efficiency[0]) if efficiency else None,
        )


# ---- the endpoint -----------------------------------------------------------------------


class MetricsEndpoint:
    """An HTTP server answering ``GET /metrics`` from one registry (plain HTTP, no auth)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int):
        """Binds ``host:port`` (port 0 picks a free one) and serves in a thread.

        Raises:
            InvalidRequest: a port out of range, or an address that cannot be bound.
        """
        addr = "0.0.0.0" if host == "" else host
        if not 0 <= port <= 65535:
            raise InvalidRequest(f"metrics port {port} is not in [0, 65535]")
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            raise InvalidRequest(f"cannot serve metrics on {addr} port {port}: {exc}") from exc
        self.port = int(self._server.server_port)
        log.info("metrics_serving", host=addr, port=self.port)

    def close(self) -> None:
        """Stops serving."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
