"""The GPU check: transparency, overhead and stage-to-stage transfer with stages on CUDA.

Three parts, all in one run on one CUDA machine, each against a baseline from the same run:

* **(a) transparency** -- ``Pipeline`` over 2 stage servers on ``--device cuda`` (1F1B, 4
  micro-batches) against plain PyTorch training of the same model on the same GPU: every
  step's loss and every final weight must agree within ``RTOL``/``ATOL`` (float32; GPU
  kernels sum micro-batches in other orders than one full batch). Fails the run otherwise.
* **(b) overhead** -- steps/s and ms per step of (a1) plain PyTorch on the GPU, (a4) plain
  PyTorch accumulating over the pipeline's micro-batches (the same kernels the stages run),
  (b) 1 stage server and (c) 2 stage servers on the GPU, all timed around the whole step
  (bench/overhead.py's structure). It also gives each pipeline's ms per step *outside
  compute*: step time less the slowest stage's compute (``event_compute_s``, from the
  layers' CUDA-event times).
* **(c) transfer GPU -> GPU** -- inference through 2 stages against 1 stage, with one
  activation of 4 MiB and 32 MiB crossing the cut (stage 0's GPU -> pinned host -> gRPC ->
  pinned host -> stage 1's GPU): the hop's time is the difference of the median step
  times, its throughput ``bytes / hop``. Baselines: a pinned device->host->device round trip
  of the same bytes in this process (the PCIe floor any host-staged path pays).

Ends with one JSON line (``transparent``, ``max_abs_diff``, ``overhead_ratio_1stage``,
``outside_ms_2stage``, ``hop_gbps_4mib``, ``hop_gbps_32mib``, ``pcie_gbps_4mib``, ...).
Without CUDA it prints why and exits 2 (its JSON line says ``"cuda": false``).

Run: ``python bench/gpu.py [--quick]`` (or ``make gpu-check``, which runs the cuda tests first).
``--dry-run-cpu`` runs the same code on CPU stages with a small model (no pinned baseline):
it checks the script itself on a machine without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/gpu.py`

from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.models.contract import build
from elasticpipe.training.objectives import loss_fn, make_optimizer, reference_step
from elasticpipe.training.schedule import split_sizes

SEED = 0
LOSS = "mse"
OPTIMIZER, OPTIMIZER_KWARGS = "sgd", {"lr": 0.05}
MICRO_BATCHES = 4
WIDTH = 2048
MODEL_KWARGS: dict[str, Any] = {"sizes": [WIDTH] * 5}  # 4 Linear(2048, 2048), ReLU between
BATCH = 1024
RTOL, ATOL = 1e-4, 1e-5
DEVICE = "cuda"  # "cpu" with --dry-run-cpu
STAGE_ARGS = ["--device", DEVICE]
HOP_BYTES = {"4mib": 4 << 20, "32mib": 32 << 20}


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The mini-batches every way trains on (on the CPU: the client sends them)."""
    g = torch.Generator().manual_seed(1234)
    distinct = [
        (torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g))
        for _ in range(4)
    ]
    return [distinct[k % len(distinct)] for k in range(n)]


def pipeline(cluster: LocalCluster, stages: int, **kw: Any) -> Pipeline:
    args: dict[str, Any] = dict(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs=MODEL_KWARGS,
        seed=SEED,
        optimizer=OPTIMIZER,
        optimizer_kwargs=OPTIMIZER_KWARGS,
        loss=LOSS,
        micro_batches=MICRO_BATCHES,
        schedule="1f1b",
        stages=stages,
    )
    args.update(kw)
    return Pipeline(**args)


def plain(
    batches: list[tuple[torch.Tensor, torch.Tensor]], micro: bool
) -> tuple[list[float], list[float], torch.nn.Module]:
    """Plain PyTorch on the GPU: (step seconds, losses, model); inputs start on the host
    as the pipeline's do, and each step ends with a synchronize (its loss is read)."""
    model = build("mlp", seed=SEED, **MODEL_KWARGS).to(DEVICE)
    opt = make_optimizer(OPTIMIZER, model.parameters(), OPTIMIZER_KWARGS)
    fn = loss_fn(LOSS)
    times, losses = [], []
    for host_x, host_y in batches:
        start = time.perf_counter()
        x, y = host_x.to(DEVICE), host_y.to(DEVICE)
        if micro:
            opt.zero_grad(set_to_none=True)
            sizes = split_sizes(BATCH, MICRO_BATCHES)
            total = torch.zeros((), device=DEVICE)
            for xs, ys in zip(torch.split(x, sizes), torch.split(y, sizes), strict=True):
                loss = fn(model(xs), ys) * (xs.shape[0] / BATCH)
                loss.backward()
                total += loss.detach()
            opt.step()
            losses.append(float(total))
        else:
            losses.append(reference_step(model, opt, LOSS, x, y))
        times.append(time.perf_counter() - start)
    return times, losses, model


def piped(
    cluster: LocalCluster, stages: int, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[list[float], list[float], list[float], dict[str, torch.Tensor]]:
    """(step seconds, losses, outside-compute seconds, final weights) through ``stages``."""
    times, losses, outside = [], [], []
    with pipeline(cluster, stages) as pipe:
        for x, y in batches:
            start = time.perf_counter()
            losses.append(pipe.train_step(x, y))
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            outside.append(elapsed - max(map(event_compute_s, pipe.last_step.reports)))
        return times, losses, outside, pipe.state_dict()


def event_compute_s(report: Any) -> float:
    """A stage's compute in a step from its layers' CUDA-event times: micro-batches times
    the sum of each layer's (smoothed) forward and backward seconds. (The report's own
    ``compute_s`` is a host clock around the ops: on a GPU, mostly kernel-launch time.)"""
    return MICRO_BATCHES * sum(t.forward_s + t.backward_s for t in report.timings)


def hop(cluster: LocalCluster, repeats: int) -> dict[str, float]:
    """Median inference step through 1 and 2 stages with one activation of each size at
    the cut; the hop is their difference."""
    out: dict[str, float] = {}
    for name, size in HOP_BYTES.items():
        rows = size // (WIDTH * 4)
        x = torch.randn(rows, WIDTH)
        medians = []
        for stages in (1, 2):
            with pipeline(cluster, stages, micro_batches=1) as pipe:
                pipe.predict(x)  # warm-up: the job, the allocator, the pinned pool
                runs = []
                for _ in range(repeats):
                    start = time.perf_counter()
                    pipe.predict(x)
                    runs.append(time.perf_counter() - start)
                medians.append(statistics.median(runs))
        hop_s = max(medians[1] - medians[0], 1e-9)
        out[f"one_stage_ms_{name}"] = 1000 * medians[0]
        out[f"two_stage_ms_{name}"] = 1000 * medians[1]
        out[f"hop_ms_{name}"] = 1000 * hop_s
        out[f"hop_gbps_{name}"] = size / hop_s / 1e9
        out[f"pcie_gbps_{name}"] = pcie_round_trip(size, repeats)
    return out


def pcie_round_trip(size: int, repeats: int) -> float:
    """GB/s of a pinned device -> host -> device round trip of ``size`` bytes, as a hop's
    two copies (the floor of any host-staged path); NaN in a CPU dry run."""
    if DEVICE == "cpu":
        return float("nan")
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    runs = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return size / statistics.median(runs[1:]) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed training steps per way")
    parser.add_argument("--quick", action="store_true", help="10 steps, 5 repeats")
    parser.add_argument(
        "--dry-run-cpu", action="store_true", help="check the script on CPU stages (no figures)"
    )
    args = parser.parse_args()
    if args.dry_run_cpu:
        global DEVICE, WIDTH, BATCH, MODEL_KWARGS, HOP_BYTES  # noqa: PLW0603  # a dry run shrinks the setup
        DEVICE, WIDTH, BATCH = "cpu", 64, 32
        MODEL_KWARGS = {"sizes": [WIDTH] * 5}
        HOP_BYTES = {"4mib": 64 << 10, "32mib": 256 << 10}  # the names stay, the sizes shrink
        STAGE_ARGS[:] = ["--device", "cpu"]
    elif not torch.cuda.is_available():
        why = (
            f"no CUDA device: torch {torch.__version__} (built for CUDA "
            f"{torch.version.cuda or 'none: a CPU build'}) sees none"
        )
        print(f"bench/gpu.py: {why}; nothing measured", file=sys.stderr)
        print(json.dumps({"cuda": False, "skipped": why}))
        return 2
    steps, warmup = (10, 3) if args.quick else (args.steps, 5)
    repeats = 5 if args.quick else 15
    torch.backends.cuda.matmul.allow_tf32 = False  # the stages' default
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    print(
        f"device: {name}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}; model mlp {MODEL_KWARGS['sizes']}, batch {BATCH}, "
        f"{MICRO_BATCHES} micro-batches, {steps} timed steps after {warmup}"
    )
    batches = data(warmup + steps)
    figures: dict[str, Any] = {"cuda": DEVICE == "cuda", "device": name}

    a1, a1_losses, ref = plain(batches, micro=False)
    a4, _, _ = plain(batches, micro=True)
    with LocalCluster(
        stages=2, state=":memory:", auto_rebalance=False, stage_args=STAGE_ARGS
    ) as cluster:
        b, _, b_out, _ = piped(cluster, 1, batches)
        c, c_losses, c_out, state = piped(cluster, 2, batches)
        transfer = hop(cluster, repeats)

    # (a) transparency
    diffs = [
        (key, float((state[key] - value.cpu()).abs().max()))
        for key, value in ref.state_dict().items()
    ]
    worst = max(diffs, key=lambda kv: kv[1])
    try:
        torch.testing.assert_close(
            torch.tensor(c_losses), torch.tensor(a1_losses), rtol=RTOL, atol=ATOL
        )
        for key, value in ref.state_dict().items():
            torch.testing.assert_close(state[key], value.cpu(), rtol=RTOL, atol=ATOL, msg=key)
        transparent = True
    except AssertionError as exc:
        transparent = False
        print(f"(a) TRANSPARENCY FAILED: {exc}")
    print(
        f"\n(a) transparency, 2 CUDA stages vs plain PyTorch on the GPU: "
        f"{'agree' if transparent else 'DIFFER'} (rtol {RTOL}, atol {ATOL}); largest weight "
        f"difference {worst[1]:.2e} ({worst[0]}), final losses {c_losses[-1]:.6f} vs "
        f"{a1_losses[-1]:.6f}"
    )
    figures.update(transparent=transparent, max_abs_diff=worst[1])

    # (b) overhead
    def ms(times: list[float]) -> float:
        return 1000 * statistics.median(times[warmup:])

    base = ms(a1)
    print("\n(b) overhead (median ms per step; ratio = plain full batch / way)")
    for label, times in (
        ("(a1) plain PyTorch, full batch", a1),
        (f"(a4) plain PyTorch, {MICRO_BATCHES} micro-batches", a4),
        ("(b)  1 CUDA stage server", b),
        ("(c)  2 CUDA stage servers, 1F1B", c),
    ):
        print(f"  {label:<40}{ms(times):9.2f} ms {base / ms(times):7.2f}x")
    print(
        f"  outside compute (step less the slowest stage's compute): "
        f"1 stage {ms(b_out):.2f} ms, 2 stages {ms(c_out):.2f} ms"
    )
    figures.update(
        plain_ms=base,
        plain_micro_ms=ms(a4),
        one_stage_ms=ms(b),
        two_stage_ms=ms(c),
        overhead_ratio_1stage=base / ms(b),
        overhead_ratio_2stage=base / ms(c),
        outside_ms_1stage=ms(b_out),
        outside_ms_2stage=ms(c_out),
    )

    # (c) transfer
    print("\n(c) transfer GPU -> GPU through the stages (inference, 1 micro-batch)")
    for name in HOP_BYTES:
        print(
            f"  {name}: 1 stage {transfer[f'one_stage_ms_{name}']:.2f} ms, 2 stages "
            f"{transfer[f'two_stage_ms_{name}']:.2f} ms: hop {transfer[f'hop_ms_{name}']:.2f} ms "
            f"= {transfer[f'hop_gbps_{name}']:.2f} GB/s; pinned D2H+H2D in-process "
            f"{transfer[f'pcie_gbps_{name}']:.2f} GB/s "
            f"({transfer[f'hop_gbps_{name}'] / transfer[f'pcie_gbps_{name}']:.2f}x of it)"
        )
    figures.update(transfer)
    print(json.dumps(figures))
    return 0 if transparent else 1


if __name__ == "__main__":
    raise SystemExit(main())
