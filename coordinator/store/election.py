"""A leader election on etcd: one coordinator leads a store, the others wait for its place.

The leader is whoever created ``PREFIX/leader`` under its own lease (a ``Txn`` on
``create_revision == 0``). Its **term** is that key's ``create_revision``: etcd's revisions
only grow, so every later leader has a higher term, and a term names one leadership exactly.

    candidate ──campaign()──► key absent? ──yes──► leader (term = create_revision)
        ▲                        │ no                 │ keep-alive every ttl/3
        └── the key is deleted ◄─┘ (watch)            │ no renewal for ttl - margin
            (resigned, or its lease expired)          ▼
                                                   lost (step down; never write again)

A leader's writes are conditioned on its key still having its term
(``EtcdStore.fence_with``), so a deposed leader cannot write even before it notices. It
also steps down by itself (``lost`` is set) once it has failed to renew its lease for
``ttl_s - margin_s``: before etcd lets the lease expire and hands the key to a standby.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass

import grpc

from elasticpipe.coordinator.store.etcd import EtcdStore, created_at
from elasticpipe.errors import ElasticPipeError, NotLeader
from elasticpipe.etcdpb import kv_pb2
from elasticpipe.etcdpb import rpc_pb2 as pb
from elasticpipe.etcdpb import rpc_pb2_grpc as pb_grpc
from elasticpipe.logs import get_logger

log = get_logger(__name__)

QUICK_READ_S = 0.3  # a quick read of who leads: one try per member


@dataclass(frozen=True)
class Leader:
    """Who leads a store: its address and its term."""

    address: str
    term: int


class Election:
    """One candidate's side of the election on ``store``'s prefix."""

    def __init__(self, store: EtcdStore, address: str, ttl_s: int = 5, margin_s: float = 1.5):
        if ttl_s < 2 or not 0 < margin_s < ttl_s * 2 / 3:
            raise ValueError(
                f"a leader lease of {ttl_s} s with a margin of {margin_s} s: the lease must "
                "be at least 2 s and the margin leave at least one renewal (ttl/3) before it"
            )
        self.store = store
        self.address = address
        self.ttl_s = ttl_s
        self.margin_s = margin_s
        self.key = f"{store.prefix}/leader".encode()
        self.term = 0  # 0: not leading
        self.lost = threading.Event()  # set when a leadership ended without resign()
        self._lease = 0
        self._lease_from = 0.0  # when the request that last granted or renewed it was sent
        self._stop = threading.Event()
        self._closed = False  # close(): no campaign ever again
        self._renewer: threading.Thread | None = None

    # ---- who leads ---------------------------------------------------------------------

    def leader(self, quick: bool = False) -> Leader | None:
        """The current leader, or None while nobody leads. ``quick``: one pass over the
        members, a short try each (a standby naming the leader must not wait out an
        outage)."""
        request = pb.RangeRequest(key=self.key)
        found = self.store.call(
            lambda ch, timeout: pb_grpc.KVStub(ch).Range(request, timeout=timeout),
            **({"retry_for_s": 0.0, "attempt_s": QUICK_READ_S} if quick else {}),
        ).kvs
        if not found:
            return None
        return Leader(json.loads(found[0].value)["address"], found[0].create_revision)

    def current_term(self) -> int:
        """This candidate's term while it leads.

        Raises:
            NotLeader: it does not lead (never did, stepped down or resigned).
        """
        term = self.term
        if term == 0:
            raise NotLeader(f"coordinator {self.address} does not lead {self.store.prefix}")
        return term

    # ---- campaign ----------------------------------------------------------------------

    def campaign(self, timeout_s: float | None = None) -> int:
        """Blocks until this candidate leads (returns its term) or ``timeout_s`` passes
        (TimeoutError). While another leads, it waits for that leader's key to go.
        ``resign()`` from another thread ends the wait (NotLeader)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._stop.clear()
        value = json.dumps({"address": self.address, "at": time.time()}).encode()
        absent = created_at(self.key, 0)
        while True:
            self._check_not_stopped()
            # A lease that lapsed while this candidate stood by (etcd out of reach) would
            # make etcd refuse the create: renew it, or take a new one, just before.
            if not self._lease or self._keep_alive_once() is not True:
                self._lease = self._grant()
            put = pb.RequestOp(
                request_put=pb.PutRequest(key=self.key, value=value, lease=self._lease)
            )
            read = pb.RequestOp(request_range=pb.RangeRequest(key=self.key))
            answer = self.store.txn(pb.TxnRequest(compare=[absent], success=[put], failure=[read]))
            term = self._term_won(answer)
            if term:
                self.term = term
                self.lost.clear()
                self._renewer = threading.Thread(
                    target=self._renew, name="leader-lease", daemon=True
                )
                self._renewer.start()
                log.info("coordinator_leads", address=self.address, term=self.term)
                return self.term
            current = self.leader()
            log.info("coordinator_stands_by", leader=current.address if current else "")
            self._wait_for_vacancy(deadline)

    def _term_won(self, answer: pb.TxnResponse) -> int:
        """The term a create Txn won, or 0. A Txn that ``call`` sent again after its first
        try applied finds the key under this candidate's own lease: that is a win too."""
        if answer.succeeded:
            return int(answer.header.revision)  # the revision that created the key
        held = answer.responses[0].response_range.kvs if answer.responses else []
        if held and held[0].lease == self._lease:
            return int(held[0].create_revision)
        return 0

    def _check_not_stopped(self) -> None:
        if self._stop.is_set() or self._closed:
            raise NotLeader(f"{self.address} resigned while campaigning")

    def _grant(self) -> int:
        request = pb.LeaseGrantRequest(TTL=self.ttl_s)
        sent = time.monotonic()
        answer = self.store.call(
            lambda ch, timeout: pb_grpc.LeaseStub(ch).LeaseGrant(request, timeout=timeout)
        )
        self._lease_from = sent
        return int(answer.ID)

    def _wait_for_vacancy(self, deadline: float | None) -> None:
        """Returns once the leader key is gone (or at once if it already is). Watching
        from the revision read keeps a delete between the read and the watch from being
        missed. The candidate's own lease is kept alive meanwhile."""
        while True:
            self._check_not_stopped()
            found = self.store.range(self.key)
            if not found.kvs:
                return
            start = found.header.revision + 1
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"{self.address} did not become leader in time")
            wait = min(self.ttl_s / 3, left) if left is not None else self.ttl_s / 3
            self._keep_alive_once()  # campaign() takes a new lease if this one lapsed
            if self._deleted_since(start, wait):
                return

    def _deleted_since(self, start: int, wait_s: float) -> bool:
        """Whether the leader key is deleted at or after revision ``start``, watching for
        up to ``wait_s`` seconds."""
        create = pb.WatchCreateRequest(key=self.key, start_revision=start)

        def watch(channel: grpc.Channel, timeout: float) -> bool:
            requests = iter([pb.WatchRequest(create_request=create)])
            stream = pb_grpc.WatchStub(channel).Watch(requests, timeout=min(wait_s, timeout))
            try:
                for answer in stream:
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

        return self.store.call(watch, attempt_s=wait_s)

    # ---- holding the lease ---------------------------------------------------------------

    def _keep_alive_once(self, until: float | None = None) -> bool | None:
        """A renewal of this candidate's lease (on any member, trying until ``until``, or
        one pass): True if renewed, False if etcd says the lease is gone, None if no member
        answered. On True, ``_lease_from`` is when the renewal was sent."""
        request = pb.LeaseKeepAliveRequest(ID=self._lease)

        def renew(channel: grpc.Channel, timeout: float) -> pb.LeaseKeepAliveResponse:
            stream = pb_grpc.LeaseStub(channel).LeaseKeepAlive(iter([request]), timeout=timeout)
            return next(iter(stream))

        retry_for = 0.0 if until is None else max(0.0, until - time.monotonic())
        sent = time.monotonic()
        try:
            answer = self.store.call(renew, retry_for_s=retry_for, attempt_s=self.ttl_s / 6)
        except (ElasticPipeError, StopIteration):
            return None
        if answer.TTL <= 0:
            return False
        self._lease_from = sent
        return True

    def _renew(self) -> None:
        """Renews the lease every ttl/3 while leading. Steps down (``lost``) by
        ``ttl_s - margin_s`` after the last renewal that etcd accepted was *sent* (the
        lease runs at least ``ttl_s`` from then on etcd's side), whatever a call is doing
        at that moment, or at once when etcd says the lease is gone."""
        while True:
            step_down_at = self._lease_from + self.ttl_s - self.margin_s
            wait = min(self.ttl_s / 3, step_down_at - time.monotonic())
            if self._stop.wait(max(0.0, wait)):
                return
            if time.monotonic() >= step_down_at:
                break
            if self._keep_alive_once(until=step_down_at) is False:
                break
            if self._stop.is_set():
                return
        log.warning("coordinator_leadership_lost", address=self.address, term=self.term)
        self.term = 0
        # A later campaign takes a new lease, so that it can only win a new key under a
        # higher term, never this one again (whose leftovers must stay fenced out).
        lease, self._lease = self._lease, 0
        self._revoke(lease)
        self.lost.set()

    def _revoke(self, lease: int) -> None:
        """Revokes ``lease`` (deleting the key it holds), one quick try: it expires anyway."""
        if not lease:
            return
        request = pb.LeaseRevokeRequest(ID=lease)
        with contextlib.suppress(ElasticPipeError):
            self.store.call(
                lambda ch, timeout: pb_grpc.LeaseStub(ch).LeaseRevoke(request, timeout=timeout),
                retry_for_s=0,
            )

    def close(self) -> None:
        """Resigns for good: a campaign running or started later raises NotLeader."""
        self._closed = True
        self.resign()

    def resign(self) -> None:
        """Gives up leading (or campaigning, in another thread): revokes the lease, which
        deletes the key."""
        self._stop.set()
        self.term = 0
        if self._renewer is not None:
            self._renewer.join(timeout=self.ttl_s)
        lease, self._lease = self._lease, 0
        self._revoke(lease)
