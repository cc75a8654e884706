"""The control plane at scale: 64, 128 and 256 fake stages against a real coordinator and client.

Each chain size runs on a fresh cluster of three processes:

* **the coordinator** -- the real one (``elasticpipe coordinator``, started by
  ``LocalCluster`` with no stage; ``--state :memory: --no-auto-rebalance``, heartbeat
  interval ``--heartbeat-interval``, default 1 s, the product's default);
* **the fake stages** (``bench/fake_stage.py``) -- child processes of at most
  ``--fakes-per-process`` (64) fake stages each (one process of hundreds of gRPC servers on
  one GIL measured its own thread convoys). Each fake is a real gRPC server
  (``serving.start_server``, like a stage server's) on a loopback address of its own
  (127.0.0.2, 127.0.0.3, ...: its own host, as a real stage's; the coordinator profiles
  hosts at once), whose servicer implements every method of ``StageService`` with no
  compute (and refuses to start when the service has an RPC it lacks), and a membership
  thread that registers and heartbeats exactly like ``stage_server/server.py``
  (``Register``, then a ``HeartbeatRequest`` with epoch, per-layer timings, committed step,
  run state and snapshot holdings every interval; re-registers when told). What the fakes
  keep is what the coordinator and the client look at: the step and epoch protocols (epoch
  checks, client fences, one run at a time,
  ``RunStep``/``CommitStep``/``AbortStep``/``Fence``;
  ``Freeze``/``PrepareEpoch``/``CommitEpoch``/``AbortEpoch``), the layers owned, per-layer
  timings, and snapshots: at step 0 and every ``snapshot_every`` committed steps a fake
  records its own snapshot and pushes a copy to the next stage (``PushSnapshot``, real
  checksummed ``LayerChunk`` streams of a 1 KiB state blob per layer), and reports both in
  its holdings, so the coordinator's safe-step bookkeeping and its wait for step 0's copies
  at job setup run for real. ``Describe`` answers with the real model description
  (``models.describe``/``factory_source``, allocating nothing), ``Profile`` with synthetic
  timings (distinct speeds per stage, so the planner has work), a migration's
  ``PrepareEpoch`` pulls each incoming layer from its owner through ``ExportLayers``
  (``transfers.pull_layer``, as a stage does). The data path is accepted and dropped: the
  first stage's ``RunStep`` waits until the client's inputs for the run arrived, the last
  stage's until its targets did, every other stage answers at once with an empty report (no
  activations flow between fakes). Losses are reported as 0.
* **the client** -- this process: a real ``Pipeline`` over all S stages (mlp of 4S+1
  layers, SGD, 4 micro-batches, snapshots every 10 steps, the defaults otherwise), and
  admin calls to the coordinator.

Measured per chain size S:

* **registration**: from starting the S membership threads at once (a cluster restart)
  until every fake is registered; the Register RPC latencies; the coordinator's CPU.
* **heartbeat load**: with every fake heartbeating and nothing else happening, over a
  ``--window`` of seconds: heartbeats answered, the coordinator process's CPU seconds
  (``/proc``, all threads; 10 ms ticks) per heartbeat, and its CPU share, against its idle
  CPU with no stage (measured first); heartbeat RPC latencies and the largest gap between
  two heartbeats of one fake (a fake is declared dead after ``--dead-after`` s without
  one).
* **planning**: the coordinator's planner (``planner.plan``) on the job's costs and the
  fakes' speeds in this process (median of 5), ``order_hosts`` (which job setup runs
  once), and the coordinator's ``Plan`` RPC (``plan_view``: the planner plus its bookkeeping,
  median of 3).
* **job setup**: the first ``train_step`` (SetupJob: Describe on every stage, Profile on
  up to 16 hosts at once, ``order_hosts``, Assign everywhere, waiting for step 0's
  snapshot copies; then the first step). The coordinator logs each phase's seconds
  (``job_started ... phases_s``; ``--log-dir`` keeps its log).
* **step fan-out**: ``--steps`` timed ``train_step`` calls after a warm-up step (inputs to
  the first stage, targets to the last, RunStep on every stage, CommitStep on every
  stage), with this process's CPU per step and the fakes' and coordinator's.
* **migration**: the coordinator's ``SetPartition`` moving every interior boundary by one
  layer (S-1 layers change owner: freeze, prepare with S-1 layer pulls, commit on every
  stage), timed around the RPC, and back again (median of the two), with the pause the
  coordinator records; then the client's first step after it (a StaleEpoch, a partition
  refresh and a retry).

The table gives, per figure, its growth from the smallest to the largest chain divided by
the chain's growth (``growth/S``: 1.0 is linear, 0.25 flat over 64 to 256, 4.0 quadratic)
and the exponent k of figure ~ S^k: k > 1.3 is flagged as growing worse than linearly
(and k > 0.3 for figures that should stay flat); the last table divides each figure by S.
Dead declarations, re-registrations and failed heartbeats are counted and the
coordinator's log is searched for warnings.

On this 2-core machine the processes share both cores with each other (and with other
work): the fakes' processes serve S gRPC servers and S membership threads, so wall times
include their queueing; the CPU columns separate who spent what. A real
stage serves its RPCs on its own host. The printed load averages say how busy the machine
was.

Run: ``python bench/scale.py [--sizes 64,128,256] [--steps N] [--window S]
[--heartbeat-interval S] [--dead-after S] [--snapshot-every K] [--fakes-per-process N]
[--quick]`` (default: about 1.5-2 minutes; ``--quick``: 4 and 8 stages, heartbeats every
0.25 s, windows of 0.5 s, 2 steps: checks the script end to end; its figures mean little).
The last line is JSON: ``max_stages`` (the longest chain that ran a step), ``plan_ms``,
``migration_s`` and ``step_fanout_s`` at that length, ``exponents`` and ``growth_per_stage``
per figure, and every size's figures, and ``failed``: the sizes that did not run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/scale.py`

from fake_stage import (  # bench/fake_stage.py, next to this script
    BATCH,
    MICRO_BATCHES,
    WIDTH,
    layer_cost,
    stage_speed,
)
from scale_parts import (  # bench/scale_parts.py, next to this script
    Fakes,
    Phases,
    Probe,
    coordinator_log_events,
    model_kwargs,
    process_cpu_s,
    process_threads,
    quantile,
    shifted,
)
from shared.timing import median_seconds  # bench/shared/timing.py, beside this script

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.planning import order_hosts, plan, spare_positions
from elasticpipe.errors import ElasticPipeError
from elasticpipe.local.cluster import LocalCluster

STAGE_COUNTS = (64, 128, 256)
SUPERLINEAR = 1.3  # growth exponent above which a figure is flagged
FAKES_PER_PROCESS = 64


def run_size(stages: int, args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Everything measured on a fresh coordinator with ``stages`` fake stages (and one spare),
    into ``out`` (what was measured stays there if a later phase fails)."""
    hb = args.heartbeat_interval
    started = time.perf_counter()
    log_dir = Path(args.log_dir) / f"{stages}-stages" if args.log_dir else None
    with LocalCluster(
        stages=0,
        state=":memory:",
        auto_rebalance=False,
        heartbeat_s=hb,
        dead_after_s=args.dead_after,
        log_dir=log_dir,
    ) as cluster:
        cpid = cluster.procs["coordinator"].pid
        admin = cluster.admin(timeout=600)
        time.sleep(0.5)
        c0, t0 = process_cpu_s(cpid), time.perf_counter()
        time.sleep(args.idle)
        out["idle_cpu_frac"] = (process_cpu_s(cpid) - c0) / (time.perf_counter() - t0)

        fakes = Fakes(cluster.coordinator, stages + 1, stages, args.fakes_per_process)
        out["fake_processes"] = fakes.processes
        probe = Probe(cluster.coordinator)
        pipe: Pipeline | None = None

        seen: dict[str, Any] = {"calls": Counter(), "max_lag": 0.0}  # since the last phase

        def counters() -> dict[str, Any]:
            taken = fakes.ask("counters", 60)
            seen["calls"].update(taken["calls"])
            seen["max_lag"] = max(seen["max_lag"], taken["max_lag"])
            return taken

        def since_last_phase() -> dict[str, Any]:
            out = {"calls": dict(seen["calls"]), "max_lag": seen["max_lag"]}
            seen["calls"], seen["max_lag"] = Counter(), 0.0
            return out

        try:
            out["serve_s"] = fakes.receive(300)["serve_s"]
            print(
                f"  {stages} + 1 spare fake stage servers up in {out['serve_s']:.1f}s "
                f"(cluster start to here {time.perf_counter() - started:.1f}s)",
                flush=True,
            )
            phase = Phases(out, probe, counters, since_last_phase)

            with phase("registration"):
                c0 = process_cpu_s(cpid)
                reg = fakes.ask("register", 300)
                if not reg["ok"]:
                    raise RuntimeError(f"not every fake registered within 120 s: {reg['errors']}")
                out["register_s"] = reg["wall_s"]
                out["register_cpu_s"] = process_cpu_s(cpid) - c0
                out["register_p50_ms"] = 1000 * quantile(reg["register_latency"], 0.5)
                out["register_max_ms"] = 1000 * max(reg["register_latency"])
                out["register_errors"] = reg["errors"]
            print(
                f"  registered in {out['register_s']:.2f}s "
                f"(p50 {out['register_p50_ms']:.1f} ms, max {out['register_max_ms']:.0f} ms"
                f"{', errors ' + str(reg['errors']) if reg['errors'] else ''})",
                flush=True,
            )

            with phase("heartbeats"):
                time.sleep(2 * hb)
                before = counters()
                c0, f0, t0 = process_cpu_s(cpid), fakes.cpu_s(), time.perf_counter()
                time.sleep(args.window)
                c1, f1, t1 = process_cpu_s(cpid), fakes.cpu_s(), time.perf_counter()
                after = counters()
                beats = after["heartbeats"] - before["heartbeats"]
                out["heartbeats_per_s"] = beats / (t1 - t0)
                out["hb_cpu_frac"] = (c1 - c0) / (t1 - t0)
                out["hb_cpu_ms"] = 1000 * (c1 - c0) / max(beats, 1)
                net = max(0.0, out["hb_cpu_frac"] - out["idle_cpu_frac"]) * (t1 - t0)
                out["hb_net_cpu_ms"] = 1000 * net / max(beats, 1)
                out["hb_p50_ms"] = 1000 * quantile(after["heartbeat_latency"], 0.5)
                out["hb_p99_ms"] = 1000 * quantile(after["heartbeat_latency"], 0.99)
                out["hb_max_gap_s"] = after["max_gap"]
                out["fakes_hb_cpu_frac"] = (f1 - f0) / (t1 - t0)
                out["alive_after_window"] = len(admin.status().alive)
            print(
                f"  heartbeats: {out['heartbeats_per_s']:.0f}/s, coordinator CPU "
                f"{100 * out['hb_cpu_frac']:.1f}% of a core "
                f"(idle {100 * out['idle_cpu_frac']:.1f}%)"
                f" = {out['hb_cpu_ms']:.2f} ms per heartbeat; latency p50 "
                f"{out['hb_p50_ms']:.1f} ms p99 {out['hb_p99_ms']:.1f} ms; "
                f"{out['alive_after_window']}/{stages + 1} alive",
                flush=True,
            )

            with phase("planning (in the client process)"):
                num_layers, _ = models.describe("mlp", model_kwargs(stages))
                out["layers"] = num_layers
                costs = [layer_cost(i) for i in range(num_layers)]
                speeds = [stage_speed(i) for i in range(stages)]
                out["plan_ms"] = 1000 * median_seconds(lambda: plan(costs, speeds), 5)
                out["order_hosts_ms"] = 1000 * median_seconds(lambda: order_hosts(costs, speeds), 1)
                spare = stage_speed(stages)
                now = plan(costs, speeds)
                out["scale_out_eval_ms"] = (
                    1000
                    * median_seconds(  # as Rebalancer.scale_out does
                        lambda: [
                            plan(costs, [*speeds[:p], spare, *speeds[p:]])
                            for p in spare_positions(now.stage_times)
                        ],
                        1,
                    )
                )

            gen = torch.Generator().manual_seed(0)
            batches = [
                (torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen))
                for _ in range(4)
            ]
            pipe = Pipeline(
                coordinator=cluster.coordinator,
                model="mlp",
                model_kwargs=model_kwargs(stages),
                optimizer="sgd",
                optimizer_kwargs={"lr": 0.1},
                loss="mse",
                micro_batches=MICRO_BATCHES,
                stages=stages,
                snapshot_every=args.snapshot_every,
                setup_timeout=300.0,
            )
            with phase("job setup + first step"):
                t0 = time.perf_counter()
                pipe.train_step(*batches[0])
                out["setup_s"] = time.perf_counter() - t0
                assert pipe.partition.num_stages == stages, pipe.partition.num_stages
            with phase("steps"):
                pipe.train_step(*batches[1])  # warm-up
                step_s = []
                cpu0 = (time.process_time(), fakes.cpu_s(), process_cpu_s(cpid))
                for k in range(args.steps):
                    t0 = time.perf_counter()
                    pipe.train_step(*batches[k % len(batches)])
                    step_s.append(time.perf_counter() - t0)
                cpu1 = (time.process_time(), fakes.cpu_s(), process_cpu_s(cpid))
                out["step_s"] = statistics.median(step_s)
                out["step_min_s"] = min(step_s)
                out["client_cpu_ms"], out["fakes_cpu_ms"], out["coordinator_cpu_ms"] = (
                    1000 * (b - a) / args.steps for a, b in zip(cpu0, cpu1, strict=True)
                )
                out["ran_step"] = True
            print(
                f"  setup + first step {out['setup_s']:.2f}s; step {1000 * out['step_s']:.0f} ms "
                f"(CPU per step: client {out['client_cpu_ms']:.0f} ms, fakes "
                f"{out['fakes_cpu_ms']:.0f} ms, coordinator {out['coordinator_cpu_ms']:.0f} ms)",
                flush=True,
            )
            out["plan_rpc_ms"] = 1000 * median_seconds(admin.plan, 3)

            with phase("policy loop on, 1 spare"):
                kinds_before = Counter(r.kind for r in admin.status().history)
                admin.auto(True)
                time.sleep(1.0)
                counters()
                c0, t0 = process_cpu_s(cpid), time.perf_counter()
                time.sleep(args.window)
                c1, t1 = process_cpu_s(cpid), time.perf_counter()
                during = counters()
                admin.auto(False)
                out["policy_cpu_frac"] = (c1 - c0) / (t1 - t0)
                out["policy_hb_p99_ms"] = 1000 * quantile(during["heartbeat_latency"], 0.99)
                out["policy_hb_max_gap_s"] = during["max_gap"]
                kinds = Counter(r.kind for r in admin.status().history)
                out["policy_epochs"] = dict(kinds - kinds_before)
            print(
                f"  auto-rebalance on, 1 spare: coordinator CPU {100 * out['policy_cpu_frac']:.0f}%"
                f" of a core (heartbeats alone {100 * out['hb_cpu_frac']:.0f}%), heartbeat p99 "
                f"{out['policy_hb_p99_ms']:.0f} ms, largest gap {out['policy_hb_max_gap_s']:.2f}s,"
                f" epoch changes {out['policy_epochs'] or 'none'}; scale-out evaluation "
                f"(spare_positions plans) in process {out['scale_out_eval_ms']:.0f} ms",
                flush=True,
            )
            if out["policy_epochs"]:
                pipe.train_step(*batches[3])  # adopt whatever partition came of it

            with phase("migrations"):
                original = list(pipe.partition.boundaries)
                moves = []
                for target in (shifted(original), original):
                    t0 = time.perf_counter()
                    reply = admin.set_partition(target)
                    wall = time.perf_counter() - t0
                    assert reply.changed, reply.decision
                    moves.append((wall, reply.pause_s, reply.bytes_moved))
                history = admin.status().history
                out["layers_moved"] = history[-1].layers_moved
                out["migration_s"] = statistics.median(m[0] for m in moves)
                out["migration_pause_s"] = statistics.median(m[1] for m in moves)
                out["migration_bytes"] = moves[0][2]
                t0 = time.perf_counter()
                pipe.train_step(*batches[2])
                out["step_after_move_s"] = time.perf_counter() - t0
                out["attempts_after_move"] = pipe.last_step.attempts
            print(
                f"  migration ({out['layers_moved']} layers): {out['migration_s']:.2f}s "
                f"(pause {out['migration_pause_s']:.2f}s); next step "
                f"{1000 * out['step_after_move_s']:.0f} ms in {out['attempts_after_move']} "
                f"attempts; Plan RPC {out['plan_rpc_ms']:.0f} ms",
                flush=True,
            )
        finally:
            try:
                final = counters()
                out["dead"], out["reregistered"] = final["dead"], final["reregistered"]
                out["membership_errors"] = final["errors"]
            except (RuntimeError, TimeoutError, EOFError, OSError):
                pass
            out["coordinator_threads"] = process_threads(cpid)
            if pipe is not None:
                with contextlib.suppress(ElasticPipeError):
                    pipe.close()
            probe.close()
            fakes.stop()
            admin.close()
            out["coordinator_log"] = dict(
                coordinator_log_events(cluster.log_dir / "coordinator.log")
            )
    out["total_s"] = time.perf_counter() - started


def growth(results: Sequence[dict[str, Any]], key: str) -> float | None:
    """The figure's growth from the smallest to the largest chain that measured it, divided
    by the growth of the chain: 1.0 is linear, 4.0 quadratic over a 4x range, 0.25 flat."""
    points = [(r["stages"], r[key]) for r in results if r.get(key) and r[key] > 0]
    if len(points) < 2 or points[0][0] == points[-1][0]:
        return None
    (s0, v0), (s1, v1) = points[0], points[-1]
    return (v1 / v0) / (s1 / s0)


def exponent(results: Sequence[dict[str, Any]], key: str) -> float | None:
    """k in figure ~ S^k between the smallest and the largest chain that measured it."""
    points = [(r["stages"], r[key]) for r in results if r.get(key) and r[key] > 0]
    if len(points) < 2 or points[0][0] == points[-1][0]:
        return None
    (s0, v0), (s1, v1) = points[0], points[-1]
    return math.log(v1 / v0) / math.log(s1 / s0)


# (key, label, unit scale, unit, the exponent it should have: 1 linear, 0 flat, None: not
# judged)
FIGURES: list[tuple[str, str, float, str, float | None]] = [
    ("register_s", "registration, all stages at once", 1.0, "s", 1.0),
    ("register_p50_ms", "  Register RPC, median", 1.0, "ms", 0.0),
    ("register_cpu_s", "  coordinator CPU for it", 1.0, "s", 1.0),
    ("heartbeats_per_s", "heartbeats answered", 1.0, "/s", 1.0),
    ("hb_cpu_frac", "  coordinator CPU (share of a core)", 100.0, "%", 1.0),
    ("hb_cpu_ms", "  coordinator CPU per heartbeat", 1.0, "ms", 0.0),
    ("hb_p99_ms", "  heartbeat RPC p99", 1.0, "ms", 0.0),
    ("hb_max_gap_s", "  largest gap between heartbeats", 1.0, "s", 0.0),
    ("plan_ms", "planner.plan (in process)", 1.0, "ms", 1.0),
    ("order_hosts_ms", "order_hosts (job setup)", 1.0, "ms", 1.0),
    ("plan_rpc_ms", "Plan RPC (plan_view)", 1.0, "ms", 1.0),
    ("scale_out_eval_ms", "scale-out evaluation (spare_positions)", 1.0, "ms", 1.0),
    ("policy_cpu_frac", "policy loop on + spare: coord. CPU", 100.0, "%", 1.0),
    ("policy_hb_p99_ms", "  heartbeat RPC p99 meanwhile", 1.0, "ms", 0.0),
    ("policy_hb_max_gap_s", "  largest heartbeat gap meanwhile", 1.0, "s", 0.0),
    ("setup_s", "job setup + first step", 1.0, "s", 1.0),
    ("step_s", "train_step (fan-out), median", 1000.0, "ms", 1.0),
    ("client_cpu_ms", "  client CPU per step", 1.0, "ms", 1.0),
    ("fakes_cpu_ms", "  fake stages' CPU per step", 1.0, "ms", 1.0),
    ("coordinator_cpu_ms", "  coordinator CPU per step (heartbeats)", 1.0, "ms", None),
    ("migration_s", "migration (SetPartition), median", 1.0, "s", 1.0),
    ("migration_pause_s", "  its pause (coordinator's record)", 1.0, "s", 1.0),
    ("step_after_move_s", "  first step after it", 1000.0, "ms", 1.0),
]


def report(results: list[dict[str, Any]]) -> None:
    ok = [r for r in results if r.get("ran_step")]
    sizes = [r["stages"] for r in ok]
    print()
    print(
        f"{'':40}"
        + "".join(f"{s:>10}" for s in sizes)
        + f"{'growth/S':>9}{'k':>7}  verdict (growth/S: the figure's ratio largest/smallest"
        " over the chain's; 1.0 linear)"
    )
    for key, label, scale, unit, expected in FIGURES:
        cells = "".join(
            f"{scale * r[key]:>10.3g}" if r.get(key) is not None else f"{'-':>10}" for r in ok
        )
        k = exponent(ok, key)
        verdict = ""
        if k is not None and expected is not None:
            if expected >= 1.0 and k > SUPERLINEAR:
                verdict = "WORSE THAN LINEAR"
            elif expected == 0.0 and k > SUPERLINEAR - 1.0:
                verdict = "grows with S (should be flat)"
            else:
                verdict = "ok"
        ktext = f"{k:>7.2f}" if k is not None else f"{'':>7}"
        g = growth(ok, key)
        gtext = f"{g:>9.2f}" if g is not None else f"{'':>9}"
        print(f"{label + ' (' + unit + ')':<40}{cells}{gtext}{ktext}  {verdict}")
    print()
    print("per stage (figure / S), for the figures that should grow linearly:")
    print(f"{'':40}" + "".join(f"{s:>10}" for s in sizes))
    for key, label, scale, unit, expected in FIGURES:
        if expected != 1.0:
            continue
        cells = "".join(
            f"{scale * r[key] / r['stages']:>10.3g}" if r.get(key) else f"{'-':>10}" for r in ok
        )
        print(f"{label.strip() + ' (' + unit + '/stage)':<40}{cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes",
        "--stages",
        dest="sizes",
        default=",".join(map(str, STAGE_COUNTS)),
        help="chain sizes, comma-separated",
    )
    parser.add_argument(
        "--fakes-per-process",
        type=int,
        default=FAKES_PER_PROCESS,
        help="fake stages per process (one GIL each)",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps per size")
    parser.add_argument("--window", type=float, default=5.0, help="seconds of heartbeats timed")
    parser.add_argument("--idle", type=float, default=2.0, help="seconds of idle coordinator")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0)
    parser.add_argument("--dead-after", type=float, default=5.0)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--log-dir", default="", help="keep the coordinator's logs there")
    parser.add_argument("--quick", action="store_true", help="4 and 8 stages, short windows")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.steps, args.window, args.idle = "4,8", 2, 0.5, 0.2
        args.heartbeat_interval = 0.25
    try:
        sizes = sorted(int(s) for s in args.sizes.split(","))
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers (got {args.sizes!r})")
    if any(s < 2 for s in sizes) or args.steps < 1 or args.fakes_per_process < 1:
        parser.error("every chain size must be >= 2, --steps and --fakes-per-process >= 1")

    bench_started = time.perf_counter()
    load_before = os.getloadavg()
    print(
        f"chains of {sizes} fake stages; heartbeat every {args.heartbeat_interval:g}s, dead "
        f"after {args.dead_after:g}s; {args.steps} timed steps; snapshots every "
        f"{args.snapshot_every} steps; {os.cpu_count()} CPUs; load average {load_before[0]:.2f}",
        flush=True,
    )
    results = []
    for stages in sizes:
        print(f"{stages} stages:", flush=True)
        result: dict[str, Any] = {"stages": stages}
        try:
            run_size(stages, args, result)
        except (ElasticPipeError, grpc.RpcError, RuntimeError, TimeoutError, AssertionError) as exc:
            print(f"  FAILED at {stages} stages: {type(exc).__name__}: {exc}", flush=True)
            result["failed"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        results.append(result)
        if result.get("phases"):
            print(
                f"  {'phase':<34}{'s':>8}{'coord. probe':>13}{'fakes lag':>11}{'dead':>6}"
                f"{'re-reg.':>8}  RPCs the fakes served (most frequent)"
            )
            for name, ph in result["phases"].items():
                top = sorted(ph["fakes_rpcs"].items(), key=lambda kv: -kv[1])[:4]
                print(
                    f"  {name:<34}{ph['s']:>8.2f}{ph['coordinator_probe_max_ms']:>10.0f} ms"
                    f"{ph['fakes_max_lag_ms']:>8.0f} ms{ph['fakes_declared_dead']:>6}"
                    f"{ph['fakes_reregistered']:>8}  {', '.join(f'{k} {v}' for k, v in top)}"
                )
        problems = {
            k: result[k]
            for k in ("register_errors", "membership_errors", "coordinator_log")
            if result.get(k)
        }
        if result.get("dead") or result.get("reregistered"):
            problems["dead/reregistered"] = (result["dead"], result["reregistered"])
        if problems:
            print(f"  noticed: {problems}", flush=True)
    load_after = os.getloadavg()

    report(results)
    ok = [r for r in results if r.get("ran_step")]
    largest = ok[-1] if ok else {}
    print(
        f"\nload average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"bench took {time.perf_counter() - bench_started:.0f} s"
    )
    keep = [k for k, *_ in FIGURES] + ["stages", "layers", "layers_moved", "failed"]
    figures = {
        "max_stages": largest.get("stages", 0),
        "plan_ms": round(largest["plan_ms"], 3) if largest else None,
        "migration_s": round(largest["migration_s"], 3) if largest else None,
        "step_fanout_s": round(largest["step_s"], 4) if largest else None,
        "exponents": {k: round(e, 3) for k, *_ in FIGURES if (e := exponent(ok, k)) is not None},
        "growth_per_stage": {
            k: round(g, 3) for k, *_ in FIGURES if (g := growth(ok, k)) is not None
        },
        "sizes": [
            {k: (round(v, 5) if isinstance(v, float) else v) for k, v in r.items() if k in keep}
            for r in results
        ],
        "failed": [r["stages"] for r in results if "failed" in r],
        "load_before": round(load_before[0], 2),
        "load_after": round(load_after[0], 2),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
