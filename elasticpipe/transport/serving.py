"""Starting a gRPC server of the project: addresses, TLS, limits, health service, lifecycle.

A server binds ``listen`` and tells peers to use its *advertised* address: ``--advertise``
if given, else the listen address, and for a wildcard listen (``0.0.0.0``, ``[::]``) the
host's primary address -- never loopback, which other hosts cannot reach. IPv6 literals
go in brackets (``[fd00::5]:7200``).

Secure by default: a server that listens beyond loopback refuses to start without TLS
unless ``--insecure`` says that its network is trusted. Loopback-only servers (tests, the
demo) need no certificates.

``ServerLifecycle`` is what the coordinator's and the stage's servers share: ``address``,
``wait`` and the ``with`` block around their own ``start`` and ``stop``.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from elasticpipe.errors import InvalidRequest
from elasticpipe.security.admission import Guard, Limits, RoutingExecutor
from elasticpipe.security.tls import TLS
from elasticpipe.transport import rpc

WILDCARDS = ("", "0.0.0.0", "::", "[::]")


@dataclass
class RunningServer:
    """A started server and the address peers reach it at."""

    server: grpc.Server
    address: str
    health: health.HealthServicer
    guard: Guard

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving, letting calls in flight finish for ``grace`` seconds."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)


_Lifecycle = TypeVar("_Lifecycle", bound="ServerLifecycle")


class ServerLifecycle:
    """What a process's server (``CoordinatorServer``, ``StageServer``) shares: ``start``
    binds its ``RunningServer`` and returns it, ``stop`` ends it, ``wait`` blocks until it
    stops, and a ``with`` block starts and stops it."""

    _server: RunningServer | None = None

    @property
    def address(self) -> str:
        """The address peers reach the service at (the advertised one)."""
        assert self._server is not None, "server not started"
        return self._server.address

    def start(self: _Lifecycle) -> _Lifecycle:
        """Binds the port and starts serving; returns the started server."""
        raise NotImplementedError

    def stop(self) -> None:
        """Stops serving and releases what ``start`` acquired."""
        raise NotImplementedError

    def wait(self) -> None:
        """Blocks until the server stops."""
        assert self._server is not None
        self._server.server.wait_for_termination()

    def __enter__(self: _Lifecycle) -> _Lifecycle:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port" (the brackets removed).

    Raises:
        InvalidRequest: not HOST:PORT with a port in [0, 65535].
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdecimal() or not 0 <= int(port) <= 65535:
        raise InvalidRequest(f"bad address {address!r} (expected HOST:PORT, IPv6 as [ADDR]:PORT)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise InvalidRequest(
            f"bad address {address!r}: put an IPv6 address in brackets, [ADDR]:PORT"
        )
    return host, int(port)


def check_dial_address(address: str, what: str = "address") -> str:
    """Checks, before anything is dialled, that ``address`` is a HOST:PORT to connect to.

    gRPC takes almost any string as a target and fails late and obscurely: without a port
    it dials 443, and ``http://HOST:PORT`` fails name resolution ("Misformatted domain
    name"). IPv6 literals go in brackets (``[::1]:7100``).

    Args:
        address: what the user gave.
        what: what it is, for the message ("coordinator address").

    Returns:
        ``address``, unchanged.

    Raises:
        InvalidRequest: not HOST:PORT with a host and a port in [1, 65535]; the message
            names the value and the fix.
    """
    expected = "expected HOST:PORT, e.g. 127.0.0.1:7100 ([ADDR]:PORT for IPv6)"
    if not address:
        raise InvalidRequest(f"no {what} given: {expected}")
    scheme, sep, rest = address.partition("://")
    if sep:
        raise InvalidRequest(
            f"{what} {address!r} is a URL: give HOST:PORT without {scheme + sep!r}, "
            f"e.g. {rest.rstrip('/')!r}"
        )
    if any(c.isspace() or c in "/?#@" for c in address):
        raise InvalidRequest(f"{what} {address!r} is not HOST:PORT: {expected}")
    host, sep, port = address.rpartition(":")
    bracketed = address.startswith("[") and address.endswith("]")  # [ADDR] alone
    if ":" in host and not bracketed and not (host.startswith("[") and host.endswith("]")):
        raise InvalidRequest(f"{what} {address!r}: put an IPv6 address in brackets, [ADDR]:PORT")
    if not sep or not port or bracketed:
        raise InvalidRequest(
            f"{what} {address!r} has no port: {expected} (without a port, gRPC would dial port 443)"
        )
    if not port.isdecimal():
        raise InvalidRequest(f"{what} {address!r}: port {port!r} is not a number: {expected}")
    if not host or host == "[]":
        raise InvalidRequest(f"{what} {address!r} has no host: {expected}")
    if not 1 <= int(port) <= 65535:
        raise InvalidRequest(f"{what} {address!r}: port {port} is not in [1, 65535]")
    return address


def join_address(host: str, port: int) -> str:
    """ "host:port", with IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether a listen host reaches only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def primary_address(ipv6: bool = False) -> str:
    """This host's address for other hosts: the address of the default route's interface
    (``/proc/net/route``, ``/proc/net/ipv6_route``), else the source address the kernel
    picks for a private destination, else the only non-loopback interface address.

    The default route comes first: a VPN or container bridge routing 10.0.0.0/8 would
    otherwise win the probe.

    Raises:
        InvalidRequest: no such address, or several with no default route to choose;
            ``--advertise`` must say.
    """
    found = default_route_address(ipv6)
    if found:
        return found
    family = socket.AF_INET6 if ipv6 else socket.AF_INET
    probe = ("fd00::1", 9) if ipv6 else ("10.255.255.255", 9)
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(probe)  # UDP: sends nothing, only picks the route's source address
            found = str(s.getsockname()[0])
        if not is_loopback(found):
            return found
    except OSError:
        pass
    candidates = interface_addresses(ipv6)
    if len(candidates) == 1:
        return candidates[0]
    why = f"several addresses {', '.join(candidates)}" if candidates else "only loopback"
    raise InvalidRequest(
        f"cannot tell this host's address for its peers ({why}): pass --advertise HOST:PORT"
    )


def default_route_address(ipv6: bool = False, proc: Path = Path("/proc/net")) -> str | None:
    """The address of the interface the default route leaves by (Linux), or None."""
    interface = _default_interface(ipv6, proc)
    if interface is None:
        return None
    if not ipv6:
        return _ipv4_of(interface)
    try:
        lines = (proc / "if_inet6").read_text().splitlines()
    except OSError:
        return None
    for line in lines:  # address, index, prefix length, scope (00: global), flags, name
        fields = line.split()
        if len(fields) >= 6 and fields[5] == interface and fields[3] == "00":
            return str(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return None


def _default_interface(ipv6: bool, proc: Path) -> str | None:
    """The interface of the default route with the lowest metric, or None."""
    try:
        lines = (proc / ("ipv6_route" if ipv6 else "route")).read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in lines:
        fields = line.split()
        if ipv6:  # dest, dest prefix, src, src prefix, next hop, metric, ..., flags, name
            if len(fields) < 10 or fields[0] != "0" * 32 or fields[1] != "00":
                continue
            metric, name, up = int(fields[5], 16), fields[9], int(fields[8], 16) & 1
        else:  # Iface Destination Gateway Flags RefCnt Use Metric Mask ...
            if len(fields) < 8 or fields[1] != "00000000" or fields[7] != "00000000":
                continue
            metric, name, up = int(fields[6]), fields[0], int(fields[3], 16) & 1
        if up and name != "lo" and (best is None or metric < best[0]):
            best = (metric, name)
    return best[1] if best else None


def interface_addresses(ipv6: bool = False) -> list[str]:
    """The non-loopback, non-link-local addresses of this host's interfaces (Linux)."""
    found: list[str] = []
    if ipv6:
        try:
            lines = Path("/proc/net/if_inet6").read_text().split("\n")
        except OSError:
            return found
        for line in lines:
            if line.strip():
                raw = line.split()[0]
                found.append(str(ipaddress.IPv6Address(bytes.fromhex(raw))))
    else:
        for _, name in socket.if_nameindex():
            address = _ipv4_of(name)
            if address:
                found.append(address)
    return [
        a
        for a in found
        if not (ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_link_local)
    ]


def _ipv4_of(interface: str) -> str | None:
    """The IPv4 address of ``interface`` (SIOCGIFADDR), or None if it has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            reply = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(reply[20:24])


def advertised(listen: str, port: int, advertise: str | None) -> str:
    """The address peers should use for a server bound to ``listen`` (on ``port``)."""
    if advertise:
        split_address(advertise)
        return advertise
    host, _ = split_address(listen)
    if host in WILDCARDS:
        host = primary_address(ipv6=":" in listen.rpartition(":")[0])
    return join_address(host, port)


def metrics_bind_host(
    listen: str, metrics_port: int | None, metrics_listen: str, insecure: bool
) -> str:
    """``metrics_host`` for a server with a metrics endpoint (``metrics_port`` set), so that
    a refused host stops it before anything binds; "" for a server without one.

    Raises:
        InvalidRequest: as ``metrics_host``.
    """
    return metrics_host(listen, metrics_listen, insecure) if metrics_port is not None else ""


def metrics_host(listen: str, metrics_listen: str = "", insecure: bool = False) -> str:
    """Where the metrics endpoint (plain HTTP, no authentication) listens: ``metrics_listen``
    if the operator chose it, else the gRPC listen host.

    Raises:
        InvalidRequest: the gRPC listen host is beyond loopback and neither
            ``--metrics-listen`` nor ``--insecure`` says that plaintext metrics there are
            meant.
    """
    if metrics_listen:
        return metrics_listen.strip("[]")
    host = split_address(listen)[0]
    if not insecure and not is_loopback(host):
        raise InvalidRequest(
            f"refusing to serve metrics (plain HTTP, no authentication) on {host}: give "
            "--metrics-listen HOST (127.0.0.1 for a local scraper) or --insecure"
        )
    return host


def start_server(
    listen: str,
    services: list[tuple[ServiceDescriptor, object]],
    max_workers: int = 32,
    max_message_bytes: int = rpc.MAX_MESSAGE_BYTES,
    tls: TLS | None = None,
    insecure: bool = False,
    advertise: str | None = None,
    interceptors: Sequence[grpc.ServerInterceptor[Any, Any]] = (),
    limits: Limits | None = None,
    check: Callable[[grpc.ServicerContext], None] | None = None,
) -> RunningServer:
    """Starts a server on ``listen`` ("host:port"; port 0 picks a free one).

    Args:
        tls: serve mutual TLS, checking every caller's role (``elasticpipe.security.authz``).
        insecure: allow plaintext beyond loopback (a trusted network).
        advertise: the address peers use (default: see the module's docstring).
        interceptors: wrap every call (the metrics' RPC error counter).
        check: called with each authorized call's context, raising to refuse it (a
            stage's ``TermFence``).
        limits: per-peer cap and stream timeouts (default: ``Limits.from_env()``);
            heartbeats and other quick control calls get workers of their own
            (``elasticpipe.security.admission``).

    Raises:
        InvalidRequest: the address cannot be bound, or plaintext beyond loopback
            without ``insecure``.
    """
    host, _ = split_address(listen)
    if tls is None and not insecure and not is_loopback(host):
        raise InvalidRequest(
            f"refusing to listen on {listen} without TLS: give --tls-cert, --tls-key and "
            "--tls-ca (see 'elasticpipe certs'), or --insecure on a trusted network"
        )
    server = grpc.server(
        RoutingExecutor(max_workers),
        options=rpc.server_options(max_message_bytes),
        maximum_concurrent_rpcs=max_workers * 4,
        interceptors=list(interceptors),
    )
    guard = Guard(limits or Limits.from_env())
    for descriptor, servicer in services:
        rpc.add_service(
            server, descriptor, servicer, authorize=tls is not None, guard=guard, check=check
        )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    # Reflection: grpcurl and other generic tools list and call the services unaided.
    reflection.enable_server_reflection(
        [
            *(descriptor.full_name for descriptor, _ in services),
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ],
        server,
    )
    try:
        port = (
            server.add_secure_port(listen, tls.server_credentials())
            if tls is not None
            else server.add_insecure_port(listen)
        )
    except RuntimeError as exc:
        raise InvalidRequest(f"cannot listen on {listen!r}: {exc}") from exc
    if port == 0:
        raise InvalidRequest(f"cannot listen on {listen!r}")
    address = advertised(listen, port, advertise)
    server.start()
    for descriptor, _ in services:
        health_servicer.set(descriptor.full_name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, address=address, health=health_servicer, guard=guard)
