"""``elasticpipe admin``: the operator's view of a running cluster, and its levers."""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

from google.protobuf.json_format import MessageToDict

from elasticpipe import rpc
from elasticpipe.errors import InvalidRequest
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc

ADMIN_TIMEOUT_S = 300.0


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


def _ago(unix: float) -> str:
    return "never" if unix <= 0 else f"{time.time() - unix:.1f}s ago"


def format_status(s: coordinator_pb2.StatusResponse) -> str:
    """The status as a table."""
    lines = [
        f"model: {s.job_model or '-'}   layers: {s.num_layers}   epoch: {s.partition.epoch}   "
        f"partition: {_ranges(list(s.partition.boundaries)) or '-'}   "
        f"auto-rebalance: {'on' if s.auto_rebalance else 'off'}",
        "",
        f"{'name':<14}{'address':<22}{'device':<8}{'alive':<7}{'speed':>7}{'slow':>6}"
        f"{'layers':>10}{'step':>7}  heartbeat",
    ]
    for st in s.stages:
        layers = f"{st.layer_lo}:{st.layer_hi}" if st.index >= 0 else "-"
        lines.append(
            f"{st.name:<14}{st.address:<22}{st.device:<8}{'yes' if st.alive else 'NO':<7}"
            f"{st.speed:>7.3f}{st.slowdown:>6.1f}{layers:>10}{st.committed_step:>7}  "
            f"{_ago(st.last_heartbeat_unix)}"
        )
    if s.history:
        lines += [
            "",
            "epoch history:",
            f"{'epoch':>6}  {'when':<20}{'partition':<28}{'moved':>6}{'bytes':>12}"
            f"{'pause':>8}  reason",
        ]
        for r in s.history:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.at_unix))
            lines.append(
                f"{r.epoch:>6}  {when:<20}{_ranges(list(r.boundaries)):<28}{r.layers_moved:>6}"
                f"{r.bytes_moved:>12}{r.pause_s:>7.2f}s  {r.reason}"
            )
    return "\n".join(lines)


def format_plan(p: coordinator_pb2.PlanResponse) -> str:
    """Current and optimal partitions side by side."""
    current = list(p.current.boundaries)
    optimal = list(p.optimal_boundaries)
    lines = [f"{'stage':<8}{'speed':>8}{'current':>12}{'optimal':>12}"]
    for s, speed in enumerate(p.stage_speeds):
        lines.append(
            f"{s:<8}{speed:>8.3f}{current[s]:>5}:{current[s + 1]:<6}"
            f"{optimal[s]:>5}:{optimal[s + 1]:<6}"
        )
    gain = 1 - p.optimal_step_s / p.current_step_s if p.current_step_s else 0.0
    lines += [
        f"predicted step: current {p.current_step_s * 1e3:.1f} ms, optimal "
        f"{p.optimal_step_s * 1e3:.1f} ms (gain {gain:.1%}); "
        f"{p.bytes_to_move} bytes to move",
    ]
    return "\n".join(lines)


def format_move(r: coordinator_pb2.RebalanceResponse) -> str:
    """The outcome of rebalance / set-partition / drain."""
    what = "moved" if r.changed else "unchanged"
    return (
        f"{what}: epoch {r.partition.epoch}, partition "
        f"{_ranges(list(r.partition.boundaries))}; {r.decision}"
        + (f"; {r.bytes_moved} bytes in {r.pause_s:.2f}s" if r.changed else "")
    )


def run_admin(args: argparse.Namespace) -> int:
    """Executes ``elasticpipe admin ...`` and prints the answer."""
    address = args.coordinator
    with rpc.channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorServiceStub(channel)

        def call(method: Any, request: Any) -> Any:
            return rpc.call(address, method, request, timeout=ADMIN_TIMEOUT_S)

        command = args.admin_command
        if command == "status":
            reply = call(stub.Status, coordinator_pb2.StatusRequest())
            text = format_status(reply)
        elif command == "plan":
            reply = call(stub.Plan, coordinator_pb2.PlanRequest())
            text = format_plan(reply)
        elif command == "rebalance":
            reply = call(
                stub.Rebalance,
                coordinator_pb2.RebalanceRequest(dry_run=args.dry_run, reason="admin rebalance"),
            )
            text = format_move(reply)
        elif command == "set-partition":
            reply = call(
                stub.SetPartition,
                coordinator_pb2.SetPartitionRequest(
                    boundaries=parse_ranges(args.ranges), stage_ids=args.stages
                ),
            )
            text = format_move(reply)
        elif command in ("drain", "undrain"):
            method = stub.Drain if command == "drain" else stub.Undrain
            reply = call(method, coordinator_pb2.DrainRequest(stage=args.stage))
            text = format_move(reply)
        elif command == "slowdown":
            reply = call(
                stub.Slowdown,
                coordinator_pb2.AdminSlowdownRequest(stage=args.stage, factor=args.factor),
            )
            text = reply.message
        else:
            reply = call(
                stub.SetAutoRebalance,
                coordinator_pb2.AutoRebalanceRequest(enabled=args.state == "on"),
            )
            text = reply.message
    if args.json:
        print(json.dumps(MessageToDict(reply, preserving_proto_field_name=True), indent=2))
    else:
        print(text)
    return 0
