"""Mutual TLS with roles: every connection authenticated, every RPC allowed to its roles
only, stage names bound to certificates, and plaintext refused beyond loopback."""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from elasticpipe.client.admin import Admin
from elasticpipe.errors import CoordinatorUnavailable, PermissionDenied
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.security import tls
from elasticpipe.transport import rpc
from elasticpipe.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    job_pb2,
    stage_pb2,
    stage_pb2_grpc,
)
from tests.support.clusters import set_partition
from tests.support.reference import Lockstep

pytestmark = pytest.mark.timeout(240)
KWARGS = {"sizes": [8, 16, 16, 16, 4]}

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Three stages, a coordinator, a client and an admin, all with certificates."""
    with LocalCluster(stages=3, tls=True, auto_rebalance=False) as c:
        yield c


def _coordinator(
    cluster: LocalCluster, who: tls.TLS | None
) -> coordinator_pb2_grpc.CoordinatorServiceStub:
    return coordinator_pb2_grpc.CoordinatorServiceStub(rpc.channel(cluster.coordinator, who))


def _stage(address: str, who: tls.TLS | None) -> stage_pb2_grpc.StageServiceStub:
    return stage_pb2_grpc.StageServiceStub(rpc.channel(address, who))


def test_a_tls_cluster_trains_and_moves_layers_exactly(cluster: LocalCluster) -> None:
    """Client, coordinator and stages on mutual TLS: training, a live migration (stages
    pulling layers from each other) and state_dict all work and equal LocalPipeline's bit
    for bit."""
    g = torch.Generator().manual_seed(0)
    with Lockstep(
        cluster,
        model="mlp",
        model_kwargs=KWARGS,
        optimizer_kwargs={"lr": 1e-2},
        stages=3,
        tls=cluster.client_tls,
    ) as both:
        for step in range(4):
            both.train_step(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            if step == 1:
                assert set_partition(cluster, [0, 1, 2, 7]).changed  # the admin's certificate
        both.assert_same_weights()
        # The new epoch's first snapshot reaches every next stage, over mutual TLS: a copy
        # arriving before its receiver commits the epoch is sent again, not lost.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = [
                _stage(a, cluster.admin_tls).GetStats(stage_pb2.StatsRequest(), timeout=10)
                for a in cluster.stage_addresses
            ]
            if all(any(h.peer_copy and h.step == 2 for h in s.snapshots) for s in stats):
                break
            time.sleep(0.2)
        held = {s.name: [(h.step, list(h.layers), h.peer_copy) for h in s.snapshots] for s in stats}
        assert all(any(h.peer_copy and h.step == 2 for h in s.snapshots) for s in stats), held


@pytest.mark.parametrize(
    ("role", "call", "rpc_name"),
    [
        ("client", lambda s: s.Status(coordinator_pb2.StatusRequest(), timeout=10), "Status"),
        (
            "stage",
            lambda s: s.SetupJob(
                coordinator_pb2.SetupJobRequest(job=job_pb2.JobSpec(model="mlp")), timeout=10
            ),
            "SetupJob",
        ),
        (
            "admin",
            lambda s: s.Register(
                coordinator_pb2.RegisterRequest(name="admin", address="x:1"), timeout=10
            ),
            "Register",
        ),
    ],
    ids=["client-admin-rpc", "stage-client-rpc", "admin-stage-rpc"],
)
def test_a_wrong_role_is_refused_naming_role_and_rpc(
    cluster: LocalCluster, role: str, call: object, rpc_name: str
) -> None:
    """A certificate of the wrong role gets PERMISSION_DENIED naming the role and the RPC."""
    who = cluster.tls_of(f"someone-{role}", role)
    with pytest.raises(grpc.RpcError) as info:
        call(_coordinator(cluster, who))  # type: ignore[operator]
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert f"role {role!r}" in info.value.details() and rpc_name in info.value.details()  # type: ignore[attr-defined]


def test_stage_rpcs_take_only_their_roles(cluster: LocalCluster) -> None:
    """On a stage: a client may not Freeze or Assign, an admin may not RunStep, and the
    stage still serves its coordinator and clients afterwards."""
    address = cluster.stage_addresses[0]
    client = _stage(address, cluster.client_tls)
    with pytest.raises(grpc.RpcError) as info:
        client.Freeze(stage_pb2.EpochRequest(epoch=99), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert "StageService/Freeze" in info.value.details()  # type: ignore[attr-defined]
    admin = _stage(address, cluster.admin_tls)
    with pytest.raises(grpc.RpcError) as info:
        admin.RunStep(stage_pb2.RunStepRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert admin.GetStats(stage_pb2.StatsRequest(), timeout=10).name == "stage-0"


def test_traces_are_for_admins_only(cluster: LocalCluster) -> None:
    """A stage's spans and clock (GetTrace) answer an admin and refuse a client."""
    address = cluster.stage_addresses[0]
    with pytest.raises(grpc.RpcError) as info:
        _stage(address, cluster.client_tls).GetTrace(stage_pb2.TraceRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert "StageService/GetTrace" in info.value.details()  # type: ignore[attr-defined]
    reply = _stage(address, cluster.admin_tls).GetTrace(stage_pb2.TraceRequest(), timeout=10)
    assert reply.name == "stage-0" and reply.now_ns > 0


def test_callers_without_a_cluster_certificate_get_nothing(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """Plaintext, or a certificate from another CA, cannot even connect."""
    tls.init_ca(tmp_path)
    cert, key = tls.issue(tmp_path, "mallory", "admin")
    forged = tls.TLS(str(cert), str(key), str(tmp_path / "ca.pem"))
    for credentials in (None, forged):
        with (
            Admin(cluster.coordinator, credentials, timeout=5) as admin,
            pytest.raises(CoordinatorUnavailable),
        ):
            admin.status()


def test_a_stage_can_register_only_under_its_certificates_name(cluster: LocalCluster) -> None:
    """The certificate of stage-0 cannot register as stage-1 (no takeover of another
    stage's registration)."""
    stage0 = cluster.tls_of("stage-0")
    with pytest.raises(PermissionDenied, match="'stage-0' cannot register as 'stage-1'"):
        rpc.call(
            cluster.coordinator,
            _coordinator(cluster, stage0).Register,
            coordinator_pb2.RegisterRequest(name="stage-1", address="127.0.0.1:1", device="cpu"),
            timeout=10,
        )
    stage1 = next(s for s in cluster.status().stages if s.name == "stage-1" and s.alive)
    for method, request in (
        ("Heartbeat", coordinator_pb2.HeartbeatRequest(stage_id=stage1.stage_id)),
        ("Leave", coordinator_pb2.LeaveRequest(stage_id=stage1.stage_id, timeout_s=1)),
        ("ResolveRun", coordinator_pb2.ResolveRunRequest(stage_id=stage1.stage_id, run=1)),
    ):
        with pytest.raises(PermissionDenied, match="'stage-0' cannot speak for 'stage-1'"):
            rpc.call(
                cluster.coordinator,
                getattr(_coordinator(cluster, stage0), method),
                request,
                timeout=10,
            )


def test_the_admin_cli_speaks_tls(cluster: LocalCluster) -> None:
    """admin with --tls-* works; without a certificate it fails with a clear error."""
    admin = cluster.admin_tls
    assert admin is not None
    base = [
        sys.executable,
        "-m",
        "elasticpipe",
        "admin",
        "status",
        "--coordinator",
        cluster.coordinator,
    ]
    ok = subprocess.run(
        [*base, "--tls-cert", admin.cert, "--tls-key", admin.key, "--tls-ca", admin.ca],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0 and "stage-0" in ok.stdout, ok.stderr
    bare = subprocess.run(
        [*base, "--timeout", "5"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bare.returncode == 2 and "cannot reach the coordinator" in bare.stderr


def test_plaintext_beyond_loopback_is_refused_unless_insecure() -> None:
    """A stage asked to listen on 0.0.0.0 without TLS refuses to start, saying how to fix
    it in one line; --insecure lets it start."""
    base = [sys.executable, "-m", "elasticpipe", "stage", "--coordinator", "127.0.0.1:9"]
    refused = subprocess.run(
        [*base, "--listen", "0.0.0.0:0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert refused.returncode == 2
    assert "refusing to listen on 0.0.0.0:0 without TLS" in refused.stderr
    assert "--insecure" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    started = subprocess.Popen(
        [*base, "--listen", "0.0.0.0:0", "--insecure", "--advertise", "127.0.0.1:1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            started.wait(timeout=5)  # still serving
    finally:
        started.kill()
        started.wait(10)


def test_reflection_lists_the_services_to_any_cluster_member(cluster: LocalCluster) -> None:
    """grpcurl-style tools see every service through reflection (any role of the cluster;
    nobody without a certificate)."""
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    for address, want in (
        (cluster.coordinator, "elasticpipe.v1.CoordinatorService"),
        (cluster.stage_addresses[0], "elasticpipe.v1.StageService"),
    ):
        db = ProtoReflectionDescriptorDatabase(rpc.channel(address, cluster.tls_of("r", "stage")))
        services = set(db.get_services())
        assert {want, "grpc.health.v1.Health"} <= services, services
        method = DescriptorPool(db).FindServiceByName(want).methods[0]
        assert method.input_type.full_name.startswith("elasticpipe.v1.")
    with pytest.raises(grpc.RpcError) as refused:
        ProtoReflectionDescriptorDatabase(rpc.channel(cluster.coordinator, None)).get_services()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]


def test_the_bulk_channel_is_mutual_tls_bound_to_the_token_holder(cluster: LocalCluster) -> None:
    """A stage's bulk channel speaks mutual TLS: a stage-role sender's large message goes
    over it and is refused exactly as gRPC refuses it (a stale epoch: the handshake, the
    token and the checks all ran); a token presented under another certificate, or a
    connection without one, is dropped before anything is admitted."""
    from elasticpipe.errors import NotReady
    from elasticpipe.transport import bulk, sending

    address = cluster.stage_addresses[0]
    peer = cluster.tls_of("bulk-peer", "stage")
    assert peer is not None
    stub = _stage(address, peer)
    sender = sending.Sender(stub, address, peer)
    payload = torch.rand((2 << 20) // 4)
    with pytest.raises(NotReady):  # a stale epoch, or no job yet
        sender.send(sending.Outgoing("Forward", 0, 1, 0, 0, payload, secret=STRANGER), timeout=20)
    assert sender._bulk is not None and sender._bulk._sock is not None  # over the channel
    sender.close()

    reply = stub.OpenBulk(stage_pb2.OpenBulkRequest(), timeout=10)
    host = "127.0.0.1"
    mallory = cluster.tls_of("mallory-bulk", "stage")
    assert mallory is not None
    raw = socket.create_connection((host, reply.port), timeout=10)
    stolen = bulk.client_context(mallory).wrap_socket(raw, server_hostname=host)
    stolen.sendall(bulk.MAGIC + reply.token)  # the token was issued to bulk-peer
    assert stolen.recv(1) == b""
    stolen.close()
    raw = socket.create_connection((host, reply.port), timeout=10)
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        plain = raw  # no certificate at all: the TLS listener ends the connection
        plain.sendall(bulk.MAGIC + reply.token)
        assert plain.recv(1) == b""
        raise ConnectionError("closed")
    raw.close()


def test_init_state_streams_over_the_mutual_tls_bulk_channel_and_only_from_a_client(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job from init_state on the TLS cluster: each stage's layers stream over its bulk
    channel (mutual TLS), and training equals LocalPipeline's from those weights bit for
    bit. A stage's certificate may open a bulk channel but not load into it."""
    from elasticpipe.client import streaming
    from elasticpipe.errors import PermissionDenied
    from elasticpipe.models.contract import build
    from elasticpipe.transport import bulk, bulk_layers

    streams: list[str] = []
    send_layers = bulk_layers.send_layers

    def counted(sock: socket.socket, address: str, *args: Any) -> Any:
        assert isinstance(sock, ssl.SSLSocket)
        streams.append(address)
        return send_layers(sock, address, *args)

    monkeypatch.setattr(streaming.bulk_layers, "send_layers", counted)
    init = build("mlp", seed=4, **KWARGS).state_dict()
    g = torch.Generator().manual_seed(1)
    with Lockstep(
        cluster,
        model="mlp",
        model_kwargs=KWARGS,
        optimizer_kwargs={"lr": 1e-2},
        stages=3,
        tls=cluster.client_tls,
        init_state=init,
    ) as both:
        for _ in range(2):
            both.train_step(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
        both.assert_same_weights()
    assert len(set(streams)) == 3

    address = cluster.stage_addresses[0]
    peer = cluster.tls_of("bulk-loader", "stage")
    assert peer is not None
    sock = bulk.connect(_stage(address, peer), address, peer, time.monotonic() + 10)
    first = stage_pb2.RestoreChunk(epoch=1)
    with pytest.raises(PermissionDenied, match="RestoreLayers"):
        bulk_layers.send_layers(
            sock, address, first, [0], lambda layer: None, threading.Event(), time.monotonic() + 10
        )
    sock.close()


def test_step_calls_on_the_bulk_channel_are_taken_only_from_their_roles(
    cluster: LocalCluster,
) -> None:
    """A stage's certificate may open a bulk channel, but a ``CommitStep`` or ``RunStep``
    written on it is refused as over gRPC, naming the role and the RPC (the client's calls
    travel there: the training tests above)."""
    from elasticpipe.errors import PermissionDenied
    from elasticpipe.transport import bulk_calls

    address = cluster.stage_addresses[0]
    peer = cluster.tls_of("bulk-committer", "stage")
    assert peer is not None
    caller = bulk_calls.BulkCaller(_stage(address, peer), address, peer)
    commit = stage_pb2.CommitStepRequest(epoch=1, run=1, step=1)
    run = stage_pb2.RunStepRequest(epoch=1, run=1, step=1, micro_batches=1, timeout_s=5)
    try:
        for kind, request, method in (
            (bulk_calls.COMMIT, commit, "CommitStep"),
            (bulk_calls.RUN, run, "RunStep"),
        ):
            assert caller.start(kind, request.SerializeToString(), time.monotonic() + 10)
            with pytest.raises(PermissionDenied, match=rf"'stage'.*{method}"):
                caller.finish(time.monotonic() + 10)
    finally:
        caller.close()


def test_reduction_pieces_are_taken_only_from_stages(cluster: LocalCluster) -> None:
    """A gradient reduction's piece comes only from a stage's certificate: a client's
    ``Reduce`` stream is refused by the role table, and the job holder's own REDUCE piece,
    over the data path clients may use for their inputs (``Deliver``, the bulk channel),
    is refused by the stage, naming why, before anything is admitted; a stage's goes on to
    the epoch check."""
    from elasticpipe import Pipeline
    from elasticpipe.errors import NotReady, PermissionDenied
    from elasticpipe.transport import sending

    address = cluster.stage_addresses[0]
    piece = (torch.zeros(3), torch.ones(1, dtype=torch.bool))
    client = _stage(address, cluster.client_tls)
    with pytest.raises(grpc.RpcError) as info:
        client.Reduce(iter([stage_pb2.DataChunk()]), timeout=10)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    assert "StageService/Reduce" in info.value.details()  # type: ignore[attr-defined]
    with Pipeline(
        coordinator=cluster.coordinator,
        model="mlp",
        model_kwargs=KWARGS,
        stages=3,
        tls=cluster.client_tls,
    ) as pipe:  # the client certificate now holds the job: the gate lets its data in
        pipe.train_step(torch.randn(8, 8), torch.randint(0, 4, (8,)))
        epoch = pipe.partition.epoch
        large = (torch.rand((2 << 20) // 4), torch.ones(1, dtype=torch.bool))  # bulk channel
        for value, bulk_on in ((piece, False), (large, True)):
            msg = sending.Outgoing("Reduce", epoch, 1 << 60, 0, 5, value, secret=STRANGER)
            sender = sending.Sender(client, address, cluster.client_tls, use_bulk=bulk_on)
            with pytest.raises(PermissionDenied, match="only stages send them"):
                sender.send(msg, timeout=20)
            sender.close()
    peer = cluster.tls_of("reduce-peer", "stage")
    assert peer is not None
    sender = sending.Sender(_stage(address, peer), address, peer, use_bulk=False)
    with pytest.raises(NotReady):  # a stale epoch: past the role check
        sender.send(sending.Outgoing("Reduce", 0, 1, 0, 5, piece, secret=STRANGER), timeout=20)
    sender.close()
