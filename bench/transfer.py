"""Stage-to-stage activation throughput: the real data path against bare gRPC, gloo and TCP.

What is measured, all in one run, per tensor size (64 KiB to 64 MiB) and per path:

* **data path** -- ``elasticpipe.transport.sending.send``, the very call a stage's ``Link`` makes to
  pass its output on: one unary ``Deliver`` for a tensor of at most one chunk (1 MiB), a
  client-streaming ``Forward`` (header, then 1 MiB chunks) above that. The sender is this
  process; the receiver is a real stage server process (``elasticpipe stage``, started by
  ``LocalCluster`` with its coordinator) that holds a job: this bench calls the stage's
  ``Assign`` with a placement (stage 1 of 2, owning layer 1 of ``mlp`` sizes [4, 4, 4], a
  ReLU) at epoch ``EPOCH``, exactly as the coordinator would. So every message goes through
  the receiver's whole path: gRPC, the generic handler's parsing, the tensor checks
  (``codec.check_meta``, the epoch check and the mailbox's room in ``Stage.admit``), the
  ``TensorAssembler`` (a buffer of exactly the declared size), and ``Stage.deliver`` into
  the mailbox under (run, micro-batch).
* **bare gRPC** -- the same bytes, chunked the same way (one unary call up to 1 MiB, a
  client stream of 1 MiB chunks above), through grpcio with the project's channel and
  server options to a child process whose handlers only drain the request: no protobuf
  messages, no stage, payload bytes built once per size. What gRPC itself costs.
* **gloo** -- ``torch.distributed`` send/recv of a uint8 tensor of the same size between
  this process (rank 0) and a child process (rank 1) that receives into one preallocated
  tensor, over loopback.
* **TCP** -- ``socket.sendall`` of the same bytes to a child process that ``recv_into``'s a
  preallocated buffer (``TCP_NODELAY``): the floor any path over loopback pays.

The same semantics for all: a message counts once the *sender knows the receiver holds
it*. ``sending.send`` returns when the stage's ``Ack`` arrives, which the stage sends
only after the tensor is assembled and in its mailbox (a refused message raises and ends
the bench); the bare gRPC sink answers once it has drained the request; gloo and TCP
receivers answer every message with a 1-byte ack (a 1-element gloo send / one byte on the
socket), which the sender waits for. One message at a time, like a ``Link`` (it sends its
queue in order, each waiting for its ack). Each timed *repeat* sends
``n = max(1, --min-bytes / size)`` messages back to back and gives ``n * size / elapsed``;
the table shows the median of ``--repeats`` repeats (after one untimed warm-up batch per
size and path), and the paths alternate repeat by repeat so that the machine's load drifts
over all of them alike. GB/s are 10^9 bytes per second.

Honesty check that the stage really accepted the bytes (not timed): every batch of data-path
sends goes to a fresh run id, micro-batches 0..n-1; after the batch the bench runs an
inference ``RunStep`` of that run on the stage, which takes every one of those n
micro-batches out of the mailbox (it would fail at its deadline if one were missing) and
runs the ReLU on it. The payload is ``torch.rand`` (non-negative, so the ReLU is the
identity); after the last repeat of each size the bench fetches micro-batch 0's output
back (``FetchOutput``) and checks it is bitwise the tensor sent. The bench fails unless
every byte sent was taken out of the mailbox that way.

Where the time goes (cheap and approximate, to guide the optimization):

* the CPU seconds and the minor page faults of each side's whole process per GB moved,
  for every path (``/proc``; CPU in 10 ms ticks, summed over the timed repeats);
* the cost of one page fault on this machine (first touch of fresh memory against a second
  touch; a few microseconds in this VM, far more than on bare metal), so that the data
  path's faults per message convert to time: every copy into freshly allocated memory
  pays them, and the data path makes several per message on each side;
* the data path's Python-level work, timed in this process with the code the two ends
  run: (a) the sender's serialization -- ``codec.tensor_bytes``/``tensor_chunks`` (a copy
  out of the tensor) and protobuf's ``SerializeToString`` of every message (a second
  copy) -- and (b) the receiver's parsing and assembly -- ``rpc._parse`` of every message
  (a copy of the payload) plus ``TensorAssembler.add`` (a copy into the tensor's buffer)
  and ``finish``; medians of 5, run when this process's allocator has free memory at hand,
  so mostly without faults;
* bare gRPC's time per message next to it.

Each is shown as a share of the measured time per message. They overlap (faults happen
inside serialization, parsing and gRPC; on a stream both ends work at once), so they are
a guide, not a sum.

This machine has 2 cores shared with other work: sender and receiver each want one, and
the figures swing with the load (printed before and after). The ratios to gloo, TCP and
bare gRPC measured in the same run are what to compare across runs; gloo and TCP receive
into reused buffers, as a tuned transport would.

Run: ``python bench/transfer.py [--repeats N] [--min-bytes B] [--sizes KiB,...] [--quick]``
(default: 5 repeats of at least 64 MiB per size and path; about a minute and a half on
this machine, 10-15 s of it starting processes; ``--quick``: 1 repeat of at least 4 MiB at
64 KiB and 4 MiB, to check the script end to end: most of its time is starting processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/transfer.py`

from datapaths import (  # bench/datapaths.py, next to this script
    EPOCH,
    KIB,
    MIB,
    SIZES,
    BareGrpcPath,
    Carrier,
    DataPath,
    GlooPath,
    TcpPath,
    make_schedule,
    page_fault_us,
)
from shared.timing import median_seconds  # bench/shared/timing.py, beside this script

from elasticpipe.transport import rpc, sending
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import codec

# ---- where the data path's time goes ---------------------------------------------------


def breakdown(size: int, repeats: int = 5) -> tuple[float, float]:
    """Seconds per message of the data path's Python-level work at ``size``, in this process
    (median of ``repeats``, fresh buffers every time as on the wire).

    Returns:
        (sender: tensor bytes + protobuf serialization of every message,
         receiver: protobuf parsing of every message + assembly into the tensor's buffer)
    """
    payload = torch.rand(size // 4)
    msg = sending.Outgoing("Forward", EPOCH, 1, 0, 0, payload)
    meta = codec.tensor_meta(payload)
    unary = meta.nbytes <= codec.DEFAULT_CHUNK_BYTES

    def serialize() -> list[bytes]:
        if unary:
            request = stage_pb2.DataMessage(
                slot=stage_pb2.INPUT,
                header=sending.header(msg, meta),
                data=codec.tensor_bytes(payload),
            )
            return [request.SerializeToString()]
        return [m.SerializeToString() for m in sending.data_stream(msg)]

    wire = serialize()

    def receive() -> torch.Tensor:
        if unary:
            request = rpc._parse(stage_pb2.DataMessage, wire[0])
            assembler = codec.TensorAssembler(request.header.meta)
            assembler.add(request.data)
            return assembler.finish()
        assembler = codec.TensorAssembler(rpc._parse(stage_pb2.DataChunk, wire[0]).header.meta)
        for raw in wire[1:]:
            assembler.add(rpc._parse(stage_pb2.DataChunk, raw).data)
        return assembler.finish()

    assert torch.equal(receive(), payload)
    return median_seconds(serialize, repeats), median_seconds(receive, repeats)


# ---- report ---------------------------------------------------------------------------


def fmt_size(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def per_gb(carrier: Carrier, which: int, sizes: Sequence[int]) -> float:
    """Sum of ``usage[which]`` over ``sizes`` per GB moved."""
    total = sum(carrier.timed_bytes[s] for s in sizes)
    return sum(carrier.usage[s][which] for s in sizes) / (total / 1e9) if total else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per size and path")
    parser.add_argument(
        "--min-bytes",
        type=int,
        default=64 * MIB,
        help="bytes per timed repeat at least (small sizes send several messages)",
    )
    parser.add_argument(
        "--sizes",
        default="",
        help="comma-separated sizes in KiB (default 64,256,1024,4096,16384,32768,65536)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="1 repeat of >= 4 MiB at 64 KiB and 4 MiB"
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.min_bytes, args.sizes = 1, 4 * MIB, "64,4096"
    sizes = [int(s) * KIB for s in args.sizes.split(",")] if args.sizes else SIZES
    if args.repeats < 1 or any(s < 4 or s % 4 for s in sizes):
        parser.error("--repeats must be >= 1 and every size a multiple of 4 bytes")

    bench_started = time.perf_counter()
    load_before = os.getloadavg()
    print(
        f"sizes {', '.join(fmt_size(s) for s in sizes)}; {args.repeats} repeats of >= "
        f"{fmt_size(args.min_bytes)} per size and path; {os.cpu_count()} CPUs; torch "
        f"{torch.__version__}; load average {load_before[0]:.2f}",
        flush=True,
    )
    schedule = make_schedule(sizes, args.repeats, args.min_bytes)
    started = time.perf_counter()
    paths: list[Carrier] = []
    try:
        paths.append(DataPath())
        paths.append(DataPath(use_bulk=False, cluster=paths[0].cluster))
        paths.append(BareGrpcPath())
        paths.append(GlooPath(schedule))
        paths.append(TcpPath(schedule))
        print(f"processes started in {time.perf_counter() - started:.1f} s", flush=True)
        payloads = {s: torch.rand(s // 4) for s in sizes}
        for n, batch in enumerate(schedule):
            last = n + 1 == len(schedule) or schedule[n + 1].size != batch.size
            for path in paths:  # alternate the paths repeat by repeat
                path.run(batch, payloads[batch.size], last)
    finally:
        for path in reversed(paths):
            path.close()
    data, grpc_path, bare, gloo, tcp = paths
    assert isinstance(data, DataPath) and isinstance(grpc_path, DataPath)
    expected = sum(b.size * b.count for b in schedule)
    for p in (data, grpc_path):
        assert p.accepted_bytes == expected and p.verified == sizes
    load_after = os.getloadavg()

    print()
    print(f"throughput, GB/s (10^9 B/s), median of {args.repeats} repeats [min-max]")
    print(
        f"{'size':>8} {'msgs':>5} "
        + "".join(f"{p.name:>20}" for p in paths)
        + f"  {'data/gloo':>9} {'data/tcp':>8} {'data/bare':>9}"
    )
    table = []
    for s in sizes:
        cells = "".join(
            f"{p.median_gbps(s):.3f} [{min(p.gbps[s]):.2f}-{max(p.gbps[s]):.2f}]".rjust(20)
            for p in paths
        )
        ratios = {
            "gloo_ratio": data.median_gbps(s) / gloo.median_gbps(s),
            "tcp_ratio": data.median_gbps(s) / tcp.median_gbps(s),
            "bare_grpc_ratio": data.median_gbps(s) / bare.median_gbps(s),
            "grpc_path_gloo_ratio": grpc_path.median_gbps(s) / gloo.median_gbps(s),
        }
        count = max(1, math.ceil(args.min_bytes / s))
        print(
            f"{fmt_size(s):>8} {count:>5} {cells}  {ratios['gloo_ratio']:>9.2f}"
            f" {ratios['tcp_ratio']:>8.2f} {ratios['bare_grpc_ratio']:>9.2f}"
        )
        table.append(
            {
                "bytes": s,
                "data_path_gbps": round(data.median_gbps(s), 4),
                "grpc_path_gbps": round(grpc_path.median_gbps(s), 4),
                "bare_grpc_gbps": round(bare.median_gbps(s), 4),
                "gloo_gbps": round(gloo.median_gbps(s), 4),
                "tcp_gbps": round(tcp.median_gbps(s), 4),
                **{k: round(v, 4) for k, v in ratios.items()},
            }
        )

    fault_us = page_fault_us()
    print()
    print(
        "each side's whole process (/proc), per GB moved: CPU seconds (10 ms ticks) and "
        f"minor page faults (one costs {fault_us:.2f} us here: first touch of fresh memory)"
    )
    groups = [
        ("small", f"<= {fmt_size(codec.DEFAULT_CHUNK_BYTES)}", [s for s in sizes if s <= MIB]),
        ("large", f"> {fmt_size(codec.DEFAULT_CHUNK_BYTES)}", [s for s in sizes if s > MIB]),
    ]
    print(
        f"  {'path':<10} {'sizes':<9} {'CPU s send':>11} {'CPU s recv':>11} "
        f"{'faults send':>12} {'faults recv':>12}"
    )
    usage: dict[str, dict[str, float]] = {}
    what = ("sender_cpu_s", "receiver_cpu_s", "sender_faults", "receiver_faults")
    for p in paths:
        usage[p.name] = {}
        for key, label, group in groups:
            if not group:
                continue
            values = [per_gb(p, k, group) for k in range(4)]
            usage[p.name] |= {
                f"{w}_per_gb_{key}": round(v, 3) for w, v in zip(what, values, strict=True)
            }
            print(
                f"  {p.name:<10} {label:<9} {values[0]:>11.2f} {values[1]:>11.2f} "
                f"{values[2]:>12.0f} {values[3]:>12.0f}"
            )

    print()
    print(
        "gRPC path (no bulk channel), one message: measured; the sender's serialization and "
        "the receiver's parsing + assembly (the same code timed in this process, median of "
        "5); page faults of both processes during the timed repeats at the cost above; the "
        "same bytes over bare gRPC and TCP"
    )
    print(
        f"{'size':>8} {'measured':>9} {'serialize':>15} {'parse+assemble':>15}"
        f" {'page faults':>15} {'bare gRPC':>15} {'tcp':>8}"
    )
    shares = []
    for s in sizes:
        ser, deser = breakdown(s)
        total = statistics.median(grpc_path.per_message_s[s])
        faults = (grpc_path.usage[s][2] + grpc_path.usage[s][3]) / grpc_path.timed_messages[s]
        fault_s = faults * fault_us / 1e6
        grpc_only = statistics.median(bare.per_message_s[s])
        floor = statistics.median(tcp.per_message_s[s])
        cells = "".join(
            f" {1000 * v:>7.2f}ms {v / total:>5.0%}" for v in (ser, deser, fault_s, grpc_only)
        )
        print(f"{fmt_size(s):>8} {1000 * total:>7.2f}ms{cells} {1000 * floor:>6.2f}ms")
        shares.append(
            {
                "bytes": s,
                "ms_per_message": round(1000 * total, 3),
                "serialize_frac": round(ser / total, 3),
                "parse_assemble_frac": round(deser / total, 3),
                "page_faults_per_message": round(faults, 1),
                "page_fault_frac": round(fault_s / total, 3),
                "bare_grpc_frac": round(grpc_only / total, 3),
                "tcp_frac": round(floor / total, 3),
            }
        )
    print(
        "  (shares overlap: page faults happen inside serialization, parsing and gRPC; on a "
        "stream both ends work at once.) The Python layer copies the payload 4 times, each "
        "into fresh memory: tensor -> bytes (tobytes), -> protobuf wire bytes, wire -> the "
        "parsed message's bytes, -> the assembler's buffer; gRPC adds its own copies"
    )
    print(
        f"every timed and warm-up batch of the data path was taken out of the stage's mailbox "
        f"by an inference RunStep ({data.accepted_bytes / 1e9:.2f} GB in all), and the first "
        "micro-batch of each size came back bitwise equal (FetchOutput)"
    )
    print(
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after; "
        f"bench took {time.perf_counter() - bench_started:.0f} s"
    )

    def ratio(size: int) -> float | None:
        if size not in sizes:
            return None
        return round(data.median_gbps(size) / gloo.median_gbps(size), 4)

    figures = {
        "gloo_ratio_4mib": ratio(4 * MIB),
        "gloo_ratio_32mib": ratio(32 * MIB),
        "tcp_ratio_4mib": (
            round(data.median_gbps(4 * MIB) / tcp.median_gbps(4 * MIB), 4)
            if 4 * MIB in sizes
            else None
        ),
        "table": table,
        "usage_per_gb": usage,
        "page_fault_us": round(fault_us, 3),
        "data_path_time_shares": shares,
        "repeats": args.repeats,
        "min_bytes": args.min_bytes,
        "load_before": round(load_before[0], 2),
        "load_after": round(load_after[0], 2),
    }
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
