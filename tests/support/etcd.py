"""Real etcd members on loopback for the store tests (``elasticpipe.local.etcd``); a test
that needs one skips, saying why, where no etcd binary is installed."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from elasticpipe.coordinator.store.etcd import EtcdTLS
from elasticpipe.local.etcd import (
    NO_ETCD,
    EtcdCluster,
    EtcdMember,
    etcd_binary,
)
from elasticpipe.local.etcd import start_etcd_cluster as _start_cluster

__all__ = [
    "EtcdCluster",
    "EtcdMember",
    "etcd_binary",
    "lead_elsewhere",
    "start_etcd",
    "start_etcd_cluster",
]


def start_etcd_cluster(
    data_dir: Path, size: int = 3, timeout_s: float = 30.0, tls: EtcdTLS | None = None
) -> EtcdCluster:
    """An etcd cluster of ``size`` members on loopback (skips without an etcd binary)."""
    if etcd_binary() is None:
        pytest.skip(NO_ETCD)
    return _start_cluster(data_dir, size, timeout_s, tls)


def start_etcd(data_dir: Path, timeout_s: float = 20.0) -> EtcdMember:
    """A one-member etcd cluster in ``data_dir`` (skips without an etcd binary)."""
    return start_etcd_cluster(data_dir, 1, timeout_s).members[0]


def lead_elsewhere(cluster: EtcdCluster, index: int, timeout_s: float = 20.0) -> None:
    """Moves etcd's leadership off member ``index`` if it holds it (``etcdctl
    move-leader``), so that stopping that member costs etcd no election: losing the etcd
    leader stops every write and lease renewal until the others elect one, and on a loaded
    host that can outlast a coordinator's lease (which a test of a follower's loss must
    not depend on)."""
    binary = etcd_binary()
    assert binary is not None
    ctl = str(Path(binary).with_name("etcdctl"))
    endpoints = ",".join(m.endpoint for m in cluster.members)
    deadline = time.monotonic() + timeout_s
    while True:
        found = json.loads(
            subprocess.run(
                [ctl, f"--endpoints={endpoints}", "endpoint", "status", "-w", "json"],
                capture_output=True,
                check=True,
                timeout=timeout_s,
            ).stdout
        )
        ids = {entry["Endpoint"]: entry["Status"]["header"]["member_id"] for entry in found}
        leader = found[0]["Status"]["leader"]
        mine = ids[cluster.members[index].endpoint]
        if leader != mine:
            return
        other = next(i for e, i in ids.items() if i != mine)
        subprocess.run(
            [ctl, f"--endpoints={cluster.members[index].endpoint}", "move-leader", f"{other:x}"],
            capture_output=True,
            check=True,
            timeout=timeout_s,
        )
        assert time.monotonic() < deadline, "etcd's leadership did not move"
        time.sleep(0.2)
