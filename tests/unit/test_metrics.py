"""The metric definitions: the dashboard and the docs name only metrics the code exports,
the measured step time, and the HTTP endpoint."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from elasticpipe.errors import InvalidRequest
from elasticpipe.observe.metrics import (
    CoordinatorMetrics,
    CoordinatorView,
    MetricsEndpoint,
    StageMetrics,
    StageView,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "elasticpipe-dashboard.json"
DOCS = ROOT / "docs" / "metrics.md"
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gauge": ("",),
}


def _stage() -> StageMetrics:
    view = StageView(
        epoch=3,
        layer_lo=2,
        layer_hi=5,
        committed_step=7,
        mailbox_bytes=100,
        mailbox_entries=1,
        stashed_bytes=4096,
        stashed_micro_batches=2,
        slowdown=1.0,
        layer_seconds={(2, "forward"): 0.01, (2, "backward"): 0.02},
        device_memory=(1 << 20, 2 << 20),  # a CUDA stage: its device gauges too
    )
    return StageMetrics(lambda: view)


def _coordinator() -> CoordinatorMetrics:
    view = CoordinatorView(
        members={"chain": 3, "spare": 1}, epoch=4, chain_length=3, predicted_step_s=0.2
    )
    metrics = CoordinatorMetrics(lambda: view)
    metrics.heard(1, now=10.0)
    metrics.heard(3, now=11.0)
    metrics.efficiency_reported(3, 0.74)
    return metrics


def _families(registry: CollectorRegistry) -> dict[str, str]:
    """Every family the registry exports: name -> type."""
    return {f.name: f.type for f in registry.collect()}


def _exported() -> dict[str, str]:
    return {**_families(_stage().registry), **_families(_coordinator().registry)}


def _sample_names() -> set[str]:
    return {name + s for name, kind in _exported().items() for s in SUFFIXES[kind]}


def _expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]


def test_the_dashboard_queries_only_exported_metrics() -> None:
    """Every metric name in the dashboard's expressions is exported by the code."""
    used = {n for e in _expressions() for n in re.findall(r"\belasticpipe_\w+", e)}
    assert used, "the dashboard has no expressions"
    assert used <= _sample_names(), sorted(used - _sample_names())


def test_every_exported_metric_is_on_the_dashboard() -> None:
    """Each metric family appears in at least one panel."""
    text = " ".join(_expressions())
    missing = [name for name in _exported() if not re.search(rf"\b{name}(_\w+)?\b", text)]
    assert not missing


def test_the_documented_table_is_the_exported_metrics() -> None:
    """docs/metrics.md lists every family, with its type, and nothing else."""
    documented: dict[str, str] = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.fullmatch(r"`(elasticpipe_\w+)`", cells[0]) if len(cells) >= 3 else None
        if match:
            name = match.group(1)
            for suffix in ("_total",):
                name = name.removesuffix(suffix)
            documented[name] = cells[1]
    assert documented == _exported()


def test_names_follow_prometheus_conventions() -> None:
    """Component prefix; times in seconds and sizes in bytes say so in the name."""
    for name, kind in _exported().items():
        assert re.fullmatch(r"elasticpipe_(stage|coordinator)_[a-z_]+", name), name
        if "time" in name or "pause" in name:
            assert name.endswith("_seconds"), name
        if kind == "counter" and "bytes" in name:
            assert name.endswith("_bytes"), name  # exported as ..._bytes_total


def test_measured_step_time_is_seconds_per_committed_step() -> None:
    """Two heartbeats 1 s apart that saw steps 1 and 3: 0.5 s per step; a migration's
    pause does not count."""
    metrics = _coordinator()
    assert metrics.measured_step_s() == pytest.approx(0.5)
    metrics.heard(3, now=30.0)  # no progress: not a sample
    metrics.heard(4, now=12.0)
    assert metrics.measured_step_s() == pytest.approx(2.0 / 3.0)
    metrics.epoch_changed("move", 1000, 0.4)
    assert metrics.measured_step_s() is None
    samples = {
        s.name: s.value
        for f in metrics.registry.collect()
        for s in f.samples
        if not s.name.endswith("_created")
    }
    assert "elasticpipe_coordinator_measured_step_seconds" not in samples
    assert samples["elasticpipe_coordinator_predicted_step_seconds"] == 0.2  # the partition's
    metrics.decided("optimal", 0.25)
    samples = {s.name: s.value for f in metrics.registry.collect() for s in f.samples}
    assert samples["elasticpipe_coordinator_predicted_step_seconds"] == 0.25


@pytest.mark.timeout(20)
def test_the_endpoint_serves_its_registry_on_a_free_port() -> None:
    """Port 0 picks a free port; GET /metrics answers the text format of that registry
    only (two stages in one process do not mix)."""
    first, second = _stage(), _stage()
    first.ran(True, 0.5, [("forward", 0.1)])
    endpoint = MetricsEndpoint(first.registry, "127.0.0.1", 0)
    try:
        assert endpoint.port > 0
        url = f"http://127.0.0.1:{endpoint.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
    finally:
        endpoint.close()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("elasticpipe_stage_step_seconds_count", (("mode", "train"),))] == 1
    assert samples[("elasticpipe_stage_first_layer", ())] == 2
    assert samples[("elasticpipe_stage_last_layer", ())] == 4
    second_steps = [
        s for f in second.registry.collect() for s in f.samples if s.name.endswith("_count")
    ]
    assert not second_steps


@pytest.mark.parametrize("port", [-1, 70000])
def test_a_port_out_of_range_is_refused_by_value(port: int) -> None:
    with pytest.raises(InvalidRequest, match=f"metrics port {port}"):
        MetricsEndpoint(_stage().registry, "127.0.0.1", port)


def test_a_port_in_use_is_refused_by_value() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(InvalidRequest, match=f"cannot serve metrics on 127.0.0.1 port {port}"):
            MetricsEndpoint(_stage().registry, "127.0.0.1", port)


@pytest.mark.timeout(30)
def test_a_reply_stream_its_caller_abandons_counts_as_cancelled_or_deadline_not_unknown() -> None:
    """A server-streaming call the caller cancels after one reply, and one whose deadline
    passes mid-stream, count as CANCELLED and DEADLINE_EXCEEDED (gRPC sets no code for
    either: they used to count as UNKNOWN, with nothing logged)."""
    stage = _stage()

    def replies(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in range(100):
            yield b"chunk"
            time.sleep(0.05)

    handler = grpc.method_handlers_generic_handler(
        "elasticpipe.v1.StageService",
        {"ExportLayers": grpc.unary_stream_rpc_method_handler(replies)},
    )
    server = grpc.server(futures.ThreadPoolExecutor(2), interceptors=[stage.interceptor()])
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            export = channel.unary_stream("/elasticpipe.v1.StageService/ExportLayers")
            cancelled = export(b"", timeout=10)
            next(cancelled)
            cancelled.cancel()
            with pytest.raises(grpc.RpcError) as late:
                list(export(b"", timeout=0.3))
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 10

        def counted() -> dict[str, float]:
            return {
                s.labels["code"]: s.value
                for f in stage.registry.collect()
                for s in f.samples
                if s.name == "elasticpipe_stage_rpc_errors_total"
            }

        while len(counted()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server notices each caller's departure on its own
    finally:
        server.stop(0)
    assert counted() == {"CANCELLED": 1.0, "DEADLINE_EXCEEDED": 1.0}
