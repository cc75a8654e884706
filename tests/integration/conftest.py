"""Shared fixtures: real clusters of real processes on loopback, and in-process servers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.server import CoordinatorServer
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig


@pytest.fixture(scope="module")
def cluster4() -> Iterator[LocalCluster]:
    """Four stage processes and a coordinator (auto-rebalance off: tests move layers)."""
    with LocalCluster(
        stages=4, coordinator_args=["--state", ":memory:", "--no-auto-rebalance"]
    ) as cluster:
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
    servers = [
        StageServer(
            StageConfig(name=f"s{i}", max_tensor_bytes=1 << 20, enable_fault_injection=True),
            coordinator_server.address,
        ).start()
        for i in range(2)
    ]
    for server in servers:
        assert server.registered.wait(10), "stage did not register"
    yield servers
    for server in servers:
        server.stop()


def as_at_a_terminal(command: list[str]) -> list[str]:
    """``python -m MODULE ARGS`` that a test will stop with Ctrl-C (SIGINT), run with SIGINT
    handled as at a terminal: a suite started in the background of a non-interactive shell
    runs with SIGINT ignored, children inherit that, and Python then installs no handler."""
    python, flag, module, *args = command
    assert flag == "-m", command
    code = (
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"sys.argv[0] = {module!r}; runpy.run_module({module!r}, run_name='__main__', "
        "alter_sys=True)"
    )
    return [python, "-c", code, *args]
