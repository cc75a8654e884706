"""In-process stage servers for the tests that run a ``CoordinatorServer`` in the test process:
started, registered with the coordinator, and stopped, spelled once; and a bare
``StageService`` of a test's own servicer (``serve_stage``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from elasticpipe.layout import Layout
from elasticpipe.local.ports import free_port
from elasticpipe.partition import Partition
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.training.job import JobConfig
from elasticpipe.transport import rpc, serving
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

__all__ = [
    "assign_by_hand",
    "free_port",
    "serve_stage",
    "stage_servers",
    "unregistered_stage_servers",
]


@contextlib.contextmanager
def unregistered_stage_servers(
    count: int, allow_models: tuple[str, ...]
) -> Iterator[list[StageServer]]:
    """``count`` stage servers on loopback that no coordinator knows (a test assigns them
    by hand, as the coordinator would), allowed ``allow_models``; stopped when the block
    ends."""
    started = []
    try:
        for n in range(count):
            config = StageConfig(name=f"st{n}", allow_models=allow_models)
            started.append(StageServer(config, "127.0.0.1:1").start())
        yield started
    finally:
        for server in started:
            server.stop()


def assign_by_hand(job: JobConfig, placed: Partition | Layout) -> None:
    """Assigns every stage of ``placed`` (a chain, or every replica's) its place in it for
    ``job``, as the coordinator would: for stages that no coordinator knows."""
    chains = placed.replicas if isinstance(placed, Layout) else (placed,)
    for chain in chains:
        for ref in chain.stages:
            with rpc.channel(ref.address) as chan:
                stage_pb2_grpc.StageServiceStub(chan).Assign(
                    stage_pb2.AssignRequest(
                        job=job.to_proto(), assignment=placed.assignment(ref.stage_id).to_proto()
                    ),
                    timeout=30,
                )


@contextlib.contextmanager
def stage_servers(
    coordinator: str,
    configs: Iterable[StageConfig],
    listen: str = "127.0.0.1:0",
    register_s: float = 10.0,
) -> Iterator[list[StageServer]]:
    """One ``StageServer`` per config, listening on ``listen`` and registered with
    ``coordinator`` (each within ``register_s``, or the test fails); all are stopped when the
    block ends, whether it fails or not."""
    servers = [StageServer(config, coordinator, listen).start() for config in configs]
    try:
        for server in servers:
            assert server.registered.wait(register_s), "stage did not register"
        yield servers
    finally:
        for server in servers:
            server.stop()


def serve_stage(
    servicer: stage_pb2_grpc.StageServiceServicer, address: str = "127.0.0.1:0"
) -> serving.RunningServer:
    """A gRPC server of ``StageService`` answered by ``servicer`` (a test's stand-in peer)."""
    descriptor = stage_pb2.DESCRIPTOR.services_by_name["StageService"]
    return serving.start_server(address, [(descriptor, servicer)])
