"""What the operator chose for the coordinator: one frozen record, parsed once at start-up.

The stage has ``StageConfig``; this is its counterpart, handed whole from the command line
(``elasticpipe coordinator``) or a test to ``CoordinatorServer``, which gives it to the
``Coordinator`` and its ``Cluster``: no layer threads the fields one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elasticpipe.coordinator.planning.policy import PolicyConfig
from elasticpipe.coordinator.store.etcd import EtcdTLS
from elasticpipe.errors import InvalidRequest
from elasticpipe.security.tls import TLS

__all__ = ["CoordinatorConfig"]


@dataclass(frozen=True)
class CoordinatorConfig:
    """The coordinator's settings (``elasticpipe coordinator --help`` describes each flag)."""

    listen: str = "127.0.0.1:0"
    state: str = ":memory:"  # the store URL (sqlite:PATH, a bare path, etcd://...; see --store)
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # automatic rebalancing
    dead_after_s: float = 5.0  # a stage silent this long is dead
    heartbeat_interval_s: float = 1.0  # what stages are told to beat at
    link_bandwidth: float = 0.0  # bytes/s of every link for planning (0: unknown)
    pause_at: str = ""  # fault injection: pause at this protocol point (tests)
    freeze_lease_s: float = 60.0  # how long a frozen stage waits for news of its epoch change
    tls: TLS | None = None  # mutual TLS for the service and the calls to stages
    insecure: bool = False  # plaintext beyond loopback, on a trusted network
    advertise: str = ""  # the address others use (default: derived from the listen address)
    metrics_port: int | None = None  # serve Prometheus metrics here (0: any port)
    metrics_listen: str = ""  # the metrics' host (default: the listen host)
    leader_lease_s: int = 3  # on etcd: the leader's lease; a standby leads this soon after
    etcd_tls: EtcdTLS | None = None  # TLS to etcd (None: plaintext)

    def __post_init__(self) -> None:
        for name in ("dead_after_s", "heartbeat_interval_s", "freeze_lease_s"):
            value = getattr(self, name)
            if not value > 0:
                raise InvalidRequest(f"coordinator {name} must be positive, got {value!r}")
        if not isinstance(self.leader_lease_s, int) or self.leader_lease_s < 2:
            raise InvalidRequest(
                f"coordinator leader_lease_s must be a whole number of seconds >= 2, got "
                f"{self.leader_lease_s!r}"
            )
        if self.link_bandwidth < 0:
            raise InvalidRequest(
                f"coordinator link_bandwidth must be >= 0, got {self.link_bandwidth!r}"
            )
