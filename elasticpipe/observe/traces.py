"""``elasticpipe admin trace``: every stage's spans on one clock, as Chrome/Perfetto JSON.

Each stage of the chain is asked for the spans of its last N steps (``GetTrace``). The
stages' clocks differ from ours, so before that each is measured NTP-style: a few round
trips of ``GetTrace(steps=0)``, which answers with the stage's clock; for a sample sent at
``t0`` and answered at ``t1`` (our clock) with the stage's ``now``, the stage is ahead by
``now - (t0 + t1) / 2``, give or take half the round trip, so the sample of the lowest
round trip wins. Subtracting that offset puts every span on our clock.

The trace JSON is the Trace Event Format that chrome://tracing and ui.perfetto.dev open:
one process per stage (named, in chain order), one thread per kind of work (compute,
waits, sends to each peer, control), an "X" event per span with the micro-batch id, step,
run and layer range in ``args``.

An inference run (``predict``) carries the number of the step committed before it, so its
spans are marked (``Span.inference``) and kept apart: they are in the Chrome trace under
their own category ("predict F0", ...), but never in a training step's ops, figure or
timeline; ``summary`` lists them on their own.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from elasticpipe.errors import InvalidRequest
from elasticpipe.observe.efficiency import critical_path, efficiency
from elasticpipe.security.tls import TLS
from elasticpipe.training.schedule import Op, OpKind
from elasticpipe.transport import rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

CLOCK_SAMPLES = 5
MAX_STEPS = 16  # what a stage keeps (stage_server.tracing.DEFAULT_STEPS_KEPT)
COMPUTE, WAITS, CONTROL, FIRST_SEND = 0, 1, 2, 3  # thread ids of a stage's tracks
FIRST_REDUCE = 1000  # replicas: a track per reduction group, FIRST_REDUCE + its index
OP_KINDS = {  # the op each op span times
    stage_pb2.SPAN_FORWARD: OpKind.FORWARD,
    stage_pb2.SPAN_BACKWARD: OpKind.BACKWARD,
    stage_pb2.SPAN_WEIGHT: OpKind.WEIGHT,
}
OP_SPANS = tuple(OP_KINDS)
INFERENCE = "inference"  # the Chrome trace category of every span of an inference run

_NAMES = {
    stage_pb2.SPAN_FORWARD: "F",
    stage_pb2.SPAN_BACKWARD: "B",
    stage_pb2.SPAN_WEIGHT: "W",
    stage_pb2.SPAN_SEND: "send",
    stage_pb2.SPAN_RECV_WAIT: "wait",
    stage_pb2.SPAN_COMMIT: "commit",
    stage_pb2.SPAN_FREEZE: "freeze",
    stage_pb2.SPAN_PREPARE: "prepare epoch",
    stage_pb2.SPAN_EPOCH_COMMIT: "commit epoch",
    stage_pb2.SPAN_REDUCE: "reduce",
}


@dataclass(frozen=True)
class StageTrace:
    """One stage's spans, with what it took to put them on the collector's clock."""

    index: int
    name: str
    address: str
    layer_lo: int
    layer_hi: int
    offset_ns: int  # the stage's clock minus ours
    rtt_ns: int  # round trip of the sample the offset came from
    spans: tuple[stage_pb2.Span, ...]
    truncated: bool
    replica: int = 0  # the replica whose chain it is in (a job of several replicas)

    def local(self, span: stage_pb2.Span) -> tuple[int, int]:
        """A span's (start, end) on the collector's clock, in ns."""
        start = span.start_ns - self.offset_ns
        return start, start + span.duration_ns


@dataclass(frozen=True)
class StepFigure:
    """The pipeline efficiency of one traced step, from its spans."""

    step: int
    ideal_s: float
    measured_s: float  # first F to last B over every stage, clocks corrected
    efficiency: float


def clock_offset(stub: Any, timeout: float, samples: int = CLOCK_SAMPLES) -> tuple[int, int]:
    """NTP-style: (offset_ns, rtt_ns) of the lowest-round-trip of ``samples`` probes."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        t0 = time.time_ns()
        reply = stub.GetTrace(stage_pb2.TraceRequest(steps=0), timeout=timeout)
        t1 = time.time_ns()
        sample = (reply.now_ns - (t0 + t1) // 2, t1 - t0)
        if best is None or sample[1] < best[1]:
            best = sample
    assert best is not None
    return best


class ChainedStage(Protocol):
    """What ``collect`` reads of a stage in a status (a ``StageInfo``, typed or wire)."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def layer_lo(self) -> int: ...
    @property
    def layer_hi(self) -> int: ...
    @property
    def replica(self) -> int: ...


def collect(
    stages: Iterable[ChainedStage], steps: int, tls: TLS | None, timeout: float
) -> list[StageTrace]:
    """The spans of the last ``steps`` steps of every stage of ``stages`` that is in the
    chain (a status's stages), in chain order (replica after replica, with several).

    Raises:
        InvalidRequest: no job is running (nothing to trace).
        StageUnavailable (and the rest of the tree): a stage did not answer.
    """
    chain = sorted((s for s in stages if s.index >= 0), key=lambda s: (max(s.replica, 0), s.index))
    if not chain:
        raise InvalidRequest("no stage is in a chain: start a job before tracing it")
    out = []
    for info in chain:
        try:
            with rpc.channel(info.address, tls) as channel:
                stub = stage_pb2_grpc.StageServiceStub(channel)
                offset, rtt = clock_offset(stub, timeout)
                reply = stub.GetTrace(stage_pb2.TraceRequest(steps=steps), timeout=timeout)
        except grpc.RpcError as exc:
            raise rpc.translate(exc, info.address) from exc
        out.append(
            StageTrace(
                index=info.index,
                name=info.name,
                address=info.address,
                layer_lo=info.layer_lo,
                layer_hi=info.layer_hi,
                replica=max(info.replica, 0),
                offset_ns=offset,
                rtt_ns=rtt,
                spans=tuple(reply.spans),
                truncated=reply.truncated,
            )
        )
    return out


def latest_ops(trace: StageTrace) -> dict[int, list[stage_pb2.Span]]:
    """Per step, the stage's F, B (and W) spans of the newest training run of that step (a
    retried step keeps only its last attempt; inference runs are no step's), in the order
    they ran."""
    runs: dict[int, int] = {}
    for span in trace.spans:
        if span.kind in OP_SPANS and not span.inference:
            runs[span.step] = max(runs.get(span.step, 0), span.run)
    ops: dict[int, list[stage_pb2.Span]] = defaultdict(list)
    for span in trace.spans:
        if span.kind in OP_SPANS and not span.inference and span.run == runs[span.step]:
            ops[span.step].append(span)
    for spans in ops.values():
        spans.sort(key=lambda s: s.start_ns)
    return dict(ops)


def step_figures(traces: Sequence[StageTrace]) -> list[StepFigure]:
    """The efficiency of every step that each stage traced completely (a forward and a
    backward of every micro-batch), oldest first."""
    per_stage = [latest_ops(t) for t in traces]
    steps = set.intersection(*(set(p) for p in per_stage)) if per_stage else set()
    figures = []
    for step in sorted(steps):
        ops: list[list[Op]] = []
        durations: list[dict[OpKind, list[float]]] = []
        first, last = None, None
        for trace, spans_of in zip(traces, per_stage, strict=True):
            spans = spans_of[step]
            m = 1 + max(s.micro_batch for s in spans)
            took = {kind: [-1.0] * m for kind in OpKind}
            order = []
            for s in spans:
                kind = OP_KINDS[s.kind]
                took[kind][s.micro_batch] = s.duration_ns / 1e9
                order.append(Op(kind, s.micro_batch))
                start, end = trace.local(s)
                first = start if first is None else min(first, start)
                last = end if last is None else max(last, end)
            split = any(op.kind is OpKind.WEIGHT for op in order)
            needed = [OpKind.FORWARD, OpKind.BACKWARD] + ([OpKind.WEIGHT] if split else [])
            if min(t for kind in needed for t in took[kind]) < 0:
                break  # a micro-batch's span is missing (the step was cut): no figure
            ops.append(order)
            durations.append(took)
        else:
            if len({len(d[OpKind.FORWARD]) for d in durations}) != 1 or first is None:
                continue
            assert last is not None
            fwd = [d[OpKind.FORWARD] for d in durations]
            bwd = [d[OpKind.BACKWARD] for d in durations]
            split = any(op.kind is OpKind.WEIGHT for order in ops for op in order)
            weights = [d[OpKind.WEIGHT] for d in durations] if split else None
            try:
                ideal = critical_path(ops, fwd, bwd, weights)
            except InvalidRequest:
                continue
            measured = (last - first) / 1e9
            figures.append(StepFigure(step, ideal, measured, efficiency(ideal, measured)))
    return figures


def inference_runs(traces: Sequence[StageTrace]) -> list[tuple[int, int]]:
    """The (run, step) of every inference run any stage traced, by run: ``step`` is the
    step committed before it ran."""
    return sorted({(s.run, s.step) for t in traces for s in t.spans if s.inference})


def _label(span: stage_pb2.Span) -> str:
    name = _NAMES.get(span.kind, "span")
    if span.kind in OP_SPANS:
        name = f"{name}{span.micro_batch}"
    elif span.kind == stage_pb2.SPAN_SEND:
        name = f"send {span.micro_batch}"
    elif span.kind == stage_pb2.SPAN_RECV_WAIT:
        name = f"wait {span.micro_batch}"
    elif span.kind == stage_pb2.SPAN_REDUCE:
        name = f"reduce group {span.micro_batch}"
    return f"predict {name}" if span.inference else name


def chrome_trace(traces: Sequence[StageTrace]) -> dict[str, Any]:
    """The Trace Event Format JSON of the stages' spans (timestamps in µs from the first)."""
    starts = [t.local(s)[0] for t in traces for s in t.spans]
    origin = min(starts, default=0)
    events: list[dict[str, Any]] = []
    for t in traces:
        pid = t.index + 1000 * t.replica  # a track per stage, grouped by replica
        where = f"replica {t.replica} stage {t.index}" if t.replica else f"stage {t.index}"
        title = f"{where}: {t.name} (layers {t.layer_lo}:{t.layer_hi})"
        events += [
            {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": title}},
            {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}},
        ]
        threads = {COMPUTE: "compute", WAITS: "waiting for inputs", CONTROL: "commit, epochs"}
        peers: dict[str, int] = {}
        for span in t.spans:
            if span.kind in OP_SPANS:
                tid = COMPUTE
            elif span.kind == stage_pb2.SPAN_RECV_WAIT:
                tid = WAITS
            elif span.kind == stage_pb2.SPAN_REDUCE:  # (groups may overlap: a track each)
                tid = FIRST_REDUCE + span.micro_batch
                threads[tid] = f"reduce group {span.micro_batch}"
            elif span.kind == stage_pb2.SPAN_SEND:
                tid = peers.setdefault(span.peer, FIRST_SEND + len(peers))
                threads[tid] = f"sends to {span.peer}"
            else:
                tid = CONTROL
            start, _ = t.local(span)
            args: dict[str, Any] = {"step": span.step, "run": span.run, "epoch": span.epoch}
            if span.kind == stage_pb2.SPAN_REDUCE:
                args["group"] = span.micro_batch
            elif span.micro_batch >= 0:
                args["micro_batch"] = span.micro_batch
            if span.layer_hi:
                args["layers"] = f"{span.layer_lo}:{span.layer_hi}"
            if span.peer:
                args["peer"] = span.peer
            if span.inference:
                args["inference"] = True
            events.append(
                {
                    "name": _label(span),
                    "cat": INFERENCE if span.inference else _NAMES.get(span.kind, "span"),
                    "ph": "X",
                    "ts": (start - origin) / 1e3,
                    "dur": span.duration_ns / 1e3,
                    "pid": pid,
                    "tid": tid,
                    "args": args,
                }
            )
        events += [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in sorted(threads.items())
        ]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def summary(traces: Sequence[StageTrace], figures: Sequence[StepFigure]) -> dict[str, Any]:
    """What ``admin trace --json`` prints: per stage, per training step, and the inference
    runs apart."""
    return {
        "stages": [
            {
                "index": t.index,
                "name": t.name,
                "address": t.address,
                "layers": [t.layer_lo, t.layer_hi],
                "spans": len(t.spans),
                "truncated": t.truncated,
                "clock_offset_ms": t.offset_ns / 1e6,
                "clock_rtt_ms": t.rtt_ns / 1e6,
            }
            for t in traces
        ],
        "steps": [
            {
                "step": f.step,
                "ideal_s": f.ideal_s,
                "measured_s": f.measured_s,
                "efficiency": f.efficiency,
            }
            for f in figures
        ],
        "inference_runs": [
            {"run": run, "after_step": step} for run, step in inference_runs(traces)
        ],
    }


__all__ = [
    "StageTrace",
    "StepFigure",
    "chrome_trace",
    "clock_offset",
    "collect",
    "inference_runs",
    "latest_ops",
    "step_figures",
    "summary",
]
