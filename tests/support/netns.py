"""Separate "hosts" for tests: network namespaces joined by veth pairs on a bridge, each
with its own IP (root needed; a test skips with the reason where it cannot make them)."""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

WIRE = Path(__file__).with_name("delay_wire.py")


def ip(*args: str) -> None:
    """Runs ``ip ARGS`` (iproute2), raising on failure."""
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"epprobe{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        return f"cannot create a network namespace (root needed): {stderr.decode().strip()}"
    ip("netns", "del", probe)
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
        ip("link", "add", self.bridge, "type", "bridge")
        ip("link", "set", self.bridge, "up")

    def join(self, address: str) -> None:
        """Gives this process's own namespace ``address``/24 on the bridge, so that the
        test itself reaches the hosts (a client, an admin)."""
        ip("addr", "add", f"{address}/24", "dev", self.bridge)

    def add(
        self, host: str, address: str, default_route: bool = False, delay_s: float = 0.0
    ) -> str:
        """A namespace ``TAG-host`` holding ``address``/24 on a veth to the bridge, or, with
        ``delay_s``, on a cable that holds every frame the host sends that long
        (``delay_wire``: this kernel has no ``netem``)."""
        ns, outer, inner = f"{self.tag}-{host}", f"{self.tag}{host}o", f"{self.tag}{host}i"
        ip("netns", "add", ns)
        self.names.append(ns)
        if delay_s:
            self._delay_wire(inner, outer, delay_s)
        else:
            ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        ip("link", "set", outer, "master", self.bridge)
        ip("link", "set", outer, "up")
        ip("link", "set", inner, "netns", ns)
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        ip("-n", ns, "link", "set", inner, "up")
        ip("-n", ns, "link", "set", "lo", "up")
        if default_route:
            ip("-n", ns, "route", "add", "default", "dev", inner)
        return ns

    def _delay_wire(self, inner: str, outer: str, delay_s: float) -> None:
        wire = subprocess.Popen(
            [sys.executable, str(WIRE), inner, outer, str(delay_s)],
            stdout=subprocess.PIPE,
        )  # (its errors on the test's stderr)
        self.procs.append(wire)
        assert wire.stdout is not None
        ready, _, _ = select.select([wire.stdout], [], [], 30)
        line = wire.stdout.readline() if ready else b"(nothing in 30 s)"
        assert line == b"ready\n", f"the delay wire for {inner} did not start: {line!r}"

    def spawn(self, ns: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
        """Runs ``elasticpipe ARGS`` on host ``ns``, its output in ``log``."""
        return self.run(ns, [sys.executable, "-m", "elasticpipe", *args], log)

    def run(self, ns: str, command: list[str], log: Path) -> subprocess.Popen[bytes]:
        """Runs ``command`` on host ``ns``, its output in ``log``."""
        with log.open("ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", ns, *command],
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


def wait_for_log(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = log.read_text(errors="replace") if log.exists() else ""
        for line in content.splitlines():
            if text in line:
                return line
        assert proc.poll() is None, f"exited {proc.returncode}:\n{content[-3000:]}"
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {log} after {timeout}s:\n{content[-3000:]}")
