"""The bulk channel: large activations and gradients on a raw socket beside gRPC.

grpcio moves a tensor through four Python-level copies and HTTP/2 framing, each copy into
fresh memory, which tops out near 1 GB/s on loopback; a socket that sends straight from the
tensor's memory and receives straight into the new tensor's runs at the transport's speed
(``bench/transfer.py`` measures both against gloo and raw TCP). So a tensor larger than one
gRPC chunk travels here, and everything else -- small tensors, control, errors -- stays on
gRPC.

The channel is negotiated over gRPC and keeps gRPC's checks:

1. The sender calls the receiver's ``OpenBulk`` (authenticated and authorised like
   ``Forward``: role ``client`` or ``stage`` with mutual TLS). The reply names the port of
   the receiver's bulk listener and a one-time token bound to the caller's identity; it
   expires after ``TOKEN_TTL_S``.
2. The sender connects to that port on the host it dialled for gRPC -- with TLS, a mutual
   TLS handshake with the same certificates (the receiver checks that the certificate names
   the caller the token was issued to) -- and sends ``MAGIC`` and the token.
3. Then, per message, one exchange at a time::

       sender:   u32 length, DataMessage (slot + DataHeader, no data)
       receiver: GO -- or an error frame, and the message ends there
       sender:   exactly the declared bytes, tensor after tensor
       receiver: OK -- or an error frame

   The receiver checks the header as it checks a gRPC data message (dtypes, shapes, byte
   counts against its limit, the caller, the epoch, the room in the mailbox) and reserves
   the room *before* it answers GO, so it never reads a byte it did not agree to hold; it
   then reads the bytes straight into the tensor they become.

An error frame is ``ERR``, a u32 length and JSON ``{"reason", "details"}``: the sender
raises the same ``ElasticPipeError`` a gRPC call would have. Anything malformed closes the
connection; a sender whose connection breaks before GO reconnects once, since nothing was
delivered (after GO the message's run fails, as a broken gRPC stream fails it).
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
from collections.abc import Iterator

import torch

from elasticpipe import bundle, codec, rpc, serving, structure
from elasticpipe.errors import BY_REASON, ElasticPipeError, InvalidRequest, StageUnavailable
from elasticpipe.logs import get_logger
from elasticpipe.structure import Value
from elasticpipe.tls import TLS
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

log = get_logger(__name__)

MAGIC = b"EPBULK1\n"
TOKEN_BYTES = 32
TOKEN_TTL_S = 30.0
MAX_HEADER_BYTES = 1 << 20  # a DataHeader of a bundle of many tensors stays far below
GO, OK, ERR = b"G", b"K", b"E"
MAX_ERROR_BYTES = 1 << 16
_U32 = struct.Struct("<I")

# A tensor above this goes on the bulk channel (one gRPC chunk: below it a unary Deliver
# is a single round trip already).
MIN_BULK_BYTES = codec.DEFAULT_CHUNK_BYTES


# ---- framing, shared by both ends -------------------------------------------------------


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fills ``view`` from the socket.

    Raises:
        ConnectionError: the peer closed the connection first.
    """
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("the peer closed the bulk connection")
        view = view[n:]


def recv_bytes(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from the socket."""
    buf = bytearray(n)
    recv_exactly(sock, memoryview(buf))
    return bytes(buf)


def send_error(sock: socket.socket, exc: ElasticPipeError) -> None:
    """The error frame for ``exc``."""
    body = json.dumps({"reason": exc.reason(), "details": str(exc)}).encode()[:MAX_ERROR_BYTES]
    sock.sendall(ERR + _U32.pack(len(body)) + body)


def read_error(sock: socket.socket, peer: str) -> ElasticPipeError:
    """Reads the rest of an error frame (after ``ERR``) into the error it names."""
    (n,) = _U32.unpack(recv_bytes(sock, _U32.size))
    if n > MAX_ERROR_BYTES:
        raise ConnectionError(f"bulk error frame of {n} bytes from {peer}")
    try:
        frame = json.loads(recv_bytes(sock, n))
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


def header_frame(slot: int, head: stage_pb2.DataHeader) -> bytes:
    """The length-prefixed header of one message."""
    body = stage_pb2.DataMessage(slot=slot, header=head).SerializeToString()  # type: ignore[arg-type]
    return _U32.pack(len(body)) + body


def client_context(tls: TLS) -> ssl.SSLContext:
    """Checks the receiver against the cluster's CA and its name; presents our certificate."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca)
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


class BulkSender:
    """One sender's bulk connection to one stage, opened on first use (not thread-safe: a
    ``Link`` sends one message at a time)."""

    def __init__(self, stub: stage_pb2_grpc.StageServiceStub, address: str, tls: TLS | None):
        self._stub = stub
        self.address = address
        self._tls = tls
        self._sock: socket.socket | None = None
        self.unsupported = False  # the peer has no bulk listener: use gRPC

    def _connect(self, timeout: float) -> socket.socket:
        reply = rpc.call(
            self.address, self._stub.OpenBulk, stage_pb2.OpenBulkRequest(), timeout=timeout
        )
        if not reply.port:
            self.unsupported = True
            raise _Unsupported()
        host, _ = serving.split_address(self.address)
        sock = socket.create_connection((host, reply.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = client_context(self._tls).wrap_socket(sock, server_hostname=host)
            sock.sendall(MAGIC + reply.token)
            if recv_bytes(sock, 1) != OK:
                raise ConnectionError(f"{self.address} refused the bulk connection")
        except BaseException:
            sock.close()
            raise
        return sock

    def close(self) -> None:
        """Closes the connection (the next send opens another)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def send(self, slot: int, head: stage_pb2.DataHeader, value: Value, timeout: float) -> bool:
        """Sends one declared value; False when the peer has no bulk channel (send it over
        gRPC instead).

        Raises:
            ElasticPipeError: the receiver refused it (as gRPC would have), or the
                connection broke after the receiver accepted the header
                (``StageUnavailable``).
        """
        if self.unsupported:
            return False
        frame = header_frame(slot, head)
        for attempt in (0, 1):  # a connection found broken before GO: nothing was delivered
            try:
                sock = self._sock if self._sock is not None else self._connect(timeout)
                self._sock = sock
                sock.settimeout(timeout)
                sock.sendall(frame)
                answer = recv_bytes(sock, 1)
                break
            except _Unsupported:
                return False
            except ElasticPipeError:  # OpenBulk refused (some are OSErrors too)
                self.close()
                raise
            except (OSError, ConnectionError) as exc:
                self.close()
                if attempt:
                    raise StageUnavailable(f"bulk channel to {self.address}: {exc}") from exc
        try:
            if answer == GO:
                for view in raw_views(value):
                    sock.sendall(view)
                answer = recv_bytes(sock, 1)
            if answer == ERR:
                raise read_error(sock, self.address)
        except ElasticPipeError:
            raise  # the receiver's refusal (some are OSErrors too): the connection is fine
        except (OSError, ConnectionError) as exc:
            self.close()
            raise StageUnavailable(f"bulk channel to {self.address}: {exc}") from exc
        if answer != OK:
            self.close()
            raise StageUnavailable(f"unexpected bulk answer {answer!r} from {self.address}")
        return True


class _Unsupported(Exception):
    """The peer answered OpenBulk without a port."""


# ---- the receiving end: buffers ------------------------------------------------------


def receive_value(
    sock: socket.socket, head: stage_pb2.DataHeader, limit: int
) -> tuple[bundle.Assembler | None, Value]:
    """Reads a checked header's bytes into the value they make: a single tensor straight
    into its own memory, a bundle through its assembler."""
    if head.HasField("meta"):
        dtype = codec.check_meta(head.meta, limit)
        tensor = torch.empty(tuple(head.meta.shape), dtype=dtype)
        if tensor.numel():
            recv_exactly(sock, tensor.reshape(-1).view(torch.uint8).numpy().data)
        return None, tensor
    assembler = bundle.assembler(head, limit)
    buf = bytearray(bundle.declared_bytes(head, limit))
    recv_exactly(sock, memoryview(buf))
    assembler.add(bytes(buf))
    return assembler, assembler.finish()


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
