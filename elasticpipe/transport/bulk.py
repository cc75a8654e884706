"""The bulk channel: large activations and gradients on a raw socket beside gRPC.

grpcio moves a tensor through four Python-level copies and HTTP/2 framing, each copy into
fresh memory, which tops out near 1 GB/s on loopback; a socket that sends straight from the
tensor's memory and receives straight into the new tensor's runs at the transport's speed
(``bench/transfer.py`` measures both against gloo and raw TCP). So every tensor of the data
path travels here, and so does a step's commit (``bulk_calls``); other control stays on
gRPC.

The channel is negotiated over gRPC and keeps gRPC's checks:

1. The sender calls the receiver's ``OpenBulk`` (authenticated and authorised like
   ``Forward``: role ``client`` or ``stage`` with mutual TLS). The reply names the port of
   the receiver's bulk listener and a one-time token bound to the caller's identity; it
   expires after ``TOKEN_TTL_S``.
2. The sender connects to that port on the host it dialled for gRPC -- with TLS, a mutual
   TLS handshake with the same certificates (the receiver checks that the certificate names
   the caller the token was issued to) -- and sends ``MAGIC`` and the token.
3. Then the messages, answered in order (``write_eager`` writes small ones without waiting
   for the answers of earlier ones; anything else is one exchange at a time after them).
   A message of at most ``EAGER_BYTES`` (every
   activation of a usual micro-batch) is *eager*: it costs one round trip::

       sender:   u32 length, b"E", u64 n, DataMessage (slot + DataHeader, no data),
                 then the n declared bytes at once, tensor after tensor
       receiver: OK -- or an error frame (after reading the n bytes into a scratch buffer)

   A larger one waits for the receiver's go-ahead (*rendezvous*, as MPI calls the two)::

       sender:   u32 length, b"R", u64 n, DataMessage
       receiver: GO -- or an error frame, and the message ends there
       sender:   exactly the n declared bytes
       receiver: OK -- or an error frame

   The receiver checks the header as it checks a gRPC data message (dtypes, shapes, byte
   counts against its limit and against ``n``, the caller, the epoch, the room in the
   mailbox) and reserves the room before it reads a byte into memory it keeps; it then
   reads the bytes straight into the tensor they become. A refused eager message costs it
   at most ``EAGER_BYTES`` read and dropped; a refused large one, nothing.

An error frame is ``ERR``, a u32 length and JSON ``{"reason", "details"}``: the sender
raises the same ``ElasticPipeError`` a gRPC call would have. Anything malformed closes the
connection. A message whose bytes could not all be written was not delivered, so a sender
that cannot open the channel (an older stage without ``OpenBulk``, a firewalled port, a
full listener) or finds it broken sends that message over gRPC instead, and keeps to gRPC
for that stage for ``FALLBACK_S``; once the whole message is written (or GO came), a broken
connection fails the message's run, as a broken gRPC stream does. A connection the
receiver closed while idle is noticed before the next message and reopened. One deadline
covers the whole message on both ends.
"""

from __future__ import annotations

import json
import math
import os
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator, Sequence

import grpc
import torch

from elasticpipe.errors import BY_REASON, ElasticPipeError, InvalidRequest, StageUnavailable
from elasticpipe.logs import get_logger
from elasticpipe.security.tls import TLS
from elasticpipe.transport import rpc, serving
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc
from elasticpipe.wire import bundle, codec, structure
from elasticpipe.wire.structure import Value

log = get_logger(__name__)

MAGIC = b"EPBULK2\n"  # 2: the framed protocol (an older stage closes: gRPC then)
MAGIC_CALLS = b"EPBULK3\n"  # 3: also RunStep and CommitStep calls (``bulk_calls``)
TOKEN_BYTES = 32
TOKEN_TTL_S = 30.0
MAX_HEADER_BYTES = 1 << 20  # a DataHeader of a bundle of many tensors stays far below
GO, OK, ERR = b"G", b"K", b"E"
EAGER, RENDEZVOUS = b"E", b"R"  # a message's kind, in its frame
MAX_ERROR_BYTES = 1 << 16
U32 = struct.Struct("<I")
FRAME = struct.Struct("<IcQ")  # header length, kind, payload bytes
EAGER_BYTES = 4 << 20  # a message up to this sends its bytes without waiting for GO
# A message up to this may be written by the thread that made it (``write_eager``): the
# compute thread, which then goes on without waiting for a sender thread to wake.
DIRECT_BYTES = 1 << 20
IOV_MAX = 1024  # buffers per writev (Linux's limit)
FALLBACK_S = 60.0  # after the channel could not be opened: gRPC only, this long
# On a TLS socket every write is a record (encrypted, and one syscall): parts up to this
# many bytes in all are joined into one write.
TLS_JOIN_BYTES = 64 << 10


# ---- framing, shared by both ends -------------------------------------------------------


def _until(sock: socket.socket, deadline: float | None) -> None:
    """Sets the socket's timeout to what is left until ``deadline`` (None: as it is)."""
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        sock.settimeout(left)


def recv_exactly(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fills ``view`` from the socket, by ``deadline`` (``time.monotonic()``) if given.

    Raises:
        ConnectionError: the peer closed the connection first.
        TimeoutError: the deadline passed.
    """
    while view.nbytes:
        _until(sock, deadline)
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the bulk connection")
        view = view[n:]


def recv_bytes(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from the socket."""
    buf = bytearray(n)
    recv_exactly(sock, memoryview(buf), deadline)
    return bytes(buf)


def send_all(sock: socket.socket, data: bytes | memoryview, deadline: float | None) -> None:
    """``sendall`` by ``deadline``."""
    _until(sock, deadline)
    sock.sendall(data)


def send_error(sock: socket.socket, exc: ElasticPipeError) -> None:
    """The error frame for ``exc``."""
    body = json.dumps({"reason": exc.reason(), "details": str(exc)}).encode()[:MAX_ERROR_BYTES]
    sock.sendall(ERR + U32.pack(len(body)) + body)


def read_error(sock: socket.socket, peer: str, deadline: float | None = None) -> ElasticPipeError:
    """Reads the rest of an error frame (after ``ERR``) into the error it names."""
    (n,) = U32.unpack(recv_bytes(sock, U32.size, deadline))
    if n > MAX_ERROR_BYTES:
        raise ConnectionError(f"bulk error frame of {n} bytes from {peer}")
    try:
        frame = json.loads(recv_bytes(sock, n, deadline))
        kind = BY_REASON.get(str(frame["reason"]), ElasticPipeError)
        return kind(f"{frame['details']} (from {peer})")
    except (ValueError, KeyError, TypeError) as exc:
        raise ConnectionError(f"malformed bulk error frame from {peer}") from exc


def raw_views(value: Value) -> Iterator[memoryview]:
    """The bytes of every tensor of ``value``, without copying a contiguous CPU tensor."""
    for t in structure.tensors(value):
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if flat.numel():
            yield flat.numpy().data


def header_frame(
    slot: int, head: stage_pb2.DataHeader, kind: bytes = RENDEZVOUS, nbytes: int | None = None
) -> bytes:
    """The framed header of one message (``kind``: ``EAGER``, its bytes follow at once;
    ``RENDEZVOUS``, they follow GO). ``nbytes``: the bytes it announces; by default the
    ones ``head`` declares, read as the receiver reads them (``bundle.declared``)."""
    if nbytes is None:
        nbytes = sum(int(m.nbytes) for m in (head.parts if head.structure else [head.meta]))
    body = stage_pb2.DataMessage(slot=slot, header=head).SerializeToString()  # type: ignore[arg-type]
    return FRAME.pack(len(body), kind, nbytes) + body


def send_parts(sock: socket.socket, parts: Sequence[bytes | memoryview], deadline: float) -> None:
    """Writes ``parts`` in order, by ``deadline``: in one ``sendmsg`` where the socket has
    it (a plain TCP socket). A TLS socket writes small parts joined (``TLS_JOIN_BYTES``),
    larger ones one by one."""
    if isinstance(sock, ssl.SSLSocket):
        if sum(len(p) for p in parts) <= TLS_JOIN_BYTES:
            parts = [b"".join(parts)]
        for part in parts:
            send_all(sock, part, deadline)
        return
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        _until(sock, deadline)
        _advance(views, sock.sendmsg(views[:IOV_MAX]))


def write_some(sock: socket.socket, parts: Sequence[bytes | memoryview]) -> list[memoryview]:
    """Writes what the socket's send buffer takes of ``parts`` now, without waiting (a
    plain TCP socket with a timeout, whose descriptor is non-blocking); returns what is
    left. ``os.writev`` on the descriptor, because the socket object's own calls wait out
    its timeout when the buffer is full."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    fd = sock.fileno()
    while views:
        try:
            sent = os.writev(fd, views[:IOV_MAX])
        except BlockingIOError:
            break
        if not sent:
            break
        _advance(views, sent)
    return views


def _advance(views: list[memoryview], sent: int) -> None:
    """Drops the first ``sent`` bytes of ``views`` (what one vectored write took)."""
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views.pop(0)
    if sent:
        views[0] = views[0][sent:]


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: the peer closed it (or broke the
    protocol); either way it is of no more use."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    readable, _, _ = select.select([sock], [], [], 0)
    return bool(readable)


def drain(sock: socket.socket, n: int, deadline: float) -> None:
    """Reads and drops ``n`` bytes (a refused eager message's)."""
    scratch = memoryview(bytearray(min(n, 1 << 16)))
    while n:
        view = scratch[: min(n, scratch.nbytes)]
        recv_exactly(sock, view, deadline)
        n -= view.nbytes


def keepalive(sock: socket.socket) -> None:
    """TCP_NODELAY, and TCP keepalives so that a vanished peer is noticed in ~30 s."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def client_context(tls: TLS) -> ssl.SSLContext:
    """Checks the receiver against the cluster's CA and its name, as gRPC does (no
    stricter X.509 profile than gRPC's); presents our certificate."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname and CERT_REQUIRED
    ctx.load_verify_locations(tls.ca)
    ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def server_context(tls: TLS) -> ssl.SSLContext:
    """Presents the receiver's certificate; requires one of the cluster's CA from the caller."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(tls.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


# ---- the sending end --------------------------------------------------------------------


_NO_CHANNEL_CODES = (
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


class NoChannel(Exception):
    """The channel could not be used for this message (nothing was delivered)."""


def connect(
    stub: stage_pb2_grpc.StageServiceStub,
    address: str,
    tls: TLS | None,
    deadline: float,
    magic: bytes = MAGIC,
) -> socket.socket:
    """A new bulk connection to the stage at ``address`` (``OpenBulk``, then the handshake
    opened with ``magic``: ``MAGIC``, or ``MAGIC_CALLS`` for a stage that takes calls).

    Raises:
        NoChannel: the stage offers none now, or it could not be reached or opened.
        ElasticPipeError: ``OpenBulk`` refused (as gRPC would any call).
    """
    try:
        reply = stub.OpenBulk(
            stage_pb2.OpenBulkRequest(), timeout=max(0.001, deadline - time.monotonic())
        )
    except grpc.RpcError as exc:
        if exc.code() in _NO_CHANNEL_CODES:  # an older, busy or unreachable stage
            raise NoChannel(f"OpenBulk: {exc.code().name}") from exc
        raise rpc.translate(exc, address) from exc
    if not reply.port:
        raise NoChannel("the stage offers no bulk channel")
    host, _ = serving.split_address(address)
    try:
        sock = socket.create_connection(
            (host, reply.port), timeout=max(0.001, deadline - time.monotonic())
        )
    except OSError as exc:
        raise NoChannel(f"cannot reach its bulk port {reply.port}: {exc}") from exc
    try:
        keepalive(sock)
        if tls is not None:
            sock = client_context(tls).wrap_socket(sock, server_hostname=host)
        send_all(sock, magic + reply.token, deadline)
        if recv_bytes(sock, 1, deadline) != OK:
            raise NoChannel("the stage refused the bulk connection")
    except (OSError, ConnectionError) as exc:
        sock.close()
        raise NoChannel(f"bulk handshake failed: {exc}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


class BulkSender:
    """One sender's bulk connection to one stage, opened on first use. ``send`` is called
    one at a time (a ``Link``'s thread, or ``StageClients`` under its lock); a ``Link`` also
    writes from its executor's thread (``write_eager``) while the answers are read
    (``answer_waiting``, ``read_answer``, in order, one thread at a time: the link's, or
    the writer's for what it wrote whole), never at the same time as a ``send``."""

    def __init__(self, stub: stage_pb2_grpc.StageServiceStub, address: str, tls: TLS | None):
        self._stub = stub
        self.address = address
        self._tls = tls
        self._sock: socket.socket | None = None
        self._broken = False  # a write on another thread failed: reopen before the next
        self._lost = False  # an answer could not be read: the later ones cannot be trusted
        self._partial: list[memoryview] = []  # the rest of a direct write, for ``finish``
        self._unanswered = 0  # messages written (``write_eager``) whose answer is unread
        self._count = threading.Lock()
        # A direct write and ``close``: a closed descriptor's number, reused by a new
        # socket, is never written to.
        self._fd = threading.Lock()
        self._grpc_until = 0.0  # time.monotonic(): gRPC only until then

    def _connect(self, deadline: float) -> socket.socket:
        return connect(self._stub, self.address, self._tls, deadline)

    def close(self) -> None:
        """Closes the connection (the next send opens another)."""
        with self._fd:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._broken = self._lost = False
            self._partial = []

    def send(self, slot: int, head: stage_pb2.DataHeader, value: Value, timeout: float) -> bool:
        """Sends one declared value within ``timeout``; False when it must go over gRPC
        instead (nothing was delivered: no channel now, or it broke before the whole
        message was written, or before GO).

        Raises:
            ElasticPipeError: the receiver refused it (as gRPC would have), or the
                connection broke after the whole message was written or accepted
                (``StageUnavailable``).
        """
        if time.monotonic() < self._grpc_until:
            return False
        deadline = time.monotonic() + timeout
        nbytes = structure.nbytes(value)
        eager = nbytes <= EAGER_BYTES
        frame = header_frame(slot, head, EAGER if eager else RENDEZVOUS, nbytes)
        if self._sock is not None and (self._broken or closed_by_peer(self._sock)):
            self.close()  # the stage closed it while it idled, or a write broke it
        try:
            fresh = self._sock is None
            sock = self._sock = self._sock or self._connect(deadline)
            if eager:
                send_parts(sock, [frame, *raw_views(value)], deadline)
                answer = b""
            else:
                send_all(sock, frame, deadline)
                answer = recv_bytes(sock, 1, deadline)
        except NoChannel as exc:
            self._fall_back(str(exc))
            return False
        except ElasticPipeError:
            self.close()
            raise
        except (OSError, ConnectionError) as exc:  # not all written: nothing delivered
            self.close()
            if fresh:
                self._fall_back(f"bulk connection broke before the message was sent: {exc}")
            return False
        try:
            if answer == GO:
                for view in raw_views(value):
                    send_all(sock, view, deadline)
            if eager or answer == GO:
                answer = recv_bytes(sock, 1, deadline)
            if answer == ERR:
                raise read_error(sock, self.address, deadline)
        except ElasticPipeError:
            raise  # the receiver's refusal (some are OSErrors too): the connection is fine
        except (OSError, ConnectionError) as exc:
            self.close()
            raise StageUnavailable(f"bulk channel to {self.address}: {exc}") from exc
        if answer != OK:
            self.close()
            raise StageUnavailable(f"unexpected bulk answer {answer!r} from {self.address}")
        return True

    def writable(self, nbytes: int) -> bool:
        """Whether ``write_eager`` may take a message of ``nbytes`` now."""
        sock = self._sock
        return (
            sock is not None
            and not self._broken
            and not isinstance(sock, ssl.SSLSocket)
            and not self._partial
            and nbytes <= DIRECT_BYTES
            and time.monotonic() >= self._grpc_until
        )

    def write_eager(
        self,
        slot: int,
        head: stage_pb2.DataHeader,
        value: Value,
        timeout: float,
        nbytes: int | None = None,
    ) -> tuple[float, bool] | None:
        """Writes one eager message on the open connection now, from the caller's thread,
        without waiting for the network: what the socket's buffer does not take now is
        left for ``finish``, on the link's thread, which then reads its answer
        (``read_answer``; the answers are read in order). A plain TCP socket only (a TLS
        socket is not safe to write and read from two threads), at most ``DIRECT_BYTES``,
        and never before the connection is open.

        Returns:
            The message's deadline, and whether part of it is left for ``finish``; None
            when none of it was written (send it with ``send``). ``nbytes``: the value's,
            if the caller has them.
        """
        sock = self._sock
        nbytes = structure.nbytes(value) if nbytes is None else nbytes
        if sock is None or not self.writable(nbytes):
            return None
        parts: list[bytes | memoryview] = [header_frame(slot, head, EAGER, nbytes)]
        parts += raw_views(value)
        with self._count:
            if not self._unanswered and closed_by_peer(sock):
                return None  # ``send`` reopens it
            self._unanswered += 1
        written = False
        try:
            with self._fd:
                if self._sock is not sock:
                    raise ConnectionError("the connection was closed")
                rest = write_some(sock, parts)
            written = True
        except OSError:
            self._broken = True  # a message may be cut short in it: never written again
        finally:
            if not written:
                with self._count:
                    self._unanswered -= 1
        if not written:
            return None
        self._partial = rest
        return time.monotonic() + timeout, bool(rest)

    def finish(self, deadline: float) -> None:
        """Writes what ``write_eager`` left of its message (the answer-reading thread).

        Raises:
            StageUnavailable: the connection broke (its answer is then not read, and the
                message, delivered nowhere, may go again by ``send``).
        """
        rest, sock = self._partial, self._sock
        try:
            if sock is None:
                raise ConnectionError("the connection was closed")
            if self._broken or self._lost:
                raise ConnectionError("the connection broke before the rest was written")
            send_parts(sock, rest, deadline)
        except (OSError, ConnectionError) as exc:
            self._broken = self._lost = True
            with self._count:
                self._unanswered -= 1
            raise StageUnavailable(f"bulk channel to {self.address}: {exc}") from exc
        finally:
            self._partial = []

    def read_answer(self, deadline: float) -> None:
        """Reads the answer to the oldest message ``write_eager`` wrote.

        Raises:
            ElasticPipeError: the receiver refused it (the connection is fine), or the
                connection broke, or an earlier answer could not be read, so that this
                one cannot be told apart (``StageUnavailable``).
        """
        sock = self._sock
        try:
            if sock is None:
                raise ConnectionError("the connection was closed")
            if self._lost:
                raise ConnectionError("an earlier answer on it could not be read")
            answer = recv_bytes(sock, 1, deadline)
            if answer == ERR:
                raise read_error(sock, self.address, deadline)
            if answer != OK:
                raise ConnectionError(f"unexpected bulk answer {answer!r}")
        except (OSError, ConnectionError) as exc:
            if isinstance(exc, ElasticPipeError):
                raise
            self._broken = self._lost = True
            raise StageUnavailable(f"bulk channel to {self.address}: {exc}") from exc
        finally:
            with self._count:
                self._unanswered -= 1

    def answer_waiting(self, timeout: float = 0.0) -> bool:
        """Whether an answer (or the connection's end) is there to read, after waiting up
        to ``timeout`` seconds; True without a connection, or after an answer could not be
        read (``read_answer`` then says so at once)."""
        sock = self._sock
        if sock is None or self._lost:
            return True
        try:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(max(0, math.ceil(timeout * 1000))))
        except (OSError, ValueError):  # closed meanwhile (``close``): read_answer says so
            return True

    def _fall_back(self, why: str) -> None:
        self.close()
        self._grpc_until = time.monotonic() + FALLBACK_S
        log.info("bulk_channel_unused", peer=self.address, reason=why, retry_s=FALLBACK_S)


# ---- the receiving end ------------------------------------------------------------------


def receive_value(sock: socket.socket, declared: bundle.Declared, deadline: float) -> Value:
    """Reads a header's bytes straight into the tensors ``declared`` (checked) makes, in
    declaration order: exactly the ``declared.nbytes`` the mailbox reserved."""
    tensors = []
    for meta in declared.metas:
        tensor = torch.empty(tuple(meta.shape), dtype=codec.checked_dtype(meta))
        if tensor.numel():
            recv_exactly(sock, tensor.reshape(-1).view(torch.uint8).numpy().data, deadline)
        tensors.append(tensor)
    shape = declared.shape
    return tensors[0] if shape is None else structure.unflatten(tensors, shape)


def parse_header(body: bytes) -> stage_pb2.DataMessage:
    """A header frame's message.

    Raises:
        InvalidRequest: not a DataMessage, or one that carries data.
    """
    msg = stage_pb2.DataMessage()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf's DecodeError
        raise InvalidRequest(f"malformed bulk header ({len(body)} bytes)") from exc
    if msg.data:
        raise InvalidRequest("a bulk header must not carry data")
    return msg
