"""The bulk channel under attack and in odd company: what a second reader tried (each test
failed before its fix) -- declarations that disagree, silent connections, token floods, a
closed listener, an older stage, an unreachable port, a trickling sender, bundles."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
import torch

from elasticpipe.errors import TooLarge
from elasticpipe.stage_server.server import StageServer
from elasticpipe.transport import bulk, rpc, sending
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from elasticpipe.wire import bundle, codec
from tests.support import bulk_stage
from tests.support.bulk_stage import EPOCH, connect_bulk, open_bulk

stage = bulk_stage.stage  # the fixture: one in-process stage holding a job

pytestmark = pytest.mark.timeout(60)

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


def test_meta_beside_structure_is_not_held_beyond_its_reservation(stage: StageServer) -> None:
    """A header with ``structure``+``parts`` declaring 4 bytes and ``meta`` declaring
    16 MiB: both ends read the structure (``bundle.declared``), so the 4 bytes reserved are
    the 4 bytes taken, and the mailbox limit (32 MiB) holds."""
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    port, token = open_bulk(stub)
    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    big = tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[4 << 20], nbytes=16 << 20)
    sock.settimeout(5)
    for mb in range(4):  # 64 MiB of tensors into a 32 MiB mailbox
        head = stage_pb2.DataHeader(secret=STRANGER, epoch=EPOCH, run=2, step=0, micro_batch=mb)
        bundle.describe(head, (torch.zeros(1),))  # structure + one 4-byte part
        head.meta.CopyFrom(big)
        try:
            sock.sendall(bulk.header_frame(stage_pb2.INPUT, head))
            if sock.recv(1) != bulk.GO:
                break
            sock.sendall(b"\0" * (16 << 20))  # the stage takes 4 bytes, then sees garbage
        except OSError:
            break
    sock.close()
    assert stage.stage is not None
    held, entries = stage.stage._mailbox.usage()
    assert entries <= 1 and held < 1 << 20, (held, entries)  # one 4-byte tuple at most


def test_unauthenticated_connections_are_bounded(stage: StageServer) -> None:
    """Connections that never send a token count from accept: at most MAX_HANDSHAKES
    threads for 300 silent connections."""
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    port, _ = open_bulk(stub)
    before = threading.active_count()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
    time.sleep(1.0)
    threads = threading.active_count() - before
    for s in socks:
        s.close()
    assert threads <= 16 + 1


def test_a_foreign_caller_cannot_starve_the_token_table(stage: StageServer) -> None:
    """A burst of OpenBulk calls gets at most 8 tokens per caller; a sender refused a
    token sends over gRPC instead of failing (``TooLarge``)."""
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    refused = 0
    for _ in range(1024):
        try:
            stub.OpenBulk(stage_pb2.OpenBulkRequest(), timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            refused += 1
    assert refused == 1024 - 8  # tokens per caller
    sender = sending.Sender(stub, stage.address)
    payload = torch.rand((2 << 20) // 4)
    try:
        sender.send(
            sending.Outgoing("Forward", EPOCH, 1, 0, 0, payload, secret=STRANGER), timeout=10
        )
    except TooLarge as exc:
        pytest.fail(f"honest send refused after a token burst: {exc}")
    finally:
        sender.close()


def test_a_closed_listener_stops_serving_open_connections(stage: StageServer) -> None:
    """Closing the listener ends the connections opened before (no message admitted)."""
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    port, token = open_bulk(stub)
    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    servicer_bulk = stage._servicer.bulk if stage._servicer is not None else None
    assert servicer_bulk is not None
    servicer_bulk.close()
    payload = torch.rand((2 << 20) // 4)
    head = stage_pb2.DataHeader(secret=STRANGER, epoch=EPOCH, run=5, step=0, micro_batch=0)
    head.meta.CopyFrom(codec.tensor_meta(payload))
    sock.settimeout(5)
    sock.sendall(bulk.header_frame(stage_pb2.INPUT, head))
    try:
        answer = sock.recv(1)
    except OSError:
        answer = b""
    sock.close()
    assert answer != bulk.GO, "a closed listener still admitted a message"


class _OldStage(stage_pb2_grpc.StageServiceServicer):
    """A stage of the release before the bulk channel: Forward, no OpenBulk."""

    def __init__(self) -> None:
        self.received = 0

    def Forward(self, chunks, ctx):  # type: ignore[no-untyped-def]
        for chunk in chunks:
            self.received += len(chunk.data)
        return stage_pb2.Ack()


def test_a_peer_without_open_bulk_gets_large_tensors_over_grpc() -> None:
    """A peer that answers OpenBulk with UNIMPLEMENTED (an older stage in a rolling
    upgrade) gets the tensor over gRPC, as a peer answering port 0 does."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(4))
    old = _OldStage()
    stage_pb2_grpc.add_StageServiceServicer_to_server(old, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        address = f"127.0.0.1:{port}"
        stub = stage_pb2_grpc.StageServiceStub(rpc.channel(address))
        sender = sending.Sender(stub, address)
        payload = torch.rand((2 << 20) // 4)
        sender.send(
            sending.Outgoing("Forward", EPOCH, 1, 0, 0, payload, secret=STRANGER), timeout=10
        )
        assert old.received == payload.numel() * 4
    finally:
        server.stop(0)


def test_a_bundle_is_received_without_extra_copies() -> None:
    """receive_value reads a bundle straight into its tensors: no Python buffers of its
    size beside them (it used to hold two more copies)."""
    import tracemalloc

    value = (torch.rand(4 << 20), torch.rand(4 << 20))  # 32 MiB
    head = stage_pb2.DataHeader(secret=STRANGER, epoch=EPOCH, run=1, step=0, micro_batch=0)
    declared = bundle.describe(head, value)
    a, b = socket.socketpair()
    feeder = threading.Thread(
        target=lambda: [a.sendall(v) for v in bulk.raw_views(value)], daemon=True
    )
    tracemalloc.start()
    feeder.start()
    got = bulk.receive_value(b, bundle.declared(head, 1 << 30), time.monotonic() + 30)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    feeder.join()
    a.close()
    b.close()
    assert isinstance(got, tuple) and torch.equal(got[0], value[0])
    assert peak < declared // 2, f"{peak} bytes of Python buffers for {declared} declared"


def test_an_unreachable_bulk_port_falls_back_to_grpc(stage: StageServer) -> None:
    """OpenBulk names a port the sender cannot reach (a firewall, a port-forward or NAT
    that maps only the gRPC port; here: the listener is gone): the message must still go
    over gRPC, which works, rather than fail the run with StageUnavailable."""
    # (the bench and training tests show the channel used when it can be)
    assert stage._servicer is not None and stage._servicer.bulk is not None
    stage._servicer.bulk.close()
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    sender = sending.Sender(stub, stage.address)
    payload = torch.rand((2 << 20) // 4)
    sender.send(sending.Outgoing("Forward", EPOCH, 1, 0, 0, payload, secret=STRANGER), timeout=5)


def test_a_message_must_arrive_within_the_read_timeout(
    stage: StageServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/security.md: 'a message's header and bytes must arrive within 30 s' -- one
    deadline for the message, not per read: a peer trickling a byte at a time loses its
    reservation. READ_TIMEOUT_S scaled to 1 s here."""
    from elasticpipe.stage_server import bulk as listener

    monkeypatch.setattr(listener, "READ_TIMEOUT_S", 1.0)
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    port, token = open_bulk(stub)
    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    payload = torch.rand((2 << 20) // 4)
    head = stage_pb2.DataHeader(secret=STRANGER, epoch=EPOCH, run=6, step=0, micro_batch=0)
    head.meta.CopyFrom(codec.tensor_meta(payload))
    sock.sendall(bulk.header_frame(stage_pb2.INPUT, head))
    assert sock.recv(1) == bulk.GO
    start = time.monotonic()
    alive = True
    while time.monotonic() - start < 4.0:  # 4x the read timeout
        try:
            sock.sendall(b"\0")
        except OSError:
            alive = False
            break
        time.sleep(0.5)
    assert stage.stage is not None
    held = stage.stage._mailbox.usage()
    sock.close()
    assert not alive and held == (0, 0), f"after 4 s the reservation is still held: {held}"
