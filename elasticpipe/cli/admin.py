"""``elasticpipe admin``: the operator's view of a running cluster, and its levers.

Every command prints a table for people, or with ``--json`` one JSON object for scripts:
every field present (zeros too), 64-bit integers as numbers, enums by name. An error is
``{"error": {"code": ..., "message": ...}}`` with ``--json``, a line on stderr without;
either way the exit code is 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from elasticpipe.client.admin import (
    GONE_STATES,
    Admin,
    Move,
    PlanReport,
    StageInfo,
    Status,
    document,
)
from elasticpipe.errors import CoordinatorUnavailable, ElasticPipeError, InvalidRequest
from elasticpipe.security.tls import TLS
from elasticpipe.transport.coordinators import parse_coordinators

STATUS_HELP = """\
step (in the first line) is the job's committed step. A step is committed on every stage
of the chain or on none, so the chain has one step, shown once; each stage reports its
own with its heartbeats, which lag by up to an interval (--json: stages[].committed_step,
as of that stage's last heartbeat).
live stages come first, the chain in chain order; then the incarnations that are gone.
columns of the stage table:
  id      the incarnation's id (each start of a stage process gets a new one)
  state   chain (holds layers), spare (live, outside the chain: replaces a stage that
          dies, or joins when the planner predicts a gain), drained (kept out by an
          operator), dead (declared dead: missed heartbeats or unreachable), left (shut
          down on purpose, SIGTERM, after its layers moved off)
  inc     incarnation: how many times a stage of this name registered
  speed   measured speed relative to the job's profile: 1.0 is the slowest profiled
          stage; 2.0 runs the same layers in half the time (-: not measured, or not in
          the chain)
  slow    emulated slowdown factor (admin slowdown; 1 = none)
  memory  bytes the stage offers its job (--memory, or measured at start; -: unknown)
  layers  the layer range owned, LO:HI (HI excluded)
  step    (gone incarnations) the last step it had committed when last heard from
'admin forget NAME' removes the gone incarnations of a name.
the epoch history lists every partition change of the job: its kind (start, move,
scale-out, recovery, restore: a checkpoint or init_state streamed by the client, attach:
the snapshot taken when a client resumes, or an attempt abandoned before its commit
point), the layers and bytes moved, how long training paused, and why. A job started
from init_state has two epochs: its start, then the restore of its initial weights.
"""


def parse_ranges(text: str) -> list[int]:
    """Turns "0:6,6:12,12:18" into boundaries [0, 6, 12, 18].

    Raises:
        InvalidRequest: ranges that are malformed or not contiguous.
    """
    bounds: list[int] = []
    for part in text.split(","):
        lo_s, _, hi_s = part.partition(":")
        if not (lo_s.strip().isdecimal() and hi_s.strip().isdecimal()):
            raise InvalidRequest(
                f"bad range {part!r} in {text!r} (expected LO:HI, two non-negative layer numbers)"
            )
        lo, hi = int(lo_s), int(hi_s)
        if bounds and lo != bounds[-1]:
            raise InvalidRequest(
                f"range {part!r} does not start where the previous ended ({bounds[-1]})"
            )
        if hi <= lo:
            raise InvalidRequest(f"range {part!r} is empty")
        bounds = [*bounds, hi] if bounds else [lo, hi]
    return bounds


def _ranges(boundaries: list[int]) -> str:
    return ",".join(f"{a}:{b}" for a, b in itertools.pairwise(boundaries))


def _width(cells: Iterable[str], minimum: int) -> int:
    """A column's width: the longest cell plus a two-space gutter, at least ``minimum``."""
    return max([minimum, *(len(c) + 2 for c in cells)])


def _ago(unix: float) -> str:
    return "never" if unix <= 0 else f"{time.time() - unix:.1f}s ago"


# ---- JSON --------------------------------------------------------------------------------


def _value(field: Any, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return to_json(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    if field.type == FieldDescriptor.TYPE_BYTES:
        return value.hex()
    return value


def to_json(message: Message) -> dict[str, Any]:
    """Every field of a message, zeros included; integers stay numbers; an ``optional``
    scalar that is not set (unknown, such as a step time before profiling) is None. The
    JSON form of the wire message itself: what ``Admin``'s ``document`` of its typed answer
    must equal (``tests/unit/test_admin_client.py``), and what the schemas are checked on."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is None and field.has_presence and not field.is_repeated:
            out[field.name] = value if message.HasField(field.name) else None
        elif field.is_repeated:
            out[field.name] = [_value(field, v) for v in value]
        else:
            out[field.name] = _value(field, value)
    return out


# ---- tables ------------------------------------------------------------------------------


def format_status(s: Status) -> str:
    """The status as tables (stages, then the epoch history)."""
    job = s.job_id or "-"
    replicas = s.partition.replicas
    cut = f"{len(replicas)} replicas" if replicas else _ranges(list(s.partition.boundaries))
    lines = [
        f"job: {job}   model: {s.job_model or '-'}   layers: {s.num_layers}   "
        f"epoch: {s.partition.epoch}   step: {s.committed_step}   "
        f"partition: {cut or '-'}   "
        f"auto-rebalance: {'on' if s.auto_rebalance else 'off'}   "
        f"efficiency: "
        + (f"{s.efficiency:.0%} (step {s.efficiency_step})" if s.efficiency_step else "-"),
        f"client: {s.client or 'none (the job is free)'}"
        + (f"   factory: {s.factory_file} sha256 {s.factory_sha256[:12]}" if s.factory_file else "")
        + (f"   leader: {s.leader} (term {s.term})" if s.term else ""),
    ]
    if s.job_failure:
        lines.append(f"JOB FAILED: {s.job_failure}")
    if replicas:
        names = {st.stage_id: st.name for st in s.stages}
        lines += ["", f"{'replica':>7}{'share':>7}{'predicted':>11}  partition (stages)"]
        for i, (p, share) in enumerate(zip(replicas, s.partition.shares, strict=False)):
            step = f"{p.predicted_step_s:.3f}s" if p.predicted_step_s else "-"
            stages = ", ".join(names.get(sid, sid) for sid in p.stage_ids)
            lines.append(f"{i:>7}{share:>7}{step:>11}  {_ranges(list(p.boundaries))} ({stages})")
    live, gone = ordered_stages(s.stages)
    nw = _width((st.name for st in s.stages), 14)  # long names and addresses widen
    iw = _width((st.stage_id for st in s.stages), 13)
    aw = _width((st.address for st in s.stages), 22)  # their columns, never overrun them
    lines += [
        "",
        f"{'name':<{nw}}{'id':<{iw}}{'state':<9}{'inc':>4}  {'address':<{aw}}{'device':<8}"
        f"{'speed':>7}{'slow':>6}{'memory':>8}{'layers':>9}  heartbeat",
    ]
    for st in live:
        layers = f"{st.layer_lo}:{st.layer_hi}" if st.index >= 0 else "-"
        if replicas and st.replica >= 0:
            layers = f"r{st.replica} {layers}"
        speed = f"{st.speed:.3f}" if st.speed > 0 else "-"
        lines.append(
            f"{st.name:<{nw}}{st.stage_id:<{iw}}{st.state:<9}{st.incarnation:>4}  "
            f"{st.address:<{aw}}{st.device:<8}{speed:>7}{st.slowdown:>6.1f}"
            f"{_mem(st.memory_bytes):>8}{layers:>9}  {_ago(st.last_heartbeat_unix)}"
        )
    if gone:
        lines += [
            "",
            "gone (dead or left; 'admin forget NAME' removes them):",
            f"{'name':<{nw}}{'id':<{iw}}{'state':<9}{'inc':>4}  {'address':<{aw}}{'device':<8}"
            f"{'step':>7}  last heartbeat",
        ]
        for st in gone:
            lines.append(
                f"{st.name:<{nw}}{st.stage_id:<{iw}}{st.state:<9}{st.incarnation:>4}  "
                f"{st.address:<{aw}}{st.device:<8}{st.committed_step:>7}  "
                f"{_ago(st.last_heartbeat_unix)}"
            )
    if s.history:
        lines += [
            "",
            "epoch history:",
            f"{'epoch':>6}  {'when':<20}{'kind':<11}{'partition':<24}{'moved':>6}{'bytes':>12}"
            f"{'pause':>8}{'loop':>8}  reason",
        ]
        for r in s.history:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.at_unix))
            loop = f"{r.loop_pause_s:>7.2f}s" if r.loop_pause_s else f"{'-':>8}"
            lines.append(
                f"{r.epoch:>6}  {when:<20}{r.kind:<11}{_ranges(list(r.boundaries)):<24}"
                f"{r.layers_moved:>6}{r.bytes_moved:>12}{r.pause_s:>7.2f}s{loop}  {r.reason}"
            )
    return "\n".join(lines)


def ordered_stages(
    stages: Iterable[StageInfo],
) -> tuple[list[StageInfo], list[StageInfo]]:
    """The live stages (the chain in chain order, then spares, then drained ones, each in
    registration order), and the incarnations that are gone (dead or left)."""
    every = list(stages)
    rank = {"chain": 0, "spare": 1, "drained": 2}
    live = [st for st in every if st.state not in GONE_STATES]
    live.sort(
        key=lambda st: (
            rank.get(st.state, 3),
            (st.replica, st.index) if st.state == "chain" else (0, 0),
        )
    )
    return live, [st for st in every if st.state in GONE_STATES]


def format_plan(p: PlanReport) -> str:
    """Current and optimal partitions side by side."""
    current = list(p.current.boundaries)
    optimal = list(p.optimal_boundaries)
    names = list(p.stage_names) or [str(s) for s in range(len(p.stage_speeds))]
    nw = _width(names, 14)
    spreads = list(p.stage_speed_spreads) or [0.0] * len(p.stage_speeds)
    lines = [f"{'stage':<{nw}}{'speed':>8}{'spread':>8}{'current':>12}{'optimal':>12}"]
    for s, (name, speed) in enumerate(zip(names, p.stage_speeds, strict=False)):
        spread = f"{spreads[s]:.0%}" if s < len(spreads) else "-"
        lines.append(
            f"{name:<{nw}}{speed:>8.3f}{spread:>8}{current[s]:>5}:{current[s + 1]:<6}"
            f"{optimal[s]:>5}:{optimal[s + 1]:<6}"
        )
    gain = p.gain
    if gain is not None and p.current_step_s is not None and p.optimal_step_s is not None:
        predicted = (
            f"predicted step: current {p.current_step_s * 1e3:.1f} ms, optimal "
            f"{p.optimal_step_s * 1e3:.1f} ms (gain {gain:.1%})"
        )
    else:
        predicted = (
            "predicted step: unknown until the stages are profiled (the first training "
            "step does it; until then layer costs are estimated from parameter sizes)"
        )
    lines += [f"{predicted}; {p.bytes_to_move} bytes to move"]
    if p.current.replicas:
        lines.append(
            f"the job runs {len(p.current.replicas)} replicas, shares "
            f"{list(p.current.shares)}: 'current' and 'optimal' are replica 0's cuts, and "
            "the predicted steps those of its shares now and of the best shares"
        )
    if p.layouts:
        reductions = (
            f"reductions at {p.reduce_bytes_per_s / 1e6:.1f} MB/s"
            if p.reduce_bytes_per_s
            else "reductions counted as free: no rate measured or given yet"
        )
        if p.slot_overhead_s:
            reductions += f", {p.slot_overhead_s * 1e3:.2f} ms measured per pipeline slot"
        if p.step_overhead_s:
            reductions += f", {p.step_overhead_s * 1e3:.1f} ms per step"
        if p.optimizer_bytes_per_s:
            reductions += f", optimizer steps at {p.optimizer_bytes_per_s / 1e6:.0f} MB/s"
        lines += [
            "",
            f"layouts (replicas='auto', over the job's stages and the spares; {reductions}):",
        ]
        for c in p.layouts:
            step = f"{c.step_s * 1e3:.1f} ms" if c.in_seconds else f"{c.step_s:.3g} (no unit)"
            chains = " | ".join(
                f"{_ranges(list(r.boundaries))} x{m}"
                for r, m in zip(c.replicas, c.shares, strict=False)
            )
            parts = [f"reduction {c.reduce_s * 1e3:.1f} ms"] if c.reduce_s else []
            if c.per_step_s:
                parts.append(f"per step {c.per_step_s * 1e3:.1f} ms")
            reduce = f" ({', '.join(parts)})" if parts else ""
            lines.append(f"  {len(c.replicas):>3} replicas  {step:>12}  {chains}{reduce}")
    return "\n".join(lines)


def format_move(r: Move, dry_run: bool = False) -> str:
    """The outcome of rebalance / set-partition / drain (or what a dry run would do)."""
    target = _ranges(list(r.target.boundaries)) if r.target.boundaries else "-"
    if dry_run:
        return (
            f"dry run: would move to {target} (gain {r.predicted_gain:.1%}, "
            f"{r.bytes_moved} bytes to move); {r.decision}"
        )
    what = "moved" if r.changed else "unchanged"
    replicas = r.partition.replicas
    cut = (
        " | ".join(
            f"{_ranges(list(p.boundaries))} x{m}"
            for p, m in zip(replicas, r.partition.shares, strict=False)
        )
        if replicas
        else _ranges(list(r.partition.boundaries))
    )
    return (
        f"{what}: epoch {r.partition.epoch}, {'replicas' if replicas else 'partition'} "
        f"{cut}; {r.decision}"
        + (f"; {r.bytes_moved} bytes in {r.pause_s:.2f}s" if r.changed else "")
    )


# ---- commands ----------------------------------------------------------------------------


def _status(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.status(all_jobs=args.all)
    return reply, format_status(reply)


def _plan(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.plan()
    return reply, format_plan(reply)


def _rebalance(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.rebalance(dry_run=args.dry_run)
    return reply, format_move(reply, dry_run=args.dry_run)


def _set_partition(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.set_partition(parse_ranges(args.ranges), args.stages)
    return reply, format_move(reply)


def _set_layout(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    stages = [[s for s in chain.split(",") if s] for chain in args.stages]
    shares = []
    for part in filter(None, args.shares.split(",")):
        if not part.strip().isdecimal():
            raise InvalidRequest(f"bad share {part!r} in {args.shares!r} (micro-batch counts)")
        shares.append(int(part))
    reply = admin.set_layout([parse_ranges(r) for r in args.replicas], stages, shares)
    return reply, format_move(reply)


def _drain(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.drain(args.stage)
    return reply, format_move(reply)


def _undrain(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.undrain(args.stage)
    return reply, format_move(reply)


def _forget(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.forget(args.stage)
    return reply, reply.message


def _mem(value: int) -> str:
    """A byte count in a status column, binary units: ``400K``, ``2.0G``; ``-`` if unknown."""
    if not value:
        return "-"
    size = float(value)
    for unit in ("B", "K", "M", "G"):
        if size < 1024:
            return f"{size:.0f}{unit}" if unit in ("B", "K") else f"{size:.1f}{unit}"
        size /= 1024
    return f"{size:.1f}T"


def _slowdown(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.slowdown(args.stage, args.factor)
    return reply, reply.message


def _auto(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    reply = admin.auto(args.state == "on")
    return reply, reply.message


def _trace(admin: Admin, args: argparse.Namespace) -> tuple[Any, str]:
    from elasticpipe.observe.traces import MAX_STEPS

    if not 1 <= args.steps <= MAX_STEPS:
        raise InvalidRequest(f"--steps must be in [1, {MAX_STEPS}] (got {args.steps})")
    trace = admin.trace(args.steps)
    with open(args.out, "w") as f:
        json.dump(trace.chrome(), f)
    if args.png:
        trace.draw(args.png)
    summary = trace.summary()
    summary.update(out=args.out, png=args.png or "")
    lines = [
        f"{t['name']:<14} layers {t['layers'][0]}:{t['layers'][1]:<5} {t['spans']:>6} spans"
        f"   clock offset {t['clock_offset_ms']:+.3f} ms (rtt {t['clock_rtt_ms']:.3f} ms)"
        + ("   (oldest left out)" if t["truncated"] else "")
        for t in summary["stages"]
    ]
    lines += [
        f"step {f.step}: ideal {f.ideal_s * 1e3:.1f} ms, measured {f.measured_s * 1e3:.1f} ms, "
        f"pipeline efficiency {f.efficiency:.0%}"
        for f in trace.figures
    ]
    predicted = summary["inference_runs"]
    if predicted:
        after = sorted({r["after_step"] for r in predicted})
        lines.append(
            f"{len(predicted)} inference run(s) (predict) after step(s) "
            f"{', '.join(map(str, after))}: in the trace, not in the figures or the timeline"
        )
    lines.append(f"wrote {args.out}" + (f" and {args.png}" if args.png else ""))
    return summary, "\n".join(lines)


# Each command calls its Admin method; it returns the answer (a dataclass, or the trace's
# summary) and its table.
Command = Callable[[Admin, argparse.Namespace], tuple[Any, str]]
COMMANDS: dict[str, Command] = {
    "status": _status,
    "plan": _plan,
    "rebalance": _rebalance,
    "set-partition": _set_partition,
    "set-layout": _set_layout,
    "drain": _drain,
    "undrain": _undrain,
    "forget": _forget,
    "slowdown": _slowdown,
    "auto": _auto,
    "trace": _trace,
}


def _watch(admin: Admin, args: argparse.Namespace) -> int:
    """``status --watch``: the live view (or JSON lines) until Ctrl-C or ``--count`` polls."""
    from rich.console import Console

    from elasticpipe.cli.watch import watch

    if args.interval <= 0:
        raise InvalidRequest(f"--interval must be positive, got {args.interval}")
    if args.count < 0:
        raise InvalidRequest(f"--count must be 0 (no limit) or positive, got {args.count}")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide lines rather than folded cells
        console = Console(width=max(console.width, 160))
    as_json = document if args.json else None
    return watch(
        lambda: admin.status(all_jobs=args.all), console, args.interval, args.count, as_json
    )


class AdminParser(argparse.ArgumentParser):
    """The parser of an admin subcommand: with ``--json`` on the command line, a usage error
    (a missing or malformed argument) is the JSON error object too, exit code 2, so that a
    script reads every failure the same way."""

    def error(self, message: str) -> NoReturn:
        if "--json" in sys.argv[1:]:
            error = {"code": "INVALID_ARGUMENT", "message": f"{self.prog}: {message}"}
            _print(json.dumps({"error": error}))
            raise SystemExit(2)
        super().error(message)


def _print(text: str) -> None:
    """Prints for a reader that may go away (``| head``): a closed pipe ends quietly."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        sys.stdout = None  # no flush at exit either


def run_admin(args: argparse.Namespace) -> int:
    """Executes ``elasticpipe admin ...`` and prints the answer; returns the exit code."""
    address = args.coordinator
    try:
        parse_coordinators(address)
        if args.timeout <= 0:
            raise InvalidRequest(f"--timeout must be positive, got {args.timeout}")
        tls = TLS.from_flags(args.tls_cert, args.tls_key, args.tls_ca)
        with Admin(address, tls, timeout=args.timeout) as admin:
            if args.admin_command == "status" and getattr(args, "watch", False):
                return _watch(admin, args)
            reply, text = COMMANDS[args.admin_command](admin, args)
    except ElasticPipeError as exc:
        message = str(exc)
        if isinstance(exc, CoordinatorUnavailable):
            message = (
                f"cannot reach the coordinator at {address}: is it running, and is that its "
                f"address (--coordinator)? ({exc})"
            )
        if args.json:
            _print(json.dumps({"error": {"code": exc.code.name, "message": message}}))
        else:
            print(f"error: {message}", file=sys.stderr)
        return 2
    answer = reply if isinstance(reply, dict) else document(reply)
    _print(json.dumps(answer, indent=2) if args.json else text)
    return 0
