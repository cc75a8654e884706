"""``elasticpipe.local.etcd`` on a real etcd binary: a port taken between picking it and
the member binding it (another process's) makes the start try again on other ports."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticpipe.local import etcd as local_etcd
from tests.support.etcd import start_etcd_cluster

pytestmark = pytest.mark.timeout(60)


def test_a_port_taken_meanwhile_is_retried_on_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    taken = busy.getsockname()[1]
    real = local_etcd.free_port

    def ports() -> Iterator[int]:
        yield taken  # the first member's client port: another process holds it
        while True:
            yield real()

    handed = ports()
    monkeypatch.setattr(local_etcd, "free_port", lambda: next(handed))
    try:
        cluster = start_etcd_cluster(tmp_path / "etcd", 1)
        try:
            assert cluster.members[0].client_port != taken
            assert (tmp_path / "etcd" / "try-1").is_dir()  # the second try
        finally:
            cluster.stop()
    finally:
        busy.close()
