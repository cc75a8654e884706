"""Starting a gRPC server of the project: limits, health service, bound address."""

from __future__ import annotations

from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from elasticpipe import rpc
from elasticpipe.errors import InvalidRequest


@dataclass
class RunningServer:
    """A started server and the address it is reachable at."""

    server: grpc.Server
    address: str
    health: health.HealthServicer

    def stop(self, grace: float = 1.0) -> None:
        """Stops serving, letting calls in flight finish for ``grace`` seconds."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(grace + 1.0)


def start_server(
    listen: str,
    services: list[tuple[ServiceDescriptor, object]],
    max_workers: int = 32,
    max_message_bytes: int = rpc.MAX_MESSAGE_BYTES,
) -> RunningServer:
    """Starts a server on ``listen`` ("host:port"; port 0 picks a free one).

    Raises:
        InvalidRequest: the address cannot be bound.
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
        options=rpc.server_options(max_message_bytes),
        maximum_concurrent_rpcs=max_workers * 4,
    )
    for descriptor, servicer in services:
        rpc.add_service(server, descriptor, servicer)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise InvalidRequest(f"cannot listen on {listen!r}: {exc}") from exc
    if port == 0:
        raise InvalidRequest(f"cannot listen on {listen!r}")
    server.start()
    host = listen.rsplit(":", 1)[0] or "127.0.0.1"
    if host in ("0.0.0.0", "[::]"):
        host = "127.0.0.1"
    for descriptor, _ in services:
        health_servicer.set(descriptor.full_name, health_pb2.HealthCheckResponse.SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    return RunningServer(server=server, address=f"{host}:{port}", health=health_servicer)
