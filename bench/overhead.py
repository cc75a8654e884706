"""Benchmark of the pipeline's overhead: the same training run locally, on 1 stage, on 2 stages.

What is measured (all in one run, same model, seed, data and number of steps):

* (a)  plain PyTorch in this process with ``torch.set_num_threads(1)`` -- one stage's thread
  budget (``LocalCluster`` gives every stage one intra-op thread);
* (a') plain PyTorch with 2 threads, i.e. the whole machine, for honesty;
* (a4) plain PyTorch, 1 thread, accumulating over the pipeline's micro-batches: the same
  compute as the stages do, so (b)/(a4) isolates the pipeline's own overhead from the cost
  of smaller matrix products;
* (b)  ``Pipeline`` over 1 stage server (a coordinator and a stage as separate processes on
  loopback): what the client/server machinery costs when nothing is parallel;
* (c)  ``Pipeline`` over 2 stage servers with the 1F1B schedule;
* (e)  the same with the ZB-H1 schedule (backward split into input and weight gradients,
  the weight gradients filling the drain's bubble: ``elasticpipe.training.schedule``).

Each is warmed up, then ``--steps`` steps are timed with ``time.perf_counter`` around the
whole ``train_step`` (split, RPCs, compute, commit). The table gives steps/s, ms/step (mean
and median), and the ratios to (a), (a') and (a4). For (b) and (c) it also prints the time
the stages report as computing (what is left of the step is the pipeline's own overhead:
optimizer-step RPC, sends, waits, the fill/drain bubble), the CPU time each process used
per step (client from ``time.process_time``, stages from ``/proc``), and how long starting
the processes and setting the job up took (not part of the timed steps). The bytes that
travel per step (activations and gradients between the stages, inputs and targets from the
client) are computed from the shapes. Finally the last losses of all ways are compared with
``torch.testing.assert_close``: with the same seed and data the pipeline must reproduce
ordinary training.

Why (c) cannot beat (a) here: this machine has 2 cores. A 2-stage pipeline can at best
overlap the two stages' compute (each stage busy while the other works on another
micro-batch), i.e. approach 2x of one single-threaded process -- but the two stage
processes, their gRPC threads, and the client (serialising inputs and targets, driving the
step) all share those same 2 cores, the pipeline has a fill/drain bubble of (S-1)/(M+S-1) of
the step with S=2 stages and M=4 micro-batches, and every activation is copied through the
loopback network twice (serialise, deserialise). So (c) is bounded well below 2x (a), and
below (a') which already uses both cores for the whole step without any of those costs. On
real hardware each stage has its own device and the client runs elsewhere; this benchmark
measures the software overhead, not the speed-up.

Everything here shares the machine with whatever else runs on it; the load average is
printed before and after, and with load from other processes the wall-clock figures (the
2-thread one most of all) swing by tens of percent between runs -- compare the CPU times.

Run: ``python bench/overhead.py [--steps N] [--quick] [--profile [N]]``. ``--quick``: 2 timed
steps per way after 1 warm-up step and 1 round of the TLS pair, to check the script end to
end (its figures mean little). ``--profile [N]`` adds N
(default 10) untimed steps of the 2-stage pipeline under a sampling profiler of every client
thread and prints where each thread spent them; the table never comes from a profiled pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/overhead.py`

from shared import mlp  # bench/shared/, beside this script
from shared.cpu import process_cpu_s

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.models.contract import build
from elasticpipe.training.objectives import loss_fn, make_optimizer, reference_step
from elasticpipe.training.schedule import split_sizes

# file names of the client-side modules, for the profile's "inclusive" list
OURS = {
    p.name
    for d in ("client", "elasticpipe")
    for p in (Path(__file__).parents[1] / d).glob("*.py")
    if p.name != "__init__.py"
}
SIZES, BATCH, MICRO_BATCHES = mlp.SIZES, mlp.BATCH, mlp.MICRO_BATCHES  # (shared.mlp)
MODEL_KWARGS: dict[str, Any] = {"sizes": SIZES}
SEED = 0
LOSS, OPTIMIZER, OPTIMIZER_KWARGS = mlp.LOSS, mlp.OPTIMIZER, mlp.OPTIMIZER_KWARGS
Batches = list[tuple[torch.Tensor, torch.Tensor]]

FULL = {"steps": 40, "warmup": 5, "tls_rounds": 5}
QUICK = {"steps": 2, "warmup": 1, "tls_rounds": 1}


@dataclass
class Result:
    """What one way of training measured."""

    name: str
    label: str
    step_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    compute_s: list[list[float]] = field(default_factory=list)  # [stage][timed step]
    stage_wall_s: list[list[float]] = field(default_factory=list)
    boundaries: tuple[int, ...] = ()
    num_stages: int = 0
    cpu_ms: list[float] = field(default_factory=list)  # per timed step: client, stage 0, ...
    start_s: float = 0.0  # starting the processes until every stage registered
    first_step_s: float = 0.0  # the first step, which also sets the job up

    @property
    def total_s(self) -> float:
        return sum(self.step_s)

    @property
    def steps_per_s(self) -> float:
        return len(self.step_s) / self.total_s

    @property
    def mean_ms(self) -> float:
        return 1000.0 * self.total_s / len(self.step_s)

    @property
    def median_ms(self) -> float:
        return 1000.0 * statistics.median(self.step_s)


def make_data() -> Batches:
    """The mini-batches every way trains on, the same for all."""
    return mlp.batches()


def accumulated_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    """One plain step over the pipeline's micro-batches, accumulating gradients."""
    optimizer.zero_grad(set_to_none=True)
    sizes = split_sizes(x.shape[0], MICRO_BATCHES)
    total = 0.0
    for xs, ys in zip(torch.split(x, sizes), torch.split(y, sizes), strict=True):
        loss = loss_fn(LOSS)(model(xs), ys) * (xs.shape[0] / x.shape[0])
        torch.autograd.backward(loss)
        total += float(loss.detach())
    optimizer.step()
    return total


def run_plain(
    name: str,
    label: str,
    threads: int,
    data: Batches,
    warmup: int,
    steps: int,
    micro_batched: bool = False,
) -> Result:
    """Ordinary single-process training with ``threads`` intra-op threads."""
    torch.set_num_threads(threads)
    model = build("mlp", seed=SEED, **MODEL_KWARGS)
    optimizer = make_optimizer(OPTIMIZER, model.parameters(), OPTIMIZER_KWARGS)
    result = Result(name, label)
    for k in range(warmup + steps):
        x, y = data[k % len(data)]
        started = time.perf_counter()
        if micro_batched:
            loss = accumulated_step(model, optimizer, x, y)
        else:
            loss = reference_step(model, optimizer, LOSS, x, y)
        elapsed = time.perf_counter() - started
        result.losses.append(loss)
        if k >= warmup:
            result.step_s.append(elapsed)
    return result


def make_pipeline(cluster: LocalCluster, stages: int, schedule: str = "1f1b") -> Pipeline:
    return Pipeline(
        tls=cluster.client_tls,
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs=MODEL_KWARGS,
        seed=SEED,
        optimizer=OPTIMIZER,
        optimizer_kwargs=OPTIMIZER_KWARGS,
        loss=LOSS,
        micro_batches=MICRO_BATCHES,
        stages=stages,
        schedule=schedule,
    )


def run_pipeline(
    name: str,
    label: str,
    stages: int,
    data: Batches,
    warmup: int,
    steps: int,
    profile_steps: int = 0,
    schedule: str = "1f1b",
) -> tuple[Result, str]:
    """Training through ``stages`` stage servers; returns the result and a profile report."""
    torch.set_num_threads(1)
    result = Result(name, label, compute_s=[[] for _ in range(stages)], num_stages=stages)
    result.stage_wall_s = [[] for _ in range(stages)]
    report = ""
    started = time.perf_counter()
    with LocalCluster(stages=stages, state=":memory:", auto_rebalance=False) as cluster:
        result.start_s = time.perf_counter() - started
        procs = [cluster.procs[f"stage-{s}"].pid for s in range(stages)]
        with make_pipeline(cluster, stages, schedule) as pipe:
            for k in range(warmup + steps):
                x, y = data[k % len(data)]
                if k == warmup:
                    cpu_before = [time.process_time(), *map(process_cpu_s, procs)]
                started = time.perf_counter()
                loss = pipe.train_step(x, y)
                elapsed = time.perf_counter() - started
                result.losses.append(loss)
                if k == 0:
                    result.first_step_s = elapsed
                if k >= warmup:
                    result.step_s.append(elapsed)
                    for s, rep in enumerate(pipe.last_step.reports):
                        result.compute_s[s].append(rep.compute_s)
                        result.stage_wall_s[s].append(rep.wall_s)
            cpu_after = [time.process_time(), *map(process_cpu_s, procs)]
            result.cpu_ms = [
                1000.0 * (b - a) / steps for a, b in zip(cpu_before, cpu_after, strict=True)
            ]
            result.boundaries = pipe.partition.boundaries
            if profile_steps:
                with Sampler() as sampler:
                    for k in range(profile_steps):
                        pipe.train_step(*data[k % len(data)])
                report = sampler.report(profile_steps)
    return result, report


@dataclass
class TlsPair:
    """The same 2-stage training on a plaintext and a mutual-TLS cluster, alternated."""

    plain_ms: list[float] = field(default_factory=list)  # mean step time per round
    tls_ms: list[float] = field(default_factory=list)
    losses: tuple[list[float], list[float]] = field(default_factory=lambda: ([], []))

    @property
    def overheads(self) -> list[float]:
        """Per round: how much slower a step is with mTLS (a fraction)."""
        return [t / p - 1.0 for p, t in zip(self.plain_ms, self.tls_ms, strict=True)]

    @property
    def median_overhead(self) -> float:
        return statistics.median(self.overheads)


def run_tls_pair(data: Batches, warmup: int, steps: int, rounds: int) -> TlsPair:
    """Both clusters up at once; each round times ``steps // rounds`` steps on one, then on
    the other (the order alternating), so that the machine's load drifts into both alike.
    The ratio per round is what counts; the median over rounds is reported."""
    torch.set_num_threads(1)
    pair = TlsPair()
    per_round = max(1, steps // rounds)
    with contextlib.ExitStack() as stack:
        clusters = [
            stack.enter_context(
                LocalCluster(stages=2, state=":memory:", auto_rebalance=False, tls=t)
            )
            for t in (False, True)
        ]
        pipes = [stack.enter_context(make_pipeline(c, 2)) for c in clusters]
        for k in range(warmup):
            for pipe, losses in zip(pipes, pair.losses, strict=True):
                losses.append(pipe.train_step(*data[k % len(data)]))
        k = warmup
        for r in range(rounds):
            times: list[float] = [0.0, 0.0]
            order = (0, 1) if r % 2 == 0 else (1, 0)
            for which in order:
                for j in range(per_round):
                    x, y = data[(k + j) % len(data)]
                    started = time.perf_counter()
                    pair.losses[which].append(pipes[which].train_step(x, y))
                    times[which] += time.perf_counter() - started
            k += per_round
            pair.plain_ms.append(1000.0 * times[0] / per_round)
            pair.tls_ms.append(1000.0 * times[1] / per_round)
    return pair


class Sampler:
    """A CPU-weighted sampling profiler of every thread of this process.

    cProfile sees only the thread that enabled it, and the client's work runs in its pool's
    threads and in gRPC's. Every ``interval`` seconds this reads each thread's CPU clock and
    stack, and charges the CPU the thread used since the last sample to that stack: to the
    innermost frame ("self") and to every distinct frame on it ("incl."). Waiting costs no
    CPU, so a thread blocked in a gRPC call or on a lock shows only what it really burnt.
    """

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.leaf: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.inclusive: defaultdict[tuple[str, str], float] = defaultdict(float)
        self.wall_s = 0.0
        self.process_cpu_s = 0.0

    def __enter__(self) -> Sampler:
        self._started = time.perf_counter()
        self._cpu_started = time.process_time()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.wall_s = time.perf_counter() - self._started
        self.process_cpu_s = time.process_time() - self._cpu_started

    def _run(self) -> None:
        me = threading.get_ident()
        last: dict[int, float] = {}
        while not self._stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                try:
                    now = time.clock_gettime(time.pthread_getcpuclockid(ident))
                except OSError:  # the thread ended meanwhile
                    continue
                used = now - last.get(ident, now)
                last[ident] = now
                if used <= 0:
                    continue
                group = re.sub(r"\d+", "N", names.get(ident, "?"))
                self.cpu[group] += used
                self.leaf[group, _where(frame)] += used
                seen = set()
                f: FrameType | None = frame
                while f is not None:
                    here = _where(f)
                    if here not in seen:
                        seen.add(here)
                        self.inclusive[group, here] += used
                    f = f.f_back

    def report(self, steps: int, top: int = 12) -> str:
        per_step = 1000.0 / steps
        sampled = sum(self.cpu.values())
        lines = [
            f"  client process CPU {per_step * self.process_cpu_s:.1f} ms/step (wall "
            f"{per_step * self.wall_s:.1f} ms/step); {per_step * sampled:.1f} ms/step of it "
            "in Python threads, sampled below; the rest ran in gRPC's C threads (or in "
            "threads that ended between samples). By thread group:"
        ]
        lines += [f"    {per_step * c:7.2f} ms/step  {g!r}" for g, c in _top(self.cpu)]
        lines.append("  self (innermost frame):")
        lines += [
            f"    {per_step * c:7.2f} ms/step  {g:<18} {w}" for (g, w), c in _top(self.leaf, top)
        ]
        lines.append("  inclusive (frames of this project):")
        ours = [(k, c) for k, c in _top(self.inclusive) if k[1].split(":")[0] in OURS]
        lines += [f"    {per_step * c:7.2f} ms/step  {g:<18} {w}" for (g, w), c in ours[:top]]
        return "\n".join(lines)


def _top(counts: dict[Any, float], n: int | None = None) -> list[tuple[Any, float]]:
    return sorted(counts.items(), key=lambda kv: -kv[1])[:n]


def _where(frame: FrameType) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{code.co_firstlineno}({code.co_name})"


def cut_bytes(boundaries: tuple[int, ...]) -> int:
    """Bytes of activations forward plus their gradients backward, per step, over all cuts."""
    model = build("mlp", seed=SEED, **MODEL_KWARGS)
    total = 0
    with torch.no_grad():
        for cut in boundaries[1:-1]:
            out = model[:cut](torch.zeros(1, SIZES[0]))
            per_sample = out.numel() * out.element_size()
            total += 2 * per_sample * sum(split_sizes(BATCH, MICRO_BATCHES))
    return total


def outside_ms(r: Result) -> float:
    """Mean ms of a client step beyond the busiest stage's mean compute."""
    return r.mean_ms - max(mean_per_step(r.compute_s))


def mean_per_step(per_stage: list[list[float]]) -> list[float]:
    return [1000.0 * sum(v) / len(v) for v in per_stage]


def print_table(results: list[Result], bases: list[Result]) -> None:
    print()
    ratios = "".join(f"{'vs ' + b.name:>9}" for b in bases)
    print(f"{'':5}{'way':<37}{'steps/s':>8}{'ms/step':>9}{'median':>8}{ratios}")
    for r in results:
        ratios = "".join(f"{r.steps_per_s / b.steps_per_s:>9.2f}" for b in bases)
        print(
            f"{r.name:<5}{r.label:<37}{r.steps_per_s:>8.2f}{r.mean_ms:>9.1f}{r.median_ms:>8.1f}"
            f"{ratios}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps of each way")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="2 timed steps per way, 1 TLS round (most of its time is starting processes)",
    )
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=10,
        default=0,
        metavar="STEPS",
        help="then profile STEPS (default 10) untimed 2-stage steps on the client",
    )
    parser.add_argument(
        "--tls-rounds",
        type=int,
        default=None,
        metavar="N",
        help="rounds of the plaintext vs mutual-TLS comparison (default 5; 0: skip it)",
    )
    args = parser.parse_args()
    preset = QUICK if args.quick else FULL
    steps = args.steps if args.steps is not None else preset["steps"]
    warmup = preset["warmup"]
    if args.tls_rounds is None:
        args.tls_rounds = preset["tls_rounds"]
    if steps < 1:
        parser.error("--steps must be >= 1")

    bench_started = time.perf_counter()
    load_before = os.getloadavg()
    params = sum(p.numel() for p in build("mlp", seed=SEED, **MODEL_KWARGS).parameters())
    print(
        f"model mlp sizes={SIZES} ({params / 1e6:.1f} M params), batch {BATCH}, "
        f"{MICRO_BATCHES} micro-batches, loss {LOSS}, {OPTIMIZER} {OPTIMIZER_KWARGS}"
    )
    print(
        f"{warmup} warm-up + {steps} timed steps per way; {os.cpu_count()} CPUs; "
        f"torch {torch.__version__}; load average {load_before[0]:.2f}"
    )
    data = make_data()
    plain = run_plain("(a)", "plain PyTorch, 1 thread", 1, data, warmup, steps)
    plain2 = run_plain("(a')", "plain PyTorch, 2 threads", 2, data, warmup, steps)
    plain_mb = run_plain(
        "(a4)", f"plain, 1 thread, {MICRO_BATCHES} micro-batches", 1, data, warmup, steps, True
    )
    one, _ = run_pipeline("(b)", "Pipeline, 1 stage server", 1, data, warmup, steps)
    two, profile = run_pipeline(
        "(c)", "Pipeline, 2 stage servers (1F1B)", 2, data, warmup, steps, args.profile
    )
    zb, _ = run_pipeline(
        "(e)", "Pipeline, 2 stage servers (ZB-H1)", 2, data, warmup, steps, schedule="zb-h1"
    )
    tls_pair = run_tls_pair(data, warmup, steps, args.tls_rounds) if args.tls_rounds else None
    load_after = os.getloadavg()

    print_table([plain, plain2, plain_mb, one, two, zb], [plain, plain2, plain_mb])
    print()
    for r in (one, two, zb):
        compute = mean_per_step(r.compute_s)
        wall = mean_per_step(r.stage_wall_s)
        stages = ", ".join(
            f"stage {s} layers {r.boundaries[s]}-{r.boundaries[s + 1] - 1}: "
            f"compute {c:.1f} ms, run {w:.1f} ms"
            for s, (c, w) in enumerate(zip(compute, wall, strict=True))
        )
        print(f"{r.name} per step as the stages report it: {stages}")
        print(
            f"     client step {r.mean_ms:.1f} ms - busiest stage's compute {max(compute):.1f} ms "
            f"= {r.mean_ms - max(compute):.1f} ms outside the stages' compute "
            "(optimizer step, RPCs, waits)"
        )
        cpu = ", ".join(
            [f"client {r.cpu_ms[0]:.0f} ms"]
            + [f"stage {s} {c:.0f} ms" for s, c in enumerate(r.cpu_ms[1:])]
        )
        print(
            f"     CPU time per step: {cpu} (sum {sum(r.cpu_ms):.0f} ms of "
            f"{os.cpu_count()} cores x {r.mean_ms:.0f} ms = "
            f"{(os.cpu_count() or 1) * r.mean_ms:.0f} ms available)"
        )
        print(
            f"     starting {r.num_stages} stage process(es) + coordinator took {r.start_s:.1f} s; "
            f"the first step (job setup + profiling) {r.first_step_s:.1f} s (not timed above)"
        )
    print(
        f"(a4) computes like the stages (micro-batches of {BATCH // MICRO_BATCHES}); "
        "(b) vs (a4) is the pipeline's own overhead, (a4) vs (a) the cost of micro-batching"
    )

    inputs_bytes = BATCH * SIZES[0] * 4
    targets_bytes = BATCH * SIZES[-1] * 4
    between = cut_bytes(two.boundaries)
    print(
        f"bytes per step: between the 2 stages {between / 2**20:.2f} MiB "
        f"(activations + gradients at cut {list(two.boundaries[1:-1])}, float32); "
        f"client to stages {(inputs_bytes + targets_bytes) / 2**20:.2f} MiB (inputs + targets)"
    )

    last = torch.tensor(plain.losses[-1])
    agree = True
    for r in (plain2, plain_mb, one, two, zb):
        try:
            torch.testing.assert_close(torch.tensor(r.losses[-1]), last)
        except AssertionError:
            agree = False
            print(
                f"final losses differ: {r.name} {r.losses[-1]:.8f} vs (a) {plain.losses[-1]:.8f} "
                f"(difference {r.losses[-1] - plain.losses[-1]:+.3e})"
            )
    finals = ", ".join(
        f"{r.name} {r.losses[-1]:.8f}" for r in (plain, plain2, plain_mb, one, two, zb)
    )
    if agree:
        print(f"losses agree (assert_close): final loss after {warmup + steps} steps {finals}")
    print(
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        "(> ~0.5 before means other processes shared the 2 cores); "
        f"bench took {time.perf_counter() - bench_started:.0f} s"
    )
    if tls_pair is not None:
        rounds = ", ".join(
            f"{p:.1f}/{t:.1f}" for p, t in zip(tls_pair.plain_ms, tls_pair.tls_ms, strict=True)
        )
        same = tls_pair.losses[0] == tls_pair.losses[1]
        print(
            f"(d) mutual TLS vs plaintext, 2 stage servers, both clusters up, alternated in "
            f"{len(tls_pair.plain_ms)} rounds: ms/step plain/mTLS per round {rounds}; "
            f"median overhead {100 * tls_pair.median_overhead:+.1f}% (goal <= +10%); "
            f"losses identical: {same}"
        )
    if profile:
        print(f"\nclient-side sampling profile of {args.profile} untimed 2-stage steps:\n{profile}")

    figures = {
        "plain_steps_per_s": round(plain.steps_per_s, 3),
        "plain2_steps_per_s": round(plain2.steps_per_s, 3),
        "one_stage_steps_per_s": round(one.steps_per_s, 3),
        "two_stage_steps_per_s": round(two.steps_per_s, 3),
        "one_stage_ratio": round(one.steps_per_s / plain.steps_per_s, 3),
        "two_stage_ratio": round(two.steps_per_s / plain.steps_per_s, 3),
        "one_stage_ratio_vs_2_threads": round(one.steps_per_s / plain2.steps_per_s, 3),
        "two_stage_ratio_vs_2_threads": round(two.steps_per_s / plain2.steps_per_s, 3),
        "two_stage_outside_compute_ms": round(outside_ms(two), 2),
        "zb_two_stage_steps_per_s": round(zb.steps_per_s, 3),
        "zb_two_stage_outside_compute_ms": round(outside_ms(zb), 2),
        "zb_vs_1f1b": round(zb.steps_per_s / two.steps_per_s, 3),
        "inter_stage_bytes_per_step": between,
        "losses_agree": agree,
        "steps": steps,
    }
    if tls_pair is not None:
        figures["mtls_overhead_median"] = round(tls_pair.median_overhead, 4)
        figures["mtls_overhead_rounds"] = [round(o, 4) for o in tls_pair.overheads]
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
