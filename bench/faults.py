"""Failures cost time, not results: kill -9 two stages and the coordinator while a GPT trains.

One cluster of 5 stage processes trains a GPT on a chain of 4 (the fifth is a spare).
Runs of the same script, each a fresh job with the same seed and data:

1. failure-free, snapshots every ``--snapshot-every`` steps (the default), and
2. failure-free, snapshots off -- the baseline of the snapshot overhead; these two
   alternate ``--rounds`` times, and the overhead is the median over the rounds (one
   pair of runs swings by several percent on this shared host);
3. with failures: a chain stage SIGKILLed a third of the way in (the spare replaces it),
   the coordinator SIGKILLed halfway and restarted a few steps later, another chain stage
   SIGKILLed at two thirds, once the coordinator is back (no spare is left: the job
   shrinks to 3 stages).

Per event it prints: detection (kill -> the coordinator declares the stage dead),
recovery (kill -> the next committed step, minus the compute of the steps replayed and
of that step itself, at the failure-free run's median step time), the steps replayed
and the bytes restored. For the runs: steps/s with failures against the failure-free
run, the snapshot overhead (run 1 against run 2), and whether run 3 ends with exactly the
weights of run 1. The last line is JSON.

Usage: ``python bench/faults.py [--steps N] [--snapshot-every K] [--quick]``. ``--quick``
checks the script end to end: 12 steps with snapshots every 2, one round of 2-step runs for
the overhead, heartbeats every 0.25 s and stages dead after 2 s (the failures and the
bitwise check are all there; the figures mean little).
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

import torch
from shared.runs import gpt_pipeline, identical, token_batch  # bench/shared/, beside this script

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster

SNAPSHOT_WAIT_S = 30.0  # a stage is killed once the newest snapshot survives, or after this
MODEL = {"vocab_size": 96, "d_model": 96, "n_heads": 4, "n_layers": 8, "max_seq_len": 32}
BATCH, SEQ = 16, 32


@dataclass
class Run:
    """What one training run measured."""

    seconds: float = 0.0
    losses: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    events: list[dict[str, object]] = field(default_factory=list)

    @property
    def steps_per_s(self) -> float:
        return len(self.losses) / self.seconds


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, MODEL["vocab_size"], BATCH, SEQ)


def train(cluster: LocalCluster, steps: int, snapshot_every: int, failures: bool = False) -> Run:
    """Trains ``steps`` steps as a fresh job; injects the failures if asked."""
    run = Run()
    plan = {steps // 3: "stage", steps // 2: "coordinator", 2 * steps // 3: "stage"}
    # the coordinator is back before the second stage is killed
    restart_at = max(steps // 2 + 1, min(steps // 2 + 5, 2 * steps // 3 - 1))
    restarting: threading.Thread | None = None
    with gpt_pipeline(cluster.coordinator, MODEL, 4, snapshot_every=snapshot_every) as pipe:
        pipe.train_step(*batch(0))  # job setup and profiling, not timed
        started = time.perf_counter()
        for step in range(1, steps + 1):
            event = plan.get(step) if failures else None
            killed_at = 0.0
            if event == "stage":
                if restarting is not None:  # one failure at a time: the coordinator is back
                    restarting.join()
                _wait_for_snapshot(pipe, step - 1, snapshot_every)
                victim = cluster.name_of(pipe.partition.addresses[1])
                killed_at = time.time()
                cluster.kill(victim)
            elif event == "coordinator":
                killed_at = time.time()
                cluster.kill("coordinator")
            if failures and step == restart_at:
                restarting = threading.Thread(target=cluster.restart_coordinator, daemon=True)
                restarting.start()
            t0 = time.perf_counter()
            run.losses.append(pipe.train_step(*batch(step)))
            run.step_s.append(time.perf_counter() - t0)
            if event:
                run.events.append(
                    {
                        "event": f"kill {victim}" if event == "stage" else "kill coordinator",
                        "killed_unix": killed_at,
                        "returned_unix": time.time(),
                        "replayed_steps": pipe.last_step.replayed,
                    }
                )
        run.seconds = time.perf_counter() - started
        run.state = pipe.state_dict()
    return run


def _wait_for_snapshot(pipe: Pipeline, committed: int, every: int) -> None:
    """Waits (at most ``SNAPSHOT_WAIT_S``) until the newest snapshot at or before step
    ``committed`` survives a failure (the coordinator's safe step, which the client hears
    with its lease renewals): a kill before its copy landed would end the job with
    ``LayersLost``, as it should (a loaded host, the quick mode's snapshot every 2 steps)."""
    if not every:
        return
    wanted = committed - committed % every
    deadline = time.monotonic() + SNAPSHOT_WAIT_S
    # (the client's own view, private: its lease renewal brings the safe step; asked now)
    while pipe._safe_step < wanted and time.monotonic() < deadline:
        pipe._renew_now.set()
        time.sleep(0.1)


def recoveries(cluster: LocalCluster, run: Run, step_s: float) -> list[dict[str, object]]:
    """Joins the run's events with the coordinator's recovery records."""
    records = [r for r in cluster.status().history if r.kind == "recovery"]
    out = []
    for event in run.events:
        killed = float(event["killed_unix"])  # type: ignore[arg-type]
        returned = float(event["returned_unix"])  # type: ignore[arg-type]
        replayed = int(event["replayed_steps"])  # type: ignore[call-overload]
        record = next((r for r in records if r.detected_unix >= killed), None)
        is_stage = str(event["event"]).startswith("kill stage")
        out.append(
            {
                "event": event["event"],
                "detect_s": round(record.detected_unix - killed, 3) if is_stage and record else 0.0,
                "recover_s": round(max(0.0, returned - killed - (replayed + 1) * step_s), 3),
                "replayed_steps": replayed,
                "bytes_restored": record.bytes_moved if is_stage and record else 0,
                "recovery": record.reason if is_stage and record else "not needed",
            }
        )
        if is_stage and record:
            records.remove(record)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--overhead-steps",
        type=int,
        default=0,
        help="steps of each snapshot on/off run (default: --steps)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="12 steps, 1 round of 2-step runs, faster deaths"
    )
    args = parser.parse_args()
    heartbeat, dead_after = (0.25, 2.0) if args.quick else (0.5, 3.0)
    if args.quick:
        args.steps, args.snapshot_every, args.rounds, args.overhead_steps = 12, 2, 1, 2
    if args.steps < 6:
        parser.error(f"--steps must be >= 6 to place the three failures apart (got {args.steps})")
    overhead_steps = args.overhead_steps or args.steps
    with LocalCluster(
        stages=5,
        auto_rebalance=False,
        heartbeat_s=heartbeat,
        dead_after_s=dead_after,
    ) as cluster:
        pairs = []
        for _ in range(args.rounds):
            pairs.append(
                (
                    train(cluster, overhead_steps, 0),
                    train(cluster, overhead_steps, args.snapshot_every),
                )
            )
        snap = train(cluster, args.steps, args.snapshot_every)  # the failure-free reference
        faulty = train(cluster, args.steps, args.snapshot_every, failures=True)
        step_s = statistics.median(snap.step_s)
        events = recoveries(cluster, faulty, step_s)
    same, worst = identical(snap.state, faulty.state)
    same_losses = snap.losses == faulty.losses
    overheads = [1.0 - s.steps_per_s / b.steps_per_s for b, s in pairs]
    overhead = statistics.median(overheads)
    bare_rate = statistics.median(b.steps_per_s for b, _ in pairs)
    snap_rate = statistics.median(s.steps_per_s for _, s in pairs)
    print(f"GPT {MODEL}, {args.steps} steps, 4 stages + 1 spare, batch {BATCH}x{SEQ}")
    print(f"{'event':<22}{'detect s':>10}{'recover s':>11}{'replayed':>10}{'bytes':>12}  how")
    for e in events:
        print(
            f"{e['event']!s:<22}{e['detect_s']:>10}{e['recover_s']:>11}{e['replayed_steps']:>10}"
            f"{e['bytes_restored']:>12}  {e['recovery']}"
        )
    print(
        f"steps/s (medians of {args.rounds} runs): failure-free {snap_rate:.3f} (snapshots "
        f"every {args.snapshot_every}), {bare_rate:.3f} (snapshots off); with failures "
        f"{faulty.steps_per_s:.3f} vs {snap.steps_per_s:.3f} failure-free over the same "
        f"{args.steps} steps ({faulty.steps_per_s / snap.steps_per_s:.2f}x)"
    )
    print(
        f"snapshot overhead: {overhead:.1%} median of "
        f"{', '.join(f'{o:.1%}' for o in overheads)} (goal <= 5%)"
    )
    print(
        f"final weights identical to the failure-free run: {same} (max |diff| {worst:.2e}); "
        f"losses identical: {same_losses}"
    )
    print(
        json.dumps(
            {
                "identical": same,
                "losses_identical": same_losses,
                "max_abs_diff": worst,
                "recoveries": [
                    {k: e[k] for k in ("event", "detect_s", "recover_s", "replayed_steps")}
                    for e in events
                ],
                "bytes_restored": [e["bytes_restored"] for e in events],
                "snapshot_overhead": round(overhead, 4),
                "snapshot_overheads": [round(o, 4) for o in overheads],
                "failure_free_steps_per_s": round(snap.steps_per_s, 4),
                "snapshots_on_steps_per_s": round(snap_rate, 4),
                "snapshots_off_steps_per_s": round(bare_rate, 4),
                "with_failures_steps_per_s": round(faulty.steps_per_s, 4),
                "steps": args.steps,
                "snapshot_every": args.snapshot_every,
            }
        )
    )


if __name__ == "__main__":
    main()
