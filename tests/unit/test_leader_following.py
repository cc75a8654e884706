"""Callers that follow the leading coordinator, and terms that fence a deposed one, on real
gRPC servers on loopback: a standby's StandingBy sends a call to the leader, an address
that refuses connections sends it to the next one, a command is never sent twice, and a
stage refuses a command of an older term."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from elasticpipe.coordinator.server import _Gate
from elasticpipe.errors import (
    CoordinatorUnavailable,
    DeadlineExceeded,
    InvalidRequest,
    NotLeader,
    PermissionDenied,
    StandingBy,
)
from elasticpipe.security import tls
from elasticpipe.security.tls import TLS
from elasticpipe.transport import rpc
from elasticpipe.transport.coordinators import Coordinators, parse_coordinators
from elasticpipe.transport.serving import RunningServer, start_server
from elasticpipe.transport.terms import TERM_KEY, TermFence, TermStamp, term_of
from elasticpipe.v1 import coordinator_pb2, stage_pb2, stage_pb2_grpc
from tests.support.servers import free_port

pytestmark = pytest.mark.timeout(60)

SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"]


class Leading:
    """A leader's servicer: Status names it, and every call is counted."""

    def __init__(self, name: str):
        self.name = name
        self.calls: list[str] = []
        self.slow_s = 0.0
        self.deposed = False

    def Plan(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append("Plan")
        if self.deposed:
            raise NotLeader(f"coordinator {self.name} no longer leads (term 3)")
        return coordinator_pb2.PlanResponse()

    def Status(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append("Status")
        return coordinator_pb2.StatusResponse(leader=self.name, term=7)

    def Rebalance(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls.append("Rebalance")
        time.sleep(self.slow_s)
        return coordinator_pb2.RebalanceResponse(decision=f"moved by {self.name}")

    def __getattr__(self, method: str) -> Any:
        raise AttributeError(method)


class Candidate:
    """A coordinator process's service: a gate that stands by or leads."""

    def __init__(self, leader: str = ""):
        self.leader = leader
        self.gate = _Gate(lambda: self.address, lambda: self.leader)
        self.server: RunningServer = start_server("127.0.0.1:0", [(SERVICE, self.gate)])
        self.address = self.server.address

    def lead(self) -> Leading:
        servicer = Leading(self.address)
        self.gate.servicer = servicer  # type: ignore[assignment]
        return servicer


@pytest.fixture
def pair() -> Iterator[tuple[Candidate, Candidate]]:
    standby, leader = Candidate(), Candidate()
    standby.leader = leader.address
    yield standby, leader
    standby.server.stop()
    leader.server.stop()


def status(coordinators: Coordinators, timeout: float = 5.0) -> Any:
    return coordinators.call("Status", coordinator_pb2.StatusRequest(), timeout)


def test_the_address_list_is_checked_and_names_a_bad_address() -> None:
    assert parse_coordinators("a:1, b:2,a:1") == ["a:1", "b:2"]
    assert parse_coordinators(["a:1", "b:2"]) == ["a:1", "b:2"]
    with pytest.raises(InvalidRequest, match="no coordinator address"):
        parse_coordinators(" , ")
    with pytest.raises(InvalidRequest, match="http://b:2"):
        parse_coordinators("a:1,http://b:2")


def test_a_standby_sends_the_call_to_the_leader_and_the_next_call_starts_there(
    pair: tuple[Candidate, Candidate],
) -> None:
    standby, leader = pair
    leading = leader.lead()
    coordinators = Coordinators([standby.address, leader.address])
    assert status(coordinators).leader == leader.address
    assert coordinators.leader == leader.address
    assert status(coordinators).leader == leader.address
    assert leading.calls == ["Status", "Status"]
    coordinators.close()


def test_a_standby_named_alone_still_leads_the_caller_to_the_leader(
    pair: tuple[Candidate, Candidate],
) -> None:
    standby, leader = pair
    leader.lead()
    coordinators = Coordinators(standby.address)
    assert status(coordinators).leader == leader.address
    coordinators.close()


def test_the_wire_keeps_the_standbys_leader(pair: tuple[Candidate, Candidate]) -> None:
    standby, _ = pair
    with grpc.insecure_channel(standby.address) as channel:
        call = channel.unary_unary(
            "/elasticpipe.v1.CoordinatorService/Status",
            request_serializer=coordinator_pb2.StatusRequest.SerializeToString,
            response_deserializer=coordinator_pb2.StatusResponse.FromString,
        )
        with pytest.raises(grpc.RpcError) as failed:
            call(coordinator_pb2.StatusRequest(), timeout=5)
    error = rpc.translate(failed.value, standby.address)
    assert isinstance(error, StandingBy), error
    assert error.leader == standby.leader
    assert standby.address in str(error) and standby.leader in str(error)


def test_an_address_that_refuses_connections_sends_the_call_on(
    pair: tuple[Candidate, Candidate],
) -> None:
    _, leader = pair
    leading = leader.lead()
    dead = f"127.0.0.1:{free_port()}"
    coordinators = Coordinators([dead, leader.address])
    assert status(coordinators).leader == leader.address
    # A command too: the dead address never received it, so it cannot run twice.
    reply = coordinators.call(
        "Rebalance", coordinator_pb2.RebalanceRequest(), timeout=5.0, once=True
    )
    assert reply.decision == f"moved by {leader.address}"
    assert leading.calls == ["Status", "Rebalance"]
    coordinators.close()


def test_a_command_that_reached_a_slow_leader_is_not_reported_as_refused(
    pair: tuple[Candidate, Candidate],
) -> None:
    """A once-only command that times out at the leader raises DeadlineExceeded (it may
    have run), not the standby's refusal that came before it; it ran once."""
    standby, leader = pair
    leading = leader.lead()
    leading.slow_s = 2.0
    coordinators = Coordinators([standby.address, leader.address])
    with pytest.raises(DeadlineExceeded):
        coordinators.call("Rebalance", coordinator_pb2.RebalanceRequest(), 1.0, once=True)
    time.sleep(1.5)
    assert leading.calls == ["Rebalance"]
    coordinators.close()


def test_a_leader_that_just_lost_etcd_sends_queries_on_but_not_commands(
    pair: tuple[Candidate, Candidate],
) -> None:
    standby, leader = pair
    old = standby.lead()  # the "standby" was the leader until a moment ago
    old.deposed = True
    new = leader.lead()
    coordinators = Coordinators([standby.address, leader.address])
    coordinators.call("Plan", coordinator_pb2.PlanRequest(), 5.0)
    assert old.calls == ["Plan"] and new.calls == ["Plan"]
    fresh = Coordinators([standby.address, leader.address])
    with pytest.raises(NotLeader):
        fresh.call("Plan", coordinator_pb2.PlanRequest(), 5.0, once=True)
    coordinators.close()
    fresh.close()


def test_with_no_leader_a_call_waits_out_its_timeout_then_raises_standing_by() -> None:
    lonely = Candidate()  # stands by; nobody leads
    other = Candidate()
    try:
        coordinators = Coordinators([lonely.address, other.address])
        started = time.monotonic()
        with pytest.raises(StandingBy, match="no coordinator leads yet"):
            status(coordinators, timeout=1.0)
        assert 0.9 < time.monotonic() - started < 3.0
        # The moment one leads, the next call finds it.
        other.lead()
        assert status(coordinators).leader == other.address
        coordinators.close()
    finally:
        lonely.server.stop()
        other.server.stop()


def test_one_address_that_cannot_be_reached_raises_at_once() -> None:
    coordinators = Coordinators(f"127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(CoordinatorUnavailable):
        status(coordinators, timeout=5.0)
    assert time.monotonic() - started < 3.0
    coordinators.close()


# ---- terms -------------------------------------------------------------------------------


def test_a_fence_lets_equal_and_newer_terms_through_and_refuses_older_ones() -> None:
    fence = TermFence()
    fence.admit(5)
    fence.admit(5)
    fence.admit(9)
    with pytest.raises(NotLeader, match="term 5, older than term 9"):
        fence.admit(5)
    assert fence.highest == 9


def test_a_term_is_a_whole_number_in_int64_and_a_bad_one_is_named() -> None:
    assert term_of([(TERM_KEY, "12")]) == 12
    assert term_of([("other", "1")]) is None
    assert term_of([(TERM_KEY, str((1 << 63) - 1))]) == (1 << 63) - 1
    for bad in ("0", "-3", "x", "1.5", "", "٣", str(1 << 63), "9" * 5000):
        with pytest.raises(InvalidRequest, match="whole number"):
            term_of([(TERM_KEY, bad)])


class Stats:
    def __init__(self) -> None:
        self.calls = 0

    def GetStats(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        return stage_pb2.StageStats(stage_id="s")

    def __getattr__(self, method: str) -> Any:
        def absent(request: Any, context: grpc.ServicerContext) -> Any:
            raise NotImplementedError(method)

        return absent


def _stage(fence: TermFence, tls: TLS | None = None) -> tuple[Stats, RunningServer]:
    servicer = Stats()
    server = start_server(
        "127.0.0.1:0",
        [(stage_pb2.DESCRIPTOR.services_by_name["StageService"], servicer)],
        tls=tls,
        check=fence.check,
    )
    return servicer, server


def test_a_stamped_channel_carries_the_term_and_a_deposed_coordinator_sends_nothing() -> None:
    """Through a real server checking terms: the current term's calls pass, a lower
    term's are refused before the servicer runs, and a stamp whose term callable raises
    NotLeader sends nothing at all; a malformed term is refused, naming it."""
    fence = TermFence()
    servicer, server = _stage(fence)
    term = {"now": 4}

    def current() -> int:
        if term["now"] == 0:
            raise NotLeader("coordinator a:1 does not lead")
        return term["now"]

    pool = rpc.StagePool(interceptors=[TermStamp(current)])
    try:
        pool.call(server.address, "GetStats", stage_pb2.StatsRequest(), 5.0)
        assert fence.highest == 4 and servicer.calls == 1
        fence.admit(6)  # a newer leader reached this stage
        with pytest.raises(NotLeader, match="term 4"):
            pool.call(server.address, "GetStats", stage_pb2.StatsRequest(), 5.0)
        assert servicer.calls == 1
        term["now"] = 0  # this coordinator stepped down
        with pytest.raises(NotLeader, match="does not lead"):
            pool.call(server.address, "GetStats", stage_pb2.StatsRequest(), 5.0)
        with grpc.insecure_channel(server.address) as channel:
            stub = stage_pb2_grpc.StageServiceStub(channel)
            with pytest.raises(grpc.RpcError) as bad:
                stub.GetStats(stage_pb2.StatsRequest(), timeout=5, metadata=[(TERM_KEY, "7x")])
        assert isinstance(rpc.translate(bad.value, server.address), InvalidRequest)
        assert "'7x'" in str(bad.value.details())
        assert servicer.calls == 1 and fence.highest == 6
    finally:
        pool.close()
        server.stop()


def test_under_tls_only_a_coordinator_certificate_moves_the_term(tmp_path: Path) -> None:
    """A client (allowed to call GetStats) that sends a huge term is refused, and the
    stage still obeys its coordinator's current term afterwards."""
    certs = tmp_path / "certs"
    tls.init_ca(certs)
    tls.issue(certs, "stage-0", "stage", hosts=("127.0.0.1",))
    tls.issue(certs, "coordinator", "coordinator")
    tls.issue(certs, "client", "client")

    def material(name: str) -> TLS:
        return TLS(str(certs / f"{name}.pem"), str(certs / f"{name}.key"), str(certs / "ca.pem"))

    fence = TermFence()
    servicer, server = _stage(fence, material("stage-0"))
    client = rpc.StagePool(tls=material("client"), interceptors=[TermStamp(lambda: 10**15)])
    coordinator = rpc.StagePool(tls=material("coordinator"), interceptors=[TermStamp(lambda: 3)])
    try:
        with pytest.raises(PermissionDenied, match="client"):
            client.call(server.address, "GetStats", stage_pb2.StatsRequest(), 5.0)
        assert fence.highest == 0
        coordinator.call(server.address, "GetStats", stage_pb2.StatsRequest(), 5.0)
        assert fence.highest == 3 and servicer.calls == 1
    finally:
        client.close()
        coordinator.close()
        server.stop()
