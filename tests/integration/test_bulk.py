"""The bulk channel (``elasticpipe.transport.bulk``): every tensor on a raw socket beside gRPC,
behind the same checks -- training over it is exact, refusals are gRPC's whether a message is
eager or waits for GO, and no sequence of bytes a peer can send takes a stage down."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from elasticpipe.client import driver
from elasticpipe.errors import DeadlineExceeded, InvalidRequest, StaleEpoch, TooLarge
from elasticpipe.local.cluster import LocalCluster
from elasticpipe.stage_server import executor
from elasticpipe.stage_server.links import Link
from elasticpipe.stage_server.mailbox import Mailbox, Slot
from elasticpipe.stage_server.server import StageServer
from elasticpipe.stage_server.stage import StageConfig
from elasticpipe.transport import bulk, rpc, sending
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc, tensor_pb2
from elasticpipe.wire import codec
from tests.support import bulk_stage
from tests.support.bulk_stage import EPOCH, connect_bulk, open_bulk
from tests.support.prometheus import scrape, value
from tests.support.reference import Lockstep

stage = bulk_stage.stage  # the fixture: one in-process stage holding a job

pytestmark = pytest.mark.timeout(120)

BIG = 2 << 20  # bytes: eager (its bytes follow the header at once)
HUGE = bulk.EAGER_BYTES + 4096  # bytes: waits for GO (rendezvous)
SECRET = bytes(range(16))  # the test's runs' secret (RunStepRequest.secret)

STRANGER = bytes(16)  # a 16-byte run secret, not the run's (every data header carries one)


def test_training_over_the_bulk_channel_equals_plain_pytorch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two stage processes whose inputs, activations, gradients and targets all travel
    over the bulk channel (the targets too: no data rides in the RunSteps here,
    ``driver.INLINE_BYTES``): losses and weights equal LocalPipeline's bit for bit, and the
    stages' metrics count every one of those bytes as received in bulk (stage 0: the
    client's inputs and stage 1's gradients; stage 1: the activations and the targets)."""
    monkeypatch.setattr(driver, "INLINE_BYTES", 0)
    kwargs = {"sizes": [640, 640, 640, 8]}
    rows, micro_batches, steps = 1024, 2, 3
    g = torch.Generator().manual_seed(0)
    with LocalCluster(stages=2, metrics=True, auto_rebalance=False) as c:
        with Lockstep(
            c,
            model="mlp",
            model_kwargs=kwargs,
            optimizer="sgd",
            optimizer_kwargs={"lr": 0.05},
            stages=2,
            micro_batches=micro_batches,
        ) as both:
            for _ in range(steps):
                x = torch.randn(rows, 640, generator=g)
                both.train_step(x, torch.randint(0, 8, (rows,), generator=g))
            both.assert_same_weights()
            addresses = list(both.pipe.partition.addresses)
        per_message = rows // micro_batches * 640 * 4
        targets = rows // micro_batches * 8  # int64 class ids
        for address, nbytes in zip(
            addresses, (2 * per_message, per_message + targets), strict=True
        ):
            samples = scrape(c.metrics_url(c.name_of(address)))
            got_bulk = value(samples, "elasticpipe_stage_bulk_received_bytes_total")
            assert got_bulk == steps * micro_batches * nbytes, address


# ---- one in-process stage holding a job, spoken to directly ------------------------------


def _sender(server: StageServer) -> tuple[sending.Sender, stage_pb2_grpc.StageServiceStub]:
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(server.address))
    return sending.Sender(stub, server.address), stub


def _consume(stub: stage_pb2_grpc.StageServiceStub, run: int, sent: torch.Tensor) -> None:
    """Runs the ReLU on micro-batch 0 of ``run`` and checks it came back bitwise as sent."""
    report = stub.RunStep(
        stage_pb2.RunStepRequest(
            epoch=EPOCH,
            run=run,
            step=0,
            micro_batches=1,
            mode=stage_pb2.INFER,
            timeout_s=10,
            secret=SECRET,
        ),
        timeout=20,
    )
    assert report.run == run
    request = stage_pb2.FetchOutputRequest(run=run, micro_batch=0, secret=SECRET)
    stream = stub.FetchOutput(request, timeout=20)
    assembler = codec.TensorAssembler(next(stream).header.meta)
    for chunk in stream:
        assembler.add(chunk.data)
    assert torch.equal(assembler.finish(), sent)


def _forward(run: int, tensor: torch.Tensor, epoch: int = EPOCH) -> sending.Outgoing:
    return sending.Outgoing("Forward", epoch, run, 0, 0, tensor, secret=SECRET)


@pytest.mark.parametrize("nbytes", [BIG, HUGE], ids=["eager", "rendezvous"])
def test_a_refusal_is_grpcs_error_and_the_connection_goes_on(
    stage: StageServer, nbytes: int
) -> None:
    """A refused eager message's bytes are read and dropped, a refused large one's never
    sent: either way the same connection carries the next message intact."""
    sender, stub = _sender(stage)
    payload = torch.rand(nbytes // 4)
    with pytest.raises(StaleEpoch):  # as over gRPC
        sender.send(_forward(1, payload, epoch=EPOCH - 1), timeout=10)
    with pytest.raises(StaleEpoch):
        sending.send(stub, stage.address, _forward(1, payload, epoch=EPOCH - 1), timeout=10)
    connection = sender._bulk._sock if sender._bulk is not None else None
    assert connection is not None
    sender.send(_forward(1, payload), timeout=10)
    assert sender._bulk is not None and sender._bulk._sock is connection  # not reopened
    _consume(stub, 1, payload)
    sender.close()


def test_garbage_and_stolen_tokens_never_take_the_stage_down(stage: StageServer) -> None:
    """No token, a replayed token, an oversized header frame, a declared tensor over the
    limit, and a peer that vanishes after GO: each is refused or dropped, nothing leaks
    from the mailbox, and the next honest message arrives intact."""
    sender, stub = _sender(stage)
    port, token = open_bulk(stub)

    sock = connect_bulk(port, b"\0" * bulk.TOKEN_BYTES)  # a token never issued
    assert sock.recv(1) == b""  # closed without OK
    sock.close()

    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    again = connect_bulk(port, token)  # the same token twice
    assert again.recv(1) == b""
    again.close()

    too_big = tensor_pb2.TensorMeta(dtype=tensor_pb2.FLOAT32, shape=[1 << 26], nbytes=1 << 28)
    head = stage_pb2.DataHeader(
        secret=STRANGER, epoch=EPOCH, run=2, step=0, micro_batch=0, meta=too_big
    )
    sock.sendall(bulk.header_frame(stage_pb2.INPUT, head))
    assert sock.recv(1) == bulk.ERR
    assert isinstance(bulk.read_error(sock, "stage"), TooLarge)

    ok_meta = codec.tensor_meta(torch.rand(BIG // 4))
    head = stage_pb2.DataHeader(
        secret=STRANGER, epoch=EPOCH, run=2, step=0, micro_batch=0, meta=ok_meta
    )
    sock.sendall(bulk.header_frame(stage_pb2.INPUT, head))
    assert sock.recv(1) == bulk.GO
    sock.sendall(b"\1" * 1000)  # then vanish mid-tensor
    sock.close()

    port, token = open_bulk(stub)
    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    sock.sendall(bulk.FRAME.pack(bulk.MAX_HEADER_BYTES + 1, bulk.RENDEZVOUS, 0))
    assert sock.recv(1) == b""  # dropped
    sock.close()

    port, token = open_bulk(stub)
    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    sock.sendall(bulk.FRAME.pack(10, bulk.EAGER, bulk.EAGER_BYTES + 1))
    assert sock.recv(1) == b""  # an eager message over EAGER_BYTES: dropped, nothing read
    sock.close()

    held = stage.stage
    assert held is not None
    deadline = time.monotonic() + 10
    while held._mailbox.usage() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.05)  # the vanished peer's reservation is given back
    assert held._mailbox.usage() == (0, 0)

    payload = torch.rand(BIG // 4)
    sender.send(_forward(3, payload), timeout=10)
    _consume(stub, 3, payload)
    sender.close()


def test_an_eager_message_that_misstates_its_bytes_is_refused_and_drained(
    stage: StageServer,
) -> None:
    """An eager frame announcing 100 bytes for a header declaring 4096: refused (naming
    both), its 100 bytes read and dropped, and the same connection then takes a
    well-formed message intact."""
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    port, token = open_bulk(stub)
    sock = connect_bulk(port, token)
    assert sock.recv(1) == bulk.OK
    payload = torch.rand(1024)
    head = stage_pb2.DataHeader(
        secret=SECRET, epoch=EPOCH, run=4, step=0, micro_batch=0, meta=codec.tensor_meta(payload)
    )
    sock.sendall(bulk.header_frame(stage_pb2.INPUT, head, bulk.EAGER, nbytes=100) + bytes(100))
    assert sock.recv(1) == bulk.ERR
    error = bulk.read_error(sock, "stage")
    assert isinstance(error, InvalidRequest) and "100" in str(error) and "4096" in str(error)
    data = payload.numpy().tobytes()
    sock.sendall(bulk.header_frame(stage_pb2.INPUT, head, bulk.EAGER) + data)
    assert sock.recv(1) == bulk.OK
    _consume(stub, 4, payload)
    sock.close()


def test_a_links_direct_writes_arrive_whatever_is_queued_between_them(
    stage: StageServer,
) -> None:
    """A ``Link`` writes small tensors from the caller's thread once its connection is
    open, and queues the first (it opens the connection) and a large one: every tensor
    arrives intact, the direct writes were taken, and a refusal of a direct write, or a
    tensor the wire cannot carry, reaches the run's failure handler as gRPC's error would,
    the link going on."""
    failures: list[tuple[int, Exception]] = []
    link = Link(stage.address, lambda run, exc: failures.append((run, exc)), timeout=10)
    direct = []
    write_now = link._sender.write_now

    def counted(msg: sending.Outgoing, timeout: float) -> tuple[float, bool] | None:
        written = write_now(msg, timeout)
        direct.append(written is not None)
        return written

    link._sender.write_now = counted  # type: ignore[method-assign]
    sent = {}
    for run, nbytes in enumerate([4096, 4096, 4096, HUGE, 4096, 4096], start=1):
        sent[run] = torch.rand(nbytes // 4)
        link.put(_forward(run, sent[run]))
        if run == 1:
            assert link.flush(10)  # the connection is open from now on
    assert link.flush(30) and not failures
    assert direct[0] is False and direct[1] is True and direct[2] is True, direct
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    for run, tensor in sent.items():
        _consume(stub, run, tensor)
    link.put(_forward(7, torch.rand(64), epoch=EPOCH - 1))
    assert link.flush(10)
    assert direct[-1] is True
    assert len(failures) == 1 and failures[0][0] == 7 and isinstance(failures[0][1], StaleEpoch)
    link.put(_forward(8, sent[1]))  # the connection goes on
    assert link.flush(10) and len(failures) == 1
    _consume(stub, 8, sent[1])
    link.put(_forward(9, torch.zeros(4, dtype=torch.complex64)))  # no wire dtype for it
    assert link.flush(10) and len(failures) == 2  # failed, and nothing left pending
    assert failures[1][0] == 9 and isinstance(failures[1][1], InvalidRequest)
    assert "complex" in str(failures[1][1])
    link.put(_forward(10, sent[1]))
    assert link.flush(10) and len(failures) == 2
    _consume(stub, 10, sent[1])
    link.close()


def test_answers_the_writer_reads_come_in_order_and_a_refusal_fails_its_run(
    stage: StageServer,
) -> None:
    """Direct writes whose answers their writer reads (``put(answer_here=True)``, the
    executor's): nobody reads an answer for the writer before it collects; mixed with
    writes the link's thread answers (another thread's) and with a queued message, every
    tensor arrives intact; in a batch of answers read at once, a refusal fails exactly its
    own run; an answer read long after its deadline is no failure; and a refusal fails
    the run within ``ANSWER_POLL_S`` of a wait for a tensor (``executor._take``), not at
    the run's deadline."""
    failures: list[tuple[int, Exception]] = []
    mailbox = Mailbox(1 << 20)

    def failed(run: int, exc: Exception) -> None:
        failures.append((run, exc))
        mailbox.fail(run, exc)  # as the stage does (``Stage._send_failed``)

    link = Link(stage.address, failed, timeout=10)
    stub = stage_pb2_grpc.StageServiceStub(rpc.channel(stage.address))
    sent = {run: torch.rand(1024) for run in range(1, 8)}
    link.put(_forward(1, sent[1]), answer_here=True)  # queued: it opens the connection
    assert link.flush(10) and not failures
    link.put(_forward(2, sent[2]), answer_here=True)
    assert link._sender.answer_waiting(10)  # its answer has come, and stays for the writer
    time.sleep(0.1)
    assert [w.msg.run for w in link._unread] == [2]
    link.put(_forward(3, sent[3]))  # another thread's: the link's thread reads 2's first
    link.put(_forward(4, sent[4]), answer_here=True)
    link.put(_forward(5, torch.rand(HUGE // 4)), answer_here=True)  # queued behind them
    link.put(_forward(6, sent[6]), answer_here=True)
    assert link.flush(30) and not failures and not link._unread
    for run in (1, 2, 3, 4, 6):
        _consume(stub, run, sent[run])

    link.put(_forward(10, sent[7]), answer_here=True)
    link.put(_forward(11, sent[7], epoch=EPOCH - 1), answer_here=True)  # refused
    link.put(_forward(12, sent[7]), answer_here=True)
    assert link._sender.answer_waiting(10)
    time.sleep(0.2)  # the three answers wait together; one flush reads them
    assert link.flush(10)
    assert [(r, type(e)) for r, e in failures] == [(11, StaleEpoch)]
    _consume(stub, 10, sent[7])
    _consume(stub, 12, sent[7])

    late = Link(stage.address, failed, timeout=0.5)
    late.put(_forward(13, sent[1]))  # opens its connection (runs stay within the stage's
    # window of early data: at most EARLY_RUNS past the newest run it started)
    assert late.flush(10)
    late.put(_forward(14, sent[1]), answer_here=True)
    time.sleep(1.0)  # read long after the message's 0.5 s deadline: it came in time
    assert late.flush(10) and len(failures) == 1
    _consume(stub, 14, sent[1])
    late.close()

    link.put(_forward(15, sent[1], epoch=EPOCH - 1), answer_here=True)  # refused too
    mailbox.expect(15, SECRET)
    ctx = SimpleNamespace(mailbox=mailbox, run=15, deadline=time.monotonic() + 60)
    started = time.monotonic()
    with pytest.raises(StaleEpoch):  # waiting for a gradient that will never come
        executor._take(ctx, [link], Slot.GRAD, 0)  # type: ignore[arg-type]
    assert time.monotonic() - started < 10
    assert failures[-1][0] == 15
    link.put(_forward(16, sent[1]), answer_here=True)  # the connection goes on
    assert link.flush(10) and len(failures) == 2
    _consume(stub, 16, sent[1])

    # A run that failed leaves the answers it owes to the link's thread (``leave_answers``):
    # read without the writer, a refusal among them still reported.
    link.put(_forward(17, sent[1]), answer_here=True)
    link.put(_forward(18, sent[1], epoch=EPOCH - 1), answer_here=True)
    link.leave_answers()
    until = time.monotonic() + 10
    while link._unread and time.monotonic() < until:
        time.sleep(0.01)
    assert not link._unread and [r for r, _ in failures] == [11, 15, 18]
    assert link.flush(1)
    link.close()


def test_a_wait_for_a_tensor_ends_at_once_when_the_run_failed_by_a_deadline() -> None:
    """A run failed with a DeadlineExceeded (a send that timed out) ends ``executor._take``
    at once: its 20 ms slices of waiting tell their own end from the run's failure."""
    mailbox = Mailbox(1 << 20)
    mailbox.expect(5, SECRET)
    mailbox.fail(5, DeadlineExceeded("a send to stage-1 timed out"))
    ctx = SimpleNamespace(mailbox=mailbox, run=5, deadline=time.monotonic() + 60)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="timed out"):
        executor._take(ctx, [SimpleNamespace(collect=lambda: None)], Slot.INPUT, 0)  # type: ignore[list-item]
    assert time.monotonic() - started < 5


def test_a_stage_without_a_bulk_channel_gets_everything_over_grpc() -> None:
    config = StageConfig(name="no-bulk", bulk_port=None)
    with StageServer(config, "127.0.0.1:1") as server:
        stub = stage_pb2_grpc.StageServiceStub(rpc.channel(server.address))
        assert stub.OpenBulk(stage_pb2.OpenBulkRequest(), timeout=10).port == 0
        sender = sending.Sender(stub, server.address)
        with pytest.raises(Exception) as info:  # no job: refused over gRPC, not bulk
            sender.send(_forward(1, torch.rand(BIG // 4)), timeout=10)
        assert sender._bulk is not None and sender._bulk._grpc_until > time.monotonic()
        assert "epoch" in str(info.value) or "job" in str(info.value)
