"""The cluster profiles the integration tests share: each a ``LocalCluster`` set-up spelled
once (its flags named here), exposed as fixtures by ``tests/integration/conftest.py``.

- ``quiet(n)``: n stages and an in-memory coordinator that moves nothing by itself (the
  tests move layers);
- ``fast(n)``: n stages and a coordinator with fast heartbeats that declares a silent stage
  dead after 2 s, and moves nothing by itself;
- ``failing(n)``: n stages that accept injected faults, with a short commit lease, and a
  coordinator with fast heartbeats that declares a silent stage dead after 2 s;
- ``set_partition``: a move of a cluster's job, as an operator asks for it;
- ``revive``: a killed stage of ``failing`` back under its name (a new incarnation);
  ``revive_exited``: every stage process that exited (after a test that failed before its
  own ``revive``, so that the next tests of the module do not fail for want of stages).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from elasticpipe.client.admin import Move
from elasticpipe.local.cluster import LocalCluster

# The coordinator that fails fast: heartbeats every 0.2 s, dead after 2 s silent, no moves.
FAST_OPTIONS: dict[str, Any] = {"heartbeat_s": 0.2, "dead_after_s": 2.0, "auto_rebalance": False}
FAST = ["--heartbeat-interval", "0.2", "--dead-after", "2", "--no-auto-rebalance"]  # as flags,
# for ``restart_coordinator``
# A replica mended after a loss takes its first option (a spare, else its survivors
# re-partitioned) unless another is predicted 10x faster: the tests that name the option
# must not see noise on a loaded machine pick another (the choice between options is
# unit-tested: tests/unit/test_replica_options.py).
FIRST_OPTION = ["--rebalance-threshold", "0.9"]
FAULTS: dict[str, Any] = {"fault_injection": True, "commit_lease_s": 5.0}  # a stage: faults
# armed by RPC, a commit lease of 5 s


def quiet(stages: int, **options: Any) -> LocalCluster:
    """``stages`` stage processes and an in-memory coordinator with auto-rebalance off."""
    return LocalCluster(stages=stages, state=":memory:", auto_rebalance=False, **options)


def fast(stages: int, **options: Any) -> LocalCluster:
    """``stages`` stage processes and a coordinator that declares a silent stage dead after
    2 s (``FAST_OPTIONS``); ``options`` add to them."""
    return LocalCluster(stages=stages, **{**FAST_OPTIONS, **options})


def failing(stages: int = 4, **options: Any) -> LocalCluster:
    """``stages`` stages that accept injected faults (a commit lease of 5 s) and a coordinator
    with fast heartbeats; the processes' logs are kept under $ELASTICPIPE_TEST_LOGS if set."""
    options.setdefault("log_dir", kept_logs())
    return fast(stages, **FAULTS, **options)


def kept_logs() -> str | None:
    """A folder of its own under $ELASTICPIPE_TEST_LOGS for one cluster's logs (None when
    unset): a cluster's processes reuse their names, and ``wait_for_log`` must read only its
    own cluster's lines. It is named after the test module that made the cluster."""
    root = os.environ.get("ELASTICPIPE_TEST_LOGS")
    if not root:
        return None
    current = os.environ.get("PYTEST_CURRENT_TEST", "cluster").split("::")[0]
    os.makedirs(root, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{Path(current).stem}-", dir=root)


def set_partition(cluster: LocalCluster, boundaries: list[int]) -> Move:
    """Moves the cluster's job to ``boundaries`` (as ``admin set-partition`` does) and returns
    the outcome; a move waits for its layers to be copied, up to two minutes."""
    with cluster.admin(timeout=120) as admin:
        return admin.set_partition(boundaries)


def revive(cluster: LocalCluster, *names: str) -> None:
    """Brings killed stages of a ``failing`` cluster back under their names (each a new
    incarnation, then a spare)."""
    for name in names:
        cluster.add_stage(name)


def revive_exited(cluster: LocalCluster) -> list[str]:
    """Brings back every stage process of ``cluster`` that has exited; returns their names."""
    exited = [
        name
        for name, proc in cluster.procs.items()
        if name not in cluster.coordinator_names and proc.poll() is not None
    ]
    revive(cluster, *exited)
    return exited
