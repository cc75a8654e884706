"""Several "hosts" for real: the coordinator, three stages and the client each run in a
network namespace of their own, joined by veth pairs on a bridge, each with its own IP.
Nothing is on loopback: a stage that registered or dialled 127.0.0.1 would reach nothing.

The stages listen on 0.0.0.0 (all on the same port, which only separate hosts allow) and
advertise their namespace's address three ways: ``--advertise`` given; not given, with a
default route; not given, without one (the only interface address). Every connection is
mutual TLS, the certificates naming each host's IP (one of them a family certificate,
``host-*``, as the pods of a StatefulSet share). The client trains, moves every
layer to another host mid-run, and must equal single-process training.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from elasticpipe.security import tls

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
SUBNET = "10.77.0"
COORDINATOR_IP = f"{SUBNET}.1"
STAGE_IPS = [f"{SUBNET}.11", f"{SUBNET}.12", f"{SUBNET}.13"]
CLIENT_IP = f"{SUBNET}.100"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"epprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        return f"cannot create a network namespace (root needed): {stderr.decode().strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Hosts:
    """Network namespaces on one bridge; each is a host with one address."""

    tag: str = field(default_factory=lambda: f"ep{os.getpid() % 100000}")
    names: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    def up(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")

    def add(self, host: str, address: str, default_route: bool = False) -> str:
        """A namespace ``TAG-host`` holding ``address``/24 on a veth to the bridge."""
        ns, outer, inner = f"{self.tag}-{host}", f"{self.tag}{host}o", f"{self.tag}{host}i"
        _ip("netns", "add", ns)
        self.names.append(ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        if default_route:
            _ip("-n", ns, "route", "add", "default", "dev", inner)
        return ns

    def spawn(self, ns: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, sys.executable, "-m", "elasticpipe", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_NUM_THREADS": "1", "ELASTICPIPE_TORCH_THREADS": "1"},
            )
        self.procs.append(proc)
        return proc

    def down(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait(10)
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], check=False, capture_output=True)


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    why = _netns_unavailable()
    if why is not None:
        pytest.skip(why)
    net = Hosts()
    try:
        net.up()
        yield net
    finally:
        net.down()


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text(errors="replace") if log.exists() else ""
        for line in content.splitlines():
            if text in line:
                return line
        assert proc.poll() is None, f"exited {proc.returncode}:\n{content[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {log} after {timeout}s:\n{content[-3000:]}")


def test_training_across_namespaced_hosts_with_a_live_migration(
    hosts: Hosts, tmp_path: Path
) -> None:
    """Stages on three hosts advertise their own addresses (given, from the default
    route, from the only interface); the client on a fourth trains with mutual TLS, moves
    every layer to another host and equals single-process training."""
    certs = tmp_path / "certs"
    tls.init_ca(certs)
    tls.issue(certs, "coordinator", "coordinator", hosts=(COORDINATOR_IP,))
    for i, address in enumerate(STAGE_IPS[:2]):
        tls.issue(certs, f"host-{i}", "stage", hosts=(address,))
    # the third stage holds a family certificate, as a StatefulSet's pods share one
    tls.issue(certs, "host-*", "stage", hosts=(STAGE_IPS[2],), file_name="host-2")
    tls.issue(certs, "client", "client")
    tls.issue(certs, "admin", "admin")

    def flags(name: str) -> list[str]:
        return [
            "--tls-cert",
            str(certs / f"{name}.pem"),
            "--tls-key",
            str(certs / f"{name}.key"),
            "--tls-ca",
            str(certs / "ca.pem"),
        ]

    coordinator = f"{COORDINATOR_IP}:7100"
    ns = hosts.add("coord", COORDINATOR_IP)
    log = tmp_path / "coordinator.log"
    proc = hosts.spawn(
        ns,
        [
            "coordinator",
            "--listen",
            "0.0.0.0:7100",
            "--state",
            str(tmp_path / "coordinator.sqlite"),
            "--no-auto-rebalance",
            *flags("coordinator"),
        ],
        log,
    )
    listening = _wait_for(log, "coordinator_listening", proc)
    assert f"address={coordinator}" in listening, listening  # the interface's, not loopback

    advertise = [["--advertise", f"{STAGE_IPS[0]}:7200"], [], []]
    stage_logs = []
    for i, address in enumerate(STAGE_IPS):
        ns = hosts.add(f"s{i}", address, default_route=i == 1)
        log = tmp_path / f"host-{i}.log"
        proc = hosts.spawn(
            ns,
            [
                "stage",
                "--coordinator",
                coordinator,
                "--listen",
                "0.0.0.0:7200",
                "--name",
                f"host-{i}",
                *advertise[i],
                *flags(f"host-{i}"),
            ],
            log,
        )
        stage_logs.append((log, proc))
    for i, (log, proc) in enumerate(stage_logs):
        _wait_for(log, "stage_registered", proc)
        listening = _wait_for(log, "stage_listening", proc)
        assert f"address={STAGE_IPS[i]}:7200" in listening, listening

    ns = hosts.add("client", CLIENT_IP)
    run = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            str(HERE.parent / "support" / "multihost_client.py"),
            coordinator,
            str(certs),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=False,
    )
    logs = "\n".join(p.read_text(errors="replace")[-2000:] for p in tmp_path.glob("*.log"))
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}\n{logs}"
    result = json.loads(run.stdout.strip().splitlines()[-1])

    addresses = {s["name"]: s["address"] for s in result["before"]["stages"]}
    assert addresses == {f"host-{i}": f"{ip}:7200" for i, ip in enumerate(STAGE_IPS)}
    before, after = result["before"]["partition"], result["after"]["partition"]
    assert after["epoch"] == before["epoch"] + 1
    assert after["stage_ids"] == list(reversed(before["stage_ids"]))
    assert after["boundaries"] == [0, 2, 5, 9]
    assert result["moved"]["changed"] and result["moved"]["bytes_moved"] > 0, result["moved"]
    # Close, not bit for bit: the pipeline sums three micro-batches' gradients where the
    # single-process reference takes one whole-batch step (measured: losses differ in the
    # last bits), so ``exact`` is reported by the client but not required.
    assert result["close"], (result["losses"], result["exact"], result["want"])
