"""A/B of two 2-stage pipeline configurations, alternated round by round in one run.

Both clusters are up at once; each round times ``--per-round`` steps on one, then on the
other (the order alternating), so that the machine's load drifts into both alike, as
``bench/overhead.py``'s TLS pair does. Prints per-round ms/step of both and the median of
the per-round ratios B/A. A side is ``key=value,...``: ``schedule``, ``snapshot_every``,
``micro_batches`` go to ``Pipeline``; an upper-case key is an environment variable of that
side's processes (the stages, set when they start; the client, set around its rounds).

    python bench/ab.py --a schedule=1f1b --b schedule=gpipe --rounds 8

Its noise floor on the 2-core development machine: two identical sides gave 0.978 (14
rounds) and 0.999 (``--workload gpt``, 10 rounds), and one change measured in both orders
gave 0.975 and 1/0.938 = 1.066 (which side runs as B can count a few percent). Read a
difference under about 7% as noise unless both orders agree on it.

``--workload gpt``: a GPT (6 blocks of d=256, 4.9M parameters) trained with AdamW instead of
the MLP with SGD, so that the optimizer step weighs more in a step (AdamW over its blocks' 4.7M
parameters takes about 7 ms on one core here, in a step of about 110 ms).

``--slowdown F``: every stage an emulated device F times slower than a core (``--timer
fastest``): most of an op's time is then a wait, not CPU, as on a host whose device
computes, so that what overlaps with the compute shows as it would there.

``--quick``: 2 rounds of 1 step after 1 warm-up step (checks the script end to end in
seconds; its figures mean little).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shared import mlp  # bench/shared/, beside this script

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster

GPT = {"vocab_size": 256, "d_model": 256, "n_heads": 4, "n_layers": 6, "max_seq_len": 32}
WORKLOADS: dict[str, dict[str, Any]] = {
    "mlp": mlp.JOB,
    "gpt": {"model": "gpt", "model_kwargs": GPT, "optimizer": "adamw", "optimizer_kwargs": {}},
}


def batches(workload: str, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Eight batches of the workload's data."""
    if workload == "gpt":
        tokens = [torch.randint(0, GPT["vocab_size"], (8, 33), generator=gen) for _ in range(8)]
        return [(t[:, :-1], t[:, 1:]) for t in tokens]
    return mlp.batches()


def parse(side: str) -> tuple[dict[str, Any], dict[str, str]]:
    kwargs: dict[str, Any] = {}
    env: dict[str, str] = {}
    for item in filter(None, side.split(",")):
        key, _, value = item.partition("=")
        if key.isupper():
            env[key] = value
        else:
            kwargs[key] = value if key == "schedule" else int(value)
    return kwargs, env


@contextlib.contextmanager
def environ(env: dict[str, str]):  # type: ignore[no-untyped-def]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="")
    parser.add_argument("--b", default="")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="mlp")
    parser.add_argument("--slowdown", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 1 step, 1 warm-up")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.per_round, args.warmup = 2, 1, 1
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1234)
    data = batches(args.workload, gen)
    sides = [parse(args.a), parse(args.b)]
    load = os.getloadavg()[0]
    times: list[list[float]] = [[], []]
    losses: list[list[float]] = [[], []]
    with contextlib.ExitStack() as stack:
        pipes = []
        for kwargs, env in sides:
            with environ(env):
                cluster = stack.enter_context(
                    LocalCluster(
                        stages=args.stages,
                        state=":memory:",
                        auto_rebalance=False,
                        slowdowns=[args.slowdown] * args.stages,
                        stage_args=["--timer", "fastest"] if args.slowdown != 1.0 else [],
                    )
                )
            options: dict[str, Any] = {"micro_batches": 4, **kwargs}
            pipes.append(
                stack.enter_context(
                    Pipeline(
                        coordinator=cluster.coordinator,
                        seed=0,
                        stages=args.stages,
                        **WORKLOADS[args.workload],
                        **options,
                    )
                )
            )
        for k in range(args.warmup):
            for which in (0, 1):
                with environ(sides[which][1]):
                    losses[which].append(pipes[which].train_step(*data[k % len(data)]))
        k = args.warmup
        for r in range(args.rounds):
            for which in (0, 1) if r % 2 == 0 else (1, 0):
                with environ(sides[which][1]):
                    started = time.perf_counter()
                    for j in range(args.per_round):
                        losses[which].append(pipes[which].train_step(*data[(k + j) % len(data)]))
                    times[which].append(1e3 * (time.perf_counter() - started) / args.per_round)
            k += args.per_round
    ratios = [b / a for a, b in zip(*times, strict=True)]
    print(f"A: {args.a or '(default)'}   B: {args.b or '(default)'}")
    print(
        "ms/step per round A/B: "
        + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(*times, strict=True))
    )
    print(
        f"median A {statistics.median(times[0]):.1f} ms, B {statistics.median(times[1]):.1f} ms; "
        f"median ratio B/A {statistics.median(ratios):.3f}; "
        f"load {load:.2f} before, {os.getloadavg()[0]:.2f} after; "
        f"final losses {losses[0][-1]:.8f} / {losses[1][-1]:.8f}"
    )
    print(
        json.dumps(
            {
                "a": args.a,
                "b": args.b,
                "workload": args.workload,
                "slowdown": args.slowdown,
                "ratio_b_over_a": round(statistics.median(ratios), 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
