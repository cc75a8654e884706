"""``LocalCluster``: a coordinator and N stage servers as separate processes on loopback.

::

    with LocalCluster(stages=4) as cluster:
        with Pipeline(coordinator=cluster.coordinator, model="gpt") as pipe:
            ...

Each process is a real ``elasticpipe`` command (the same an operator runs on each host);
they bind port 0 and report the address they got through a ready file (and, with
``metrics=True``, the port of their Prometheus endpoint: ``metrics_url``). Leaving the block
(or Ctrl-C) stops every process: SIGTERM first, SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from elasticpipe.client.admin import ADMIN_TIMEOUT_S, Admin, Status
from elasticpipe.errors import CoordinatorUnavailable, DeadlineExceeded, StageUnavailable
from elasticpipe.local import forkserver
from elasticpipe.security.tls import TLS, init_ca, issue
from elasticpipe.stage_server.cpus import available, format_cpus, stage_cpus

Process = subprocess.Popen[bytes] | forkserver.Forked  # (forked: ELASTICPIPE_FORK_SERVER=1)

START_TIMEOUT_S = 60.0


def _wait_ready(path: Path, proc: Process, what: str, log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise StageUnavailable(f"{what} exited with code {proc.returncode}:\n{tail}")
        if path.exists() and path.stat().st_size > 0:
            return str(json.loads(path.read_text())["address"])
        time.sleep(0.05)
    raise DeadlineExceeded(f"{what} did not start within {timeout:.0f}s (log: {log})")


def _signal(proc: Process, sig: int) -> None:
    """Sends ``sig`` to a process's group (its session: the process and anything it
    started), unless it has exited (a forked one is reaped at once: its group is gone)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)


def _store_of(args: Sequence[str]) -> str | None:
    """The store named in coordinator ``args`` (``--store`` or its alias ``--state``, as
    ``--flag VALUE`` or ``--flag=VALUE``), or None."""
    for i, arg in enumerate(args):
        for flag in ("--store", "--state"):
            if arg == flag and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return None


class LocalCluster:
    """A coordinator plus ``stages`` stage servers, each its own process."""

    def __init__(
        self,
        stages: int = 2,
        slowdowns: Sequence[float] | None = None,
        coordinator_args: Sequence[str] = (),
        stage_args: Sequence[str] = (),
        log_dir: str | os.PathLike[str] | None = None,
        threads_per_stage: int = 1,
        tls: bool = False,
        metrics: bool = False,
        per_stage_args: Sequence[Sequence[str]] | None = None,
        *,
        auto_rebalance: bool = True,
        heartbeat_s: float | None = None,
        dead_after_s: float | None = None,
        state: str | None = None,
        fault_injection: bool = False,
        commit_lease_s: float | None = None,
        allow_models: Sequence[str] = (),
        coordinators: int = 1,
        bind_cpus: bool = True,
    ):
        """Describes the cluster; ``start`` (or ``with``) launches it.

        Args:
            stages: number of stage servers.
            slowdowns: per-stage emulated slowdown factors (default all 1).
            coordinator_args: extra flags for ``elasticpipe coordinator`` (after those the
                typed options below spell).
            stage_args: extra flags for every ``elasticpipe stage``.
            log_dir: where each process writes its log (default: a temporary folder).
            threads_per_stage: torch intra-op threads of each stage (they share the host).
            tls: mutual TLS everywhere: a throw-away CA issues a certificate to the
                coordinator, each stage, a client and an admin (``client_tls``,
                ``admin_tls``).
            metrics: every process serves Prometheus metrics on a free port
                (``metrics_ports``, ``metrics_url``).
            per_stage_args: extra flags of each stage in turn, after ``stage_args``
                (e.g. ``[["--memory", "2M"], []]``).
            auto_rebalance: the coordinator moves layers by itself when the planner
                predicts a gain (False: only on request, ``Admin.rebalance``).
            heartbeat_s: seconds between the stages' heartbeats (None: the default, 1 s).
            dead_after_s: seconds of silence before a stage is declared dead (None: 5 s).
            state: the coordinator's store (``--store``: a SQLite file or ``etcd://...``);
                ``":memory:"`` keeps nothing (None: a file in the cluster's temporary
                folder, so that ``restart_coordinator`` finds it).
            fault_injection: the stages accept injected faults (``tests``, ``bench``).
            commit_lease_s: how long a stage holds a step's commit for its client.
            allow_models: module prefixes every stage may import model factories from.
            coordinators: coordinator processes on the one store (more than one needs an
                etcd ``state``: one leads, the others stand by). They are named
                "coordinator", "coordinator-1", ...; ``coordinator`` lists every address.
            bind_cpus: bind each stage "stage-K" to its own CPUs (``elasticpipe stage
                --cpus``): an equal part of those this process may use, at least
                ``threads_per_stage``, stage 0 the first, stage 1 the next, around again
                once all are given (``stage_server.cpus.stage_cpus``); not where
                the stages cannot be spread evenly (3 on 2 CPUs), a stage's flags name
                ``--cpus`` themselves, or the platform cannot bind (not Linux). The
                coordinators and the client stay unbound.
        """
        if coordinators > 1 and not (state or "").startswith("etcd://"):
            raise ValueError(f"{coordinators} coordinators need an etcd:// state, not {state!r}")
        self.coordinator_names = [
            "coordinator",
            *(f"coordinator-{i}" for i in range(1, coordinators)),
        ]
        self.num_stages = stages
        self.slowdowns = list(slowdowns or [1.0] * stages)
        if len(self.slowdowns) != stages:
            raise ValueError(f"{len(self.slowdowns)} slowdowns given for {stages} stages")
        typed: list[str] = [] if auto_rebalance else ["--no-auto-rebalance"]
        for flag, value in (("--heartbeat-interval", heartbeat_s), ("--dead-after", dead_after_s)):
            if value is not None:
                typed += [flag, str(value)]
        if state is not None:
            typed += ["--state", state]
        self._coordinator_args = [*typed, *coordinator_args]
        typed = ["--enable-fault-injection"] if fault_injection else []
        if commit_lease_s is not None:
            typed += ["--commit-lease", str(commit_lease_s)]
        if allow_models:
            typed += ["--allow-models", *allow_models]
        self._stage_args = [*typed, *stage_args]
        self._per_stage_args = [list(a) for a in per_stage_args or [[]] * stages]
        if len(self._per_stage_args) != stages:
            raise ValueError(f"{len(self._per_stage_args)} per_stage_args for {stages} stages")
        self._tmp = tempfile.TemporaryDirectory(prefix="elasticpipe-")
        if _store_of(self._coordinator_args) is None:  # a restarted coordinator finds its state
            self._coordinator_args += ["--state", str(Path(self._tmp.name) / "coordinator.sqlite")]
        self.log_dir = Path(log_dir) if log_dir else Path(self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._threads = threads_per_stage
        self._cpus = sorted(available() or ()) if bind_cpus else []  # to bind stages to
        self.coordinator = ""  # every coordinator's address, comma-separated
        self.coordinator_addresses: dict[str, str] = {}  # process name -> address
        self.stage_addresses: list[str] = []
        self.procs: dict[str, Process] = {}
        self.stopped = threading.Event()  # set by ``stop``: the cluster is going away
        self.certs: Path | None = None
        self._metrics = metrics
        self.metrics_ports: dict[str, int] = {}  # process name -> its metrics port
        if tls:
            self.certs = Path(self._tmp.name) / "certs"
            init_ca(self.certs)
            for name, role in (
                ("coordinator", "coordinator"),
                ("client", "client"),
                ("admin", "admin"),
            ):
                issue(self.certs, name, role)

    def tls_of(self, name: str, role: str = "stage") -> TLS | None:
        """The TLS material of ``name`` (issued on first use); None without TLS."""
        if self.certs is None:
            return None
        if not (self.certs / f"{name}.pem").exists():
            issue(self.certs, name, role)
        return TLS(
            str(self.certs / f"{name}.pem"),
            str(self.certs / f"{name}.key"),
            str(self.certs / "ca.pem"),
        )

    @property
    def client_tls(self) -> TLS | None:
        """What a ``Pipeline`` of this cluster passes as ``tls`` (None without TLS)."""
        return self.tls_of("client", "client")

    @property
    def admin_tls(self) -> TLS | None:
        """An admin's TLS material (None without TLS)."""
        return self.tls_of("admin", "admin")

    def _tls_flags(self, name: str, role: str) -> list[str]:
        tls = self.tls_of(name, role)
        if tls is None:
            return []
        return ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]

    def metrics_url(self, name: str) -> str:
        """Where process ``name`` ("coordinator", "stage-0", ...) serves its metrics."""
        if name not in self.metrics_ports:
            raise KeyError(f"{name!r} serves no metrics (LocalCluster(metrics=True) starts them)")
        return f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"

    def _ready(self, name: str, spawned: tuple[Process, Path, Path]) -> str:
        """Waits for a process's ready file; returns its address (and notes its metrics port)."""
        proc, ready, log = spawned
        address = _wait_ready(ready, proc, name, log, START_TIMEOUT_S)
        port = json.loads(ready.read_text()).get("metrics_port")
        if port is not None:
            self.metrics_ports[name] = int(port)
        return address

    def _spawn(
        self, name: str, args: list[str], env: Mapping[str, str] | None = None
    ) -> tuple[Process, Path, Path]:
        ready = Path(self._tmp.name) / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log = self.log_dir / f"{name}.log"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(self._threads),
            "ELASTICPIPE_TORCH_THREADS": str(self._threads),
            **(env or {}),
        }
        argv = [
            *args,
            *(["--metrics-port", "0"] if self._metrics else []),
            "--ready-file",
            str(ready),
        ]
        proc: Process
        if forkserver.enabled():  # forked from a process that imported torch already
            proc = forkserver.shared().spawn(argv, env, log)
        else:
            with log.open("ab") as out:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "elasticpipe", *argv],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        self.procs[name] = proc
        return proc, ready, log

    def start(self) -> LocalCluster:
        """Starts every process and waits until all stages have registered."""
        try:
            for name in self.coordinator_names:
                self._start_coordinator(name, "127.0.0.1:0")
            pending = [
                (f"stage-{i}", self._spawn_stage(f"stage-{i}", i)) for i in range(self.num_stages)
            ]
            self.stage_addresses = [self._ready(name, spawned) for name, spawned in pending]
            self.wait_for_stages(self.num_stages, START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_coordinator(self, name: str, listen: str) -> None:
        spawned = self._spawn(
            name,
            [
                "coordinator",
                "--listen",
                listen,
                *self._tls_flags(name, "coordinator"),
                *self._coordinator_args,
            ],
        )
        self.coordinator_addresses[name] = self._ready(name, spawned)
        self.coordinator = ",".join(self.coordinator_addresses.values())

    def _spawn_stage(
        self,
        name: str,
        index: int | None = None,
        extra: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> tuple[Process, Path, Path]:
        slowdown = self.slowdowns[index] if index is not None else 1.0
        own = self._per_stage_args[index] if index is not None else []
        return self._spawn(
            name,
            [
                "stage",
                "--coordinator",
                self.coordinator,
                "--listen",
                "127.0.0.1:0",
                "--name",
                name,
                "--slowdown",
                str(slowdown),
                *self._tls_flags(name, "stage"),
                *self._stage_args,
                *own,
                *extra,
                *self._cpu_flags(name, [*self._stage_args, *own, *extra]),
            ],
            env,
        )

    def _cpu_flags(self, name: str, flags: Sequence[str]) -> list[str]:
        """``--cpus`` for stage ``name`` ("stage-K": its spread share of the CPUs), unless
        the cluster binds none, ``flags`` bind it already, or the name numbers no stage."""
        number = name.removeprefix("stage-")
        bound = any(f.startswith("--cpu") for f in flags)  # (argparse: --cpu is --cpus)
        if bound or not number.isdecimal():
            return []
        cpus = stage_cpus(int(number), self.num_stages, self._threads, self._cpus)
        return ["--cpus", format_cpus(cpus)] if cpus else []

    def add_stage(
        self, name: str, extra: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> str:
        """Starts one more stage process (a spare, or a restarted stage under its old
        name: a new incarnation) with ``extra`` flags and ``env`` variables; returns its
        address once it has registered."""
        spawned = self._spawn_stage(name, extra=extra, env=env)
        address, log = self._ready(name, spawned), spawned[2]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any(s.address == address and s.alive for s in self.status().stages):
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"{name} did not register (log: {log})")
            time.sleep(0.05)
        if (
            name.startswith("stage-")
            and name[6:].isdecimal()
            and int(name[6:]) < len(self.stage_addresses)
        ):
            self.stage_addresses[int(name[6:])] = address
        return address

    def restart_coordinator(
        self, args: Sequence[str] | None = None, name: str = "coordinator"
    ) -> None:
        """Starts coordinator ``name`` again on its old address, from its state (with
        ``args`` instead of the original flags, if given); returns once a coordinator
        answers as leader."""
        if args is not None:
            state = _store_of(self._coordinator_args)
            assert state is not None  # __init__ gives every cluster a store
            self._coordinator_args = [*args, "--store", state]
        if self.stopped.is_set():  # (a restart on a timer that outlived its test)
            return
        self._start_coordinator(name, self.coordinator_addresses[name])
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # answering (channels to the old one may still be backing off)
            try:
                self.status(timeout=2.0)
                return
            except (CoordinatorUnavailable, DeadlineExceeded):
                if self.stopped.is_set():  # (a restart on a thread that outlived its test)
                    return
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def wait_for_log(self, name: str, text: str, timeout: float = 60.0) -> None:
        """Waits until ``text`` appears in a process's log (a pause point reached, say)."""
        log = self.log_dir / f"{name}.log"
        deadline = time.monotonic() + timeout
        while not (log.exists() and text in log.read_text(errors="replace")):
            if time.monotonic() > deadline:
                raise DeadlineExceeded(f"{text!r} did not appear in {log} within {timeout:.0f}s")
            time.sleep(0.05)

    def name_of(self, address: str) -> str:
        """The process name of a stage address."""
        return f"stage-{self.stage_addresses.index(address)}"

    def leader(self, timeout: float = 10.0) -> str:
        """The process name of the coordinator that leads (waiting up to ``timeout``)."""
        address = self.status(timeout=timeout).leader
        for name, known in self.coordinator_addresses.items():
            if known == address:
                return name
        raise KeyError(f"the leader {address!r} is none of {self.coordinator_addresses}")

    def admin(self, timeout: float = ADMIN_TIMEOUT_S) -> Admin:
        """A typed admin client of this cluster's coordinator (with the admin's certificate
        under TLS); close it, or use ``with``."""
        return Admin(self.coordinator, self.admin_tls, timeout=timeout)

    def status(self, timeout: float = 10.0) -> Status:
        """The coordinator's status (waiting up to ``timeout`` for it to be reachable: a
        restarted coordinator's channel may still be backing off)."""
        with self.admin(timeout) as admin:
            return admin.status(wait=True)

    def wait_for_stages(self, count: int, timeout: float) -> None:
        """Waits until ``count`` stages are registered and alive."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                alive = sum(s.alive for s in self.status(timeout=2.0).stages)
            except (CoordinatorUnavailable, DeadlineExceeded):
                alive = 0
            if alive >= count:
                return
            if time.monotonic() > deadline:
                raise DeadlineExceeded(
                    f"{alive} of {count} stages registered after "
                    f"{timeout:.0f}s (logs in {self.log_dir})"
                )
            time.sleep(0.1)

    def kill(self, name: str) -> None:
        """Kills one process at once (SIGKILL), as a crash would."""
        proc = self.procs[name]
        _signal(proc, signal.SIGKILL)
        proc.wait(timeout=10)

    def terminate(self, name: str, timeout: float = 60.0) -> int:
        """Sends SIGTERM to one process and waits for it to exit; returns its exit code."""
        proc = self.procs[name]
        _signal(proc, signal.SIGTERM)
        return proc.wait(timeout=timeout)

    def stop(self, grace: float = 5.0) -> None:
        """Stops every process: SIGTERM, then SIGKILL after ``grace`` seconds.

        The coordinators go first, so that stages shutting down do not wait for their
        layers to be moved off (the whole cluster is going away).
        """
        self.stopped.set()
        coordinators = [p for n, p in self.procs.items() if n in self.coordinator_names]
        stages = [p for n, p in self.procs.items() if n not in self.coordinator_names]
        for group in (coordinators, stages):  # every coordinator at once: no takeover
            for proc in group:
                _signal(proc, signal.SIGTERM)
            if group is coordinators:
                for proc in group:
                    with contextlib.suppress(subprocess.SubprocessError):
                        proc.wait(timeout=grace)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.SubprocessError:  # still running (or its fork server is gone)
                _signal(proc, signal.SIGKILL)
                with contextlib.suppress(subprocess.SubprocessError):
                    proc.wait(timeout=5)

    def logs(self) -> str:
        """Every process's log, for a failing test's report."""
        return "\n".join(
            f"==> {p.name} <==\n{p.read_text(errors='replace')[-4000:]}"
            for p in sorted(self.log_dir.glob("*.log"))
        )

    def close(self) -> None:
        """Stops the processes and removes the temporary folder."""
        self.stop()
        self._tmp.cleanup()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
