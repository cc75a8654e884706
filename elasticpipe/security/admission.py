"""Who gets a server's workers: per-peer caps, reserved workers, stream timeouts.

A gRPC server of the project serves every call on a worker thread of a fixed pool, so
an authorised but hostile (or broken) peer could otherwise take every worker -- streams
that never send, many slow calls -- and leave nothing for heartbeats and admins. Three
guards, all set by ``Limits``:

* **Per-peer cap.** A peer (its certificate's name with TLS; its host in plaintext) has
  at most ``per_peer`` calls in flight on one server; one more is refused at once with
  ``RESOURCE_EXHAUSTED`` naming the cap. Plaintext loopback peers are not capped: every
  process of a local cluster shares 127.0.0.1.
* **Reserved workers.** ``Heartbeat``, ``Register``, ``Status``, ``GetStats`` and health
  checks run on a small pool of their own (``RoutingExecutor``), so they never queue
  behind long calls.
* **Stream timeouts.** A client stream (``Forward``, ``Backward``, ``Targets``,
  ``RestoreLayers``, ``PushSnapshot``) must send its first message within
  ``first_message_s`` and each later one within ``idle_s``; otherwise the call is
  cancelled (``StreamWatchdog``), which ends the handler and releases what it reserved
  (a mailbox reservation, a half-assembled tensor).

Operators tune them with environment variables (``Limits.from_env``), named in
``docs/security.md``.
"""

from __future__ import annotations

import contextlib
import heapq
import ipaddress
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from elasticpipe.errors import DeadlineExceeded, InvalidRequest, TooLarge
from elasticpipe.logs import get_logger

log = get_logger(__name__)

ENV_PER_PEER = "ELASTICPIPE_MAX_CALLS_PER_PEER"
ENV_FIRST_MESSAGE_S = "ELASTICPIPE_STREAM_FIRST_MESSAGE_S"
ENV_IDLE_S = "ELASTICPIPE_STREAM_IDLE_S"
ENV_WATCH_S = "ELASTICPIPE_MAX_WATCH_S"

# Quick calls that must answer while everything else is busy: liveness and inspection.
RESERVED_METHODS = frozenset(
    {
        "/elasticpipe.v1.CoordinatorService/Heartbeat",
        "/elasticpipe.v1.CoordinatorService/Register",
        "/elasticpipe.v1.CoordinatorService/Status",
        "/elasticpipe.v1.StageService/GetStats",
        "/grpc.health.v1.Health/Check",
    }
)
RESERVED_WORKERS = 4

T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """How much of a server one peer or one stream may hold.

    Attributes:
        per_peer: calls in flight per peer (certificate name, or host in plaintext).
        first_message_s: a client stream's first message arrives within this.
        idle_s: each later message of a client stream arrives within this.
        watch_s: a ``WatchPartition`` stream ends after this (the watcher calls again).
    """

    per_peer: int = 16
    first_message_s: float = 30.0
    idle_s: float = 30.0
    watch_s: float = 300.0

    @classmethod
    def from_env(cls) -> Limits:
        """The defaults, overridden by the ``ELASTICPIPE_*`` variables that are set.

        Raises:
            InvalidRequest: a variable that is not a positive number.
        """
        d = cls()
        return cls(
            per_peer=int(_env(ENV_PER_PEER, d.per_peer)),
            first_message_s=_env(ENV_FIRST_MESSAGE_S, d.first_message_s),
            idle_s=_env(ENV_IDLE_S, d.idle_s),
            watch_s=_env(ENV_WATCH_S, d.watch_s),
        )


def _env(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise InvalidRequest(f"${name} must be a positive number (got {raw!r})")
    return value


# ---- per-peer cap ------------------------------------------------------------------


def peer_key(context: grpc.ServicerContext, identity: tuple[str, str] | None) -> str | None:
    """Whom a call counts against: the certificate's name with TLS, else the peer's host;
    None for a plaintext loopback peer (not capped)."""
    if identity is not None:
        return f"{identity[1]} {identity[0]!r}"
    peer = context.peer() or ""  # "ipv4:127.0.0.1:5000", "ipv6:[::1]:5000", "unix:..."
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return None
    host = rest.rpartition(":")[0].strip("[]")
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        pass
    return f"host {host or peer}"


class PeerLimiter:
    """Counts each peer's calls in flight and refuses one over the cap."""

    def __init__(self, per_peer: int):
        self.per_peer = per_peer
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, key: str | None, method: str) -> Iterator[None]:
        """A place for one call of ``key`` (None: not counted).

        Raises:
            TooLarge: ``key`` already has ``per_peer`` calls in flight.
        """
        if key is None:
            yield
            return
        with self._lock:
            n = self._calls.get(key, 0)
            if n >= self.per_peer:
                raise TooLarge(
                    f"{key} already has {n} calls in flight on this server (at most "
                    f"{self.per_peer} per peer, ${ENV_PER_PEER}); {method} refused, retry later"
                )
            self._calls[key] = n + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._calls[key] - 1
                if left:
                    self._calls[key] = left
                else:
                    del self._calls[key]

    def in_flight(self, key: str) -> int:
        """Calls of ``key`` in flight now."""
        with self._lock:
            return self._calls.get(key, 0)


# ---- reserved workers --------------------------------------------------------------


class RoutingExecutor(futures.ThreadPoolExecutor):
    """The server's worker pool: ``RESERVED_METHODS`` run on a few workers of their own,
    everything else on the main pool, so a busy main pool never delays a heartbeat."""

    def __init__(self, max_workers: int, reserved_workers: int = RESERVED_WORKERS):
        super().__init__(max_workers, thread_name_prefix="rpc")
        self._reserved = futures.ThreadPoolExecutor(
            reserved_workers, thread_name_prefix="rpc-reserved"
        )

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> futures.Future[T]:
        if _method_of(args) in RESERVED_METHODS:
            return self._reserved.submit(fn, *args, **kwargs)
        return super().submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait, cancel_futures=cancel_futures)
        self._reserved.shutdown(wait, cancel_futures=cancel_futures)


def _method_of(args: tuple[Any, ...]) -> str:
    """The method a gRPC server task serves: grpcio submits ``(context.run, handler,
    rpc_event, ...)``, and the call's event carries the method's path."""
    for arg in args[:3]:
        method = getattr(getattr(arg, "call_details", None), "method", None)
        if isinstance(method, bytes):
            return method.decode("ascii", "replace")
    return ""


# ---- stream timeouts ---------------------------------------------------------------


class StreamWatchdog:
    """One thread that cancels client streams whose next message is overdue."""

    def __init__(self, first_message_s: float, idle_s: float):
        self.first_message_s = first_message_s
        self.idle_s = idle_s
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, grpc.ServicerContext]] = []
        self._due: dict[int, float] = {}  # watch id -> its current deadline
        self._expired: set[int] = set()
        self._queued: set[int] = set()  # watch ids with an entry in the heap
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, raw: Iterator[T], context: grpc.ServicerContext, method: str) -> Iterator[T]:
        """``raw``'s messages, cancelling the call if one is overdue.

        Raises:
            DeadlineExceeded: the first message took over ``first_message_s``, or a later
                one over ``idle_s`` (the call is already cancelled).
        """
        wid = next(self._ids)
        limit = self.first_message_s
        try:
            while True:
                self._arm(wid, context, limit)
                try:
                    item = next(raw)
                except StopIteration:
                    return
                except Exception:
                    if wid in self._expired:
                        log.warning("client_stream_cut", method=method, silent_s=limit)
                        raise DeadlineExceeded(
                            f"{method}: no message for {limit:g} s (a client stream sends "
                            f"its first message within {self.first_message_s:g} s and the "
                            f"next within {self.idle_s:g} s); call cancelled"
                        ) from None
                    raise
                finally:
                    self._disarm(wid)
                yield item
                limit = self.idle_s
        finally:
            with self._cond:
                self._due.pop(wid, None)
                self._expired.discard(wid)

    def _arm(self, wid: int, context: grpc.ServicerContext, limit: float) -> None:
        due = time.monotonic() + limit
        with self._cond:
            self._due[wid] = due
            if wid not in self._queued:  # one heap entry per stream, moved on when popped
                self._queued.add(wid)
                heapq.heappush(self._heap, (due, wid, context))
                self._cond.notify()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="stream-watchdog", daemon=True
                )
                self._thread.start()

    def _disarm(self, wid: int) -> None:
        with self._cond:
            self._due.pop(wid, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap:
                    self._cond.wait()
                due, wid, context = self._heap[0]
                now = time.monotonic()
                if due > now:
                    self._cond.wait(due - now)
                    continue
                heapq.heappop(self._heap)
                current = self._due.get(wid)
                if current is None:  # answered and not waiting again, or finished
                    self._queued.discard(wid)
                    continue
                if current > now:  # a later message moved its deadline on
                    heapq.heappush(self._heap, (current, wid, context))
                    continue
                self._queued.discard(wid)
                del self._due[wid]
                self._expired.add(wid)
            context.cancel()  # type: ignore[no-untyped-call]  # grpc-stubs leave it untyped


class Guard:
    """A server's per-peer cap and stream watchdog, applied by ``elasticpipe.transport.rpc``."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.peers = PeerLimiter(limits.per_peer)
        self.streams = StreamWatchdog(limits.first_message_s, limits.idle_s)

    def hold(
        self, context: grpc.ServicerContext, identity: tuple[str, str] | None, method: str
    ) -> contextlib.AbstractContextManager[None]:
        """The caller's place for one call (``PeerLimiter.hold``)."""
        return self.peers.hold(peer_key(context, identity), method)
