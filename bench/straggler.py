"""A straggler appears and recovers: static partition vs ElasticPipe's live rebalancing.

Four stage processes train a GPT with 16 blocks. Every stage emulates a device BASE times
slower than one core of this host (``--slowdown``), so that four emulated devices fit on a
2-core machine: each stage then spends most of its time waiting, like a real accelerator
host whose CPU is idle, instead of fighting the others for the two cores. Each op takes
BASE times its compute's CPU time in all (the stage sleeps what the op's wall time did not
take; the stage's own Python between the layers runs within that time, as an accelerator's
host issues kernels while the device computes), which is the time the planner is told
(``stage_server.devicetime.Slowdown``).
That CPU time is, with ``--timer fastest`` (the default), the fastest of the op's recent
runs: thread CPU time too grows with the other processes' load, so the emulated device's
speed then does not depend on the contention for the two cores, and the stages train at
about the speeds their profile measured (``stage_server.devicetime``; ``bench/replicas.py``
does the same). With ``--timer cpu``, each run's own CPU time. After a few steps one stage
is slowed 3x (``admin slowdown``), later it recovers.

Printed, from one run: steps/s before the slowdown; after it with the static partition
(auto-rebalance off); after it with auto-rebalance on; the planner's predicted optimum;
steps from the slowdown until rebalanced; the migration pause and bytes moved; the same
after recovery. Every phase measures ``--measure-steps`` steps, one at a time, asking the
planner for its predicted step (``admin plan``: the model at the live speeds, which move
with each heartbeat) after each; a phase's prediction is the median of those. The last
line is JSON.

``--schedule zb-h1`` runs the same with the zero-bubble schedule (the planner's
predictions then model that schedule's smaller bubble: ``predict_step_time``).

Usage: ``python bench/straggler.py [--measure-steps N] [--base F] [--schedule S]
[--timer fastest|cpu] [--quick]``.
``--quick`` checks the script end to end: no emulated device (``--base 1``), 4 micro-batches
of 2 sequences of 16 tokens, 1 measured step per phase, and at most 3 steps waiting for each
rebalance (``rebalance_steps`` is -1 when none came in time); its figures mean little.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from shared.devices import add_timer_argument  # bench/shared/, beside this script

from elasticpipe.client.admin import Admin, EpochRecord
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster

MODEL = {"vocab_size": 96, "d_model": 128, "n_heads": 4, "n_layers": 16, "max_seq_len": 64}


class Bench:
    """A cluster, a pipeline on it, and the admin levers."""

    def __init__(self, admin: Admin, pipe: Pipeline, batch: int, seq: int):
        self.admin = admin
        self.pipe = pipe
        self.gen = torch.Generator().manual_seed(0)
        self.batch, self.seq = batch, seq
        self.step_times: list[float] = []

    def train(self, steps: int) -> float:
        """Trains ``steps`` steps; returns steps/s over them."""
        start = time.perf_counter()
        for _ in range(steps):
            tokens = torch.randint(
                0, MODEL["vocab_size"], (self.batch, self.seq + 1), generator=self.gen
            )
            t0 = time.perf_counter()
            self.pipe.train_step(tokens[:, :-1], tokens[:, 1:])
            self.step_times.append(time.perf_counter() - t0)
        return steps / (time.perf_counter() - start)

    def train_predicted(
        self, steps: int, step_s: Callable[[], float | None]
    ) -> tuple[float, float]:
        """Trains ``steps`` steps, asking the planner for its predicted step (``step_s``,
        seconds) after each; returns the steps/s over them and the median prediction's
        (the live speeds it is computed from move with each heartbeat)."""
        seconds, predictions = 0.0, []
        for _ in range(steps):
            seconds += 1.0 / self.train(1)
            predicted = step_s()
            if predicted:
                predictions.append(1.0 / predicted)
        if not predictions:
            raise SystemExit("the planner gave no predicted step")
        return steps / seconds, statistics.median(predictions)

    def steps_until_epoch_changes(self, limit: int) -> int:
        """Trains until the partition changes (auto-rebalance); returns the steps it took."""
        epoch = self.pipe.partition.epoch
        for n in range(1, limit + 1):
            self.train(1)
            if self.pipe.partition.epoch != epoch:
                return n
        return -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--measure-steps", type=int, default=8)
    parser.add_argument("--base", type=float, default=4.0, help="slowdown of every stage")
    parser.add_argument("--micro-batches", type=int, default=16)
    add_timer_argument(parser)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "zb-h1"])
    parser.add_argument("--quick", action="store_true", help="tiny batches, 1 step per phase")
    args = parser.parse_args()
    wait_limit = 20  # steps waiting for a rebalance
    if args.quick:
        args.measure_steps, args.base, args.micro_batches = 1, 1.0, 4
        args.batch, args.seq, wait_limit = 8, 16, 3
    n, base = args.measure_steps, args.base
    out: dict[str, Any] = {"schedule": args.schedule, "timer": args.timer, "measure_steps": n}
    with (
        LocalCluster(
            stages=4,
            slowdowns=[base] * 4,
            stage_args=["--timer", args.timer],
            coordinator_args=[
                "--state",
                ":memory:",
                "--heartbeat-interval",
                "0.5",
                "--policy-interval",
                "0.5",
                "--rebalance-cooldown",
                "3",
            ],
        ) as cluster,
        Pipeline(
            coordinator=cluster.coordinator,
            model="gpt",
            model_kwargs=MODEL,
            optimizer="adam",
            optimizer_kwargs={"lr": 1e-3},
            micro_batches=args.micro_batches,
            schedule=args.schedule,
        ) as pipe,
        cluster.admin(timeout=300) as admin,
    ):
        bench = Bench(admin, pipe, args.batch, args.seq)
        # Warm-up and first measurements. The first steps of a job run slower than the
        # steady state the planner predicts (fresh memory, first counts of each stash): with
        # 2 warm-up steps the "before" phase measured 71% of the prediction and the same
        # partition after the recovery 99% (one run, --timer cpu); with 5, 85% before.
        bench.train(2 if args.quick else 5)
        initial = list(pipe.partition.boundaries)
        out["before_steps_per_s"], out["before_predicted_steps_per_s"] = bench.train_predicted(
            n, lambda: admin.plan().current_step_s
        )
        print(
            f"partition {initial}; before the slowdown: {out['before_steps_per_s']:.3f} "
            f"steps/s (planner predicts {out['before_predicted_steps_per_s']:.3f})",
            flush=True,
        )

        # The straggler: the stage holding the middle of the model, 3x slower.
        victim = f"stage-{cluster.stage_addresses.index(pipe.partition.addresses[1])}"
        admin.slowdown(victim, 3 * base)
        steps = bench.steps_until_epoch_changes(limit=wait_limit)
        move = admin.status().history[-1]
        out["rebalance_steps"] = steps
        out["pause_s"] = move.pause_s
        out["bytes_moved"] = move.bytes_moved
        elastic_bounds = list(pipe.partition.boundaries)
        moves_before = len(admin.status().history)
        print(
            f"{victim} slowed 3x: rebalanced after {steps} steps to {elastic_bounds} "
            f"({move.layers_moved} layers, {move.bytes_moved / 1e6:.1f} MB, pause "
            f"{move.pause_s:.2f}s)",
            flush=True,
        )
        bench.train(1)
        out["elastic_steps_per_s"], out["optimal_steps_per_s"] = bench.train_predicted(
            n, lambda: admin.plan().optimal_step_s
        )
        history = admin.status().history
        out["extra_moves"] = len(history) - moves_before
        # What the move cost the training loop, as the client reported it (a lease renewal
        # right after the step it resumed on): beside the stages' pause above.
        out["loop_pause_s"] = _loop_pause(history, move.epoch)
        print(f"the move cost the training loop {out['loop_pause_s']:.2f}s", flush=True)
        print(
            f"elastic: {out['elastic_steps_per_s']:.3f} steps/s; planner's optimum "
            f"{out['optimal_steps_per_s']:.3f} steps/s",
            flush=True,
        )

        # The same straggler on the static partition.
        admin.auto(False)
        admin.set_partition(initial)
        bench.train(1)
        out["static_steps_per_s"], out["static_predicted_steps_per_s"] = bench.train_predicted(
            n, lambda: admin.plan().current_step_s
        )
        print(f"static partition {initial}: {out['static_steps_per_s']:.3f} steps/s", flush=True)
        admin.set_partition(elastic_bounds)
        admin.auto(True)
        bench.train(1)

        # Recovery: the stage is fast again; the layers should come back.
        admin.slowdown(victim, base)
        steps = bench.steps_until_epoch_changes(limit=wait_limit)
        move = admin.status().history[-1]
        out["recovery_steps"] = steps
        out["recovery_pause_s"] = move.pause_s
        out["recovery_bytes_moved"] = move.bytes_moved
        bench.train(1)
        out["recovered_steps_per_s"], out["recovered_predicted_steps_per_s"] = (
            bench.train_predicted(n, lambda: admin.plan().current_step_s)
        )
        out["recovery_loop_pause_s"] = _loop_pause(admin.status().history, move.epoch)
        print(
            f"{victim} recovered: rebalanced after {steps} steps to "
            f"{list(pipe.partition.boundaries)} (pause {move.pause_s:.2f}s, the loop's "
            f"{out['recovery_loop_pause_s']:.2f}s); "
            f"{out['recovered_steps_per_s']:.3f} steps/s",
            flush=True,
        )

    out["elastic_vs_static"] = out["elastic_steps_per_s"] / out["static_steps_per_s"]
    out["elastic_vs_optimal"] = out["elastic_steps_per_s"] / out["optimal_steps_per_s"]
    out["before_vs_predicted"] = out["before_steps_per_s"] / out["before_predicted_steps_per_s"]
    print()
    print(f"schedule {args.schedule}, {args.micro_batches} micro-batches")
    print(f"{'phase':<34}{'steps/s':>10}")
    for key, label in (
        ("before_steps_per_s", "before the slowdown"),
        ("static_steps_per_s", "straggler, static partition"),
        ("elastic_steps_per_s", "straggler, auto-rebalance"),
        ("optimal_steps_per_s", "straggler, planner's optimum"),
        ("recovered_steps_per_s", "after recovery"),
    ):
        print(f"{label:<34}{out[key]:>10.3f}")
    print(
        f"before / predicted: {out['before_vs_predicted']:.0%} (goal >= 95%); "
        f"elastic / static: {out['elastic_vs_static']:.2f}x (goal >= 1.8x); "
        f"elastic / optimum: {out['elastic_vs_optimal']:.0%} (goal >= 95%); "
        f"rebalanced {out['rebalance_steps']} steps after the slowdown (goal <= 5)"
    )
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


def _loop_pause(history: Sequence[EpochRecord], epoch: int) -> float:
    """What the change to ``epoch`` cost the training loop (its row of the history)."""
    return next(r.loop_pause_s for r in history if r.epoch == epoch)


if __name__ == "__main__":
    sys.exit(main())
