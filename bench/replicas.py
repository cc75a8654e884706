"""Replicas: one pipeline of 6 stages against the same 6 stages as replicas of other shapes.

Six stage processes train a GPT. Every stage emulates a device ``--base`` (6) times slower
than one core of this host (the stages' ``--slowdown``: each op takes ``--base`` times its
compute's CPU time in all, sleeping what the op's wall time did not take, however the six share
the two cores; ``stage_server.devicetime.Slowdown``), so the stages wait like accelerator hosts
with idle CPUs instead of fighting for the two cores (at 4, the two cores were 71-88%
busy, and the stages trained 12-24% slower than the same speeds predicted). Their ops are
timed with ``--timer fastest`` (``--timer cpu``: as before): each op counts as the fastest
of its recent runs, since thread CPU time too grows with the others' load, and a job then
trains at about the speeds its profile measured (``stage_server.devicetime``). In one run,
one job after another on the same stages, each trained ``--steps`` (12) steps after a
warm-up:

    one pipeline of 6 on the fresh cluster ("1 x 6 cold"); then ``--rounds`` (3) rounds of
    the layouts: one pipeline of 6 (``stages=6``); 2 replicas of 3; 3 of 2; 2 of (2, 4);
    ``replicas="auto"``; 2 of 3 again reducing on gloo (``collectives="gloo"``, "2 x 3 gl")

Each job profiles afresh, and so has a prediction of its own; on this shared host one job's
measured over predicted swung by +-10% from one run to the next (its profile's speeds, and
its own steps/s), so the table gives each layout's median over the rounds, its ratios
too, and the JSON every round's ratio.

Printed per layout: steps/s, the planner's prediction (the slowest replica's predicted step
for its share, plus the reduction at the rate the stages measured in the jobs before, the
overhead per pipeline slot their chains measured beyond the model, and the part outside
the pipelines each step pays once (the figure per step learned from the stages' waits
between runs, and the busiest stage's optimizer step at the rate the stages measured):
"planned with"; no link bandwidth is given here), measured over predicted, and the
speed-up over one pipeline of 6. The cold job is predicted with no learned figure, as a
new cluster's first job is: its measured over predicted is printed
(``cold_vs_predicted``) apart from the layouts' (``min_vs_predicted``), which are
predicted as on a cluster that ran a job before (the figures are kept in the
coordinator's store, across restarts, and by the stages); the first of replicas, 2 x 3,
still without the reduction's rate.
The last line is JSON with ``speedup_best`` (the best fixed layout over one pipeline),
``auto_vs_best`` (auto over the best fixed layout), ``gloo_vs_data_channel`` (2 of 3 on
gloo over the same on the data channel) and ``straggler_vs_optimum``.

Then the straggler: a job of 2 replicas of 3 with auto-rebalance on, one host of replica 1
slowed 3x more. Printed: the steps until the coordinator re-split the shares (the policy's
confirmation takes a step), the shares after, steps/s after, and that over the planner's
predicted optimum for the slowed speeds (``straggler_vs_optimum``).

Usage: ``python bench/replicas.py [--steps N] [--base F] [--quick]``. ``--quick`` checks the
script end to end: no emulated device (``--base 1``), a tiny model, 1 measured step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from shared.cpu import process_cpu_s  # bench/shared/, beside this script
from shared.devices import add_timer_argument

from elasticpipe.client.admin import Admin
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.coordinator.planning import estimates
from elasticpipe.coordinator.planning.cost import predict_step_time
from elasticpipe.layout import Layout
from elasticpipe.local.cluster import LocalCluster

MODEL = {"vocab_size": 96, "d_model": 128, "n_heads": 4, "n_layers": 12, "max_seq_len": 64}
QUICK_MODEL = {"vocab_size": 32, "d_model": 16, "n_heads": 2, "n_layers": 4, "max_seq_len": 16}
LAYOUTS: list[tuple[str, dict[str, Any]]] = [
    ("1 x 6", {"stages": 6}),
    ("2 x 3", {"replicas": 2, "stages": 3}),
    ("3 x 2", {"replicas": 3, "stages": 2}),
    ("(2, 4)", {"stages": (2, 4)}),
    ("auto", {"replicas": "auto", "stages": 6}),
    # the same reduction on gloo process groups instead of the stages' data channel
    ("2 x 3 gl", {"replicas": 2, "stages": 3, "collectives": "gloo"}),
]
ENGINES = ("2 x 3", "2 x 3 gl")  # compared: gloo_vs_data_channel
# The first job on the fresh cluster, before the layouts: predicted before anything was
# measured (no reduction rate, no overhead per slot), as a new cluster's first job is
COLD = ("1 x 6 cold", {"stages": 6})


def _pipeline(
    cluster: LocalCluster, args: argparse.Namespace, model: dict[str, int], **shape: Any
) -> Pipeline:
    """The bench's job (a GPT, Adam, no snapshots) of ``shape`` on the cluster."""
    return Pipeline(
        coordinator=cluster.coordinator,
        model="gpt",
        model_kwargs=model,
        optimizer="adam",
        optimizer_kwargs={"lr": 1e-3},
        micro_batches=args.micro_batches,
        snapshot_every=0,
        **shape,
    )


def _trainer(
    pipe: Pipeline, args: argparse.Namespace, model: dict[str, int], seed: int
) -> Callable[[int], float]:
    """``train(steps)``: trains that many steps of random tokens, returns their steps/s."""
    gen = torch.Generator().manual_seed(seed)

    def train(steps: int) -> float:
        start = time.perf_counter()
        for _ in range(steps):
            tokens = torch.randint(
                0, model["vocab_size"], (args.batch, args.seq + 1), generator=gen
            )
            pipe.train_step(tokens[:, :-1], tokens[:, 1:])
        return steps / (time.perf_counter() - start)

    return train


def run_layout(
    cluster: LocalCluster, shape: dict[str, Any], args: argparse.Namespace, model: dict[str, int]
) -> dict[str, Any]:
    """One job of ``shape`` on the cluster: warm-up, then ``args.steps`` timed steps."""
    with _pipeline(cluster, args, model, **shape) as pipe:
        train = _trainer(pipe, args, model, seed=0)
        train(args.warmup)
        cpu = cpu_s(cluster)
        measured = train(args.steps)
        busy = (cpu_s(cluster) - cpu) * measured / args.steps / len(os.sched_getaffinity(0))
        layout = pipe.layout
        with cluster.admin() as admin:
            plan = admin.plan()  # (its figures: what the next layout's prediction counts)
            live_s = model_at_live_speeds(admin, plan.layer_costs, layout)
        predicted = [p.predicted_step_s for p in layout.replicas]
    step_s = max(s for s in predicted if s is not None) if all(predicted) else None
    return {
        "steps_per_s": measured,
        "predicted_steps_per_s": 1.0 / step_s if step_s else None,
        "cores_busy": busy,
        "live_model_steps_per_s": 1.0 / live_s if live_s else None,
        "replicas": [list(p.boundaries) for p in layout.replicas],
        "lengths": [p.num_stages for p in layout.replicas],
        "shares": list(layout.shares),
        "learned_reduce_mb_per_s": plan.reduce_bytes_per_s / 1e6,
        "learned_slot_ms": plan.slot_overhead_s * 1e3,
        "learned_step_ms": plan.step_overhead_s * 1e3,
        "learned_optimizer_mb_per_s": plan.optimizer_bytes_per_s / 1e6,
    }


def model_at_live_speeds(admin: Admin, costs: Sequence[float], layout: Layout) -> float | None:
    """The planner's model of ``layout``'s step (``cost.predict_step_time``: each replica's
    stage times at its share, the slowest replica's) at the speeds its stages measured in
    the steps just run, as ``admin status`` reports them: the same model as the
    prediction, without the profile's speeds in it (and without any measured step time:
    not the shortfall-corrected ``current_step_s`` of ``admin plan``). None while a stage
    has no live speed. ``costs``: the layer costs, as ``admin plan`` gives them."""
    speeds = {s.stage_id: s.speed for s in admin.status().stages if s.alive}
    times = []
    for replica, share in zip(layout.replicas, layout.shares, strict=True):
        if not share:  # (a replica that runs nothing takes no time)
            continue
        chain = [speeds.get(sid, 0.0) for sid in replica.stage_ids]
        if not all(chain):
            return None
        times.append(predict_step_time(estimates.evaluate(replica.boundaries, costs, chain), share))
    return max(times)


def cpu_s(cluster: LocalCluster) -> float:
    """CPU seconds used so far by every process of the run: the cluster's and this one."""
    return sum(process_cpu_s(p.pid) for p in cluster.procs.values()) + time.process_time()


def run_straggler(
    cluster: LocalCluster, args: argparse.Namespace, model: dict[str, int]
) -> dict[str, Any]:
    """2 replicas of 3, auto-rebalance on; one stage of replica 1 slowed 3x more: steps until
    the shares change, then steps/s against the planner's optimum for those speeds."""
    with (
        _pipeline(cluster, args, model, replicas=2, stages=3) as pipe,
        cluster.admin(timeout=300) as admin,
    ):
        train = _trainer(pipe, args, model, seed=1)
        train(args.warmup)
        before = pipe.layout.shares
        slow = pipe.layout.replicas[1].addresses[1]
        victim = f"stage-{cluster.stage_addresses.index(slow)}"
        admin.auto(True)
        admin.slowdown(victim, 3 * args.base)
        steps = 0
        while pipe.layout.shares == before and steps < args.straggler_wait:
            train(1)
            steps += 1
        admin.auto(False)  # measured on the shares found
        after = pipe.layout.shares
        train(1)
        measured = train(args.steps)
        optimal_s = admin.plan().optimal_step_s
        admin.slowdown(victim, args.base)
    optimum = 1.0 / optimal_s if optimal_s else None
    return {
        "victim": victim,
        "shares_before": list(before),
        "shares_after": list(after),
        "reshare_steps": steps if after != before else -1,
        "steps_per_s": measured,
        "optimal_steps_per_s": optimum,
        "vs_optimum": measured / optimum if optimum else 0.0,
    }


def run_rounds(
    cluster: LocalCluster, args: argparse.Namespace, model: dict[str, int]
) -> list[tuple[str, list[dict[str, Any]]]]:
    """The cold job, then ``args.rounds`` rounds of every layout, one job after another:
    each layout's runs, with what the coordinator had learned before each ("planned
    with") and its measured over predicted."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in [COLD, *LAYOUTS]}
    keys = ("reduce_mb_per_s", "slot_ms", "step_ms", "optimizer_mb_per_s")
    learned = dict.fromkeys(keys, 0.0)
    for r in range(args.rounds):
        for name, shape in [COLD, *LAYOUTS] if r == 0 else LAYOUTS:
            found = run_layout(cluster, shape, args, model)
            found.update({f"planned_{key}": figure for key, figure in learned.items()})
            learned = {key: found[f"learned_{key}"] for key in keys}
            pred, live = found["predicted_steps_per_s"], found["live_model_steps_per_s"]
            found["vs_predicted"] = found["steps_per_s"] / pred if pred else None
            found["vs_live_model"] = found["steps_per_s"] / live if live else None
            runs[name].append(found)
            vs = f"{found['vs_predicted']:.0%}" if pred else "-"
            print(
                f"round {r + 1} {name:<10} lengths {found['lengths']} shares "
                f"{found['shares']}: {found['steps_per_s']:.3f} steps/s, {vs} of predicted",
                flush=True,
            )
    return list(runs.items())


MEDIANS = (
    "steps_per_s",
    "predicted_steps_per_s",
    "live_model_steps_per_s",
    "vs_predicted",
    "vs_live_model",
    "cores_busy",
    "planned_reduce_mb_per_s",
    "planned_slot_ms",
    "planned_step_ms",
    "planned_optimizer_mb_per_s",
)


def _median(founds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One layout's rounds: the median of each figure (of the ratios too: each round's
    job has a profile, and so a prediction, of its own); its shape and shares from the
    first round; every round's measured over predicted."""
    out = dict(founds[0])
    for key in MEDIANS:
        values = [f[key] for f in founds if f[key] is not None]
        out[key] = statistics.median(values) if values else None
    out["vs_predicted_rounds"] = [f["vs_predicted"] for f in founds]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument(
        "--rounds", type=int, default=3, help="rounds of the layouts; medians are printed"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--base", type=float, default=6.0, help="slowdown of every stage")
    parser.add_argument("--micro-batches", type=int, default=12)
    add_timer_argument(parser)
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument(
        "--straggler-wait", type=int, default=10, help="steps waiting for the shares to change"
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 step per layout")
    args = parser.parse_args()
    model = MODEL
    if args.quick:
        args.steps, args.warmup, args.base, args.micro_batches, args.rounds = 1, 1, 1.0, 6, 1
        args.batch, args.seq, model, args.straggler_wait = 6, 8, QUICK_MODEL, 3
    policy = ["--policy-interval", "0.5", "--rebalance-cooldown", "2"]
    with LocalCluster(
        stages=6,
        slowdowns=[args.base] * 6,
        coordinator_args=["--state", ":memory:", "--no-auto-rebalance", *policy],
        stage_args=["--timer", args.timer],
    ) as cluster:
        results = {name: _median(founds) for name, founds in run_rounds(cluster, args, model)}
        straggler = run_straggler(cluster, args, model)
        print(
            f"straggler: shares {straggler['shares_before']} -> {straggler['shares_after']} "
            f"after {straggler['reshare_steps']} steps; {straggler['steps_per_s']:.3f} steps/s, "
            f"{straggler['vs_optimum']:.0%} of the planner's optimum",
            flush=True,
        )
    one = results["1 x 6"]["steps_per_s"]
    fixed = [n for n, _ in LAYOUTS if n != "auto" and n != ENGINES[1]]
    best = max(fixed, key=lambda n: results[n]["steps_per_s"])
    print()
    print(
        f"{'layout':<12}{'lengths':<14}{'shares':<14}{'steps/s':>9}{'predicted':>11}"
        f"{'measured/pred':>15}{'live model':>12}{'measured/live':>15}{'speed-up':>10}"
        f"{'cores busy':>12}{'planned with':>54}"
    )
    for name, found in results.items():
        pred, ratio = found["predicted_steps_per_s"], found["vs_predicted"]
        found["speedup"] = found["steps_per_s"] / one
        live, vs_live = found["live_model_steps_per_s"], found["vs_live_model"]
        print(
            f"{name:<12}{found['lengths']!s:<14}{found['shares']!s:<14}"
            f"{found['steps_per_s']:>9.3f}{(f'{pred:.3f}' if pred else '-'):>11}"
            f"{(f'{ratio:.0%}' if ratio is not None else '-'):>15}"
            f"{(f'{live:.3f}' if live else '-'):>12}"
            f"{(f'{vs_live:.0%}' if vs_live else '-'):>15}{found['speedup']:>9.2f}x"
            f"{found['cores_busy']:>12.0%}"
            f"{found['planned_reduce_mb_per_s']:>9.0f} MB/s "
            f"{found['planned_slot_ms']:>4.1f} ms/slot "
            f"{found['planned_step_ms']:>4.1f} ms/step "
            f"{found['planned_optimizer_mb_per_s']:>4.0f} MB/s opt"
        )
    cold = results.pop(COLD[0])["vs_predicted"]
    out = {
        "base": args.base,
        "timer": args.timer,
        "micro_batches": args.micro_batches,
        "best_fixed": best,
        "speedup_best": results[best]["steps_per_s"] / one,
        "auto_vs_best": results["auto"]["steps_per_s"] / results[best]["steps_per_s"],
        "auto_lengths": results["auto"]["lengths"],
        "gloo_vs_data_channel": results[ENGINES[1]]["steps_per_s"]
        / results[ENGINES[0]]["steps_per_s"],
        "min_vs_predicted": min(
            (f["vs_predicted"] for f in results.values() if f["vs_predicted"] is not None),
            default=None,
        ),
        "max_vs_predicted": max(
            (f["vs_predicted"] for f in results.values() if f["vs_predicted"] is not None),
            default=None,
        ),
        "cold_vs_predicted": cold,
        "straggler_vs_optimum": straggler["vs_optimum"],
        "min_vs_live_model": min(
            (f["vs_live_model"] for f in results.values() if f["vs_live_model"] is not None),
            default=None,
        ),
        "max_cores_busy": max(f["cores_busy"] for f in results.values()),
        "reshare_steps": straggler["reshare_steps"],
        "straggler": straggler,
        "layouts": {
            name: {
                k: f[k]
                for k in (
                    "steps_per_s",
                    "predicted_steps_per_s",
                    "live_model_steps_per_s",
                    "shares",
                    "lengths",
                    "cores_busy",
                    "planned_reduce_mb_per_s",
                    "planned_slot_ms",
                    "vs_predicted_rounds",
                )
            }
            for name, f in results.items()
        },
    }
    print(
        f"best fixed layout {best}: {out['speedup_best']:.2f}x one pipeline of 6; "
        f"auto ({out['auto_lengths']}) {out['auto_vs_best']:.0%} of it (goal >= 95%); "
        f"gloo {out['gloo_vs_data_channel']:.2f}x the data channel; "
        f"lowest measured/predicted {out['min_vs_predicted'] or 0:.0%} (goal >= 90%; "
        f"the cold first job {cold or 0:.0%}); "
        f"straggler: re-split after {out['reshare_steps']} steps (goal <= 3), "
        f"{out['straggler_vs_optimum']:.0%} of the optimum (goal >= 90%)"
    )
    print(json.dumps(_rounded(out)))
    return 0


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
