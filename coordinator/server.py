"""A running coordinator: state store, domain object, gRPC service, policy loop."""

from __future__ import annotations

from types import TracebackType

from elasticpipe.coordinator.coordinator import Coordinator
from elasticpipe.coordinator.policy import PolicyConfig
from elasticpipe.coordinator.service import CoordinatorServicer
from elasticpipe.coordinator.store import Store
from elasticpipe.logs import get_logger
from elasticpipe.observe.metrics import MetricsEndpoint
from elasticpipe.security.tls import TLS
from elasticpipe.transport.serving import RunningServer, metrics_host, start_server
from elasticpipe.v1 import coordinator_pb2

log = get_logger(__name__)


class CoordinatorServer:
    """Serves a ``Coordinator`` (a context manager)."""

    def __init__(
        self,
        listen: str = "127.0.0.1:0",
        state: str = ":memory:",
        policy: PolicyConfig | None = None,
        dead_after_s: float = 5.0,
        heartbeat_interval_s: float = 1.0,
        link_bandwidth: float = 0.0,
        pause_at: str = "",
        freeze_lease_s: float = 60.0,
        tls: TLS | None = None,
        insecure: bool = False,
        advertise: str = "",
        metrics_port: int | None = None,
        metrics_listen: str = "",
    ):
        self._listen = listen
        self._state = state
        self._policy = policy
        self._dead_after_s = dead_after_s
        self._heartbeat_interval_s = heartbeat_interval_s
        self._link_bandwidth = link_bandwidth
        self._pause_at = pause_at
        self._freeze_lease_s = freeze_lease_s
        self._tls, self._insecure, self._advertise = tls, insecure, advertise
        self.coordinator: Coordinator | None = None
        self._server: RunningServer | None = None
        self._metrics_port = metrics_port  # None: no metrics endpoint; 0: any port
        self._metrics_listen = metrics_listen  # its host (default: the listen host)
        self.metrics: MetricsEndpoint | None = None

    @property
    def address(self) -> str:
        """Where the CoordinatorService listens."""
        assert self._server is not None, "server not started"
        return self._server.address

    def start(self) -> CoordinatorServer:
        """Opens the state file, binds the port and starts the policy loop."""
        metrics_on = (
            metrics_host(self._listen, self._metrics_listen, self._insecure)
            if self._metrics_port is not None
            else ""
        )
        self.coordinator = Coordinator(
            Store(self._state),
            self._policy,
            self._dead_after_s,
            self._heartbeat_interval_s,
            self._link_bandwidth,
            self._pause_at,
            self._freeze_lease_s,
            self._tls,
        )
        self._server = start_server(
            self._listen,
            [
                (
                    coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"],
                    CoordinatorServicer(self.coordinator),
                )
            ],
            tls=self._tls,
            insecure=self._insecure,
            advertise=self._advertise or None,
            interceptors=[self.coordinator.cluster.metrics.interceptor()],
        )
        if self._metrics_port is not None:
            self.metrics = MetricsEndpoint(
                self.coordinator.cluster.metrics.registry, metrics_on, self._metrics_port
            )
        self.coordinator.start()
        log.info(
            "coordinator_listening",
            address=self.address,
            state=self._state,
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

    def wait(self) -> None:
        """Blocks until the server stops."""
        assert self._server is not None
        self._server.server.wait_for_termination()

    def __enter__(self) -> CoordinatorServer:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
