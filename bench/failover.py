"""Failover of the coordinator: kill -9 the leader of two coordinators on etcd while a GPT trains.

One cluster: an etcd of ``--etcd-members`` members, two coordinators on it (one leads, one
stands by), three stage processes. Two runs of the same script, each a fresh job with the
same seed and data:

1. failure-free;
2. the leading coordinator SIGKILLed a third of the way in, and a move asked for at once
   (an admin given both coordinators' addresses, retrying until a leader takes it).

It prints the failover: kill -> a standby leads (its Status answers with a higher term),
and kill -> the next epoch change is possible (the move commits; minus the move's own
pause); the steps/s of training while no coordinator leads against before the kill; and
whether run 2 ends with exactly the weights and losses of run 1 (the move included:
moves are exact).

Then etcd's cost: the leading coordinator's CPU time per stage heartbeat (all its
threads' run time from /proc over ``--cpu-s`` seconds, background loops included, divided
by the heartbeats the stages sent meanwhile), for this cluster on etcd and for a SQLite
cluster of the same shape started in the same run, both idle with a job set up; the
ratio is the median of ``--rounds`` alternating measurements.

Usage: ``python bench/failover.py [--steps N] [--rounds R] [--quick]``. ``--quick`` checks
the script end to end: 12 steps, one round of 2 s (the figures mean little).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from shared.cpu import process_cpu_s  # bench/shared/, beside this script
from shared.runs import gpt_pipeline, identical, token_batch

from elasticpipe.client.admin import Admin
from elasticpipe.errors import ElasticPipeError
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.local.etcd import LocalEtcd

MODEL = {"vocab_size": 96, "d_model": 96, "n_heads": 4, "n_layers": 6, "max_seq_len": 32}
BATCH, SEQ = 16, 32
HEARTBEAT_S = 0.25


@dataclass
class Run:
    """What one training run measured."""

    losses: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)  # monotonic, after each step
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    events: dict[str, float] = field(default_factory=dict)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return token_batch(step, MODEL["vocab_size"], BATCH, SEQ)


def new_leader(cluster: LocalCluster, old_term: int, timeout: float = 60.0) -> float:
    """Polls until a coordinator leads with a term above ``old_term``; returns when."""
    deadline = time.monotonic() + timeout
    with Admin(cluster.coordinator, timeout=1.0) as admin:
        while time.monotonic() < deadline:
            try:
                if admin.status(timeout=1.0).term > old_term:
                    return time.monotonic()
            except ElasticPipeError:
                pass
            time.sleep(0.02)
    raise TimeoutError(f"no coordinator led within {timeout:.0f}s of the kill")


def note_new_leader(cluster: LocalCluster, old_term: int, run: Run) -> None:
    run.events["leading"] = new_leader(cluster, old_term)


def move_once_a_leader_takes_it(cluster: LocalCluster, target: list[int], run: Run) -> None:
    """Asks for a move until a leader takes it; notes when it committed, and its pause."""
    with Admin(cluster.coordinator, timeout=60.0) as admin:
        while True:
            try:
                moved = admin.set_partition(target)
            except ElasticPipeError:
                time.sleep(0.02)
                continue
            run.events["moved_at"] = time.monotonic()
            run.events["move_pause_s"] = moved.pause_s
            return


def train(cluster: LocalCluster, steps: int, failover: bool) -> Run:
    """Trains ``steps`` steps as a fresh job; kills the leader a third of the way in."""
    run = Run()
    mover: threading.Thread | None = None
    with gpt_pipeline(cluster.coordinator, MODEL, 3, snapshot_every=5) as pipe:
        pipe.train_step(*batch(0))  # job setup and profiling, not timed
        run.events["started"] = time.monotonic()
        for step in range(1, steps + 1):
            if failover and step == steps // 3:
                term = cluster.status().term
                part = pipe.partition
                target = [0, part.boundaries[1] + 1, *part.boundaries[2:]]
                cluster.kill(cluster.leader())
                run.events["killed"] = time.monotonic()
                mover = threading.Thread(
                    target=move_once_a_leader_takes_it, args=(cluster, target, run), daemon=True
                )
                mover.start()
                threading.Thread(
                    target=note_new_leader, args=(cluster, term, run), daemon=True
                ).start()
            run.losses.append(pipe.train_step(*batch(step)))
            run.done_at.append(time.monotonic())
        if mover is not None:
            mover.join(timeout=120)
        run.state = pipe.state_dict()
    return run


def cpu_ms_per_heartbeat(cluster: LocalCluster, seconds: float) -> float:
    """The leading coordinator's CPU milliseconds per stage heartbeat over ``seconds``."""
    pid = cluster.procs[cluster.leader()].pid
    before, started = process_cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    spent, elapsed = process_cpu_s(pid) - before, time.monotonic() - started
    heartbeats = cluster.num_stages * elapsed / HEARTBEAT_S
    return 1000.0 * spent / heartbeats


def set_up_a_job(cluster: LocalCluster) -> None:
    """A job, so that heartbeats carry what they carry while training."""
    with gpt_pipeline(cluster.coordinator, MODEL, 3) as pipe:
        pipe.train_step(*batch(0))


def rate(done_at: list[float], start: float, end: float) -> float:
    """Steps completed in [start, end) per second."""
    return sum(start <= t < end for t in done_at) / max(end - start, 1e-9)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cpu-s", type=float, default=5.0)
    parser.add_argument("--etcd-members", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="12 steps, one 2 s CPU round")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.cpu_s, args.etcd_members = 12, 1, 2.0, 1
    if args.steps < 6:
        parser.error(f"--steps must be >= 6 to kill the leader mid-run (got {args.steps})")
    shape: dict[str, Any] = {
        "stages": 3,
        "auto_rebalance": False,
        "heartbeat_s": HEARTBEAT_S,
        "dead_after_s": 2.0,
    }
    with (
        LocalEtcd(members=args.etcd_members) as etcd,
        LocalCluster(coordinators=2, state=f"etcd://{etcd.endpoints}/bench", **shape) as ha,
        LocalCluster(**shape) as single,
    ):
        reference = train(ha, args.steps, failover=False)
        failed = train(ha, args.steps, failover=True)
        set_up_a_job(single)
        etcd_cpu, sqlite_cpu = [], []
        for _ in range(args.rounds):
            etcd_cpu.append(cpu_ms_per_heartbeat(ha, args.cpu_s))
            sqlite_cpu.append(cpu_ms_per_heartbeat(single, args.cpu_s))
    ev = failed.events
    failover_s = ev["leading"] - ev["killed"]
    change_s = ev["moved_at"] - ev["killed"] - ev["move_pause_s"]
    before = rate(failed.done_at, ev["started"], ev["killed"])
    # while nobody leads, up to the new leader or the last step (the run may end first)
    during = rate(failed.done_at, ev["killed"], min(ev["leading"], failed.done_at[-1] + 1e-6))
    same, _ = identical(reference.state, failed.state)
    same_losses = reference.losses == failed.losses
    ratios = [e / s for e, s in zip(etcd_cpu, sqlite_cpu, strict=True)]
    print(
        f"GPT {MODEL}, {args.steps} steps, 3 stages, 2 coordinators on a {args.etcd_members}-"
        f"member etcd, heartbeats every {HEARTBEAT_S} s"
    )
    print(f"failover: kill -> a standby leads {failover_s:.2f} s (goal < 5 s)")
    print(f"          kill -> next epoch change possible {change_s:.2f} s (move pause excluded)")
    print(
        f"steps/s while no coordinator leads: {during:.2f} vs {before:.2f} before the kill "
        f"({during / before if before else 0:.2f}x)"
    )
    print(f"weights identical to the failure-free run: {same}; losses identical: {same_losses}")
    print(
        f"coordinator CPU per heartbeat: etcd {statistics.median(etcd_cpu):.3f} ms, SQLite "
        f"{statistics.median(sqlite_cpu):.3f} ms (etcd/SQLite {statistics.median(ratios):.2f}x, "
        f"median of {args.rounds} rounds of {args.cpu_s:g} s)"
    )
    print(
        json.dumps(
            {
                "failover_s": round(failover_s, 3),
                "epoch_change_possible_s": round(change_s, 3),
                "steps_per_s_before": round(before, 3),
                "steps_per_s_during": round(during, 3),
                "identical": same,
                "losses_identical": same_losses,
                "cpu_ms_per_heartbeat_etcd": round(statistics.median(etcd_cpu), 4),
                "cpu_ms_per_heartbeat_sqlite": round(statistics.median(sqlite_cpu), 4),
                "cpu_etcd_over_sqlite": round(statistics.median(ratios), 3),
                "steps": args.steps,
                "etcd_members": args.etcd_members,
            }
        )
    )


if __name__ == "__main__":
    main()
