"""The stage's bulk listener: the receiving end of ``elasticpipe.transport.bulk``.

One thread accepts connections on the bulk port; each connection gets its own thread,
which checks the one-time token (and, with TLS, that the certificate names the caller the
token was issued to), then takes one message at a time exactly as a gRPC data message is
taken: ``StageServicer.admit_data`` checks and reserves (before ``GO``, for a message that
waits for it), the bytes are read straight into the tensors, ``Stage.deliver`` puts them
into the mailbox, and ``OK`` tells the sender (a refused eager message's bytes are read
and dropped first). Bounded like the gRPC side: at most ``MAX_CONNECTIONS`` connections
counted from accept, ``MAX_HANDSHAKES`` of them unauthenticated (each with a deadline), at
most ``MAX_PER_CALLER`` per caller and ``MAX_TOKENS_PER_CALLER`` tokens per caller, one
deadline per message (only the wait for the next message is long), and ``close`` ends
them all.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticpipe.errors import ElasticPipeError, InvalidRequest, PermissionDenied, TooLarge
from elasticpipe.logs import get_logger
from elasticpipe.security import authz
from elasticpipe.security.tls import TLS, identity_of
from elasticpipe.stage_server import callers
from elasticpipe.stage_server.snapshots import at_lowest_priority
from elasticpipe.training.job import json_object
from elasticpipe.transport import bulk, bulk_calls, bulk_layers, serving
from elasticpipe.v1 import stage_pb2
from elasticpipe.wire import bundle, layer_state, structure

if TYPE_CHECKING:
    from elasticpipe.stage_server.service import StageServicer

log = get_logger(__name__)

MAX_CONNECTIONS = 64  # open at once, authenticated or not
MAX_HANDSHAKES = 16  # of those, not yet authenticated
MAX_PER_CALLER = 8
MAX_TOKENS_PER_CALLER = 8
HANDSHAKE_TIMEOUT_S = 10.0  # the whole handshake
READ_TIMEOUT_S = 30.0  # one whole message, as a gRPC stream is cut after 30 s of silence
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
        self._open: set[socket.socket] = set()  # every accepted connection, until closed
        self._handshaking = 0
        self._callers: Counter[object] = Counter()  # authenticated connections per caller
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="bulk-accept", daemon=True)
        self._thread.start()

    def grant(self) -> bytes:
        """A one-time token for the current gRPC caller (``OpenBulk``).

        Raises:
            TooLarge: too many tokens outstanding, for this caller or in all.
        """
        now = time.monotonic()
        identity = authz.caller()
        with self._lock:
            self._grants = {t: g for t, g in self._grants.items() if g.expires > now}
            mine = sum(1 for g in self._grants.values() if g.identity == identity)
            if mine >= MAX_TOKENS_PER_CALLER or len(self._grants) >= MAX_TOKENS:
                raise TooLarge(
                    f"{mine} bulk tokens outstanding for this caller, {len(self._grants)} in "
                    f"all (at most {MAX_TOKENS_PER_CALLER} and {MAX_TOKENS}): send over gRPC"
                )
            token = secrets.token_bytes(bulk.TOKEN_BYTES)
            self._grants[token] = _Grant(identity, now + bulk.TOKEN_TTL_S)
        return token

    def close(self) -> None:
        """Stops accepting and ends every open connection."""
        with self._lock:
            self._closed = True
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                refused = (
                    self._closed
                    or len(self._open) >= MAX_CONNECTIONS
                    or self._handshaking >= MAX_HANDSHAKES
                )
                if not refused:
                    self._open.add(conn)
                    self._handshaking += 1
            if refused:
                log.debug("bulk_connection_refused", peer=peer[0], reason="too many")
                conn.close()
                continue
            threading.Thread(
                target=self._serve, args=(conn, peer[0]), name="bulk-conn", daemon=True
            ).start()

    def _handshake(self, conn: socket.socket) -> tuple[socket.socket, _Grant]:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        if self._tls is not None:
            conn = self._tls.wrap_socket(conn, server_side=True)
        hello = bulk.recv_bytes(conn, len(bulk.MAGIC) + bulk.TOKEN_BYTES, deadline)
        if not hello.startswith((bulk.MAGIC, bulk.MAGIC_CALLS)):  # (the same length)
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

    def _serve(self, raw: socket.socket, peer: str) -> None:
        conn, key, handshaking = raw, None, True
        try:
            bulk.keepalive(raw)
            conn, grant = self._handshake(raw)
            with self._lock:
                self._handshaking -= 1
                handshaking = False
                key = grant.identity or peer
                if self._callers[key] >= MAX_PER_CALLER:
                    raise TooLarge(f"{MAX_PER_CALLER} bulk connections open from {key}")
                self._callers[key] += 1
            authz.act_as(grant.identity)  # this thread serves this caller only
            conn.sendall(bulk.OK)
            while not self._closed and self._take(conn):
                pass
        except ElasticPipeError as exc:
            log.debug("bulk_connection_refused", peer=peer, error=str(exc))
        except (OSError, ConnectionError, ssl.SSLError) as exc:
            log.debug("bulk_connection_closed", peer=peer, error=str(exc))
        finally:
            with self._lock:
                self._open.discard(raw)
                if handshaking:
                    self._handshaking -= 1
                if key is not None:
                    self._callers[key] -= 1
                    if not self._callers[key]:
                        del self._callers[key]
            conn.close()

    def _take(self, conn: socket.socket) -> bool:
        """Takes one message; False when the peer closed the connection between messages."""
        conn.settimeout(IDLE_TIMEOUT_S)
        first = conn.recv(1)
        if not first:
            return False
        deadline = time.monotonic() + READ_TIMEOUT_S
        prefix = first + bulk.recv_bytes(conn, bulk.FRAME.size - 1, deadline)
        n, kind, nbytes = bulk.FRAME.unpack(prefix)
        if n > bulk.MAX_HEADER_BYTES:
            raise InvalidRequest(f"bulk header of {n} bytes (at most {bulk.MAX_HEADER_BYTES})")
        if kind in (bulk_layers.LAYERS, bulk_layers.COPY):
            return self._take_layers(conn, kind, n, nbytes, deadline)
        if kind in bulk_calls.CALLS:
            if nbytes:
                raise InvalidRequest(f"a bulk call announcing {nbytes} payload bytes (none)")
            return self._call(conn, kind, n, deadline)
        if kind not in (bulk.EAGER, bulk.RENDEZVOUS):
            raise InvalidRequest(f"bulk message of unknown kind {kind!r}")
        eager = kind == bulk.EAGER
        if eager and nbytes > bulk.EAGER_BYTES:
            raise InvalidRequest(
                f"eager bulk message of {nbytes} bytes (at most {bulk.EAGER_BYTES})"
            )
        servicer = self._servicer
        limit = servicer.stage.config.max_tensor_bytes
        try:
            msg = bulk.parse_header(bulk.recv_bytes(conn, n, deadline))
            declared = bundle.declared(msg.header, limit)  # checked once, here
            if declared.nbytes != nbytes:
                raise InvalidRequest(
                    f"bulk frame announces {nbytes} bytes but its header declares {declared.nbytes}"
                )
            slot, admitted = servicer.admit_data(msg.slot, msg.header, declared.nbytes)
        except ElasticPipeError as exc:
            if eager:
                bulk.drain(conn, nbytes, deadline)  # bounded by EAGER_BYTES; nothing kept
            self._refuse(conn, "Deliver", exc)  # nothing reserved, nothing more to read
            return True
        head = msg.header
        try:
            if not eager:
                conn.sendall(bulk.GO)
            value = bulk.receive_value(conn, declared, deadline)
        except BaseException:
            admitted.mailbox.release(admitted.reservation)
            raise
        try:
            accepted = servicer.stage.deliver(
                admitted,
                slot,
                head.run,
                head.micro_batch,
                value,
                head.loss_scale,
                secret=head.secret,
            )
        except ElasticPipeError as exc:
            self._refuse(conn, "Deliver", exc)
            return True
        if accepted:
            servicer.stage.metrics.bulk_received_bytes.inc(structure.nbytes(value))
        conn.sendall(bulk.OK)
        return True

    def _call(self, conn: socket.socket, kind: bytes, n: int, deadline: float) -> bool:
        """A ``RunStep`` or ``CommitStep`` (``bulk_calls``): the caller's role checked as
        gRPC checks it, then the gRPC handler's checks and work (a RunStep's whole run, on
        this connection's thread); answered with its reply or an error frame."""
        method, parse = bulk_calls.CALLS[kind]
        body = bulk.recv_bytes(conn, n, deadline)
        servicer = self._servicer
        try:
            authz.permit(f"StageService/{method}")
            try:
                request = parse(body)
            except Exception as exc:  # as gRPC's deserializer: whatever the parser raises
                raise InvalidRequest(f"malformed {method} request on the bulk channel") from exc
            if kind == bulk_calls.RUN:
                reply = servicer.run_step(request, None).SerializeToString()
            else:
                reply = servicer.commit(request).SerializeToString()
        except ElasticPipeError as exc:
            self._count(method, exc.code.name)
            conn.settimeout(READ_TIMEOUT_S)  # (a run may have outlasted the read's deadline)
            bulk.send_error(conn, exc)
            return True
        except Exception as exc:  # a bug: logged, answered as gRPC's INTERNAL, and closed
            log.error("bulk_call_failed", method=method, error=repr(exc), exc_info=exc)
            self._count(method, "INTERNAL")
            conn.settimeout(READ_TIMEOUT_S)
            bulk.send_error(conn, ElasticPipeError(f"internal error in a bulk {method}: {exc!r}"))
            return False
        conn.settimeout(READ_TIMEOUT_S)
        conn.sendall(bulk.OK + bulk.U32.pack(len(reply)) + reply)
        return True

    def _count(self, method: str, code: str) -> None:
        """A refused call, counted as gRPC's interceptor counts one (``rpc_errors``)."""
        errors = self._servicer.stage.metrics.rpc_errors
        errors.labels(method=f"StageService/{method}", code=code).inc()

    def _refuse(self, conn: socket.socket, method: str, exc: ElasticPipeError) -> None:
        """Answers a refusal with its error frame, counted as the gRPC ``method`` it
        stands for (``Deliver`` for a data message) would be."""
        self._count(method, exc.code.name)
        bulk.send_error(conn, exc)

    def _take_layers(
        self, conn: socket.socket, kind: bytes, n: int, count: int, deadline: float
    ) -> bool:
        """Takes a load's layers or a snapshot copy (``bulk_layers``), checked and staged
        or kept as ``RestoreLayers`` or ``PushSnapshot`` checks and keeps them; False (the
        connection closes) after an error within it, and after a copy. Each piece of a
        layer's bytes has ``READ_TIMEOUT_S`` (as each message of a gRPC stream has), not
        the whole layer. Anything unexpected is logged and answered as gRPC's ``INTERNAL``
        would be."""
        try:
            if kind == bulk_layers.COPY:
                return self._copy(conn, n, count, deadline)
            return self._layers(conn, n, count, deadline)
        except (OSError, ConnectionError, ElasticPipeError):
            raise
        except Exception as exc:  # a bug, or memory: logged, and the stream ends with it
            copy = kind == bulk_layers.COPY
            what, method = ("copy", "PushSnapshot") if copy else ("load", "RestoreLayers")
            log.error(f"bulk_{what}_failed", error=repr(exc), exc_info=exc)
            self._count(method, "INTERNAL")
            bulk.send_error(conn, ElasticPipeError(f"internal error in a bulk {what}: {exc!r}"))
            return False

    def _layers(self, conn: socket.socket, n: int, count: int, deadline: float) -> bool:
        servicer = self._servicer
        stage = servicer.stage
        body = bulk.recv_bytes(conn, n, deadline)
        try:
            authz.permit("StageService/RestoreLayers")
            servicer.gate.check("RestoreLayers")
            first = bulk_layers.parse_first(body)
            bulk_layers.read_frame_count(count)
            builder = stage.check_restore(first.epoch)  # before a single layer is read
            overrides = json_object(first.optimizer_overrides_json, "optimizer_overrides_json")
        except ElasticPipeError as exc:
            self._refuse(conn, "RestoreLayers", exc)
            return False
        conn.sendall(bulk.GO)
        taken: list[int] = []

        def start(layer: int) -> layer_state.Destination:
            stage.check_restored_layer(layer)
            return stage.restore_into(layer, builder=builder)

        def done(got: layer_state.Received) -> None:
            stage.stage_restored(first.epoch, got, builder, overrides)
            taken.append(got.layer)

        if not self._each_layer(conn, "RestoreLayers", count, start, done):
            return False
        answer = stage_pb2.RestoreResponse(layers=taken).SerializeToString()
        conn.sendall(bulk.OK + bulk.U32.pack(len(answer)) + answer)
        return True

    def _copy(self, conn: socket.socket, n: int, count: int, deadline: float) -> bool:
        """A snapshot copy, checked and kept as ``PushSnapshot`` keeps one, its layers
        received on a thread at the lowest CPU priority (``at_lowest_priority``)."""
        stage = self._servicer.stage
        body = bulk.recv_bytes(conn, n, deadline)
        try:
            authz.permit("StageService/PushSnapshot")
            first = bulk_layers.parse_copy_first(body)
            bulk_layers.read_frame_count(count)
            generation = stage.snapshots.generation
            layers = stage.check_copy_source(first.job_id, first.source)  # before any layer
            check = callers.in_source_range(layers, first.source, stage.frozen)
        except ElasticPipeError as exc:
            self._refuse(conn, "PushSnapshot", exc)
            return False
        conn.sendall(bulk.GO)
        blobs: dict[int, layer_state.PackedLayer] = {}

        def start(layer: int) -> layer_state.Destination:
            check(layer)
            return layer_state.Destination()

        def done(got: layer_state.Received) -> None:
            blobs[got.layer] = got.packed

        # read and hashed at the lowest priority; kept at this thread's own, under the
        # stage's lock (where the deferred optimizer step may run on the thread holding it)
        if not at_lowest_priority(
            lambda: self._each_layer(conn, "PushSnapshot", count, start, done)
        ):
            return False
        try:
            stage.keep_copy(first.job_id, first.step, first.source, blobs, generation)
        except ElasticPipeError as exc:
            self._refuse(conn, "PushSnapshot", exc)
            return False
        answer = stage_pb2.Ack().SerializeToString()
        conn.sendall(bulk.OK + bulk.U32.pack(len(answer)) + answer)
        return False

    def _each_layer(
        self,
        conn: socket.socket,
        method: str,
        count: int,
        start: Callable[[int], layer_state.Destination],
        done: Callable[[layer_state.Received], None],
    ) -> bool:
        """Reads ``count`` layers: each header checked and its tensors placed (``start``,
        given the layer), answered ``GO``, its bytes read into them, its digest checked,
        then handed to ``done``. False after the first refusal (its error frame sent, counted
        as ``method``'s)."""
        limits = (
            self._servicer.stage.config.max_tensor_bytes,
            self._servicer.stage.config.max_layer_bytes,
        )
        seen: set[int] = set()

        def read_into(view: memoryview) -> None:
            bulk.recv_exactly(conn, view, _read_deadline())

        for _ in range(count):
            (size,) = bulk.U32.unpack(bulk.recv_bytes(conn, bulk.U32.size, _read_deadline()))
            try:
                if size > bulk_layers.MAX_HEADER_BYTES:
                    raise TooLarge(f"a bulk layer header of {size} bytes")
                head = bulk.recv_bytes(conn, size, _read_deadline())
                piece = bulk_layers.parse_layer_header(head)
                if piece.layer in seen:
                    raise InvalidRequest(f"layer {piece.layer} sent twice")
                into = start(piece.layer)
                opened = layer_state.open_layer(piece.layer, piece.header, limits, into)
            except ElasticPipeError as exc:
                self._refuse(conn, method, exc)
                return False
            conn.sendall(bulk.GO)
            opened.fill(read_into)
            digest = bulk.recv_bytes(conn, bulk_layers.DIGEST_BYTES, _read_deadline())
            try:
                done(opened.finish(digest))
            except ElasticPipeError as exc:
                self._refuse(conn, method, exc)
                return False
            seen.add(piece.layer)
        return True


def _read_deadline() -> float:
    """When a piece of a bulk load read from now must have arrived."""
    return time.monotonic() + READ_TIMEOUT_S


def listen_host(listen: str) -> str:
    """The host the bulk port binds: the gRPC listen address's."""
    host, _ = serving.split_address(listen)
    return host
