"""The coordinators a caller knows, and calls that follow their leader.

Stages, clients and the admin CLI are given every coordinator's address
(``--coordinator a:7100,b:7100,c:7100``). Only one leads; the others stand by and answer
every call with ``StandingBy``, naming the leader. A call here goes to the address that
answered last; a standby's answer sends it to the leader at once, and an address that
cannot be reached sends it to the next one, in passes over the list with a growing pause,
until the call's own timeout. With one address a call is a plain call: its errors are the
caller's, as they always were.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from elasticpipe import errors
from elasticpipe.logs import get_logger
from elasticpipe.security.tls import TLS
from elasticpipe.transport import rpc
from elasticpipe.transport.serving import check_dial_address
from elasticpipe.v1 import coordinator_pb2_grpc

log = get_logger(__name__)

PAUSE_START_S = 0.05  # between two passes over the list; doubles up to PAUSE_MAX_S
PAUSE_MAX_S = 0.5
LAST_TRY_S = 0.05  # the least time left worth one more pass
CONNECT_S = 1.0  # with several addresses: how long one may take to answer a health check


def parse_coordinators(addresses: str | Sequence[str]) -> list[str]:
    """``"a:7100,b:7100"`` (or a list of addresses) as a checked list, duplicates dropped.

    Raises:
        InvalidRequest: no address, or one that cannot be dialled (named).
    """
    given = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    checked: list[str] = []
    for address in (a.strip() for a in given):
        if address and address not in checked:
            checked.append(check_dial_address(address, "coordinator address"))
    if not checked:
        raise errors.InvalidRequest(
            f"no coordinator address in {addresses!r}: give HOST:PORT[,HOST:PORT...]"
        )
    return checked


def _dialable(address: str) -> bool:
    """Whether a standby's hint is an address this caller may dial."""
    try:
        check_dial_address(address, "leader address")
    except errors.ElasticPipeError:
        return False
    return True


def _never_sent(exc: errors.ElasticPipeError) -> bool:
    """Whether a call failed before it reached any coordinator (gRPC could not connect),
    so that sending it elsewhere cannot make it run twice."""
    return "failed to connect to all addresses" in str(exc)


class Coordinators:
    """Channels to the coordinators at ``addresses``, and calls to the one that leads."""

    def __init__(self, addresses: str | Sequence[str], tls: TLS | None = None):
        self.addresses = parse_coordinators(addresses)
        self._tls = tls
        self._lock = threading.Lock()
        self._current = self.addresses[0]
        self._stubs: dict[str, coordinator_pb2_grpc.CoordinatorServiceStub] = {}
        self._channels: dict[str, grpc.Channel] = {}
        self._answered: set[str] = set()  # addresses that answered since they last failed

    def __str__(self) -> str:
        return ",".join(self.addresses)

    @property
    def leader(self) -> str:
        """The address calls go to now: the one that answered last."""
        return self._current

    def _stub(self, address: str) -> coordinator_pb2_grpc.CoordinatorServiceStub:
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                channel = self._channels[address] = rpc.channel(address, self._tls)
                stub = self._stubs[address] = coordinator_pb2_grpc.CoordinatorServiceStub(channel)
            return stub

    def _answers(self, address: str, wait_s: float) -> bool:
        """Whether the process at ``address`` answers: it did before, or it answers a
        health check within ``wait_s`` (a frozen process accepts the connection and never
        answers; one that refuses it fails at once)."""
        if address in self._answered:
            return True
        self._stub(address)
        with self._lock:
            channel = self._channels[address]
        check = health_pb2_grpc.HealthStub(channel).Check
        try:
            reply = check(health_pb2.HealthCheckRequest(), timeout=max(wait_s, 0.001))
        except grpc.RpcError:
            return False
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return False  # shutting down
        self._answered.add(address)
        return True

    def _follow(self, address: str) -> None:
        with self._lock:
            if address != self._current:
                log.info("coordinator_followed", old=self._current, new=address)
            self._current = address

    def _after(self, address: str) -> str:
        """The address to try after ``address``: the next in the list."""
        if address not in self.addresses:
            return self.addresses[0]
        return self.addresses[(self.addresses.index(address) + 1) % len(self.addresses)]

    def call(
        self, method: str, request: Any, timeout: float, once: bool = False, **kwargs: Any
    ) -> Any:
        """Calls CoordinatorService ``method`` on the leader within ``timeout`` seconds.

        ``once``: a command that must not run twice (a move): a standby's refusal is still
        followed to the leader (the standby did nothing), and so is an address that
        refused the connection; but a coordinator lost in the middle of the call, or one
        that did not answer in time, may have acted: that error is raised at once (a
        ``DeadlineExceeded`` as itself), and the next call starts at the next address.
        Without ``once``, a leader's ``NotLeader`` (it just lost etcd) is followed too.

        Raises:
            CoordinatorUnavailable: no coordinator answered as leader in time (the last
                error: ``StandingBy`` where only standbys answered).
            ElasticPipeError: the leader's own answer.
        """
        if len(self.addresses) > 1:
            # Waiting for one address to be ready would spend the whole timeout on a dead
            # leader: the passes over the list are the wait.
            kwargs.pop("wait_for_ready", None)
        deadline = time.monotonic() + timeout
        address = self._current
        pause = PAUSE_START_S
        tried: set[str] = set()  # in this pass
        last: errors.ElasticPipeError | None = None
        while True:
            left = deadline - time.monotonic()
            wait = min(CONNECT_S, left / 2)
            if len(self.addresses) > 1 and not self._answers(address, wait):
                # Nothing answers there (a host gone silent, a process frozen): the call
                # was not sent; the others are tried, and this one again next pass.
                tried.add(address)
                last = errors.CoordinatorUnavailable(
                    f"coordinator {address} did not answer a health check within {wait:.1f}s"
                )
                address = self._after(address)
            else:
                try:
                    reply = rpc.call(
                        address,
                        getattr(self._stub(address), method),
                        request,
                        timeout=max(left, 0.001),
                        unavailable=errors.CoordinatorUnavailable,
                        **kwargs,
                    )
                except errors.NotLeader as exc:
                    # A leader that lost etcd a moment ago: it steps down within the second.
                    if once or len(self.addresses) == 1:
                        raise
                    tried.add(address)
                    address = self._after(address)
                    last = exc
                except errors.StandingBy as exc:
                    if len(self.addresses) == 1 and not exc.leader:
                        raise
                    tried.add(address)
                    hinted = exc.leader and exc.leader not in tried and _dialable(exc.leader)
                    address = exc.leader if hinted else self._after(address)
                    last = exc
                except errors.CoordinatorUnavailable as exc:
                    self._answered.discard(address)
                    if len(self.addresses) == 1:
                        raise
                    if once and not _never_sent(exc):
                        self._follow(self._after(address))
                        raise
                    tried.add(address)
                    address = self._after(address)
                    last = exc
                except errors.DeadlineExceeded:
                    self._answered.discard(address)  # probe it again before the next call
                    if once:  # it may have reached a leader that acted: say nothing else
                        raise
                    if len(self.addresses) > 1:  # a silent leader: the next call tries another
                        self._follow(self._after(address))
                    if last is not None:  # what the coordinators said is the better answer
                        raise last from None
                    raise
                else:
                    self._follow(address)
                    return reply
            if time.monotonic() >= deadline:
                assert last is not None
                raise last
            if address in tried:  # a whole pass without a leader: wait for an election
                left = deadline - time.monotonic() - LAST_TRY_S
                if left <= 0:
                    raise last
                time.sleep(min(pause, left))
                pause = min(pause * 2, PAUSE_MAX_S)
                tried.clear()

    def close(self) -> None:
        """Closes every channel (``rpc.close_channels``: a stuck one is left to the exit)."""
        with self._lock:
            channels = list(self._channels.items())
            self._channels.clear()
            self._stubs.clear()
        rpc.close_channels(channels)
