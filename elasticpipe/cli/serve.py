"""The two long-running commands, ``elasticpipe coordinator`` and ``elasticpipe stage``:
their flags (network, TLS, metrics, the coordinator's policy, the stage's device and
memory), how each builds its frozen config, and serving until SIGTERM/SIGINT.

``entry`` names the commands and hands each its parser (``coordinator_arguments``,
``stage_arguments``); it is imported first (``elasticpipe.cli``'s ``__init__``), so gRPC's
log verbosity is set before this module imports the servers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from elasticpipe.errors import ElasticPipeError
from elasticpipe.logs import get_logger
from elasticpipe.security.tls import TLS

ENV_TORCH_THREADS = "ELASTICPIPE_TORCH_THREADS"
ENV_COORDINATOR = "ELASTICPIPE_COORDINATOR"
SIGNAL_POLL_S = 0.25  # how often the main thread looks for a signal given to another thread

log = get_logger(__name__)


def _write_ready(path: str | None, address: str, metrics_port: int | None = None) -> None:
    if path:
        tmp = Path(path + ".tmp")
        ready = {"address": address, "pid": os.getpid(), "metrics_port": metrics_port}
        tmp.write_text(json.dumps(ready))
        tmp.replace(path)


class _Endpoint(Protocol):
    @property
    def port(self) -> int: ...


class _Server(Protocol):
    @property
    def address(self) -> str: ...

    @property
    def metrics(self) -> _Endpoint | None: ...

    def stop(self) -> None: ...


def _serve_until_signalled(
    server: _Server,
    ready_file: str | None,
    before_stop: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Announces the server's address, serves until SIGTERM/SIGINT (or until ``stop`` is
    set, by the server itself), then stops it (after ``before_stop``, such as moving a
    stage's layers off)."""
    stop = stop or threading.Event()
    received: list[str] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    _write_ready(ready_file, server.address, server.metrics.port if server.metrics else None)
    try:
        # Waits in slices: a signal the kernel hands to another thread (gRPC's, torch's)
        # runs its Python handler only once the main thread runs bytecode again, which a
        # wait with no timeout never does.
        while not stop.wait(SIGNAL_POLL_S):
            pass
        if before_stop is not None:
            before_stop()
    finally:
        server.stop()
        log.info("server_stopped", signal=received[0] if received else None)
    return 0


# ---- commands --------------------------------------------------------------------------


def cmd_coordinator(args: argparse.Namespace) -> int:
    """Runs the coordinator until SIGTERM/SIGINT."""
    from elasticpipe.coordinator.config import CoordinatorConfig
    from elasticpipe.coordinator.planning.policy import PolicyConfig
    from elasticpipe.coordinator.server import CoordinatorServer

    policy = PolicyConfig(
        enabled=args.auto_rebalance,
        threshold=args.rebalance_threshold,
        horizon_steps=args.rebalance_horizon,
        cooldown_s=args.rebalance_cooldown,
        interval_s=args.policy_interval,
        reserve_spares=args.reserve_spares,
    )
    config = CoordinatorConfig(
        listen=args.listen,
        state=args.state,
        policy=policy,
        dead_after_s=args.dead_after,
        heartbeat_interval_s=args.heartbeat_interval,
        link_bandwidth=args.link_bandwidth,
        pause_at=args.pause_at,
        freeze_lease_s=args.freeze_lease,
        leader_lease_s=args.leader_lease,
        etcd_tls=_etcd_tls(args),
        **_serving(args),
    )
    server = CoordinatorServer(config).start()
    return _serve_until_signalled(server, args.ready_file)


def _etcd_tls(args: argparse.Namespace) -> Any:
    """``--etcd-ca/--etcd-cert/--etcd-key`` as an ``EtcdTLS`` (None without a CA)."""
    from elasticpipe.coordinator.store.etcd import EtcdTLS
    from elasticpipe.errors import InvalidRequest

    if not args.etcd_ca:
        if args.etcd_cert or args.etcd_key:
            raise InvalidRequest("--etcd-cert and --etcd-key need --etcd-ca (TLS to etcd)")
        return None
    return EtcdTLS(args.etcd_ca, args.etcd_cert or "", args.etcd_key or "")


def _serving(args: argparse.Namespace) -> dict[str, Any]:
    """The options every server takes from ``_network_options``' flags, by config field:
    its TLS material, ``--insecure``, ``--advertise`` and where it serves metrics."""
    return {
        "tls": TLS.from_flags(args.tls_cert, args.tls_key, args.tls_ca),
        "insecure": args.insecure,
        "advertise": args.advertise,
        "metrics_port": args.metrics_port,
        "metrics_listen": args.metrics_listen,
    }


def _memory_size(text: str) -> int:
    """``--memory``'s type: a byte count with an optional unit (argparse reports the error)."""
    from elasticpipe.errors import InvalidRequest
    from elasticpipe.stage_server.memory import parse_bytes

    try:
        return parse_bytes(text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cpu_list(text: str) -> frozenset[int]:
    from elasticpipe.stage_server.cpus import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_stage(args: argparse.Namespace) -> int:
    """Runs a stage server until SIGTERM/SIGINT."""
    if args.cpus is not None:
        from elasticpipe.stage_server.cpus import bind

        try:
            bind(args.cpus)
        except ValueError as exc:
            raise SystemExit(f"--cpus: {exc}") from None
    import torch

    from elasticpipe.stage_server import memory
    from elasticpipe.stage_server.server import StageServer
    from elasticpipe.stage_server.stage import StageConfig

    threads = os.environ.get(ENV_TORCH_THREADS)
    if threads:
        torch.set_num_threads(int(threads))
    elif args.cpus is not None and "OMP_NUM_THREADS" not in os.environ:
        # torch sizes its pool by the host's cores, not the bound ones (until torch 2.14)
        torch.set_num_threads(len(args.cpus))
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: CUDA is not available on this host")
    config = StageConfig(
        name=args.name or f"stage-{os.getpid()}",
        device=args.device,
        allow_models=tuple(args.allow_models),
        slowdown=args.slowdown,
        timer=args.timer,
        max_tensor_bytes=args.max_tensor_bytes,
        transfer_chunk_bytes=args.transfer_chunk_bytes,
        commit_lease_s=args.commit_lease,
        enable_fault_injection=args.enable_fault_injection,
        memory_bytes=args.memory,
        replica=args.replica,
        bulk_port=None if args.no_bulk else args.bulk_port,
        **_serving(args),
    )
    memory.keep_freed_memory()  # received tensors reuse freed pages (memory.py)
    refused = threading.Event()  # another live stage holds the name: exit, non-zero
    server = StageServer(
        config, args.coordinator, args.listen, on_refused=lambda _: refused.set()
    ).start()
    code = _serve_until_signalled(
        server, args.ready_file, lambda: server.leave(args.drain_timeout), refused
    )
    if server.refused is not None:
        raise server.refused  # main prints it and exits 2
    return code


def _network_options(parser: argparse.ArgumentParser, port: int) -> None:
    """--advertise, --insecure, --metrics-port and the TLS flags of a server."""
    parser.add_argument(
        "--advertise",
        default="",
        metavar="HOST:PORT",
        help="the address peers use to reach this server (default: the listen address; for "
        f"0.0.0.0 or [::], this host's primary address), e.g. 10.0.0.5:{port}",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext when listening beyond loopback (a trusted, private network)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics over plain HTTP, without authentication, at "
        "PORT/metrics on the --listen host (0: any free port, logged; default: no metrics "
        "endpoint); beyond loopback only with --metrics-listen or --insecure",
    )
    parser.add_argument(
        "--metrics-listen",
        default="",
        metavar="HOST",
        help="the host the metrics endpoint listens on (default: the --listen host), e.g. "
        "127.0.0.1 for a scraper on this host",
    )
    _tls_options(parser)


def _tls_options(parser: argparse.ArgumentParser) -> None:
    for flag, what, env in (
        ("--tls-cert", "this party's certificate (PEM)", "ELASTICPIPE_TLS_CERT"),
        ("--tls-key", "its private key (PEM)", "ELASTICPIPE_TLS_KEY"),
        ("--tls-ca", "the cluster CA's certificate (PEM)", "ELASTICPIPE_TLS_CA"),
    ):
        parser.add_argument(flag, default=None, metavar="FILE", help=f"{what}; or ${env}")


# ---- parsers ---------------------------------------------------------------------------


def _coordinator_address(text: str) -> str:
    """The type of ``--coordinator``: HOST:PORT[,HOST:PORT...], each checked before
    anything dials it."""
    from elasticpipe.transport.coordinators import parse_coordinators

    try:
        return ",".join(parse_coordinators(text))
    except ElasticPipeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def coordinator_arguments(co: argparse.ArgumentParser) -> None:
    """The flags of ``elasticpipe coordinator``; it runs ``cmd_coordinator``."""
    co.add_argument("--listen", default="127.0.0.1:7100", help="HOST:PORT (port 0: any)")
    co.add_argument(
        "--store",
        "--state",
        dest="state",
        metavar="URL",
        default="elasticpipe-coordinator.sqlite",
        help="where stages, job, partition and history are kept: sqlite:PATH (a bare PATH "
        "too; ':memory:' for none) or etcd://HOST:PORT[,HOST:PORT...][/PREFIX]",
    )
    co.add_argument(
        "--auto-rebalance",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="move layers automatically when the planner predicts a gain",
    )
    co.add_argument(
        "--rebalance-threshold",
        type=float,
        default=0.10,
        help="minimum predicted step-time gain (fraction) to move layers",
    )
    co.add_argument(
        "--rebalance-horizon",
        type=int,
        default=50,
        help="steps over which a move must pay back its pause",
    )
    co.add_argument(
        "--rebalance-cooldown", type=float, default=5.0, help="seconds between two automatic moves"
    )
    co.add_argument(
        "--policy-interval", type=float, default=1.0, help="seconds between two re-plans"
    )
    co.add_argument(
        "--reserve-spares",
        type=int,
        default=0,
        help="spares the policy keeps out of the chain, ready to replace a stage that dies "
        "(the others join the chain when the planner predicts a gain)",
    )
    co.add_argument(
        "--dead-after",
        type=float,
        default=5.0,
        help="seconds without a heartbeat before a stage is declared dead (a client's "
        "failure report and a probe declare it at once)",
    )
    co.add_argument(
        "--heartbeat-interval", type=float, default=1.0, help="seconds between heartbeats"
    )
    co.add_argument(
        "--link-bandwidth",
        type=float,
        default=0.0,
        metavar="BYTES_PER_S",
        help="bandwidth between neighbouring hosts; when given, the planner counts the "
        "activations and gradients crossing each cut (0: links are free)",
    )
    co.add_argument(
        "--freeze-lease",
        type=float,
        default=60.0,
        help="seconds a stage frozen for an epoch change waits for news from the coordinator "
        "before it abandons the change (or, prepared, asks for its outcome)",
    )
    co.add_argument(
        "--leader-lease",
        type=int,
        default=3,
        metavar="SECONDS",
        help="with an etcd store: the leader's lease; when the leader dies a standby "
        "coordinator leads within about this long (at least 2)",
    )
    for flag, what, env in (
        ("--etcd-ca", "the CA certificate of the etcd members (PEM): TLS to etcd", "CA"),
        ("--etcd-cert", "this coordinator's client certificate for etcd (PEM)", "CERT"),
        ("--etcd-key", "its private key (PEM)", "KEY"),
    ):
        co.add_argument(
            flag,
            default=os.environ.get(f"ELASTICPIPE_ETCD_{env}"),
            metavar="FILE",
            help=f"{what}; or $ELASTICPIPE_ETCD_{env}",
        )
    _network_options(co, 7100)
    co.add_argument("--ready-file", help=argparse.SUPPRESS)
    co.add_argument("--pause-at", default="", help=argparse.SUPPRESS)  # tests: block there
    co.set_defaults(func=cmd_coordinator)


def stage_arguments(st: argparse.ArgumentParser) -> None:
    """The flags of ``elasticpipe stage``; it runs ``cmd_stage``."""
    st.add_argument(
        "--coordinator",
        type=_coordinator_address,
        metavar="HOST:PORT[,HOST:PORT...]",
        default=os.environ.get(ENV_COORDINATOR),
        required=ENV_COORDINATOR not in os.environ,
        help=f"HOST:PORT of the coordinator; with standby coordinators, every one's, "
        f"comma-separated: the stage follows the one that leads (or ${ENV_COORDINATOR})",
    )
    st.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT (port 0: any)")
    st.add_argument("--device", default="cpu", help="cpu or cuda:N")
    st.add_argument(
        "--cpus",
        type=_cpu_list,
        default=None,
        metavar="LIST",
        help="bind this process to these CPUs, e.g. 0-3,8 (Linux; default: any), and run "
        "as many torch threads (unless $OMP_NUM_THREADS says otherwise): for a host that runs "
        "several stages, or keeps cores for other work; a stage's compute thread then wakes "
        "where its caches are",
    )
    st.add_argument("--name", default=None, help="stable name of this host (default: stage-PID)")
    st.add_argument(
        "--allow-models",
        nargs="*",
        default=[],
        metavar="PREFIX",
        help="module prefixes whose model factories may be built here (the built-ins always)",
    )
    st.add_argument(
        "--slowdown", type=float, default=1.0, help="emulate a device this many times slower"
    )
    st.add_argument(
        "--timer",
        choices=["auto", "cpu", "wall", "fastest"],
        default="auto",
        help="how layer compute is timed: thread CPU time (auto on CPU: stages "
        "sharing a host do not see each other's load), CUDA events read once a step (auto on "
        "CUDA), wall time around a synchronize (wall), or, to emulate a device with "
        "--slowdown on a shared CPU host, each op's CPU time taken as the fastest of its "
        "last 32 runs (fastest: its time then no longer grows with the host's load)",
    )
    st.add_argument("--max-tensor-bytes", type=int, default=1 << 31, help="largest tensor accepted")
    st.add_argument(
        "--bulk-port",
        type=int,
        default=0,
        metavar="PORT",
        help="port of the bulk channel, a raw (TLS) socket beside gRPC for tensors over 1 MiB, "
        "on the --listen host (default 0: any free port, announced over gRPC)",
    )
    st.add_argument(
        "--no-bulk",
        action="store_true",
        help="no bulk channel: every tensor travels over gRPC",
    )
    st.add_argument(
        "--transfer-chunk-bytes",
        type=int,
        default=1 << 20,
        help="chunk size of layer state sent to peers (migration, snapshots, exports)",
    )
    st.add_argument(
        "--memory",
        type=_memory_size,
        default=0,
        metavar="BYTES",
        help="memory this stage offers its job, e.g. 512M, 2G (default: CPU MemAvailable "
        "less 10%%; CUDA free memory less 10%% of the device); the coordinator never "
        "places more layers here than fit",
    )
    st.add_argument(
        "--replica",
        default="",
        metavar="NAME",
        help="pin this stage to the replica NAME in jobs of several replicas of given lengths: "
        "stages of one name serve one replica (docs/replicas.md)",
    )
    st.add_argument(
        "--drain-timeout",
        type=float,
        default=60.0,
        help="on SIGTERM, how long to wait for the coordinator to move this stage's layers "
        "off before exiting (0: exit at once; recovery then replaces the stage)",
    )
    st.add_argument(
        "--commit-lease",
        type=float,
        default=30.0,
        help="seconds a finished step waits for its client's commit before the stage asks "
        "the coordinator to settle it",
    )
    _network_options(st, 7200)
    st.add_argument("--enable-fault-injection", action="store_true", help=argparse.SUPPRESS)
    st.add_argument("--ready-file", help=argparse.SUPPRESS)
    st.set_defaults(func=cmd_stage)
