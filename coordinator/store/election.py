"""A leader election on etcd: one coordinator leads a store, the others wait for its place.

The leader is whoever created ``PREFIX/leader`` under its own lease (a ``Txn`` on
``create_revision == 0``). Its **term** is that key's ``create_revision``: etcd's revisions
only grow, so every later leader has a higher term, and a term names one leadership exactly.

    candidate ──campaign()──► key absent? ──yes──► leader (term = create_revision)
        ▲                        │ no                 │ keep-alive every ttl/3
        └── the key is deleted ◄─┘ (watch)            │ no renewal for ttl - margin
            (resigned, or its lease expired)          ▼
                                                   lost (step down; never write again)

A leader's writes are conditioned on its key still having its term (``guard``), so a
deposed leader cannot write even before it notices. It also steps down by itself
(``lost`` is set) once it has failed to renew its lease for ``ttl_s - margin_s``: before
etcd lets the lease expire and hands the key to a standby.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass

import grpc

from elasticpipe.coordinator.store.etcd import CALL_TIMEOUT_S, EtcdStore
from elasticpipe.errors import ElasticPipeError
from elasticpipe.etcdpb import kv_pb2
from elasticpipe.etcdpb import rpc_pb2 as pb
from elasticpipe.etcdpb import rpc_pb2_grpc as pb_grpc
from elasticpipe.logs import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class Leader:
    """Who leads a store: its address and its term."""

    address: str
    term: int


class Election:
    """One candidate's side of the election on ``store``'s prefix."""

    def __init__(self, store: EtcdStore, address: str, ttl_s: int = 5, margin_s: float = 1.5):
        if ttl_s < 2 or not 0 < margin_s < ttl_s:
            raise ValueError(f"a leader lease of {ttl_s} s with a margin of {margin_s} s")
        self.store = store
        self.address = address
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self.key = f"{store.prefix}/leader".encode()
        self.term = 0  # 0: not leading
        self.lost = threading.Event()  # set when a leadership ended without resign()
        self._lease = 0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ---- who leads ---------------------------------------------------------------------

    def leader(self) -> Leader | None:
        """The current leader, or None while nobody leads."""
        found = self.store._range(self.key).kvs
        if not found:
            return None
        return Leader(json.loads(found[0].value)["address"], found[0].create_revision)

    def guard(self) -> pb.Compare:
        """The condition every write of this leader carries: its key has its term."""
        return pb.Compare(
            key=self.key,
            target=pb.Compare.CREATE,
            result=pb.Compare.EQUAL,
            create_revision=self.term,
        )

    # ---- campaign ----------------------------------------------------------------------

    def campaign(self, timeout_s: float | None = None) -> int:
        """Blocks until this candidate leads (returns its term) or ``timeout_s`` passes
        (TimeoutError). While another leads, it waits for that leader's key to go."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._lease = self._grant()
        value = json.dumps({"address": self.address, "at": time.time()}).encode()
        while True:
            absent = pb.Compare(
                key=self.key, target=pb.Compare.CREATE, result=pb.Compare.EQUAL, create_revision=0
            )
            put = pb.RequestOp(
                request_put=pb.PutRequest(key=self.key, value=value, lease=self._lease)
            )
            answer = self.store._txn(pb.TxnRequest(compare=[absent], success=[put]))
            if answer.succeeded:
                self.term = answer.header.revision  # the revision that created the key
                self.lost.clear()
                self._stop.clear()
                self._renewer = threading.Thread(
                    target=self._renew, name="leader-lease", daemon=True
                )
                self._renewer.start()
                log.info("coordinator_leads", address=self.address, term=self.term)
                return self.term
            current = self.leader()
            log.info("coordinator_stands_by", leader=current.address if current else "")
            self._wait_for_vacancy(deadline)

    def _grant(self) -> int:
        request = pb.LeaseGrantRequest(TTL=self.ttl_s)
        answer = self.store._call(
            lambda ch: pb_grpc.LeaseStub(ch).LeaseGrant(request, timeout=CALL_TIMEOUT_S)
        )
        return int(answer.ID)

    def _wait_for_vacancy(self, deadline: float | None) -> None:
        """Returns once the leader key is gone (or at once if it already is). Watching
        from the revision read keeps a delete between the read and the watch from being
        missed. The candidate's own lease is kept alive meanwhile."""
        while True:
            found = self.store._range(self.key)
            if not found.kvs:
                return
            start = found.header.revision + 1
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{self.address} did not become leader in time")
            wait = min(self.ttl_s / 3, left) if left is not None else self.ttl_s / 3
            if self._keep_alive_once() is False:  # it lapsed while etcd was out of reach
                self._lease = self._grant()
            if self._deleted_since(start, wait):
                return

    def _deleted_since(self, start: int, wait_s: float) -> bool:
        """Whether the leader key is deleted at or after revision ``start``, watching for
        up to ``wait_s`` seconds."""
        create = pb.WatchCreateRequest(key=self.key, start_revision=start)

        def watch(channel: grpc.Channel) -> bool:
            requests = iter([pb.WatchRequest(create_request=create)])
            try:
                for answer in pb_grpc.WatchStub(channel).Watch(requests, timeout=wait_s):
                    if any(e.type == kv_pb2.Event.DELETE for e in answer.events):
                        return True
            except grpc.RpcError as exc:
                # The wait ran out: gRPC says DEADLINE_EXCEEDED, or etcd ends the stream
                # first with UNKNOWN "context deadline exceeded".
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" not in str(
                    exc.details()
                ):
                    raise
            return False

        return self.store._call(watch)

    # ---- holding the lease ---------------------------------------------------------------

    def _keep_alive_once(self) -> bool | None:
        """One renewal of this candidate's lease (on any member): True if renewed, False
        if etcd says the lease is gone, None if no member answered."""
        request = pb.LeaseKeepAliveRequest(ID=self._lease)
        timeout = min(CALL_TIMEOUT_S, self.ttl_s / 3)

        def renew(channel: grpc.Channel) -> pb.LeaseKeepAliveResponse:
            stream = pb_grpc.LeaseStub(channel).LeaseKeepAlive(iter([request]), timeout=timeout)
            return next(iter(stream))

        try:
            return self.store._call(renew, retry_for_s=0).TTL > 0  # one pass: _renew times it
        except (grpc.RpcError, ElasticPipeError, StopIteration):
            return None

    def _renew(self) -> None:
        """Renews the lease every ttl/3; steps down (``lost``) once no renewal succeeded for
        ``ttl_s - margin_s`` seconds, or when etcd says the lease is gone."""
        renewed = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            answer = self._keep_alive_once()
            if answer:
                renewed = time.monotonic()
            elif answer is False or time.monotonic() - renewed >= self.ttl_s - self.margin_s:
                break
        if not self._stop.is_set():
            log.warning("coordinator_leadership_lost", address=self.address, term=self.term)
            self.term = 0
            self.lost.set()

    def resign(self) -> None:
        """Gives up leading (or campaigning): revokes the lease, which deletes the key."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=self.ttl_s)
        if self._lease:
            request = pb.LeaseRevokeRequest(ID=self._lease)
            with contextlib.suppress(grpc.RpcError, ElasticPipeError):  # it expires anyway
                self.store._call(
                    lambda ch: pb_grpc.LeaseStub(ch).LeaseRevoke(request, timeout=CALL_TIMEOUT_S)
                )
        self.term = 0
        self._lease = 0
