"""A running coordinator: state store, domain object, gRPC service, policy loop."""

from __future__ import annotations

from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.coordinator import Coordinator
from elasticpipe.coordinator.service import CoordinatorServicer
from elasticpipe.coordinator.store import open_store
from elasticpipe.logs import get_logger
from elasticpipe.observe.metrics import MetricsEndpoint
from elasticpipe.transport.serving import (
    RunningServer,
    ServerLifecycle,
    metrics_bind_host,
    start_server,
)
from elasticpipe.v1 import coordinator_pb2

log = get_logger(__name__)


class CoordinatorServer(ServerLifecycle):
    """Serves a ``Coordinator`` (a context manager)."""

    def __init__(self, config: CoordinatorConfig | None = None):
        self.config = config or CoordinatorConfig()
        self.coordinator: Coordinator | None = None
        self._server: RunningServer | None = None
        self.metrics: MetricsEndpoint | None = None

    def start(self) -> CoordinatorServer:
        """Opens the state file, binds the port and starts the policy loop."""
        config = self.config
        metrics_on = metrics_bind_host(
            config.listen, config.metrics_port, config.metrics_listen, config.insecure
        )
        self.coordinator = Coordinator(open_store(config.state), config)
        self._server = start_server(
            config.listen,
            [
                (
                    coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"],
                    CoordinatorServicer(self.coordinator),
                )
            ],
            tls=config.tls,
            insecure=config.insecure,
            advertise=config.advertise or None,
            interceptors=[self.coordinator.cluster.metrics.interceptor()],
        )
        if config.metrics_port is not None:
            self.metrics = MetricsEndpoint(
                self.coordinator.cluster.metrics.registry, metrics_on, config.metrics_port
            )
        self.coordinator.start()
        log.info(
            "coordinator_listening",
            address=self.address,
            state=config.state,
            auto_rebalance=self.coordinator.rebalancer.policy.enabled,
        )
        return self

    def stop(self) -> None:
        """Stops the server and closes the state file."""
        if self._server is not None:
            self._server.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator.store.close()
