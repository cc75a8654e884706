"""Memory-aware planning and bf16, measured on a small GPT in this process (no cluster).

1. The profiling pass (``stage_server/profiling.py``) run on every layer of the GPT, fp32 and
   bf16: total state (weights, gradients, Adam state) and activations stashed per
   micro-batch, and the largest single layer -- what profiling one layer at a time keeps
   resident, against the whole model that profiling used to build on every stage.
2. What a stage must hold (``coordinator/planning/memory.py``) with 4 stages and 8 micro-batches:
   GPipe keeps all 8 in flight, 1F1B at most 4.
3. The planner with equal speeds, then with stage 0 capped at 60% of what it held: the
   partition moves layers off it, and the predicted bottleneck grows (the cost of the cap).
4. Step time of ``LocalPipeline`` fp32 against bf16 and fp16 (autocast plus dynamic loss
   scaling: the loss multiplied, the gradients unscaled, their norm checked) on this CPU
   (one thread, CPU time, so that other load on a shared host does not count), alternating,
   medians.

Usage: ``python bench/memory_plan.py [--steps N] [--quick]``. The last line is JSON.
``--quick``: 2 steps of each precision (the first is not counted), to check the script end
to end in seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from shared.steps import fewest_steps  # bench/shared/steps.py, beside this script

from elasticpipe.coordinator.planning import memory, plan
from elasticpipe.coordinator.planning.estimates import Profile
from elasticpipe.local.reference import LocalPipeline
from elasticpipe.stage_server.devicetime import Slowdown
from elasticpipe.stage_server.profiling import profile_layers
from elasticpipe.training.job import JobConfig

MODEL = {"vocab_size": 96, "d_model": 96, "n_heads": 4, "n_layers": 4, "max_seq_len": 32}
MICRO, SEQ, STAGES, MICRO_BATCHES = 8, 32, 4, 8
ADAM = {"lr": 1e-3}


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.2f} MiB"


def _profile(precision: str) -> Profile:
    job = JobConfig(model="gpt", model_kwargs=MODEL, optimizer_kwargs=ADAM, precision=precision)
    sample = torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ))
    timings = profile_layers(job, sample, torch.device("cpu"), Slowdown(1.0), (), 3)
    return Profile(
        costs=tuple(max(t.forward_s + t.backward_s, 1e-9) for t in timings),
        speeds={},
        stash_bytes=tuple(t.stash_bytes for t in timings),
        state_bytes=tuple(t.state_bytes for t in timings),
    )


def _step_times(steps: int) -> dict[str, float]:
    pipes = {
        p: LocalPipeline("gpt", MODEL, optimizer_kwargs=ADAM, micro_batches=4, precision=p)
        for p in ("fp32", "bf16", "fp16")
    }
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {p: [] for p in pipes}
    for _ in range(steps):
        x = torch.randint(0, MODEL["vocab_size"], (4 * MICRO, SEQ), generator=g)
        y = torch.roll(x, -1, dims=1)
        for name, pipe in pipes.items():
            start = time.thread_time()
            pipe.train_step(x, y)
            times[name].append(time.thread_time() - start)
    return {p: statistics.median(t[1:]) for p, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 steps of each precision")
    args = parser.parse_args()
    fewest_steps(parser, args, 2, ": the first step is not counted")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    result: dict[str, object] = {}

    profiles = {p: _profile(p) for p in ("fp32", "bf16")}
    for name, prof in profiles.items():
        state, stash = sum(prof.state_bytes), sum(prof.stash_bytes)
        peak = max(a + b for a, b in zip(prof.state_bytes, prof.stash_bytes, strict=True))
        print(
            f"{name}: state {_mib(state)} (weights+grads+Adam), stash {_mib(stash)} per "
            f"micro-batch; profiling keeps at most {_mib(peak)} resident "
            f"(one layer) instead of {_mib(state + stash)} (whole model)"
        )
        result[name] = {"state_bytes": state, "stash_bytes": stash, "profile_peak_bytes": peak}

    prof = profiles["fp32"]
    sizes = [0] * len(prof.costs)  # unused: the profile is complete
    caps = {}
    for schedule in ("gpipe", "1f1b"):
        job = JobConfig(model="gpt", micro_batches=MICRO_BATCHES, schedule=schedule)
        needs = memory.layer_needs(sizes, prof, job, STAGES)
        free = plan(prof.costs, [1.0] * STAGES)
        held = [sum(needs[a:b]) for a, b in zip(free.boundaries, free.boundaries[1:], strict=False)]
        print(
            f"{schedule}: {memory.in_flight(MICRO_BATCHES, schedule, STAGES)} micro-batches in "
            f"flight; stages need {', '.join(_mib(h) for h in held)} on {free.boundaries}"
        )
        caps[schedule] = (needs, held, free)
    needs, held, free = caps["1f1b"]
    cap = 0.6 * held[0]
    capped = plan(prof.costs, [1.0] * STAGES, None, None, needs, [cap] + [float("inf")] * 3)
    cost = capped.bottleneck / free.bottleneck - 1
    print(
        f"1f1b, stage 0 capped at {_mib(cap)}: {free.boundaries} -> {capped.boundaries}, "
        f"predicted bottleneck +{cost:.0%}"
    )
    result["cap"] = {
        "free": list(free.boundaries),
        "capped": list(capped.boundaries),
        "bottleneck_cost": round(cost, 4),
    }

    times = _step_times(args.steps)
    ratio = times["bf16"] / times["fp32"]
    ratio16 = times["fp16"] / times["fp32"]
    print(
        f"step CPU time (1 thread, 4 micro-batches): fp32 {times['fp32'] * 1e3:.1f} ms, "
        f"bf16 {times['bf16'] * 1e3:.1f} ms ({ratio:.2f}x), "
        f"fp16 {times['fp16'] * 1e3:.1f} ms ({ratio16:.2f}x)"
    )
    result["step_s"] = {k: round(v, 5) for k, v in times.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
