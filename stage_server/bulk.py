"""The stage's bulk listener: the receiving end of ``elasticpipe.bulk``.

One thread accepts connections on the bulk port; each connection gets its own thread,
which checks the one-time token (and, with TLS, that the certificate names the caller the
token was issued to), then takes one message at a time exactly as a gRPC data message is
taken: ``StageServicer.admit_data`` checks and reserves before ``GO``, the bytes are read
straight into the tensor, ``Stage.deliver`` puts it into the mailbox, and ``OK`` tells the
sender. Bounded like the gRPC side: at most ``MAX_CONNECTIONS`` connections, at most
``MAX_PER_CALLER`` per caller, a deadline on every read but the wait for the next message.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticpipe import authz, bulk, serving, structure
from elasticpipe.errors import ElasticPipeError, InvalidRequest, PermissionDenied, TooLarge
from elasticpipe.logs import get_logger
from elasticpipe.tls import TLS, identity_of

if TYPE_CHECKING:
    from elasticpipe.stage_server.service import StageServicer

log = get_logger(__name__)

MAX_CONNECTIONS = 64
MAX_PER_CALLER = 8
HANDSHAKE_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 30.0  # within one message, as a gRPC stream is cut after 30 s of silence
IDLE_TIMEOUT_S = 3600.0  # between messages: a link idles between steps
MAX_TOKENS = 1024


@dataclass(frozen=True)
class _Grant:
    identity: tuple[str, str] | None
    expires: float


class BulkListener:
    """Accepts bulk connections for one stage's servicer."""

    def __init__(self, servicer: StageServicer, host: str, port: int = 0, tls: TLS | None = None):
        self._servicer = servicer
        self._tls = bulk.server_context(tls) if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self.port: int = self._sock.getsockname()[1]
        self._lock = threading.Lock()
        self._grants: dict[bytes, _Grant] = {}
        self._open: Counter[object] = Counter()
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="bulk-accept", daemon=True)
        self._thread.start()

    def grant(self) -> bytes:
        """A one-time token for the current gRPC caller (``OpenBulk``).

        Raises:
            TooLarge: too many tokens outstanding.
        """
        now = time.monotonic()
        with self._lock:
            self._grants = {t: g for t, g in self._grants.items() if g.expires > now}
            if len(self._grants) >= MAX_TOKENS:
                raise TooLarge(
                    f"{len(self._grants)} bulk tokens outstanding (at most {MAX_TOKENS})"
                )
            token = secrets.token_bytes(bulk.TOKEN_BYTES)
            self._grants[token] = _Grant(authz.caller(), now + bulk.TOKEN_TTL_S)
        return token

    def close(self) -> None:
        """Stops accepting (open connections end with their peers)."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = sum(self._open.values()) >= MAX_CONNECTIONS
            if full:
                log.warning("bulk_connection_refused", peer=peer[0], reason="too many")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer[0]), name="bulk-conn", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket) -> tuple[socket.socket, _Grant]:
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        if self._tls is not None:
            conn = self._tls.wrap_socket(conn, server_side=True)
        hello = bulk.recv_bytes(conn, len(bulk.MAGIC) + bulk.TOKEN_BYTES)
        if not hello.startswith(bulk.MAGIC):
            raise InvalidRequest("not a bulk connection")
        with self._lock:
            grant = self._grants.pop(hello[len(bulk.MAGIC) :], None)
        if grant is None or grant.expires < time.monotonic():
            raise PermissionDenied("unknown or expired bulk token")
        if isinstance(conn, ssl.SSLSocket):
            der = conn.getpeercert(binary_form=True)
            presented = identity_of(ssl.DER_cert_to_PEM_cert(der).encode()) if der else None
            if presented != grant.identity:
                raise PermissionDenied(
                    f"bulk token issued to {grant.identity} presented by {presented}"
                )
        return conn, grant

    def _serve(self, conn: socket.socket, peer: str) -> None:
        key: object = peer
        counted = False
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn, grant = self._handshake(conn)
            key = grant.identity or peer
            with self._lock:
                if self._open[key] >= MAX_PER_CALLER:
                    raise TooLarge(f"{MAX_PER_CALLER} bulk connections open from {key}")
                self._open[key] += 1
                counted = True
            authz.act_as(grant.identity)  # this thread serves this caller only
            conn.sendall(bulk.OK)
            while self._take(conn):
                pass
        except ElasticPipeError as exc:
            log.info("bulk_connection_refused", peer=peer, error=str(exc))
        except (OSError, ConnectionError, ssl.SSLError) as exc:
            log.debug("bulk_connection_closed", peer=peer, error=str(exc))
        finally:
            if counted:
                with self._lock:
                    self._open[key] -= 1
                    if not self._open[key]:
                        del self._open[key]
            conn.close()

    def _take(self, conn: socket.socket) -> bool:
        """Takes one message; False when the peer closed the connection between messages."""
        conn.settimeout(IDLE_TIMEOUT_S)
        first = conn.recv(1)
        if not first:
            return False
        conn.settimeout(READ_TIMEOUT_S)
        (n,) = bulk._U32.unpack(first + bulk.recv_bytes(conn, bulk._U32.size - 1))
        if n > bulk.MAX_HEADER_BYTES:
            raise InvalidRequest(f"bulk header of {n} bytes (at most {bulk.MAX_HEADER_BYTES})")
        servicer = self._servicer
        try:
            msg = bulk.parse_header(bulk.recv_bytes(conn, n))
            slot, admitted = servicer.admit_data(msg.slot, msg.header)
        except ElasticPipeError as exc:
            bulk.send_error(conn, exc)  # nothing reserved, nothing more to read
            return True
        head = msg.header
        try:
            conn.sendall(bulk.GO)
            _, value = bulk.receive_value(conn, head, servicer.stage.config.max_tensor_bytes)
        except BaseException:
            admitted.mailbox.release(admitted.reservation)
            raise
        try:
            servicer.stage.deliver(
                admitted, slot, head.run, head.micro_batch, value, head.loss_scale
            )
        except ElasticPipeError as exc:
            bulk.send_error(conn, exc)
            return True
        servicer.stage.metrics.bulk_received_bytes.inc(structure.nbytes(value))
        conn.sendall(bulk.OK)
        return True


def listen_host(listen: str) -> str:
    """The host the bulk port binds: the gRPC listen address's."""
    host, _ = serving.split_address(listen)
    return host
