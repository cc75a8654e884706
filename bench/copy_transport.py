"""A snapshot copy end to end, over the bulk channel against over gRPC, to a real stage.

One in-process stage server keeps the copies of a chain's first stage (as a stage keeps its
predecessor's); this process pushes that stage's sealed snapshot to it with
``transfers.push_snapshot``, as a stage's ``Snapshotter`` does: over the keeper's bulk
channel (kind ``P``: the tensors' bytes sent from their memory, received straight into the
kept tensors), and over gRPC (``PushSnapshot``: each chunk copied into its message, HTTP/2
framing, parsed and copied into the kept tensors), the way a stage without a bulk channel
gets it. Both ends run in this process, so its CPU time is the whole copy's CPU, sender's and
receiver's (the receiving thread at the lowest priority in both).

The two ways alternate round by round, the first way alternating too, on the same sealed
layers (4 layers of weights and Adam state, ``--mib`` MiB in all), and the keeper drops
each copy before the next (a stage keeps one per source). Printed per way: the median of
the rounds' wall and CPU milliseconds per copy, and the ratios gRPC / bulk; the last line
is JSON.

    python bench/copy_transport.py --mib 64 --rounds 7

``--quick``: 2 rounds of a 1 MiB copy, to check the script end to end (its figures mean
little).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from elasticpipe.partition import Placement, StageRef
from elasticpipe.stage_server import transfers
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.snapshots import Capture
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import bulk, rpc
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import layer_state
from elasticpipe.wire.layer_state import PackedLayer

LAYERS = 4
SOURCE = "st-source"
JOB = JobConfig(
    model="mlp", model_kwargs={"sizes": [4] * (LAYERS + 2)}, optimizer="sgd", optimizer_kwargs={}
)


def sealed(mib: int) -> list[tuple[int, PackedLayer]]:
    """``LAYERS`` layers of weights and Adam state, ``mib`` MiB in all, sealed as a stage's
    ``Snapshotter`` seals its capture."""
    n = max(1, mib * (1 << 20) // 4 // 3 // LAYERS)
    return [
        (
            i,
            layer_state.seal(
                layer_state.pack(
                    {
                        "index": i,
                        "model": {"weight": torch.randn(n)},
                        "optimizer": {"exp_avg": torch.randn(n), "exp_avg_sq": torch.rand(n)},
                    }
                )
            ),
        )
        for i in range(LAYERS)
    ]


def keeper() -> StageServer:
    """A stage of a 2-stage chain whose first stage, ``SOURCE``, owns layers [0, LAYERS)."""
    server = StageServer(StageConfig(name="keeper", max_layer_bytes=1 << 34), "127.0.0.1:1")
    server.start()
    chain = (StageRef(SOURCE, "127.0.0.1:9"), StageRef(server.stage.stage_id, server.address))
    placement = Placement(
        epoch=1,
        index=1,
        num_stages=2,
        lo=LAYERS,
        hi=LAYERS + 1,
        chain=chain,
        names=("source", "keeper"),
        ranges=((0, LAYERS), (LAYERS, LAYERS + 1)),
    )
    with rpc.channel(server.address) as chan:
        stage_pb2_grpc.StageServiceStub(chan).Assign(
            stage_pb2.AssignRequest(job=JOB.to_proto(), assignment=placement.to_proto()),
            timeout=30,
        )
    return server


def _no_channel(*args: Any, **kwargs: Any) -> Any:
    """Stands in for ``bulk.connect`` on the gRPC rounds: a keeper without a bulk channel."""
    raise bulk.NoChannel("the gRPC way")


def push(
    server: StageServer,
    pool: rpc.StagePool,
    blobs: list[tuple[int, PackedLayer]],
    way: str,
    step: int,
) -> tuple[float, float]:
    """One copy by ``way``; returns its wall and process CPU milliseconds."""
    capture = Capture(job_id=JOB.job_id, step=step, source=SOURCE, states={}, peer="", generation=0)
    connect = bulk.connect
    if way == "grpc":
        bulk.connect = _no_channel
    try:
        wall, cpu = time.perf_counter(), time.process_time()
        transfers.push_snapshot(pool, server.address, capture, blobs, 120, 1 << 20)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        bulk.connect = connect
    kept = server.stage.snapshots.get(JOB.job_id, step, 0)
    assert kept is not None and kept.digest == blobs[0][1].digest, way
    server.stage.snapshots.prune(None)  # the next copy arrives into no copy held
    return 1e3 * wall, 1e3 * cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=64, help="the copy's size")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="2 rounds of a 1 MiB copy")
    args = parser.parse_args()
    if args.quick:
        args.mib, args.rounds = 1, 2
    torch.manual_seed(0)
    blobs = sealed(args.mib)
    server = keeper()
    pool = rpc.StagePool()
    figures: dict[str, dict[str, list[float]]] = {
        w: {"wall": [], "cpu": []} for w in ("bulk", "grpc")
    }
    try:
        step = 0
        for r in range(args.rounds + 1):  # round 0 warms both up, untimed
            for way in ("bulk", "grpc") if r % 2 else ("grpc", "bulk"):
                step += 1
                wall, cpu = push(server, pool, blobs, way, step)
                if r:
                    figures[way]["wall"].append(wall)
                    figures[way]["cpu"].append(cpu)
    finally:
        pool.close()
        server.stop()
    med = {w: {k: statistics.median(v) for k, v in f.items()} for w, f in figures.items()}
    nbytes = sum(sum(t.numel() * t.element_size() for t in p.tensors) for _, p in blobs)
    print(f"a snapshot copy of {nbytes / 2**20:.1f} MiB, medians of {args.rounds} rounds:")
    for way in ("bulk", "grpc"):
        wall, cpu = med[way]["wall"], med[way]["cpu"]
        rate = nbytes / 1e6 / wall
        print(f"  {way:<5} {wall:9.1f} ms wall {cpu:9.1f} ms CPU (both ends) {rate:6.2f} GB/s")
    wall_ratio = med["grpc"]["wall"] / med["bulk"]["wall"]
    cpu_ratio = med["grpc"]["cpu"] / med["bulk"]["cpu"]
    print(f"gRPC / bulk: {wall_ratio:.2f}x the wall time, {cpu_ratio:.2f}x the CPU")
    print(
        json.dumps(
            {
                "mib": args.mib,
                "rounds": args.rounds,
                "bulk_wall_ms": round(med["bulk"]["wall"], 2),
                "grpc_wall_ms": round(med["grpc"]["wall"], 2),
                "bulk_cpu_ms": round(med["bulk"]["cpu"], 2),
                "grpc_cpu_ms": round(med["grpc"]["cpu"], 2),
                "grpc_over_bulk_wall": round(wall_ratio, 3),
                "grpc_over_bulk_cpu": round(cpu_ratio, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
