"""order_hosts at any chain length: the bottleneck it finds against the hosts' given order
and a lower bound no order beats, and its time, on random instances.

Instances per host count H (8 to 256): L = 3H..8H layers of lognormal cost, host speeds
from {1, 1.5, 2, 4} or uniform in [0.5, 3], in four kinds: plain, heavy ends (the first
and last layer 10-12x), memory (heavy ends, per-layer memory with heavy ends, host caps
of 1:2:4, 2.5x the model in all) and links (per-layer activations over per-position
bandwidths of 1, 10 or 100). The lower bound is the larger of total cost over total
speed and the costliest layer on the fastest host (it ignores memory and links, so the
gap overstates the loss on those kinds).

Run: ``python bench/order_hosts.py [--seeds N] [--hosts 8,16,...] [--quick]`` (about half a
minute; ``--quick``: 1 seed at 8 and 16 hosts, a second).
The last line is JSON: per H, the geometric means of found/given and found/bound, and the
median time.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/order_hosts.py`

from elasticpipe.coordinator.planning import PlanError, order_hosts, plan

HOSTS = (8, 16, 32, 48, 64, 128, 256)
KINDS = ("plain", "heavy_ends", "memory", "links")


def instances(
    seed: int, hosts: int
) -> Iterator[tuple[str, np.ndarray, np.ndarray, dict[str, Any]]]:
    rng = np.random.default_rng([seed, hosts])
    for kind in KINDS:
        n_layers = int(rng.integers(3 * hosts, 8 * hosts))
        costs = rng.lognormal(0.0, 0.7, n_layers)
        if kind in ("heavy_ends", "memory"):
            costs[0] *= 10
            costs[-1] *= 12
        if rng.random() < 0.5:
            speeds = rng.choice([1.0, 1.5, 2.0, 4.0], hosts)
        else:
            speeds = rng.uniform(0.5, 3.0, hosts)
        extra: dict[str, Any] = {}
        if kind == "memory":
            memory = rng.uniform(1.0, 3.0, n_layers)
            memory[0] *= 8
            memory[-1] *= 8
            caps = rng.choice([1.0, 2.0, 4.0], hosts)
            extra = {"layer_memory": memory, "stage_memory": caps / caps.sum() * memory.sum() * 2.5}
        if kind == "links":
            extra = {
                "activation_bytes": rng.uniform(0.5, 2.0, n_layers),
                "link_bandwidths": rng.choice([1.0, 10.0, 100.0], hosts - 1),
            }
        yield kind, costs, speeds, extra


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2, help="instances per host count and kind")
    parser.add_argument("--hosts", default=",".join(map(str, HOSTS)), help="host counts")
    parser.add_argument("--quick", action="store_true", help="1 seed at 8 and 16 hosts")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.hosts = 1, "8,16"
    try:
        host_counts = [int(h) for h in args.hosts.split(",")]
    except ValueError:
        parser.error(f"--hosts must be comma-separated integers (got {args.hosts!r})")
    if args.seeds < 1 or any(h < 2 for h in host_counts):
        parser.error("--seeds must be >= 1 and every host count >= 2")
    print(
        f"{'hosts':>6}{'cases':>7}{'found/given':>13}{'best':>8}{'found/bound':>13}{'worst':>8}"
        f"{'ms median':>11}{'ms max':>9}"
    )
    out: dict[str, Any] = {}
    for hosts in host_counts:
        vs_given, vs_bound, times = [], [], []
        for seed in range(args.seeds):
            for _, costs, speeds, extra in instances(seed, hosts):
                try:
                    given = plan(costs, speeds, **extra).bottleneck
                except PlanError:
                    given = math.nan  # the given order does not fit memory
                started = time.perf_counter()
                try:
                    _, found = order_hosts(costs, speeds, **extra)
                except PlanError:
                    continue  # no order fits
                times.append(time.perf_counter() - started)
                bound = max(costs.sum() / speeds.sum(), costs.max() / speeds.max())
                if not math.isnan(given):
                    vs_given.append(found.bottleneck / given)
                vs_bound.append(found.bottleneck / bound)
        gmean = lambda xs: math.exp(statistics.fmean(math.log(x) for x in xs))  # noqa: E731
        row = {
            "cases": len(times),
            "found_over_given": round(gmean(vs_given), 4),
            "found_over_bound": round(gmean(vs_bound), 4),
            "ms_median": round(1000 * statistics.median(times), 1),
            "ms_max": round(1000 * max(times), 1),
        }
        out[str(hosts)] = row
        print(
            f"{hosts:>6}{row['cases']:>7}{row['found_over_given']:>13.4f}{min(vs_given):>8.4f}"
            f"{row['found_over_bound']:>13.4f}{max(vs_bound):>8.4f}{row['ms_median']:>11.1f}"
            f"{row['ms_max']:>9.1f}"
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
