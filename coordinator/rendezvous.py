"""The rendezvous of the reduction engines on ``torch.distributed`` (``collectives="gloo"``
or ``"nccl"``): a ``TCPStore`` this coordinator serves, where the holders of each
reduction group find each other to open their process group.

The store is opened with the first job that asks for collectives and serves every job
after (keys are prefixed by job, epoch, group and generation). It listens on the
coordinator's own listen host only (a loopback cluster's store is loopback's), never more.
Neither it nor the process groups authenticate anyone: collectives are for trusted
fabrics, so a coordinator that requires mutual TLS refuses them, and so, for now, does one
with standby coordinators (the store would die with its leader).
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
            InvalidRequest: collectives asked of a coordinator that requires TLS, or that
                runs with standby coordinators (named).
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
        if self.c.elected:
            raise InvalidRequest(
                f"collectives={job.collectives!r} with standby coordinators is not built "
                "yet: the rendezvous store lives on one coordinator; use the default engine"
            )
        host, _ = split_address(self.c.address or "127.0.0.1:0")
        return replace(job, rendezvous=join_address(host, self._serve()))

    def restored(self, job: JobConfig) -> JobConfig:
        """The running job loaded from the store after a restart: its rendezvous served
        again, on the port the stages know if it is free (else on a new one, which the
        stages learn from their next heartbeat). Not with TLS, or standby coordinators:
        the job's reductions then fail, naming why, until it is started without
        collectives."""
        if not job.collectives or not job.rendezvous:
            return job
        if self.c.config.tls is not None or self.c.elected:
            log.error(
                "rendezvous_refused",
                why="collectives need a plaintext coordinator without standbys",
                job=job.job_id,
            )
            return replace(job, rendezvous=REFUSED)
        host, port = split_address(job.rendezvous)
        try:
            served = self._serve(port)
        except (RuntimeError, OSError) as exc:  # taken meanwhile
            log.warning("rendezvous_port_taken", port=port, error=str(exc)[:200])
            served = self._serve()
        return replace(job, rendezvous=join_address(host, served))

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
