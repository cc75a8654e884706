"""Real etcd members on loopback for the store tests (``elasticpipe.local.etcd``); a test
that needs one skips, saying why, where no etcd binary is installed."""

from __future__ import annotations

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

__all__ = ["EtcdCluster", "EtcdMember", "etcd_binary", "start_etcd", "start_etcd_cluster"]


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
