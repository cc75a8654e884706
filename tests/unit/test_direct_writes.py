"""A sender's direct writes (``bulk.BulkSender.write_eager``), against a peer socket the test
plays: the compute thread never waits for the network, and the answers are matched to the
writes in order or not at all.

The peer is a real TCP connection on loopback; the test reads and answers by hand.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from elasticpipe.errors import StageUnavailable
from elasticpipe.transport import bulk
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import bundle

pytestmark = pytest.mark.timeout(20)


@pytest.fixture
def pair() -> Iterator[tuple[bulk.BulkSender, socket.socket]]:
    """A sender whose connection is open, and the peer's end of it."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # the peer's, too
    mine = socket.create_connection(listener.getsockname(), timeout=10)
    peer, _ = listener.accept()
    listener.close()
    sender = bulk.BulkSender(None, "peer", None)  # type: ignore[arg-type]  # no OpenBulk here
    sender._sock = mine
    yield sender, peer
    sender.close()
    peer.close()


def _head(run: int, tensor: torch.Tensor) -> stage_pb2.DataHeader:
    head = stage_pb2.DataHeader(epoch=1, run=run, micro_batch=0)
    bundle.describe(head, tensor)
    return head


def _read_message(peer: socket.socket, tensor: torch.Tensor) -> bytes:
    """Reads one eager message off the peer's end; returns its payload."""
    frame = bulk.recv_bytes(peer, bulk.FRAME.size, time.monotonic() + 10)
    length, kind, nbytes = bulk.FRAME.unpack(frame)
    assert kind == bulk.EAGER and nbytes == tensor.numel() * tensor.element_size()
    bulk.recv_bytes(peer, length, time.monotonic() + 10)
    return bulk.recv_bytes(peer, nbytes, time.monotonic() + 10)


def test_a_write_the_socket_cannot_take_at_once_returns_and_the_rest_is_finished_later(
    pair: tuple[bulk.BulkSender, socket.socket],
) -> None:
    """The peer reads nothing, so the socket's buffers fill: ``write_eager`` returns at once
    with the rest left over, no direct write follows until ``finish`` wrote it, and the
    message arrives whole."""
    sender, peer = pair
    sender._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)  # type: ignore[union-attr]
    tensor = torch.rand(bulk.DIRECT_BYTES // 4)
    started = time.monotonic()
    written = sender.write_eager(stage_pb2.INPUT, _head(1, tensor), tensor, timeout=10)
    assert time.monotonic() - started < 1.0  # it did not wait for the peer to read
    assert written is not None
    deadline, partial = written
    assert partial
    assert not sender.writable(16)  # nothing overtakes the unfinished message
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(_read_message(peer, tensor)))
    reader.start()
    sender.finish(deadline)
    reader.join(10)
    assert got and got[0] == tensor.numpy().tobytes()
    assert sender.writable(16)
    peer.sendall(bulk.OK)
    sender.read_answer(deadline)


def test_after_an_answer_cannot_be_read_the_later_ones_are_not_read_either(
    pair: tuple[bulk.BulkSender, socket.socket],
) -> None:
    """Two direct writes; the first one's answer is garbage. Then the second write fails
    too, without reading the OK the peer sent for it: that byte might have been the
    first one's late answer."""
    sender, peer = pair
    tensors = [torch.rand(256), torch.rand(256)]
    deadlines = []
    for run, tensor in enumerate(tensors, start=1):
        written = sender.write_eager(stage_pb2.INPUT, _head(run, tensor), tensor, timeout=10)
        assert written is not None and not written[1]
        deadlines.append(written[0])
    for tensor in tensors:
        _read_message(peer, tensor)
    peer.sendall(b"?" + bulk.OK)
    with pytest.raises(StageUnavailable, match="unexpected bulk answer"):
        sender.read_answer(deadlines[0])
    with pytest.raises(StageUnavailable, match="earlier answer"):
        sender.read_answer(deadlines[1])
    mine = sender._sock
    assert mine is not None and mine.recv(1, socket.MSG_PEEK) == bulk.OK  # left unread
    assert not sender.writable(16)  # and the next message opens a new connection
