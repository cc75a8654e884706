"""A real-size job's first step, broken down: a GPT-2-small-sized model on 4 stages.

The model is the built-in ``gpt`` at GPT-2 small's size: 12 blocks of width 768 with 12
heads, a vocabulary of 50,257 and an untied head, 162.3M parameters (649 MB in float32).
The job starts from ``init_state`` (weights made here from another seed, as a user's
pretrained weights would be), trains with AdamW on 2 micro-batches of 4 sequences of 63
tokens, on a ``LocalCluster`` of 4 stage processes.

Printed, from one run:

* the first ``train_step``, split into its parts as the client sees them: the job's setup
  (``SetupJob``: the stages describe and build the model and profile every layer, the
  planner cuts it; the profiling's own seconds come from the coordinator's
  ``stages_profiled`` log line), loading ``init_state`` -- streaming it to the stages
  (every stage at once), then the load's commit (its epoch change, and the snapshot of
  step 0 copied to each stage's neighbour before the load returns) -- and the rest (the
  step itself);
* the steady step: the median of ``--steps`` steps after the first;
* the data path's bandwidth, measured in the same run on a stage server of its own
  (``bench/datapaths.py``'s ``DataPath``: 4 MiB activations over the bulk channel, each
  taken out of the stage's mailbox), and the rate the weights streamed at against it;
* the goals of issue 20: the first step at most 3 steady steps plus the weights' bytes at
  the data path's bandwidth, and the weights streamed at >= 0.5x that bandwidth;
* the pages the stages faulted in (their minor page faults, from ``/proc``, counted as
  4 KiB pages: with transparent huge pages one fault may map 2 MiB) and their kernel CPU
  seconds (every system call's too, in 10 ms ticks), in the setup, the load, the first
  step's own part (its gradients, the optimizer's state, activations) and a steady step
  (where the faults are mostly memory the allocator gave back and took again). A page
  touched for the first time is zeroed and mapped by the kernel, which costs more on a
  virtual machine whose host backs guest memory only as it is touched; the kernel CPU per
  fault printed is an upper bound of a fault's cost.

The timing of the setup, the load and its streaming wraps three of the client's functions
(``Session._coordinator_call`` for ``SetupJob``, ``Session._apply_init``,
``streaming.stream``): the bench's own instrumentation, nothing the library does
differently.

Run: ``python bench/first_step.py [--steps N] [--grpc] [--quick]`` (``--grpc``: the load
streams over gRPC, as to stages without a bulk channel, to compare; ``--quick``: a 4-block
model of width 64 on 2 stages and 2 steady steps, to check the script end to end; its
figures mean little). The last line is JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/first_step.py`

from datapaths import MIB, Batch, DataPath  # bench/datapaths.py, next to this script
from shared.cpu import process_faults, stage_pids  # bench/shared/, beside this script

from elasticpipe.client import streaming
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.client.session import Session
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.models.contract import build
from elasticpipe.transport import bulk

GPT2_SMALL = {"vocab_size": 50257, "d_model": 768, "n_heads": 12, "n_layers": 12, "max_seq_len": 64}
QUICK = {"vocab_size": 96, "d_model": 64, "n_heads": 4, "n_layers": 4, "max_seq_len": 64}
SEQ = 63
BATCH = 8  # 2 micro-batches of 4 sequences
STAGES = 4


@contextlib.contextmanager
def timed_phases(kernel: Callable[[], tuple[int, float]]) -> Iterator[dict[str, float]]:
    """Seconds the client spends in ``SetupJob`` and in streaming ``init_state``, and the
    stages' page faults and kernel seconds meanwhile (``kernel``: their totals so far), as
    ``KEY_s``, ``KEY_faults`` and ``KEY_kernel_s``."""
    spent: dict[str, float] = {
        f"{phase}{figure}": 0.0
        for phase in ("setup", "init_state", "stream")
        for figure in ("_s", "_faults", "_kernel_s")
    }
    call, apply_init, stream = Session._coordinator_call, Session._apply_init, streaming.stream

    def timing(phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            started, (faults, kernel_s) = time.perf_counter(), kernel()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[f"{phase}_s"] += time.perf_counter() - started
                with contextlib.suppress(OSError):  # (a stage gone: the error is fn's)
                    now_faults, now_kernel_s = kernel()
                    spent[f"{phase}_faults"] += now_faults - faults
                    spent[f"{phase}_kernel_s"] += now_kernel_s - kernel_s

        return wrapped

    def coordinator_call(self: Session, method: str, request: Any, timeout: float) -> Any:
        if method != "SetupJob":
            return call(self, method, request, timeout)
        return timing("setup", call)(self, method, request, timeout)

    Session._coordinator_call = coordinator_call  # type: ignore[method-assign]
    Session._apply_init = timing("init_state", apply_init)  # type: ignore[method-assign]
    streaming.stream = timing("stream", stream)
    try:
        yield spent
    finally:
        Session._coordinator_call = call  # type: ignore[method-assign]
        Session._apply_init = apply_init  # type: ignore[method-assign]
        streaming.stream = stream


def stages_kernel(cluster: LocalCluster) -> tuple[int, float]:
    """The stage processes' minor page faults and kernel CPU seconds so far, all together."""
    figures = [process_faults(pid) for pid in stage_pids(cluster)]
    return sum(f for f, _ in figures), sum(k for _, k in figures)


def kernel_since(cluster: LocalCluster, before: tuple[int, float]) -> tuple[int, float]:
    """The stages' page faults and kernel CPU seconds since ``before`` (``stages_kernel``)."""
    faults, kernel_s = stages_kernel(cluster)
    return faults - before[0], kernel_s - before[1]


def data_path_gbps(repeats: int, messages: int) -> float:
    """GB/s of 4 MiB activations over the bulk channel into a stage of its own (median)."""
    path = DataPath()
    try:
        payload = torch.rand(4 * MIB // 4)
        path.send_batch(Batch(4 * MIB, 2, -1), payload)  # warm-up: the connection opens
        path.after_batch(Batch(4 * MIB, 2, -1), payload, False)
        rates = []
        for r in range(repeats):
            batch = Batch(4 * MIB, messages, r)
            started = time.perf_counter()
            path.send_batch(batch, payload)
            elapsed = time.perf_counter() - started
            path.after_batch(batch, payload, r == repeats - 1)  # every byte was taken
            rates.append(batch.size * batch.count / elapsed / 1e9)
        return statistics.median(rates)
    finally:
        path.close()


def profiled_seconds(log: Path) -> float:
    """The profiling's seconds, from the coordinator's ``stages_profiled`` line."""
    for line in log.read_text(errors="replace").splitlines():
        if "stages_profiled" in line and (m := re.search(r"seconds\W+([0-9.]+)", line)):
            return float(m.group(1))
    return float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steady steps after the first")
    parser.add_argument("--quick", action="store_true", help="a small model, 2 steady steps")
    parser.add_argument("--grpc", action="store_true", help="the load over gRPC, not bulk")
    args = parser.parse_args()
    model = QUICK if args.quick else GPT2_SMALL
    steps = 2 if args.quick else args.steps
    stages = 2 if args.quick else STAGES
    torch.set_num_threads(1)

    bandwidth = data_path_gbps(repeats=1 if args.quick else 3, messages=4 if args.quick else 16)
    print(f"data path: {bandwidth:.2f} GB/s (4 MiB activations over the bulk channel)")
    if args.grpc:  # from now on (the data path above was measured on the bulk channel)

        def no_channel(*args: Any) -> Any:
            raise bulk.NoChannel("bench/first_step.py --grpc")

        streaming.bulk.connect = no_channel  # type: ignore[assignment]

    init = build("gpt", seed=1, **model).state_dict()
    weight_bytes = sum(t.numel() * t.element_size() for t in init.values())
    params = sum(t.numel() for t in init.values())
    gen = torch.Generator().manual_seed(0)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, model["vocab_size"], (BATCH, SEQ + 1), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]

    with LocalCluster(stages=stages, state=":memory:", auto_rebalance=False) as cluster:
        with (
            timed_phases(lambda: stages_kernel(cluster)) as spent,
            Pipeline(
                coordinator=cluster.coordinator,
                model="gpt",
                model_kwargs=model,
                optimizer="adamw",
                optimizer_kwargs={"lr": 1e-4},
                micro_batches=2,
                stages=stages,
                init_state=init,
            ) as pipe,
        ):
            kernel_before, started = stages_kernel(cluster), time.perf_counter()
            first_loss = pipe.train_step(*batch())
            first_s = time.perf_counter() - started
            kernel_first = kernel_since(cluster, kernel_before)
            times, steady_kernel = [], []
            for _ in range(steps):
                x, y = batch()
                kernel_before, started = stages_kernel(cluster), time.perf_counter()
                pipe.train_step(x, y)
                times.append(time.perf_counter() - started)
                steady_kernel.append(kernel_since(cluster, kernel_before))
            boundaries = list(pipe.partition.boundaries)
        profile_s = profiled_seconds(cluster.log_dir / "coordinator.log")

    steady_s = statistics.median(times)
    # the stages' first touches of memory: in the step's part (its gradients, the
    # optimizer's state, activations) and in a steady step (medians)
    step_faults = kernel_first[0] - sum(spent[f"{p}_faults"] for p in ("setup", "init_state"))
    step_kernel_s = kernel_first[1] - sum(spent[f"{p}_kernel_s"] for p in ("setup", "init_state"))
    steady_faults = statistics.median(k[0] for k in steady_kernel)
    steady_kernel_s = statistics.median(k[1] for k in steady_kernel)
    load_gbps = weight_bytes / spent["init_state_s"] / 1e9 if spent["init_state_s"] else 0.0
    stream_gbps = weight_bytes / spent["stream_s"] / 1e9 if spent["stream_s"] else 0.0
    commit_s = spent["init_state_s"] - spent["stream_s"]
    step_s = first_s - spent["setup_s"] - spent["init_state_s"]
    at_bandwidth_s = weight_bytes / (bandwidth * 1e9)
    goal_s = 3 * steady_s + at_bandwidth_s
    print(
        f"model gpt {model}: {params / 1e6:.1f}M parameters, {weight_bytes / 1e6:.0f} MB; "
        f"{stages} stages, boundaries {boundaries}; first loss {first_loss:.4f}"
    )
    print(
        f"first step {first_s:.2f} s = setup {spent['setup_s']:.2f} s (profiling "
        f"{profile_s:.2f} s of it) + init_state {spent['init_state_s']:.2f} s "
        f"({load_gbps:.2f} GB/s, {load_gbps / bandwidth:.2f}x the data path) + the step "
        f"{step_s:.2f} s"
    )
    print(
        f"init_state = streaming to the stages {spent['stream_s']:.2f} s ({stream_gbps:.2f} "
        f"GB/s, {stream_gbps / bandwidth:.2f}x the data path) + the load's commit "
        f"{commit_s:.2f} s (its epoch change, and the snapshot of step 0 copied to each "
        "stage's neighbour before the load returns)"
    )
    print(
        f"steady step {steady_s:.2f} s (median of {steps}); goal for the first step: "
        f"3 x {steady_s:.2f} + {at_bandwidth_s:.2f} s (the weights at the data path's "
        f"bandwidth) = {goal_s:.2f} s: {first_s / goal_s:.2f}x of it"
    )
    page = resource.getpagesize()

    def gib(faults: float) -> str:
        return f"{faults * page / 2**30:.2f} GiB"

    def per_fault_us(kernel_s: float, faults: float) -> str:
        return f"at most {1e6 * kernel_s / faults:.1f} us a fault" if faults else "no faults"

    print(
        f"pages the stages faulted in (minor faults x 4 KiB) and their kernel CPU (all system "
        f"calls): setup {gib(spent['setup_faults'])}, {spent['setup_kernel_s']:.2f} s; "
        f"init_state {gib(spent['init_state_faults'])}, {spent['init_state_kernel_s']:.2f} s; "
        f"the step {gib(step_faults)}, {step_kernel_s:.2f} s "
        f"({per_fault_us(step_kernel_s, step_faults)}); a steady step {gib(steady_faults)}, "
        f"{steady_kernel_s:.2f} s ({per_fault_us(steady_kernel_s, steady_faults)})"
    )
    figures = {
        "parameters": params,
        "weight_bytes": weight_bytes,
        "first_step_s": round(first_s, 3),
        "setup_s": round(spent["setup_s"], 3),
        "profile_s": None if math.isnan(profile_s) else round(profile_s, 3),  # NaN: no line
        "init_state_s": round(spent["init_state_s"], 3),
        "step_part_s": round(step_s, 3),
        "steady_step_s": round(steady_s, 3),
        "data_path_gbps": round(bandwidth, 3),
        "init_state_gbps": round(load_gbps, 3),
        "init_state_vs_data_path": round(load_gbps / bandwidth, 3),
        "stream_s": round(spent["stream_s"], 3),
        "stream_gbps": round(stream_gbps, 3),
        "stream_vs_data_path": round(stream_gbps / bandwidth, 3),
        "load_commit_s": round(commit_s, 3),
        "first_step_vs_goal": round(first_s / goal_s, 3),
        "load_over": "grpc" if args.grpc else "bulk",
        "step_part_fault_gib": round(step_faults * page / 2**30, 3),
        "step_part_kernel_s": round(step_kernel_s, 2),
        "steady_fault_gib": round(steady_faults * page / 2**30, 3),
        "steady_kernel_s": round(steady_kernel_s, 2),
        "setup_kernel_s": round(spent["setup_kernel_s"], 2),
        "init_state_kernel_s": round(spent["init_state_kernel_s"], 2),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
