"""What the trainer features save and cost: recomputation, clipping, LR schedules, wire dtypes.

Two stage processes train a small GPT. For each schedule (gpipe, 1f1b) the peak stashed
activation bytes (autograd's saved tensors plus each layer's input and output, summed over
the stages, as the step reports give them) with and without ``recompute=True``; the bytes
that cross the wire between the stages per step with ``wire_dtype`` "", "bf16", "fp16"
(from the stages' ``elasticpipe_stage_sent_bytes`` metric); and the median step time of
each feature next to the same job without it (and the layers' CPU time per step, as the
stages measure it: far less noisy on a shared host, but blind to the commit, where
clipping and the scheduler work), all in one run on one cluster.

On a CPU host the step times are dominated by RPC and scheduling noise at this size:
compare them within one run only. The last line printed is JSON.

Usage: ``python bench/memory.py [--steps N] [--quick]`` (``--quick``: 1 measured step per
config, to check the script end to end; its figures mean little).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request
from typing import Any

import torch
from shared.steps import fewest_steps  # bench/shared/steps.py, beside this script

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster

MODEL = {"vocab_size": 64, "d_model": 64, "n_heads": 4, "n_layers": 4, "max_seq_len": 32}
BATCH, SEQ, MICRO = 16, 32, 4

CONFIGS: dict[str, dict[str, Any]] = {
    "gpipe": {"schedule": "gpipe"},
    "gpipe+recompute": {"schedule": "gpipe", "recompute": True},
    "1f1b": {"schedule": "1f1b"},
    "1f1b+recompute": {"schedule": "1f1b", "recompute": True},
    "1f1b+clip": {"schedule": "1f1b", "max_grad_norm": 1.0},
    "1f1b+scheduler": {
        "schedule": "1f1b",
        "scheduler": "CosineAnnealingLR",
        "scheduler_kwargs": {"T_max": 100},
        "warmup_steps": 5,
    },
    "1f1b+bf16": {"schedule": "1f1b", "wire_dtype": "bf16"},
    "1f1b+fp16": {"schedule": "1f1b", "wire_dtype": "fp16"},
}


def sent_bytes(cluster: LocalCluster) -> float:
    """Tensor bytes every stage has sent to its neighbours so far."""
    total = 0.0
    for name in [n for n in cluster.metrics_ports if n.startswith("stage")]:
        with urllib.request.urlopen(cluster.metrics_url(name), timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("elasticpipe_stage_sent_bytes_total{"):
                    total += float(line.rsplit(" ", 1)[1])
    return total


def run(cluster: LocalCluster, options: dict[str, Any], steps: int) -> dict[str, float]:
    """Trains ``steps`` steps of a fresh job; its median step time, peak stashed bytes
    and bytes on the wire per step (after one warm-up step)."""
    gen = torch.Generator().manual_seed(0)
    times, compute, stashed = [], [], 0
    with Pipeline(
        coordinator=cluster.coordinator,
        model="gpt",
        model_kwargs=MODEL,
        micro_batches=MICRO,
        stages=2,
        snapshot_every=0,
        **options,
    ) as pipe:
        for step in range(steps + 1):
            tokens = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ + 1), generator=gen)
            before = sent_bytes(cluster)
            t0 = time.perf_counter()
            pipe.train_step(tokens[:, :-1], tokens[:, 1:])
            if step == 0:
                continue  # warm-up (job set-up, profiling)
            times.append(time.perf_counter() - t0)
            # The layers' own CPU time (forward, and backward with any recomputation), as
            # the stages measure it per micro-batch (thread CPU time: other load on the
            # host does not count).
            compute.append(
                MICRO
                * sum(t.forward_s + t.backward_s for r in pipe.last_step.reports for t in r.timings)
            )
            wire = sent_bytes(cluster) - before
            stashed = max(stashed, sum(s.peak_stashed_bytes for s in pipe.last_step.stages))
    return {
        "step_ms": statistics.median(times) * 1e3,
        "layer_cpu_ms": statistics.median(compute) * 1e3,
        "stashed": stashed,
        "wire": wire,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps per config")
    parser.add_argument("--quick", action="store_true", help="1 measured step per config")
    args = parser.parse_args()
    fewest_steps(parser, args, 1)
    started = time.perf_counter()
    results: dict[str, dict[str, float]] = {}
    with LocalCluster(stages=2, state=":memory:", auto_rebalance=False, metrics=True) as cluster:
        for name, options in CONFIGS.items():
            results[name] = run(cluster, options, args.steps)
            print(f"  ran {name}", file=sys.stderr)
    print(
        f"{'config':<18}{'step ms':>9}{'vs off':>8}{'layer CPU ms':>14}{'vs off':>8}"
        f"{'stashed KiB':>13}{'wire KiB/step':>15}"
    )
    out: dict[str, Any] = {}
    for name, r in results.items():
        base = results[name.split("+")[0]]
        cost = r["step_ms"] / base["step_ms"] - 1
        compute_cost = r["layer_cpu_ms"] / base["layer_cpu_ms"] - 1
        print(
            f"{name:<18}{r['step_ms']:>9.1f}{cost:>+8.0%}{r['layer_cpu_ms']:>14.1f}"
            f"{compute_cost:>+8.0%}{r['stashed'] / 1024:>13.1f}{r['wire'] / 1024:>15.1f}"
        )
        out[name] = {
            "step_ms": round(r["step_ms"], 1),
            "cost_vs_off": round(cost, 3),
            "layer_cpu_ms": round(r["layer_cpu_ms"], 1),
            "layer_cpu_cost_vs_off": round(compute_cost, 3),
            "peak_stashed_bytes": int(r["stashed"]),
            "wire_bytes_per_step": int(r["wire"]),
        }
    for schedule in ("gpipe", "1f1b"):
        saved = 1 - results[f"{schedule}+recompute"]["stashed"] / results[schedule]["stashed"]
        out[f"{schedule}_recompute_stash_saving"] = round(saved, 3)
        print(f"recompute saves {saved:.0%} of the peak stashed bytes with {schedule}")
    for dtype in ("bf16", "fp16"):
        ratio = results[f"1f1b+{dtype}"]["wire"] / results["1f1b"]["wire"]
        out[f"{dtype}_wire_ratio"] = round(ratio, 3)
        print(f"wire_dtype={dtype} sends {ratio:.0%} of the float32 bytes")
    out["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
