"""The four ways of moving a tensor that ``bench/transfer.py`` compares, and their receivers.

* ``DataPath``: a stage ``Link``'s ``sending.Sender`` into a real stage server process that
  holds a job (with the bulk channel, or over gRPC alone);
* ``BareGrpcPath``: the same bytes through grpcio to a child that only drains them;
* ``GlooPath``: ``torch.distributed`` send/recv to a child over loopback;
* ``TcpPath``: ``socket.sendall`` to a child that ``recv_into``'s a preallocated buffer.

Each ``Carrier`` sends a ``Batch`` of messages one at a time, waiting for each to be held by
the receiver, and records GB/s, time per message, CPU seconds and page faults of both sides.
"""

from __future__ import annotations

import itertools
import math
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as `python bench/transfer.py`

from elasticpipe.local.cluster import LocalCluster
from elasticpipe.partition import Placement
from elasticpipe.security import bounds
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc, sending
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import codec

KIB, MIB = 1 << 10, 1 << 20
SIZES = [64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 32 * MIB, 64 * MIB]
EPOCH = 7  # any epoch: the stage is assigned at it and every message carries it
JOB = JobConfig(
    model="mlp",
    model_kwargs={"sizes": [4, 4, 4]},  # Linear, ReLU, Linear: the stage owns the ReLU
    optimizer="sgd",
    optimizer_kwargs={"lr": 0.1},
    loss="mse",
    job_id="transfer-bench",
    snapshot_every=0,
)
SEND_TIMEOUT_S = 60.0
CONSUME_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Batch:
    """Messages of one size sent back to back (one timed repeat, or the warm-up)."""

    size: int
    count: int
    repeat: int  # -1: warm-up


def make_schedule(sizes: Sequence[int], repeats: int, min_bytes: int) -> list[Batch]:
    """Every batch in order: per size a warm-up batch, then the repeats."""
    out = []
    for size in sizes:
        count = max(1, math.ceil(min_bytes / size))
        out.append(Batch(size, min(count, 4), -1))
        out += [Batch(size, count, r) for r in range(repeats)]
    return out


def process_stat(pid: int) -> tuple[float, int]:
    """User + system CPU seconds and minor page faults of process ``pid`` so far, all its
    threads (Linux /proc; CPU in 10 ms ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), int(fields[7])


def page_fault_us(megabytes: int = 64) -> float:
    """Microseconds one minor page fault costs here: first touch of fresh memory, against
    touching the same memory again."""
    n = megabytes * MIB
    pages = n // 4096
    ones = b"\1" * pages
    best = math.inf
    for _ in range(3):
        _, f0 = process_stat(os.getpid())
        started = time.perf_counter()
        buffer = bytearray(n)  # calloc: the pages are mapped on first touch
        buffer[::4096] = ones
        fresh = time.perf_counter() - started
        _, f1 = process_stat(os.getpid())
        started = time.perf_counter()
        buffer[::4096] = ones
        again = time.perf_counter() - started
        del buffer
        best = min(best, (fresh - again) / max(f1 - f0, 1))
    return 1e6 * best


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- receivers (child processes) ------------------------------------------------------


def tcp_receiver(conn: Connection, schedule: list[Batch]) -> None:
    """Accepts one connection; receives every message of the schedule, acking each."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        conn.send(server.getsockname()[1])
        sock, _ = server.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buffer = bytearray(max(b.size for b in schedule))
    view = memoryview(buffer)
    with sock:
        for batch in schedule:
            for _ in range(batch.count):
                got = 0
                while got < batch.size:
                    n = sock.recv_into(view[got : batch.size])
                    if n == 0:
                        raise ConnectionError("sender went away")
                    got += n
                sock.sendall(b"\x01")


def grpc_sink(conn: Connection) -> None:
    """A bare gRPC server (the project's server options, no protobuf, no stage): a unary
    method and a client-streaming one that take bytes and answer empty bytes."""
    from concurrent import futures

    import grpc

    def unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    def stream(requests: Any, context: grpc.ServicerContext) -> bytes:
        for _ in requests:
            pass
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=32), options=rpc.server_options())
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Sink",
                {
                    "Unary": grpc.unary_unary_rpc_method_handler(unary),
                    "Stream": grpc.stream_unary_rpc_method_handler(stream),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    conn.send(port)
    conn.recv()  # until the parent is done
    server.stop(1.0).wait(2.0)


def gloo_receiver(port: int, schedule: list[Batch]) -> None:
    """Rank 1: receives every message of the schedule into a preallocated tensor, acking each."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    buffer = torch.empty(max(b.size for b in schedule), dtype=torch.uint8)
    ack = torch.ones(1, dtype=torch.uint8)
    for batch in schedule:
        target = buffer[: batch.size]
        for _ in range(batch.count):
            dist.recv(target, src=0)
            dist.send(ack, dst=0)
    dist.barrier()
    dist.destroy_process_group()


# ---- senders (this process) -----------------------------------------------------------


@dataclass
class Carrier:
    """One way of moving tensors, with what it measured."""

    name: str
    receiver_pid: int = 0
    gbps: dict[int, list[float]] = field(default_factory=dict)  # size -> per repeat
    per_message_s: dict[int, list[float]] = field(default_factory=dict)
    # size -> summed over the timed repeats: [sender CPU s, receiver CPU s,
    #                                          sender page faults, receiver page faults]
    usage: dict[int, list[float]] = field(default_factory=dict)
    timed_bytes: dict[int, int] = field(default_factory=dict)
    timed_messages: dict[int, int] = field(default_factory=dict)

    def send_batch(self, batch: Batch, payload: torch.Tensor) -> None:
        raise NotImplementedError

    def after_batch(self, batch: Batch, payload: torch.Tensor, last_of_size: bool) -> None:
        """Untimed work after a batch (the data path's check that the stage took it)."""

    def run(self, batch: Batch, payload: torch.Tensor, last_of_size: bool) -> None:
        before = (*process_stat(os.getpid()), *process_stat(self.receiver_pid))
        started = time.perf_counter()
        self.send_batch(batch, payload)
        elapsed = time.perf_counter() - started
        after = (*process_stat(os.getpid()), *process_stat(self.receiver_pid))
        if batch.repeat >= 0:
            nbytes = batch.size * batch.count
            self.gbps.setdefault(batch.size, []).append(nbytes / elapsed / 1e9)
            self.per_message_s.setdefault(batch.size, []).append(elapsed / batch.count)
            used = [b - a for a, b in zip(before, after, strict=True)]
            usage = self.usage.setdefault(batch.size, [0.0] * 4)
            for k, v in enumerate((used[0], used[2], used[1], used[3])):
                usage[k] += v
            self.timed_bytes[batch.size] = self.timed_bytes.get(batch.size, 0) + nbytes
            self.timed_messages[batch.size] = self.timed_messages.get(batch.size, 0) + batch.count
        self.after_batch(batch, payload, last_of_size)

    def median_gbps(self, size: int) -> float:
        return statistics.median(self.gbps[size])

    def close(self) -> None:
        """Stops what the path started."""


RUN_IDS = itertools.count(1)
SECRET = secrets.token_bytes(bounds.RUN_SECRET_BYTES)  # the runs' (RunStepRequest.secret)


class DataPath(Carrier):
    """A ``Link``'s ``sending.Sender`` into a real stage server process holding a job:
    with the bulk channel (the data path), or over gRPC alone (``--no-bulk``'s path)."""

    def __init__(self, use_bulk: bool = True, cluster: LocalCluster | None = None) -> None:
        super().__init__("data path" if use_bulk else "gRPC path")
        self.owns_cluster = cluster is None
        self.cluster = cluster or LocalCluster(stages=1, state=":memory:", auto_rebalance=False)
        if self.owns_cluster:
            self.cluster.start()
        self.address = self.cluster.stage_addresses[0]
        self.receiver_pid = self.cluster.procs["stage-0"].pid
        self.channel = rpc.channel(self.address)  # as a Link opens it
        self.stub = stage_pb2_grpc.StageServiceStub(self.channel)
        self.sender = sending.Sender(self.stub, self.address, use_bulk=use_bulk)
        placement = Placement(epoch=EPOCH, index=1, num_stages=2, lo=1, hi=2)
        reply = rpc.call(
            self.address,
            self.stub.Assign,
            stage_pb2.AssignRequest(job=JOB.to_proto(), assignment=placement.to_proto()),
            timeout=60.0,
        )
        assert reply.num_layers == 1, reply
        self.run_id = 0
        self.accepted_bytes = 0  # taken out of the stage's mailbox by a RunStep
        self.verified: list[int] = []

    def send_batch(self, batch: Batch, payload: torch.Tensor) -> None:
        self.run_id = next(RUN_IDS)  # one stage, two paths: run ids never repeat
        for i in range(batch.count):
            self.sender.send(
                sending.Outgoing("Forward", EPOCH, self.run_id, 0, i, payload, secret=SECRET),
                SEND_TIMEOUT_S,
            )

    def after_batch(self, batch: Batch, payload: torch.Tensor, last_of_size: bool) -> None:
        report = rpc.call(
            self.address,
            self.stub.RunStep,
            stage_pb2.RunStepRequest(
                epoch=EPOCH,
                run=self.run_id,
                step=0,
                micro_batches=batch.count,
                mode=stage_pb2.INFER,
                timeout_s=CONSUME_TIMEOUT_S,
                secret=SECRET,
            ),
            timeout=CONSUME_TIMEOUT_S + 5.0,
        )
        assert report.run == self.run_id, report
        self.accepted_bytes += batch.size * batch.count
        if last_of_size:
            stream = self.stub.FetchOutput(
                stage_pb2.FetchOutputRequest(run=self.run_id, micro_batch=0, secret=SECRET),
                timeout=SEND_TIMEOUT_S,
            )
            header = next(stream).header
            assembler = codec.TensorAssembler(header.meta)
            for chunk in stream:
                assembler.add(chunk.data)
            if not torch.equal(assembler.finish(), payload):
                raise AssertionError(f"the stage holds other bytes than sent ({batch.size} B)")
            self.verified.append(batch.size)

    def close(self) -> None:
        self.sender.close()
        self.channel.close()
        if self.owns_cluster:
            self.cluster.close()


class BareGrpcPath(Carrier):
    """The same bytes through bare gRPC (same options and 1 MiB chunking, prebuilt payload
    bytes, no protobuf, no stage) to a child process: gRPC's own share of the data path."""

    def __init__(self) -> None:
        super().__init__("bare gRPC")
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=grpc_sink, args=(child,), daemon=True)
        self.proc.start()
        assert self.proc.pid is not None
        self.receiver_pid = self.proc.pid
        address = f"127.0.0.1:{self.conn.recv()}"
        self.channel = rpc.channel(address)
        self.unary = self.channel.unary_unary("/bench.Sink/Unary")
        self.stream = self.channel.stream_unary("/bench.Sink/Stream")
        self.wire: dict[int, list[bytes]] = {}

    def send_batch(self, batch: Batch, payload: torch.Tensor) -> None:
        chunks = self.wire.get(batch.size)
        if chunks is None:
            _, pieces = codec.tensor_chunks(payload)
            chunks = self.wire[batch.size] = list(pieces)
        for _ in range(batch.count):
            if len(chunks) == 1:
                self.unary(chunks[0], timeout=SEND_TIMEOUT_S)
            else:
                self.stream(iter(chunks), timeout=SEND_TIMEOUT_S)

    def close(self) -> None:
        self.channel.close()
        self.conn.send("stop")
        self.proc.join(timeout=30)


class GlooPath(Carrier):
    """``torch.distributed`` gloo send/recv to a child process."""

    def __init__(self, schedule: list[Batch]) -> None:
        import torch.distributed as dist

        super().__init__("gloo")
        self.dist = dist
        port = free_port()
        self.proc = mp.get_context("spawn").Process(
            target=gloo_receiver, args=(port, schedule), daemon=True
        )
        self.proc.start()
        assert self.proc.pid is not None
        self.receiver_pid = self.proc.pid
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        self.ack = torch.zeros(1, dtype=torch.uint8)

    def send_batch(self, batch: Batch, payload: torch.Tensor) -> None:
        raw = payload.view(torch.uint8)
        for _ in range(batch.count):
            self.dist.send(raw, dst=1)
            self.dist.recv(self.ack, src=1)

    def close(self) -> None:
        self.dist.barrier()
        self.dist.destroy_process_group()
        self.proc.join(timeout=30)


class TcpPath(Carrier):
    """``sendall`` over a loopback TCP socket to a child process."""

    def __init__(self, schedule: list[Batch]) -> None:
        super().__init__("tcp")
        parent, child = mp.get_context("spawn").Pipe()
        self.proc = mp.get_context("spawn").Process(
            target=tcp_receiver, args=(child, schedule), daemon=True
        )
        self.proc.start()
        assert self.proc.pid is not None
        self.receiver_pid = self.proc.pid
        port = parent.recv()
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.ack = bytearray(1)

    def send_batch(self, batch: Batch, payload: torch.Tensor) -> None:
        raw = memoryview(payload.view(torch.uint8).numpy())
        for _ in range(batch.count):
            self.sock.sendall(raw)
            if self.sock.recv_into(self.ack, 1) != 1:
                raise ConnectionError("receiver went away")

    def close(self) -> None:
        self.sock.close()
        self.proc.join(timeout=30)
