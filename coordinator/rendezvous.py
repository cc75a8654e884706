"""The rendezvous of the reduction engines on ``torch.distributed`` (``collectives="gloo"``
or ``"nccl"``): a ``TCPStore`` this coordinator serves, where the holders of each
reduction group find each other to open their process group.

The store is opened with the first job that asks for collectives and serves every job
after, while this coordinator leads (keys are prefixed by job, epoch, group and
generation). It listens on the
coordinator's own listen host only (a loopback cluster's store is loopback's), never more.
Neither it nor the process groups authenticate anyone: collectives are for trusted
fabrics, so a coordinator that requires mutual TLS refuses them.

**Standby coordinators.** Each leader serves the store itself: one that takes over serves
a new one on its own host and writes its address into the job, and the stages learn it
from their next heartbeat. A process group needs the store only while it opens, so the
groups open meet the leader's death unharmed; holders that opened a group on different
stores meanwhile time out on it, and the client's next run opens it again under a new
generation (``stage_server.collectives``).
"""

from __future__ import annotations

import datetime
import socket
import threading
from dataclasses import replace

from elasticpipe.coordinator.state import Cluster
from elasticpipe.errors import InvalidRequest
from elasticpipe.logs import get_logger
from elasticpipe.training.job import JobConfig
from elasticpipe.transport.serving import join_address, split_address

__all__ = ["REFUSED", "Rendezvous"]

log = get_logger(__name__)

STORE_TIMEOUT_S = 60.0
REFUSED = "-"  # a job's rendezvous that a restarted coordinator refuses to serve


class Rendezvous:
    """The coordinator's rendezvous store, opened on first use."""

    def __init__(self, cluster: Cluster):
        self.c = cluster
        self._lock = threading.Lock()
        self._store: object | None = None  # a torch.distributed.TCPStore (the server)
        self._port = 0

    def for_job(self, job: JobConfig) -> JobConfig:
        """``job`` with this coordinator's rendezvous address, if it asks for collectives.

        Raises:
            InvalidRequest: collectives asked of a coordinator that requires TLS (named).
        """
        if not job.collectives:
            return replace(job, rendezvous="")
        if self.c.config.tls is not None:
            raise InvalidRequest(
                f"collectives={job.collectives!r}: the process groups and their rendezvous "
                "carry gradients unauthenticated and in the clear, and this coordinator "
                "requires mutual TLS; use the default engine (the stages' data channel), "
                "which is exact and authenticated"
            )
        return replace(job, rendezvous=join_address(self._host(), self._serve()))

    def restored(self, job: JobConfig) -> JobConfig:
        """The running job loaded from the store, by a restarted coordinator or a standby
        that took over: its rendezvous served again, here, on the port the stages know if
        it is this host's and free (else on a new one, which the stages learn from their
        next heartbeat). Not with TLS: the job's reductions then fail, naming why, until
        it is started without collectives."""
        if not job.collectives or not job.rendezvous:
            return job
        if self.c.config.tls is not None:
            log.error(
                "rendezvous_refused",
                why="collectives need a plaintext coordinator",
                job=job.job_id,
            )
            return replace(job, rendezvous=REFUSED)
        known, port = split_address(job.rendezvous) if job.rendezvous != REFUSED else ("", 0)
        host = self._host(known)
        served = 0
        if known == host and port:
            try:
                served = self._serve(port)
            except (RuntimeError, OSError) as exc:  # taken meanwhile (the old leader?)
                log.warning("rendezvous_port_taken", port=port, error=str(exc)[:200])
        served = served or self._serve()
        return replace(job, rendezvous=join_address(host, served))

    def _host(self, known: str = "") -> str:
        """The host the stages reach this coordinator at: its advertised address's, else
        (a restarted lone coordinator, which learns its address after loading) ``known``,
        the host the job's rendezvous had."""
        if self.c.address:
            return split_address(self.c.address)[0]
        return known or "127.0.0.1"

    def close(self) -> None:
        """Stops serving the store (a leadership that ended, a coordinator that stops):
        the stages learn the next leader's from their heartbeats."""
        with self._lock:
            self._store, self._port = None, 0  # (freed, the store closes its socket)

    def _serve(self, port: int = 0) -> int:
        """Opens the store (once) on the coordinator's listen host; returns its port."""
        with self._lock:
            if self._store is None:
                import torch.distributed as dist  # (only a job of collectives needs it)

                host, _ = split_address(self.c.config.listen)
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                # TCPStore binds every interface by itself: it serves a socket bound here.
                # Detached, it is the store's for good (closed under it, the store aborts).
                listening = socket.create_server((host, port), family=family)
                bound = listening.getsockname()[1]
                store = dist.TCPStore(  # type: ignore[attr-defined]
                    host,
                    bound,
                    is_master=True,
                    wait_for_workers=False,
                    timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
                    master_listen_fd=listening.detach(),
                    use_libuv=False,
                )
                self._store, self._port = store, int(bound)
                log.info("rendezvous_serving", host=host, port=self._port)
            return self._port
