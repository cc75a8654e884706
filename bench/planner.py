"""Benchmark of the planner: partition quality against common baselines, and planning time.

Run: ``python bench/planner.py [--quick]`` (``--quick``: one timing pass per layer and one
planning run per case, at L = 200 and S = 16: checks the script end to end in seconds). The
last line is JSON: per model, stage count and speeds, each method's bottleneck over the
optimum, and the planning times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/planner.py`

from elasticpipe.coordinator.planning import plan

STAGE_COUNTS = (4, 8)
TIMING_REPEATS = 7
PLAN_REPEATS = 7
TIMING_SIZE = (1000, 64)  # layers, stages of the planning-time table
GPT_KWARGS = {"vocab_size": 8192, "d_model": 256, "n_heads": 4, "n_layers": 12, "max_seq_len": 128}
GPT_BATCH = (4, 128)  # micro-batch of 4 sequences of 128 tokens
CNN_KWARGS = {"in_channels": 3, "num_classes": 10, "width": 32, "image_size": 32}
CNN_BATCH = 32


def load_build() -> Callable[..., nn.Sequential]:
    """Imports elasticpipe.models.contract.build, waiting for it if it is still being written."""
    deadline = time.monotonic() + 120.0
    while True:
        try:
            from elasticpipe.models.contract import build
        except ImportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(5.0)
        else:
            return build


def profile_layers(model: nn.Sequential, sample: torch.Tensor) -> list[float]:
    """Seconds of forward + backward of one micro-batch through each layer, on CPU.

    Every pass times every layer in order (the first pass is a warm-up); each layer keeps its
    fastest pass, because on a shared machine other work only ever adds time.
    """
    samples: list[list[float]] = [[] for _ in model]
    for repeat in range(TIMING_REPEATS + 1):
        x = sample
        for i, layer in enumerate(model):
            inp = x.detach().requires_grad_() if x.is_floating_point() else x
            start = time.perf_counter()
            out = layer(inp)
            out.backward(torch.ones_like(out))
            elapsed = time.perf_counter() - start
            if repeat:
                samples[i].append(elapsed)
            x = out.detach()
    return [min(s) for s in samples]


def parameter_counts(model: nn.Sequential) -> list[int]:
    """Parameters of each layer."""
    return [sum(p.numel() for p in layer.parameters()) for layer in model]


def stage_bottleneck(
    costs: Sequence[float], speeds: Sequence[float], bounds: Sequence[int]
) -> float:
    """The slowest stage's time per micro-batch for one partition."""
    return max(sum(costs[bounds[s] : bounds[s + 1]]) / speeds[s] for s in range(len(speeds)))


def uniform_split(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Equal layer counts (Megatron's default)."""
    return tuple(round(s * n_layers / n_stages) for s in range(n_stages + 1))


def parameter_balance(params: Sequence[int], n_stages: int) -> tuple[int, ...]:
    """Exact min-max balance of parameter counts on equal stages (DeepSpeed's default method).

    A layer without parameters (pooling) counts as one parameter so that the planner, which
    needs positive costs, accepts it; that changes no balance measurably.
    """
    weights = [float(max(p, 1)) for p in params]
    return plan(weights, [1.0] * n_stages).boundaries


def block_partition(costs: Sequence[float], n_stages: int) -> tuple[int, ...]:
    """torchgpipe's balance_by_time partition: one device's profile, speeds ignored.

    The idea of Bárány and Grinberg ("Block partitions of sequences", 2013), as torchgpipe
    uses it: scale the costs to [0, 1], start from equal layer counts, and while the largest
    block exceeds the smallest by more than one (scaled) unit, move one layer into the smallest
    block from its neighbour on the side of the largest.
    """
    low, span = min(costs), max(costs) - min(costs)
    scaled = [0.0 if span == 0 else (c - low) / span for c in costs]
    cuts = list(uniform_split(len(costs), n_stages))

    def size(i: int) -> float:
        return sum(scaled[cuts[i] : cuts[i + 1]])

    for _ in range(100 * len(costs) * n_stages):  # a guard; it converges long before
        largest = max(range(n_stages), key=lambda i: (size(i), i))
        smallest = min(range(n_stages), key=lambda i: (size(i), abs(i - largest)))
        if size(largest) <= size(smallest) + 1:
            break
        if largest < smallest:
            donor = smallest - 1  # move the donor's last layer right, into the smallest block
            if cuts[donor + 1] - cuts[donor] <= 1:
                break
            cuts[smallest] -= 1
        else:
            donor = smallest + 1  # move the donor's first layer left, into the smallest block
            if cuts[donor + 1] - cuts[donor] <= 1:
                break
            cuts[donor] += 1
    return tuple(cuts)


def speed_cases(n_stages: int) -> dict[str, list[float]]:
    """The speed profiles: equal, one 3x straggler in the middle, mixed 1:2:4 repeating."""
    straggler = [1.0] * n_stages
    straggler[n_stages // 2] = 1.0 / 3.0
    return {
        "homogeneous": [1.0] * n_stages,
        "3x straggler": straggler,
        "mixed 1:2:4": [(1.0, 2.0, 4.0)[s % 3] for s in range(n_stages)],
    }


def model_cases() -> dict[str, tuple[list[float], list[int]]]:
    """Per-layer costs (measured on this CPU) and parameter counts of each benchmark model."""
    build = load_build()
    torch.manual_seed(0)
    gpt = build("gpt", seed=0, **GPT_KWARGS)
    ids = torch.randint(0, GPT_KWARGS["vocab_size"], GPT_BATCH)
    cnn = build("cnn", seed=0, **CNN_KWARGS)
    side = CNN_KWARGS["image_size"]
    images = torch.randn(CNN_BATCH, CNN_KWARGS["in_channels"], side, side)
    rng = np.random.default_rng(0)
    random_costs = rng.lognormal(0.0, 0.75, 48)
    random_params = (random_costs * rng.uniform(0.5, 1.5, random_costs.size) * 1e6).astype(int)
    return {
        "gpt": (profile_layers(gpt, ids), parameter_counts(gpt)),
        "cnn": (profile_layers(cnn, images), parameter_counts(cnn)),
        "random": (random_costs.tolist(), random_params.tolist()),
    }


def quality_table(models: dict[str, tuple[list[float], list[int]]]) -> dict[str, float]:
    """Prints each method's bottleneck divided by the optimum, per model, speeds and S;
    returns them as ``{"model/S/speeds/method": ratio}``."""
    out: dict[str, float] = {}
    print("bottleneck / optimum (lower is better; 1.000 = optimal)")
    header = (
        f"{'model':<7}{'L':>4}{'S':>4}  {'speeds':<14}{'optimum ms':>11}"
        f"{'uniform':>9}{'params':>9}{'torchgpipe':>11}{'ours':>7}"
    )
    print(header)
    print("-" * len(header))
    for name, (costs, params) in models.items():
        n_layers = len(costs)
        for n_stages in STAGE_COUNTS:
            if n_layers < n_stages:
                print(f"{name:<7}{n_layers:>4}{n_stages:>4}  n/a: fewer layers than stages")
                continue
            splits = {
                "uniform": uniform_split(n_layers, n_stages),
                "params": parameter_balance(params, n_stages),
                "torchgpipe": block_partition(costs, n_stages),
            }
            for label, speeds in speed_cases(n_stages).items():
                best = plan(costs, speeds)
                ratios = [
                    stage_bottleneck(costs, speeds, b) / best.bottleneck for b in splits.values()
                ]
                ours = stage_bottleneck(costs, speeds, best.boundaries) / best.bottleneck
                for method, ratio in zip([*splits, "ours"], [*ratios, ours], strict=True):
                    out[f"{name}/{n_stages}/{label}/{method}"] = round(ratio, 4)
                unit = 1e3 if name != "random" else 1.0  # random costs are unitless
                print(
                    f"{name:<7}{n_layers:>4}{n_stages:>4}  {label:<14}"
                    f"{best.bottleneck * unit:>11.3f}{ratios[0]:>9.3f}{ratios[1]:>9.3f}"
                    f"{ratios[2]:>11.3f}{ours:>7.3f}"
                )
    print("(random: 48 lognormal costs, unitless; parameter counts = costs x U(0.5, 1.5))")
    return out


def timing_table() -> dict[str, float]:
    """Prints the planner's time at L = 1000, S = 64 (median and max of several runs);
    returns the medians in ms by case."""
    rng = np.random.default_rng(1)
    n_layers, n_stages = TIMING_SIZE
    mixed = np.array([(1.0, 2.0, 4.0)[s % 3] for s in range(n_stages)])
    heavy_ends = np.concatenate(([40.0], rng.uniform(0.8, 1.2, n_layers - 2), [120.0]))
    rng_costs = rng.uniform(0.1, 10.0, n_layers)
    log_costs = rng.lognormal(0.0, 2.0, n_layers)
    rand_speeds = rng.uniform(0.5, 4.0, n_stages)
    current = tuple(np.linspace(0, n_layers, n_stages + 1).astype(int).tolist())
    act = rng.uniform(1e5, 1e6, n_layers)
    links = np.full(n_stages - 1, 1e8)
    memory = rng.uniform(0.5, 1.5, n_layers)
    caps = np.full(n_stages, 40.0)
    cases: dict[str, Callable[[], object]] = {
        "uniform(0.1, 10) costs, mixed 1:2:4": lambda: plan(rng_costs, mixed),
        "lognormal(0, 2) costs, random speeds": lambda: plan(log_costs, rand_speeds),
        "heavy ends, mixed 1:2:4": lambda: plan(heavy_ends, mixed),
        "heavy ends, mixed, links + memory + current": lambda: plan(
            heavy_ends, mixed, act, links, memory, caps, current=current
        ),
        "lognormal, random speeds, links + memory + current": lambda: plan(
            log_costs, rand_speeds, act, links, memory, caps, current=current
        ),
    }
    print(f"\nplanning time, L = {n_layers}, S = {n_stages} ({PLAN_REPEATS} runs each)")
    print(f"{'case':<52}{'median ms':>10}{'max ms':>9}")
    out = {}
    for label, call in cases.items():
        runs = []
        for _ in range(PLAN_REPEATS):
            start = time.perf_counter()
            call()
            runs.append(time.perf_counter() - start)
        print(f"{label:<52}{statistics.median(runs) * 1e3:>10.1f}{max(runs) * 1e3:>9.1f}")
        out[label] = round(statistics.median(runs) * 1e3, 3)
    return out


def main() -> None:
    """Runs the whole benchmark and prints its tables."""
    global TIMING_REPEATS, PLAN_REPEATS, TIMING_SIZE  # --quick shrinks them
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 pass and 1 run, L = 200, S = 16")
    args = parser.parse_args()
    if args.quick:
        TIMING_REPEATS, PLAN_REPEATS, TIMING_SIZE = 1, 1, (200, 16)
    started = time.perf_counter()
    torch.set_num_threads(1)  # one thread: steadier per-layer times on a shared machine
    models = model_cases()
    print(f"layer costs measured on CPU, torch threads: {torch.get_num_threads()}")
    for name, (costs, params) in models.items():
        if name != "random":
            shown = ", ".join(f"{c * 1e3:.1f}" for c in costs)
            print(f"  {name}: ms per layer [{shown}]; params {params}")
    print()
    quality = quality_table(models)
    plan_ms = timing_table()
    took, load = time.perf_counter() - started, os.getloadavg()[0]
    print(f"\nbench took {took:.1f} s; load average {load:.1f} on {os.cpu_count()} CPUs")
    worst = max(v for k, v in quality.items() if k.endswith("/ours"))
    print(
        json.dumps(
            {
                "ours_worst_over_optimum": worst,
                "over_optimum": quality,
                "plan_ms": plan_ms,
                "plan_size": list(TIMING_SIZE),
                "seconds": round(took, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
