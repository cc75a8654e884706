"""The cluster profiles the integration tests share: each a ``LocalCluster`` set-up spelled
once (its flags named here), exposed as fixtures by ``tests/integration/conftest.py``.

- ``quiet(n)``: n stages and an in-memory coordinator that moves nothing by itself (the
  tests move layers);
- ``failing(n)``: n stages that accept injected faults, with a short commit lease, and a
  coordinator with fast heartbeats that declares a silent stage dead after 2 s;
- ``revive``: a killed stage of ``failing`` back under its name (a new incarnation).
"""

from __future__ import annotations

import os
from typing import Any

from elasticpipe.local.cluster import LocalCluster

QUIET = ["--state", ":memory:", "--no-auto-rebalance"]  # the coordinator: in memory, no moves
FAST = [  # the coordinator: heartbeats every 0.2 s, dead after 2 s silent, no moves
    "--heartbeat-interval",
    "0.2",
    "--dead-after",
    "2",
    "--no-auto-rebalance",
]
FAULTS = ["--enable-fault-injection", "--commit-lease", "5"]  # a stage: faults armed by RPC


def quiet(stages: int, **options: Any) -> LocalCluster:
    """``stages`` stage processes and an in-memory coordinator with auto-rebalance off."""
    return LocalCluster(stages=stages, coordinator_args=QUIET, **options)


def failing(stages: int = 4, **options: Any) -> LocalCluster:
    """``stages`` stages that accept injected faults (a commit lease of 5 s) and a coordinator
    with fast heartbeats; the processes' logs are kept in $ELASTICPIPE_TEST_LOGS if set."""
    options.setdefault("log_dir", os.environ.get("ELASTICPIPE_TEST_LOGS"))
    return LocalCluster(stages=stages, stage_args=FAULTS, coordinator_args=FAST, **options)


def revive(cluster: LocalCluster, *names: str) -> None:
    """Brings killed stages of a ``failing`` cluster back under their names (each a new
    incarnation, then a spare)."""
    for name in names:
        cluster.add_stage(name, FAULTS)
