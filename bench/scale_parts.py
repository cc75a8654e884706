"""What ``bench/scale.py`` runs beside its measurements: the fake stages' child processes
(``fakes_main``, ``Fakes``), the coordinator's admin and probe calls, the phase timer, and
small helpers (process CPU and threads, quantiles, log events)."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, as scale.py

from fake_stage import (  # bench/fake_stage.py, next to this script
    WIDTH,
    Counters,
    FakeStage,
    describe,
)
from shared.cpu import process_cpu_s  # bench/shared/, beside this script

from elasticpipe.errors import ElasticPipeError
from elasticpipe.transport import rpc
from elasticpipe.v1 import coordinator_pb2, coordinator_pb2_grpc


def model_kwargs(stages: int) -> dict[str, Any]:
    """An mlp of 4S+1 layers (2S+1 Linear, 2S ReLU): ~4 layers per stage."""
    return {"sizes": [WIDTH] * (2 * stages + 2)}


def fakes_main(conn: Connection, coordinator: str, first: int, end: int, chain: int) -> None:
    """A fake stages' process: serves fakes ``first`` to ``end - 1`` of a job of ``chain``
    stages; answers the bench's commands."""
    torch.set_num_threads(1)
    describe("mlp", json.dumps(model_kwargs(chain), sort_keys=True))  # as JobConfig sends it
    counters = Counters()
    stop = threading.Event()
    threading.Thread(target=counters.watch, args=(stop,), name="watch", daemon=True).start()
    fakes = [FakeStage(f"fake-{i:03d}", i, coordinator, counters) for i in range(first, end)]
    started = time.perf_counter()
    for fake in fakes:
        fake.serve()
    conn.send({"serve_s": time.perf_counter() - started})
    try:
        while True:
            command = conn.recv()
            if command == "register":
                started = time.perf_counter()
                for fake in fakes:
                    fake.join_cluster()
                ok = all(
                    f.registered.wait(max(0.0, 120 - time.perf_counter() + started)) for f in fakes
                )
                conn.send({"ok": ok, "wall_s": time.perf_counter() - started, **counters.take()})
            elif command == "counters":
                conn.send(counters.take())
            elif command == "stop":
                break
    finally:
        stop.set()
        for fake in fakes:
            fake.stop()
        conn.send("stopped")


# ---- the bench (this process: the client and the measurements) ------------------------


def process_threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


class Fakes:
    """The fake stages, in processes of at most ``per_process`` fakes each: one process
    serving hundreds of gRPC servers on one GIL would measure its own thread convoys (a
    real stage serves on its own host). Commands go to every process; answers are merged."""

    def __init__(self, coordinator: str, count: int, chain: int, per_process: int):
        ctx = mp.get_context("spawn")
        self.groups: list[tuple[Connection, Any]] = []
        for first in range(0, count, per_process):
            conn, child = ctx.Pipe()
            end = min(count, first + per_process)
            proc = ctx.Process(
                target=fakes_main, args=(child, coordinator, first, end, chain), daemon=True
            )
            proc.start()
            self.groups.append((conn, proc))

    @property
    def processes(self) -> int:
        return len(self.groups)

    def cpu_s(self) -> float:
        """CPU seconds of every fakes' process so far."""
        return sum(process_cpu_s(proc.pid) for _, proc in self.groups)

    def receive(self, timeout: float) -> dict[str, Any]:
        """Every process's next answer, merged."""
        return merge_answers([receive(conn, proc, timeout) for conn, proc in self.groups])

    def ask(self, command: str, timeout: float) -> dict[str, Any]:
        for conn, _ in self.groups:
            conn.send(command)
        return self.receive(timeout)

    def alive(self) -> bool:
        return all(proc.is_alive() for _, proc in self.groups)

    def stop(self) -> None:
        for conn, proc in self.groups:
            if proc.is_alive():
                try:
                    conn.send("stop")
                    receive(conn, proc, 60)
                except (RuntimeError, TimeoutError, EOFError, OSError):
                    proc.kill()
            proc.join(timeout=10)


def merge_answers(answers: Sequence[Any]) -> dict[str, Any]:
    """The processes' answers as one: counts and lists added, flags and-ed, the rest the
    largest (gaps, lags, wall times)."""
    out: dict[str, Any] = {}
    for answer in answers:
        if not isinstance(answer, dict):
            continue
        for key, value in answer.items():
            if key not in out:
                out[key] = list(value) if isinstance(value, list) else value
                if isinstance(value, dict):
                    out[key] = Counter(value)
            elif isinstance(value, bool):
                out[key] = out[key] and value
            elif isinstance(value, list):
                out[key] += value
            elif isinstance(value, dict):
                out[key].update(value)
            elif key in ("heartbeats", "reregistered", "dead"):
                out[key] += value
            else:
                out[key] = max(out[key], value)
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in out.items()}


def receive(conn: Connection, proc: Any, timeout: float) -> Any:
    """The fakes' next answer, or an error if they died or took longer than ``timeout``."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"the fake stages' process exited with code {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the fake stages did not answer within {timeout:.0f}s")
    return conn.recv()


def quantile(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def shifted(boundaries: Sequence[int]) -> list[int]:
    """Every interior boundary one layer later (or earlier where that is not possible)."""
    b = list(boundaries)
    for step in (1, -1):
        new = [b[0], *(x + step for x in b[1:-1]), b[-1]]
        if all(new[i] < new[i + 1] for i in range(len(new) - 1)):
            return new
    new = list(b)  # fall back: move the first cut that can move
    for i in range(1, len(b) - 1):
        if b[i] + 1 < b[i + 1]:
            new[i] += 1
            return new
    raise ValueError(f"no layer can move in {b}")


def coordinator_log_events(path: Path) -> Counter[str]:
    """Warnings and errors the coordinator logged, by event name."""
    events: Counter[str] = Counter()
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"\[(warning|error|critical)\s*\]\s+(\S+)", line)
            if m:
                events[f"{m.group(1)}: {m.group(2)}"] += 1
    return events


class Probe:
    """Asks the coordinator a cheap question every ``interval`` s from this process (a
    ``Heartbeat`` of an unknown stage id: the membership lock and a reply, nothing else)
    and keeps the latencies, so that a stalled coordinator shows apart from stalled fakes."""

    def __init__(self, address: str, interval: float = 0.2):
        self.address = address
        self.channel = rpc.channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        self.interval = interval
        self.samples: list[tuple[float, float]] = []  # (monotonic time sent, latency)
        self.pending_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        request = coordinator_pb2.HeartbeatRequest(stage_id="bench-probe")
        while not self._stop.wait(self.interval):
            sent = self.pending_since = time.monotonic()
            with contextlib.suppress(ElasticPipeError):
                rpc.call(self.address, self.stub.Heartbeat, request, timeout=30.0)
            self.pending_since = None
            self.samples.append((sent, time.monotonic() - sent))

    def worst(self, since: float, until: float) -> float:
        """The largest latency of a probe sent in [since, until], counting one still
        unanswered with its wait so far."""
        worst = max((lat for t, lat in self.samples if since <= t <= until), default=0.0)
        pending = self.pending_since
        return max(worst, until - pending) if pending is not None else worst

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=35)
        self.channel.close()


class Phases:
    """Times the bench's phases, with the probe's worst latency and the fakes' deaths in
    each."""

    def __init__(self, out: dict[str, Any], probe: Probe, counters: Any, since: Any):
        self.out, self.probe, self.counters, self.since = out, probe, counters, since
        self.out["phases"] = {}
        self._last = counters()
        since()

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            now = self.counters()
            seen = self.since()
            self.out["phases"][name] = {
                "s": round(time.monotonic() - started, 3),
                "coordinator_probe_max_ms": round(
                    1000 * self.probe.worst(started, time.monotonic()), 1
                ),
                "fakes_declared_dead": now["dead"] - self._last["dead"],
                "fakes_reregistered": now["reregistered"] - self._last["reregistered"],
                "fakes_max_lag_ms": round(1000 * seen["max_lag"], 1),
                "fakes_rpcs": seen["calls"],
            }
            self._last = now
