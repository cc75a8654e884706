"""ElasticPipe beside ``torch.distributed.pipelining`` (gloo) and one plain process, same job.

For each configuration both pipelines train the same model, built from the same seed
(``elasticpipe.models.build``), cut at the same layer boundaries, with the same schedule,
micro-batches, loss (cross-entropy), optimizer (SGD) and batches; one intra-op thread per
stage process on both sides, and each stage process bound to cores of its own on both
sides, stage (rank) k to the k-th share of the CPUs this process may use, around again once
all are given (``LocalCluster``'s ``bind_cpus``; ``--unbound``: neither side binds). The
plain process and the clients stay unbound. The plain baseline is one process computing
every layer at one thread, micro-batch by micro-batch, as the pipelines do. Rounds
alternate between the three (each round times ``--steps`` steps after ``--warmup``), so the
host's load drifts into all alike; the figures are medians over rounds.

Per configuration it prints ms/step of each system, ElasticPipe's ratio to torch's (the
goal: <= 1.10), and each system's CPU seconds per step (all its processes) beyond the plain
process's, which is the CPU the pipeline spends outside layer compute. The losses of the
first step are compared (the three agree bit for bit when they compute alike).

    python bench/vs_torch.py                 # the six configurations, 5 rounds
    python bench/vs_torch.py --only mlp-2-1f1b --rounds 9

``--quick``: one small configuration, 1 round of 1 step (checks the script end to end in
seconds; its figures mean little). Ends with one JSON line: ``ratios`` (per configuration),
``worst_ratio`` and the step times.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/vs_torch.py`

from shared.cpu import process_cpu_s, stage_pids  # bench/shared/, beside this script

from elasticpipe import models
from elasticpipe.client.pipeline import Pipeline
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.cpus import available, bind, stage_cpus

LR = 0.01


@dataclass(frozen=True)
class Config:
    """One side-by-side: a model, its cuts, a schedule, and the batches' shape."""

    name: str
    model: str
    kwargs: dict[str, Any]
    boundaries: tuple[int, ...]
    schedule: str  # "gpipe" or "1f1b"
    micro_batches: int
    batch: int
    seq: int = 0  # tokens per sample (GPT); 0: an MLP's feature vectors

    @property
    def stages(self) -> int:
        return len(self.boundaries) - 1


MLP = {"sizes": [1024] * 5}  # as bench/overhead.py: 7 layers
GPT = {"vocab_size": 96, "d_model": 96, "n_heads": 4, "n_layers": 8, "max_seq_len": 64}
CONFIGS = [
    Config("mlp-2-gpipe", "mlp", MLP, (0, 4, 7), "gpipe", 4, 256),
    Config("mlp-2-1f1b", "mlp", MLP, (0, 4, 7), "1f1b", 4, 256),
    Config("gpt-2-gpipe", "gpt", GPT, (0, 5, 10), "gpipe", 8, 16, 64),
    Config("gpt-2-1f1b", "gpt", GPT, (0, 5, 10), "1f1b", 8, 16, 64),
    Config("gpt-4-gpipe", "gpt", GPT, (0, 3, 5, 7, 10), "gpipe", 8, 16, 64),
    Config("gpt-4-1f1b", "gpt", GPT, (0, 3, 5, 7, 10), "1f1b", 8, 16, 64),
]
QUICK = Config("mlp-2-1f1b-quick", "mlp", {"sizes": [64] * 4}, (0, 2, 5), "1f1b", 2, 8)


def batches(config: Config, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` mini-batches of the configuration, the same for every system."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        if config.seq:
            vocab = config.kwargs["vocab_size"]
            tokens = torch.randint(0, vocab, (config.batch, config.seq + 1), generator=g)
            out.append((tokens[:, :-1], tokens[:, 1:]))
        else:
            width = config.kwargs["sizes"][0]
            x = torch.randn(config.batch, width, generator=g)
            out.append(
                (x, torch.randint(0, config.kwargs["sizes"][-1], (config.batch,), generator=g))
            )
    return out


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over every position, as ElasticPipe's ``"cross_entropy"`` computes it."""
    return torch.nn.functional.cross_entropy(
        output.reshape(-1, output.shape[-1]), target.reshape(-1)
    )


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---- plain PyTorch, one process ------------------------------------------------------------


def plain(
    config: Config, data: list[tuple[torch.Tensor, torch.Tensor]], warmup: int
) -> tuple[list[float], float, float]:
    """(step seconds, CPU seconds per step, first loss) of one process at one thread."""
    torch.set_num_threads(1)
    model = models.build(config.model, seed=0, **config.kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    times, first, cpu = [], 0.0, 0.0
    for k, (x, y) in enumerate(data):
        c0, t0 = self_cpu_s(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for xm, ym in zip(
            x.chunk(config.micro_batches), y.chunk(config.micro_batches), strict=True
        ):
            loss = loss_fn(model(xm), ym) / config.micro_batches
            loss.backward()
            total += float(loss.detach())
        opt.step()
        if k == 0:
            first = total
        if k >= warmup:
            times.append(time.perf_counter() - t0)
            cpu += self_cpu_s() - c0
    return times, cpu / max(1, len(times)), first


# ---- torch.distributed.pipelining over gloo ---------------------------------------------------


def _torch_rank(
    rank: int,
    config: Config,
    data: list[Any],
    warmup: int,
    port: int,
    out: Any,
    cpus: list[int],
) -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    own = stage_cpus(rank, config.stages, 1, cpus)
    if own:  # as LocalCluster binds stage ``rank``
        bind(own)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=config.stages)
    full = models.build(config.model, seed=0, **config.kwargs)
    lo, hi = config.boundaries[rank], config.boundaries[rank + 1]
    part = torch.nn.Sequential(*list(full)[lo:hi])
    stage = PipelineStage(part, rank, config.stages, torch.device("cpu"))
    kind = ScheduleGPipe if config.schedule == "gpipe" else Schedule1F1B
    last = rank == config.stages - 1
    schedule = kind(stage, config.micro_batches, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=LR)
    times, first, cpu = [], 0.0, 0.0
    for k, (x, y) in enumerate(data):
        dist.barrier()
        c0, t0 = self_cpu_s(), time.perf_counter()
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(x)
        elif last:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        dist.barrier()
        if k == 0 and last:
            first = sum(float(v.detach()) for v in losses) / len(losses)
        if k >= warmup:
            times.append(time.perf_counter() - t0)
            cpu += self_cpu_s() - c0
    out.put((rank, times, cpu / max(1, len(times)), first))
    dist.destroy_process_group()


def torch_pipelining(
    config: Config, data: list[Any], warmup: int, port: int, bound: bool = True
) -> tuple[list[float], float, float]:
    """(step seconds, CPU seconds per step over all ranks, first loss) of torch's pipeline
    (``bound``: each rank bound to a core, as ``LocalCluster`` binds its stages)."""
    cpus = sorted(available() or ()) if bound else []
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_torch_rank, args=(r, config, data, warmup, port, out, cpus))
        for r in range(config.stages)
    ]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    results.sort(key=lambda r: r[0])
    times = [max(ts) for ts in zip(*(r[1] for r in results), strict=True)]
    return times, sum(r[2] for r in results), results[-1][3]


# ---- ElasticPipe -----------------------------------------------------------------------------


def elastic_pipe(
    cluster: LocalCluster, config: Config, data: list[Any], warmup: int
) -> tuple[list[float], float, float]:
    """(step seconds, CPU seconds per step of the client and every stage, first loss)."""
    with Pipeline(
        coordinator=cluster.coordinator,
        model=config.model,
        model_kwargs=config.kwargs,
        seed=0,
        optimizer="sgd",
        optimizer_kwargs={"lr": LR},
        micro_batches=config.micro_batches,
        schedule=config.schedule,
        stages=config.stages,
        snapshot_every=0,
    ) as pipe:
        first = pipe.train_step(*data[0])  # sets the job up and profiles it
        with cluster.admin() as admin:
            if tuple(pipe.partition.boundaries) != config.boundaries:
                admin.set_partition(list(config.boundaries))
        times, cpu = [], 0.0
        for k, (x, y) in enumerate(data[1:], start=1):
            c0 = self_cpu_s() + stage_cpu_s(cluster)
            t0 = time.perf_counter()
            pipe.train_step(x, y)
            if k >= warmup:
                times.append(time.perf_counter() - t0)
                cpu += self_cpu_s() + stage_cpu_s(cluster) - c0
        assert tuple(pipe.partition.boundaries) == config.boundaries, pipe.partition
    return times, cpu / max(1, len(times)), first


def stage_cpu_s(cluster: LocalCluster) -> float:
    """CPU seconds the cluster's stage processes have used so far (from /proc)."""
    return sum(process_cpu_s(pid) for pid in stage_pids(cluster))


# ---- the run ---------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first, per round")
    parser.add_argument("--only", default="", help="comma-separated configuration names")
    parser.add_argument("--quick", action="store_true", help="one small case, 1 round of 1 step")
    parser.add_argument(
        "--unbound", action="store_true", help="no stage process bound to a core, on either side"
    )
    args = parser.parse_args()
    configs = [c for c in CONFIGS if not args.only or c.name in args.only.split(",")]
    if args.quick:
        configs, args.rounds, args.steps, args.warmup = [QUICK], 1, 1, 1
    if not configs:
        parser.error(f"--only {args.only!r} names no configuration of {[c.name for c in CONFIGS]}")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--rounds, --steps and --warmup must be at least 1")
    figures: dict[str, Any] = {}
    port = 29500 + os.getpid() % 1000
    for config in configs:
        data = batches(config, args.warmup + args.steps)
        rows: dict[str, list[float]] = {"elasticpipe": [], "torch": [], "plain": []}
        cpus: dict[str, list[float]] = {"elasticpipe": [], "torch": [], "plain": []}
        firsts: dict[str, float] = {}
        with LocalCluster(
            stages=config.stages,
            state=":memory:",
            auto_rebalance=False,
            bind_cpus=not args.unbound,
        ) as cluster:
            for r in range(args.rounds):
                order = ["elasticpipe", "torch", "plain"]
                order = order[r % 3 :] + order[: r % 3]
                for system in order:
                    if system == "elasticpipe":
                        times, cpu, first = elastic_pipe(cluster, config, data, args.warmup)
                    elif system == "torch":
                        port += 1
                        times, cpu, first = torch_pipelining(
                            config, data, args.warmup, port, not args.unbound
                        )
                    else:
                        times, cpu, first = plain(config, data, args.warmup)
                    rows[system].append(statistics.median(times))
                    cpus[system].append(cpu)
                    firsts.setdefault(system, first)
        ms = {s: 1e3 * statistics.median(v) for s, v in rows.items()}
        cpu_ms = {s: 1e3 * statistics.median(v) for s, v in cpus.items()}
        figures[config.name] = {
            "elasticpipe_ms": round(ms["elasticpipe"], 2),
            "torch_ms": round(ms["torch"], 2),
            "plain_ms": round(ms["plain"], 2),
            "ratio": round(ms["elasticpipe"] / ms["torch"], 3),
            "elasticpipe_cpu_ms_beyond_plain": round(cpu_ms["elasticpipe"] - cpu_ms["plain"], 1),
            "torch_cpu_ms_beyond_plain": round(cpu_ms["torch"] - cpu_ms["plain"], 1),
            "first_losses": {s: round(v, 6) for s, v in firsts.items()},
        }
        f = figures[config.name]
        print(
            f"{config.name:<18} ElasticPipe {f['elasticpipe_ms']:7.1f} ms  torch.pipelining "
            f"{f['torch_ms']:7.1f} ms  ratio {f['ratio']:.2f}  plain {f['plain_ms']:7.1f} ms  "
            f"CPU beyond plain: {f['elasticpipe_cpu_ms_beyond_plain']:.0f} vs "
            f"{f['torch_cpu_ms_beyond_plain']:.0f} ms/step  first losses {f['first_losses']}",
            flush=True,
        )
    ratios = {name: f["ratio"] for name, f in figures.items()}
    print(
        json.dumps(
            {
                "ratios": ratios,
                "worst_ratio": max(ratios.values()),
                "configs": figures,
                "rounds": args.rounds,
                "steps": args.steps,
                "load_after": round(os.getloadavg()[0], 2),
                "bound": not args.unbound and available() is not None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
