"""A clean stop is quick: on SIGTERM a coordinator and its stages exit in a fraction of a
second (``elasticpipe.cli.process``), so that closing a ``LocalCluster`` costs no test
seconds."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticpipe.local.cluster import LocalCluster

pytestmark = pytest.mark.timeout(120)

CLOSE_BOUND_S = 3.0  # was ~8 s: ~4 s of interpreter teardown per process, in turn


def test_a_cluster_without_a_job_closes_within_seconds(tmp_path: Path) -> None:
    """A ``LocalCluster`` of a coordinator and 2 stages, no job, closes within
    ``CLOSE_BOUND_S`` seconds, every process stopping cleanly: exit code 0 (not killed),
    its server stopped, and each stage said it leaves before it went."""
    cluster = LocalCluster(
        stages=2, coordinator_args=["--state", ":memory:"], log_dir=tmp_path
    ).start()
    started = time.monotonic()
    cluster.close()
    took = time.monotonic() - started
    assert took < CLOSE_BOUND_S, (took, cluster.logs())
    assert {name: p.returncode for name, p in cluster.procs.items()} == {
        "coordinator": 0,
        "stage-0": 0,
        "stage-1": 0,
    }
    for name in cluster.procs:
        log = (tmp_path / f"{name}.log").read_text()
        assert "server_stopped" in log, (name, log)
        if name != "coordinator":
            assert "stage_leaving" in log, (name, log)
