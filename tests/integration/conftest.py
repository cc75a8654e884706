"""Shared fixtures: real clusters of real processes on loopback (the profiles of
``tests/support/clusters.py``), and in-process servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from tests.support import clusters, servers


@pytest.fixture(scope="module")
def cluster4() -> Iterator[LocalCluster]:
    """Four stage processes and a coordinator (auto-rebalance off: tests move layers)."""
    with clusters.quiet(4) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def failing4() -> Iterator[LocalCluster]:
    """Three chain stages and a spare that accept injected faults, and a coordinator with
    fast heartbeats (one per test module: a test that kills a stage revives it)."""
    with clusters.failing(4) as cluster:
        yield cluster


@pytest.fixture
def coordinator_server() -> Iterator[CoordinatorServer]:
    """An in-process coordinator on 127.0.0.1:0."""
    from elasticpipe.coordinator.planning.policy import PolicyConfig

    with CoordinatorServer(
        CoordinatorConfig(policy=PolicyConfig(enabled=False), heartbeat_interval_s=0.2)
    ) as c:
        yield c


@pytest.fixture
def stage_servers(coordinator_server: CoordinatorServer) -> Iterator[list[StageServer]]:
    """Two in-process stage servers registered with ``coordinator_server``."""
    configs = [
        StageConfig(name=f"s{i}", max_tensor_bytes=1 << 20, enable_fault_injection=True)
        for i in range(2)
    ]
    with servers.stage_servers(coordinator_server.address, configs) as started:
        yield started
