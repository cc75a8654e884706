"""A running coordinator: state store, domain object, gRPC service, policy loop.

On SQLite the coordinator leads from the start. On etcd it is one of any number of
candidates (``store.election``): it serves at once, but as a **standby** whose every answer
is ``StandingBy`` naming the leader, until it wins; then it loads the state from the store,
finishes or undoes the epoch change a previous leader left in flight (what a restarted
coordinator does) and leads: heartbeats, the policy and recovery. If it loses the
leadership (etcd out of reach for ``ttl - margin``), it stops commanding stages at once,
stands by again and campaigns for the next term.

::

    start ──► serving as standby ──campaign won──► load state, finish pending ──► leading
                     ▲                                                             │
                     └──────────── lost: stop loops, refuse commands ◄─────────────┘
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric

from elasticpipe.coordinator.config import CoordinatorConfig
from elasticpipe.coordinator.coordinator import PAUSE_POINTS, Coordinator
from elasticpipe.coordinator.service import CoordinatorServicer
from elasticpipe.coordinator.store import Election, EtcdStore, Store, open_store
from elasticpipe.errors import ElasticPipeError, InvalidRequest, NotLeader, StandingBy
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

LEADER_CACHE_S = 0.5  # how long a standby trusts the leader it last read from the store
RECAMPAIGN_PAUSE_S = 1.0  # after a campaign or a takeover failed; doubles up to the max
RECAMPAIGN_PAUSE_MAX_S = 30.0


class _Gate:
    """The service a candidate serves: its ``CoordinatorServicer`` while it leads, else a
    ``StandingBy`` naming the leader, for every method."""

    def __init__(self, address: Callable[[], str], leader: Callable[[], str]):
        self.servicer: CoordinatorServicer | None = None
        self._address = address
        self._leader = leader

    def __getattr__(self, method: str) -> Callable[[Any, grpc.ServicerContext], Any]:
        def serve(request: Any, context: grpc.ServicerContext) -> Any:
            servicer = self.servicer
            if servicer is None:
                leader = self._leader()
                who = f"the leader is {leader}" if leader else "no coordinator leads yet"
                raise StandingBy(f"coordinator {self._address()} stands by: {who}", leader)
            return getattr(servicer, method)(request, context)

        serve.__name__ = method
        return serve


class _Metered(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """The leading coordinator's RPC error counter (none while standing by)."""

    def __init__(self, server: CoordinatorServer):
        self._server = server

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        coordinator = self._server.coordinator
        if coordinator is None:
            return continuation(details)
        return coordinator.cluster.metrics.interceptor().intercept_service(continuation, details)


class _LeaderMetrics:
    """A Prometheus collector: the leading coordinator's metrics, and whether it leads."""

    def __init__(self, server: CoordinatorServer):
        self._server = server

    def collect(self) -> Iterator[Metric]:
        coordinator = self._server.coordinator
        yield GaugeMetricFamily(
            "elasticpipe_coordinator_leading",
            "1 while this coordinator leads, 0 while it stands by",
            value=1 if coordinator is not None else 0,
        )
        if coordinator is not None:
            yield from coordinator.cluster.metrics.registry.collect()


@dataclass(frozen=True)
class _Won:
    """One won leadership, as the store's fence and the stage stamp see it: its term
    while the election still holds exactly that term, else 0 (whatever a leftover thread
    of an earlier leadership of this process tries, it cannot write or command under a
    later term)."""

    election: Election
    won: int

    @property
    def address(self) -> str:
        return self.election.address

    @property
    def key(self) -> bytes:
        return self.election.key

    @property
    def term(self) -> int:
        return self.won if self.won and self.election.term == self.won else 0

    def current(self) -> int:
        """The term, for a command to a stage.

        Raises:
            NotLeader: this leadership ended.
        """
        term = self.term
        if term == 0:
            raise NotLeader(f"coordinator {self.address} no longer leads (term {self.won})")
        return term


class CoordinatorServer(ServerLifecycle):
    """Serves a ``Coordinator`` (a context manager)."""

    def __init__(self, config: CoordinatorConfig | None = None):
        self.config = config or CoordinatorConfig()
        self.coordinator: Coordinator | None = None  # None while standing by
        self.store: Store | None = None
        self.election: Election | None = None
        self.leading = threading.Event()
        self._server: RunningServer | None = None
        self.metrics: MetricsEndpoint | None = None
        self._gate = _Gate(lambda: self.address, self._leader_address)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # leading and stepping down, one at a time
        self._candidate: threading.Thread | None = None
        self._leader_cache: tuple[float, str] = (0.0, "")
        self._refreshing = threading.Lock()

    def start(self) -> CoordinatorServer:
        """Opens the store and binds the port; leads at once on SQLite, and campaigns in
        the background on etcd (``wait_leading`` blocks until it leads)."""
        config = self.config
        metrics_on = metrics_bind_host(
            config.listen, config.metrics_port, config.metrics_listen, config.insecure
        )
        if config.pause_at and config.pause_at not in PAUSE_POINTS:
            raise InvalidRequest(
                f"unknown pause point {config.pause_at!r} (choose from {list(PAUSE_POINTS)})"
            )
        self.store = store = open_store(config.state, config.etcd_tls)
        elected = isinstance(store, EtcdStore)
        if not elected:  # SQLite: one coordinator, serving from its first call
            self.coordinator = Coordinator(store, config)
            self._gate.servicer = CoordinatorServicer(self.coordinator)
        self._server = start_server(
            config.listen,
            [(coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"], self._gate)],
            tls=config.tls,
            insecure=config.insecure,
            advertise=config.advertise or None,
            interceptors=[_Metered(self)],
        )
        if config.metrics_port is not None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(_LeaderMetrics(self))
            self.metrics = MetricsEndpoint(registry, metrics_on, config.metrics_port)
        if isinstance(store, EtcdStore):
            lease = config.leader_lease_s
            self.election = Election(store, self.address, ttl_s=lease, margin_s=min(1.0, lease / 3))
            store.fence_with(_Won(self.election, 0))  # a standby writes nothing
            log.info("coordinator_standing_by", address=self.address, state=config.state)
            self._candidate = threading.Thread(target=self._campaign, name="campaign", daemon=True)
            self._candidate.start()
        else:
            assert self.coordinator is not None
            self.coordinator.cluster.address = self.address
            self.coordinator.start()
            self.leading.set()
            self._listening()
        return self

    def wait_leading(self, timeout: float) -> bool:
        """Whether this coordinator leads within ``timeout`` seconds."""
        return self.leading.wait(timeout)

    def _listening(self) -> None:
        assert self.coordinator is not None
        log.info(
            "coordinator_listening",
            address=self.address,
            state=self.config.state,
            term=self.election.term if self.election else None,
            auto_rebalance=self.coordinator.rebalancer.policy.enabled,
        )

    # ---- leading ---------------------------------------------------------------------

    def _lead(self, won: _Won) -> None:
        """Loads the state, finishes what a previous leader left in flight, and serves.

        Raises:
            NotLeader: the leadership ended (or the server stopped) meanwhile.
        """
        assert self.store is not None and isinstance(self.store, EtcdStore)
        fenced = self.store.fenced(won)  # this leadership's writes, and no other's
        coordinator = Coordinator(fenced, self.config, won.current, self.address)
        try:
            coordinator.start()
            with self._lock:
                if self._stop.is_set() or won.term == 0:
                    raise NotLeader(f"coordinator {self.address} stopped leading while loading")
                self.coordinator = coordinator
                self._gate.servicer = CoordinatorServicer(coordinator)
                self.leading.set()
        except BaseException:
            coordinator.close()
            raise
        self._listening()

    def _step_down(self) -> None:
        """Stops serving as leader: no more answers, loops or commands to stages (its
        calls in flight to them are cancelled: the leadership is over)."""
        with self._lock:
            self._gate.servicer = None
            self.leading.clear()
            coordinator, self.coordinator = self.coordinator, None
        if coordinator is not None:
            coordinator.close(cancel=True)

    def _campaign(self) -> None:
        """Campaigns, leads until the leadership is lost, and campaigns again; whatever
        fails, it stands by and tries again (with a growing pause), never holding the
        leader key without serving."""
        election = self.election
        assert election is not None
        pause = RECAMPAIGN_PAUSE_S
        try:
            while not self._stop.is_set():
                try:
                    term = election.campaign()
                except NotLeader:  # closed: the server stops
                    return
                except Exception as exc:  # etcd out of reach, or worse: try again
                    log.warning("coordinator_campaign_failed", error=str(exc))
                    self._stop.wait(pause)
                    pause = min(pause * 2, RECAMPAIGN_PAUSE_MAX_S)
                    continue
                try:
                    self._lead(_Won(election, term))
                    pause = RECAMPAIGN_PAUSE_S
                    while not self._stop.is_set() and not election.lost.wait(0.2):
                        pass
                    if self._stop.is_set():
                        return
                    log.warning("coordinator_stepped_down", address=self.address, term=term)
                    self._step_down()
                except Exception as exc:  # deposed while loading, or a failure: stand by
                    log.warning("coordinator_lead_failed", error=str(exc), exc_info=exc)
                    with contextlib.suppress(Exception):
                        self._step_down()
                        election.resign()
                    self._stop.wait(pause)
                    pause = min(pause * 2, RECAMPAIGN_PAUSE_MAX_S)
        finally:
            if not self._stop.is_set():
                log.error("coordinator_campaign_ended", address=self.address)
            election.close()

    def _leader_address(self) -> str:
        """The leader's address as the store says: the last one read (refreshed by one
        caller at a time, with one quick try per member, every ``LEADER_CACHE_S``)."""
        at, leader = self._leader_cache
        if self.election is None or time.monotonic() - at < LEADER_CACHE_S:
            return leader
        if not self._refreshing.acquire(blocking=False):
            return leader  # another call is reading it
        try:
            found = self.election.leader(quick=True)
            leader = found.address if found is not None else ""
        except ElasticPipeError:
            pass  # etcd out of reach: the last one read
        finally:
            self._leader_cache = (time.monotonic(), leader)
            self._refreshing.release()
        return leader

    def stop(self) -> None:
        """Stops the server, resigns any leadership and closes the store.

        On etcd the leadership goes first (a standby takes over; what this one was doing
        is settled by the next leader); on SQLite the server lets calls in flight finish,
        then the coordinator stops, as it always did."""
        self._stop.set()
        if self.election is not None:
            self.election.close()
            self._step_down()
            if self._candidate is not None:
                self._candidate.join(timeout=10)
            self._step_down()  # one that a campaign finished meanwhile
        if self._server is not None:
            self._server.stop()
        if self.metrics is not None:
            self.metrics.close()
        if self.election is None and self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None
        if self.store is not None:
            self.store.close()
