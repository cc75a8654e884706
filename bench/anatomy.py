"""Where a 2-stage step's time goes: the client's phases and every stage's spans, one clock.

Trains ``bench/overhead.py``'s model (MLP 4x1024, batch 256, 4 micro-batches, 1F1B) on a
``LocalCluster`` of ``--stages`` stages, timing the client's phases of each step (split,
``driver.run``, ``driver.commit``), then collects the stages' spans of the last steps
(``GetTrace``, clocks corrected as ``admin trace`` does) and prints, as medians over the
traced steps, in ms from the step's start on the client:

* when each stage's first forward starts and its last backward ends, and the busy time
  (forward + backward) inside that window, the receive waits, and what is left (gaps:
  Python between ops, sends queued, lock hand-offs);
* the critical path of the step's measured op times (``efficiency.critical_path``): the
  step time a pipeline with no overhead at all would take with these ops -- the bubble is
  in it, the overhead is not;
* the time from the last stage's last backward to ``driver.run`` returning (reports back),
  and the commit's round trip; each stage's optimizer step (its ``SPAN_COMMIT``), which
  runs after the stage's reply to the commit (``stage_server.deferral``): a negative
  "ends before commit returns" is an optimizer step that outlasted the round trip.

Run: ``python bench/anatomy.py [--steps N] [--stages S] [--schedule 1f1b|gpipe|zb-h1]
[--quick]`` (``--quick``: 2 traced steps after 1 warm-up step, to check the script end to end
in seconds). The last line is JSON: the medians of the step's parts, in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import mlp  # bench/shared/, beside this script

from elasticpipe.client import driver
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.observe import traces
from elasticpipe.observe.efficiency import critical_path
from elasticpipe.training.schedule import Op, OpKind
from elasticpipe.v1 import stage_pb2

STRAGGLER_MODEL = {
    "vocab_size": 96,
    "d_model": 128,
    "n_heads": 4,
    "n_layers": 16,
    "max_seq_len": 64,
}
VS_TORCH_GPT = {"vocab_size": 96, "d_model": 96, "n_heads": 4, "n_layers": 8, "max_seq_len": 64}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="traced steps (at most 16)")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe", "zb-h1"])
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--show", action="store_true", help="print the last step's spans")
    parser.add_argument(
        "--workload",
        default="overhead",
        choices=["overhead", "straggler", "gpt"],
        help="bench/overhead.py's MLP; bench/straggler.py's GPT on 4 emulated devices "
        "(4x slower than a core) before its slowdown; or bench/vs_torch.py's GPT (8 small "
        "micro-batches, where the per-micro-batch hand-offs weigh most)",
    )
    parser.add_argument("--snapshot-every", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="2 traced steps, 1 warm-up")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 2, 1
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1234)
    cluster_kwargs: dict[str, Any] = {"stages": args.stages}
    if args.workload == "overhead":
        data = mlp.batches()
        job: dict[str, Any] = {**mlp.JOB, "micro_batches": mlp.MICRO_BATCHES}
    elif args.workload == "gpt":
        tokens = [torch.randint(0, 96, (16, 65), generator=gen) for _ in range(8)]
        data = [(t[:, :-1], t[:, 1:]) for t in tokens]
        job = {
            "model": "gpt",
            "model_kwargs": VS_TORCH_GPT,
            "optimizer": "sgd",
            "optimizer_kwargs": {"lr": 0.01},
            "micro_batches": 8,
        }
    else:
        tokens = [torch.randint(0, 96, (64, 65), generator=gen) for _ in range(8)]
        data = [(t[:, :-1], t[:, 1:]) for t in tokens]
        job = {
            "model": "gpt",
            "model_kwargs": STRAGGLER_MODEL,
            "optimizer": "adam",
            "optimizer_kwargs": {"lr": 1e-3},
            "micro_batches": 16,
        }
        cluster_kwargs = {"stages": 4, "slowdowns": [4.0] * 4}
    marks: dict[str, list[int]] = defaultdict(list)

    def timed(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(*a, **k):  # type: ignore[no-untyped-def]
            marks[name + "0"].append(time.time_ns())
            try:
                return fn(*a, **k)
            finally:
                marks[name + "1"].append(time.time_ns())

        return wrapper

    driver.run = timed("run", driver.run)  # type: ignore[method-assign]
    driver.commit = timed("commit", driver.commit)  # type: ignore[method-assign]
    print(f"load average {os.getloadavg()[0]:.2f} before")
    with (
        LocalCluster(state=":memory:", auto_rebalance=False, **cluster_kwargs) as cluster,
        Pipeline(
            tls=cluster.client_tls,
            coordinator=cluster.coordinator,
            seed=0,
            stages=cluster_kwargs["stages"],
            schedule=args.schedule,
            snapshot_every=args.snapshot_every,
            **job,
        ) as pipe,
    ):
        for k in range(args.warmup):
            pipe.train_step(*data[k % len(data)])
        marks.clear()
        steps: list[tuple[int, int, int]] = []  # (step, start ns, end ns)
        for k in range(args.steps):
            t0 = time.time_ns()
            pipe.train_step(*data[k % len(data)])
            steps.append((pipe.step, t0, time.time_ns()))
        with cluster.admin(timeout=30) as admin:
            status = admin.status()
            predicted = admin.plan().current_step_s or 0.0
        collected = traces.collect(
            status.stages, min(args.steps, traces.MAX_STEPS), cluster.client_tls, 30
        )
    print(f"load average {os.getloadavg()[0]:.2f} after; planner predicts {1e3 * predicted:.1f} ms")

    rows: dict[str, list[float]] = defaultdict(list)
    for n, (step, c0, c1) in enumerate(steps):

        def ms(t: int, c0: int = c0) -> float:
            return (t - c0) / 1e6

        rows["client step"].append(ms(c1))
        rows["client: run starts"].append(ms(marks["run0"][n]))
        rows["client: run returns"].append(ms(marks["run1"][n]))
        rows["client: commit starts"].append(ms(marks["commit0"][n]))
        rows["client: commit returns"].append(ms(marks["commit1"][n]))
        ops_all, fwd_all, bwd_all, w_all = [], [], [], []
        last_b_end = 0.0
        for t in collected:
            spans = [s for s in t.spans if s.step == step]
            run = max((s.run for s in spans if s.kind == stage_pb2.SPAN_FORWARD), default=0)
            spans = [s for s in spans if s.run == run]
            ops = sorted((s for s in spans if s.kind in traces.OP_SPANS), key=lambda s: s.start_ns)
            if not ops:
                continue
            first = ms(t.local(ops[0])[0])
            last = ms(t.local(ops[-1])[1])
            busy = sum(s.duration_ns for s in ops) / 1e6
            waits = sum(s.duration_ns for s in spans if s.kind == stage_pb2.SPAN_RECV_WAIT) / 1e6
            sends = sum(s.duration_ns for s in spans if s.kind == stage_pb2.SPAN_SEND) / 1e6
            p = f"stage {t.index}"
            rows[f"{p}: first F starts"].append(first)
            rows[f"{p}: last B ends"].append(last)
            rows[f"{p}: F+B(+W) busy"].append(busy)
            rows[f"{p}: recv waits (in window)"].append(waits)
            rows[f"{p}: window - busy - waits"].append(last - first - busy - waits)
            rows[f"{p}: send spans (writes; to the answer if queued)"].append(sends)
            commits = [s for s in t.spans if s.step == step and s.kind == stage_pb2.SPAN_COMMIT]
            if commits:
                rows[f"{p}: optimizer step (commit span)"].append(commits[-1].duration_ns / 1e6)
                at, to = t.local(commits[-1])
                rows[f"{p}: optimizer step starts after commit starts"].append(
                    ms(at) - ms(marks["commit0"][n])
                )
                rows[f"{p}: optimizer step ends before commit returns"].append(
                    ms(marks["commit1"][n]) - ms(to)
                )
            gaps = [(b.start_ns - a.start_ns - a.duration_ns) / 1e6 for a, b in pairwise(ops)]
            rows[f"{p}: gaps between ops (sum)"].append(sum(gaps))
            m = 1 + max(s.micro_batch for s in ops)
            took = {kind: [0.0] * m for kind in OpKind}
            order = []
            for s in ops:
                kind = traces.OP_KINDS[s.kind]
                took[kind][s.micro_batch] = s.duration_ns / 1e9
                order.append(Op(kind, s.micro_batch))
            ops_all.append(order)
            fwd_all.append(took[OpKind.FORWARD])
            bwd_all.append(took[OpKind.BACKWARD])
            w_all.append(took[OpKind.WEIGHT])
            last_b_end = max(last_b_end, last)
        if len(ops_all) == len(collected):
            rows["critical path of the ops (no overhead)"].append(
                1e3 * critical_path(ops_all, fwd_all, bwd_all, w_all)
            )
            rows["last B end -> run returns"].append(ms(marks["run1"][n]) - last_b_end)
    if args.show:
        step, c0, c1 = steps[-1]
        names = {v: k for k, v in stage_pb2.SpanKind.items()}
        events = [
            (t.local(s)[0], t.local(s)[1], t.index, names[s.kind][5:], s.micro_batch)
            for t in collected
            for s in t.spans
            if s.step == step
        ]
        print(f"step {step}: client {0:.2f} .. {(c1 - c0) / 1e6:.2f} ms")
        for start, end, index, kind, mb in sorted(events):
            at, to = (start - c0) / 1e6, (end - c0) / 1e6
            print(f"  stage {index} {kind:<9} mb {mb:>2} {at:8.2f} {to:8.2f}")
    print(
        "client step ms by step: "
        + ", ".join(f"{step}: {(c1 - c0) / 1e6:.0f}" for step, c0, c1 in steps)
    )
    width = max(map(len, rows))
    print(
        f"{cluster_kwargs['stages']} stages, {args.schedule}, medians over {len(steps)} steps (ms):"
    )
    for name, values in rows.items():
        print(f"  {name:<{width}} {statistics.median(values):8.2f}")
    med = {name: statistics.median(values) for name, values in rows.items()}
    step_ms, cp = med["client step"], med["critical path of the ops (no overhead)"]
    busiest = max(v for k, v in med.items() if k.endswith("F+B(+W) busy"))
    start = med["stage 0: first F starts"]
    commit = med["client: commit returns"] - med["client: run returns"]
    back = med["last B end -> run returns"]
    rest = step_ms - cp - start - commit - back
    print(
        f"step {step_ms:.1f} ms = busiest stage's F+B {busiest:.1f} + bubble (critical path "
        f"- busiest) {cp - busiest:.1f} + overhead beyond the critical path {step_ms - cp:.1f} "
        f"(start to stage 0's first F {start:.1f}, reports back {back:.1f}, commit "
        f"{commit:.1f}, the rest -- hand-offs between ops on the path -- {rest:.1f})"
    )
    figures = {
        "stages": cluster_kwargs["stages"],
        "schedule": args.schedule,
        "steps": len(steps),
        "step_ms": step_ms,
        "busiest_busy_ms": busiest,
        "bubble_ms": cp - busiest,
        "overhead_ms": step_ms - cp,
        "start_ms": start,
        "reports_back_ms": back,
        "commit_ms": commit,
        "hand_offs_ms": rest,
    }
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
