"""The one boundary between gRPC and the domain: serving servicers, and calling peers.

Server side: ``add_service`` registers a servicer through a generic handler that parses
requests itself, so malformed bytes become ``INVALID_ARGUMENT`` naming the message type
(grpcio would answer a bare ``INTERNAL``), domain errors become their status code with
their message, and anything unexpected becomes ``INTERNAL`` without a traceback.

Client side: ``translate`` maps a ``grpc.RpcError`` to the domain error tree (the error's
kind travels in the status details, a ``google.rpc.ErrorInfo``), and ``channel`` opens a
channel with the project's message limits. ``StagePool`` calls many stages at once through
gRPC futures, so no thread pool bounds how many stages a chain may have.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf import any_pb2
from google.protobuf import message as pb_message
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message_factory import GetMessageClass
from google.rpc.error_details_pb2 import ErrorInfo
from google.rpc.status_pb2 import Status
from grpc_status import rpc_status

from elasticpipe import errors
from elasticpipe.logs import get_logger
from elasticpipe.security import admission, authz
from elasticpipe.security.tls import TLS
from elasticpipe.v1 import stage_pb2, stage_pb2_grpc

log = get_logger(__name__)

CLOSE_WAIT_S = 5.0  # the longest a channel's close may take before it is left to the exit
# Channels being closed, and those whose close never finished: kept referenced, because
# grpcio closes a collected channel again, with no bound (``_ChannelCallState.__del__``)
_CLOSING: dict[int, grpc.Channel] = {}  # by id (one dict operation each: thread-safe)

# Messages carry at most one chunk of a tensor plus headers; whole tensors are streamed.
MAX_MESSAGE_BYTES = 64 << 20
# HTTP/2 "rapid reset" (CVE-2023-44487): bound what one connection can ask of a server.
MAX_CONCURRENT_STREAMS = 256
# Status messages travel in HTTP/2 trailers: keep them well under the metadata limit.
MAX_STATUS_MESSAGE = 2000
# StagePool.all(retry_unreachable=True) waits this long before calling the unreachable again.
RETRY_UNREACHABLE_S = 0.5
ERROR_DOMAIN = "elasticpipe"

T = TypeVar("T")


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Options shared by every server and channel of the project."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # A peer that restarts (a coordinator, a stage) is found again within a second:
        # gRPC's default reconnect backoff grows to two minutes.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel options plus the server-only limits."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 2),  # a peer pinging too often is disconnected
        # Connections are recycled, long polls included; calls in flight get an hour more.
        ("grpc.max_connection_age_ms", 2 * 3600_000),
        ("grpc.max_connection_age_grace_ms", 3600_000),
        ("grpc.so_reuseport", 0),
    ]


def channel(
    address: str, tls: TLS | None = None, max_message_bytes: int = MAX_MESSAGE_BYTES
) -> grpc.Channel:
    """Opens a channel to a peer: mutual TLS with ``tls``, plaintext without."""
    options = channel_options(max_message_bytes)
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


class StagePool:
    """Cached channels to stages, a stub per call, and calls to many stages at once."""

    def __init__(
        self,
        unavailable: type[errors.ElasticPipeError] = errors.StageUnavailable,
        tls: TLS | None = None,
        interceptors: Sequence[Any] = (),
    ):
        """``interceptors`` wrap every channel (the coordinator's ``TermStamp``)."""
        self._interceptors = list(interceptors)
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, stage_pb2_grpc.StageServiceStub] = {}
        self._lock = threading.Lock()
        self._unavailable = unavailable
        self.tls = tls

    def stub(self, address: str) -> stage_pb2_grpc.StageServiceStub:
        """A StageService stub for ``address`` over a cached channel (the stub is cached
        too: building one makes a callable per method, ~0.1 ms, and a step makes several
        calls per stage; stubs are thread-safe)."""
        with self._lock:
            cached = self._stubs.get(address)
            if cached is None:
                if address not in self._channels:
                    opened = channel(address, self.tls)
                    if self._interceptors:
                        opened = grpc.intercept_channel(opened, *self._interceptors)
                    self._channels[address] = opened
                cached = self._stubs[address] = stage_pb2_grpc.StageServiceStub(
                    self._channels[address]
                )
            return cached

    def encoded(self, address: str, method: str) -> grpc.StreamUnaryMultiCallable[bytes, Any]:
        """A client-streaming StageService ``method`` to ``address`` whose requests are
        sent as given: each already in its wire form (bytes), so not copied once more."""
        described = stage_pb2.DESCRIPTOR.services_by_name["StageService"].methods_by_name[method]
        self.stub(address)  # opens the cached channel
        with self._lock:
            cached = self._channels[address]
        return cached.stream_unary(
            f"/{described.containing_service.full_name}/{method}",
            request_serializer=None,
            response_deserializer=GetMessageClass(described.output_type).FromString,
        )

    def call(self, address: str, method: str, request: Any, timeout: float) -> Any:
        """One unary call with a deadline; errors translated."""
        return call(address, getattr(self.stub(address), method), request, timeout=timeout)

    def each(
        self, address_requests: Sequence[tuple[str, Any]], method: str, timeout: float
    ) -> list[Any | errors.ElasticPipeError]:
        """Calls ``method`` on every stage at once (gRPC futures: no thread per call).

        Returns:
            In order, each reply, or the translated error of that stage.
        """
        futures = [
            (address, getattr(self.stub(address), method).future(request, timeout=timeout))
            for address, request in address_requests
        ]
        out: list[Any | errors.ElasticPipeError] = []
        for address, future in futures:
            try:
                out.append(future.result())
            except grpc.RpcError as exc:
                out.append(translate(exc, address, self._unavailable))
        return out

    def all(
        self,
        address_requests: Sequence[tuple[str, Any]],
        method: str,
        timeout: float,
        retry_unreachable: bool = False,
    ) -> list[Any]:
        """Like ``each``, but raises the first failure (after every call ended).

        Args:
            retry_unreachable: call once more, after a short pause, the stages that could
                not be reached (for idempotent calls: opening hundreds of connections at
                once can time a few out on a loaded host).
        """
        results = self.each(address_requests, method, timeout)
        missed = [i for i, r in enumerate(results) if isinstance(r, self._unavailable)]
        if retry_unreachable and missed:
            time.sleep(RETRY_UNREACHABLE_S)
            again = self.each([address_requests[i] for i in missed], method, timeout)
            for i, result in zip(missed, again, strict=True):
                results[i] = result
        for result in results:
            if isinstance(result, errors.ElasticPipeError):
                raise result
        return results

    def close(self) -> None:
        """Closes every channel (``close_channel``: a stuck one is left to the exit)."""
        with self._lock:
            channels = list(self._channels.items())
            self._channels.clear()
            self._stubs.clear()
        close_channels(channels)


def close_channels(channels: Sequence[tuple[str, grpc.Channel]]) -> None:
    """Closes each (address, channel) with ``close_channel``. All are kept referenced
    first, so that a second Ctrl-C during one close leaves none to the collector."""
    _CLOSING.update((id(ch), ch) for _, ch in channels)
    for address, ch in channels:
        close_channel(ch, address)


def close_channel(ch: grpc.Channel, address: str, wait_s: float | None = None) -> bool:
    """Closes ``ch``, waiting at most ``wait_s`` (default ``CLOSE_WAIT_S``) for grpcio to
    finish; whether it did.

    grpcio's ``Channel.close`` cancels the calls in flight, then waits until its polling
    thread has seen each one end. A ``KeyboardInterrupt`` that lands in grpcio's own code
    while the main thread starts a call (between registering the call and starting that
    thread: ``grpc._channel._channel_managed_call_management``) leaves a call no thread
    will ever see end, and the close then waits forever: Ctrl-C hung the demo one time in
    a few. Such a channel is left open, with a warning, for the process's exit to end (and
    kept referenced until then: grpcio would close it again, unbounded, when collected).
    """
    _CLOSING[id(ch)] = ch
    closer = threading.Thread(target=ch.close, name=f"close-{address}", daemon=True)
    closer.start()
    wait = CLOSE_WAIT_S if wait_s is None else wait_s
    closer.join(wait)
    if closer.is_alive():
        log.warning("channel_close_abandoned", address=address, waited_s=wait)
        return False
    _CLOSING.pop(id(ch), None)
    return True


def _reason(exc: grpc.RpcError) -> tuple[str, dict[str, str]]:
    """The error kind a peer of ours put in the status details, and its fields, if any."""
    try:
        status = rpc_status.from_call(exc)  # type: ignore[arg-type]
    except ValueError:  # details that contradict the status line: ignore them
        return "", {}
    for detail in status.details if status is not None else ():
        info = ErrorInfo()
        if detail.Unpack(info) and info.domain == ERROR_DOMAIN:
            return str(info.reason), dict(info.metadata)
    return "", {}


def translate(
    exc: grpc.RpcError,
    peer: str,
    unavailable: type[errors.ElasticPipeError] = errors.StageUnavailable,
) -> errors.ElasticPipeError:
    """Maps a failed call to the domain error tree, naming the peer.

    Args:
        exc: the failed call.
        peer: the address called (named in the message where the error started).
        unavailable: the error for a peer that could not be reached at all.
    """
    code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    reason, metadata = _reason(exc) if isinstance(exc, grpc.Call) else ("", dict[str, str]())
    if not reason and code == grpc.StatusCode.UNAVAILABLE:
        reason = unavailable.reason()
        code = unavailable.code
    if "(from " not in details and not reason.startswith(("StaleEpoch", "Rebalancing")):
        details = f"{details} (from {peer}, {code.name})"  # name the peer once
    return errors.from_status(code, details, reason, metadata)


def call(
    peer: str,
    fn: Callable[..., T],
    request: Any,
    timeout: float,
    unavailable: type[errors.ElasticPipeError] = errors.StageUnavailable,
    **kwargs: Any,
) -> T:
    """Calls a unary (or client-streaming) stub method with a deadline, translating errors."""
    try:
        return fn(request, timeout=timeout, **kwargs)
    except grpc.RpcError as exc:
        raise translate(exc, peer, unavailable) from exc


# ---- server side -------------------------------------------------------------------


def status_of(exc: errors.ElasticPipeError) -> grpc.Status:
    """The wire status of a domain error: its code, message and kind."""
    message = str(exc)
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 15] + "... (truncated)"
    detail = any_pb2.Any()
    detail.Pack(ErrorInfo(reason=exc.reason(), domain=ERROR_DOMAIN, metadata=exc.metadata()))
    return rpc_status.to_status(Status(code=exc.code.value[0], message=message, details=[detail]))


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, errors.ElasticPipeError):
        context.abort_with_status(status_of(exc))
    log.error("rpc_failed", method=method, error=repr(exc), exc_info=exc)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}")


def _parse(cls: type[pb_message.Message], raw: bytes) -> Any:
    msg = cls()
    try:
        msg.ParseFromString(raw)
    except Exception as exc:  # protobuf raises DecodeError and, for some inputs, others
        raise errors.InvalidRequest(
            f"malformed {cls.DESCRIPTOR.full_name} ({len(raw)} bytes): {exc}"
        ) from exc
    return msg


def _parsed_stream(cls: type[pb_message.Message], raw_iter: Iterator[bytes]) -> Iterator[Any]:
    for raw in raw_iter:
        yield _parse(cls, raw)


def _handler(
    method: MethodDescriptor,
    impl: Callable[..., Any],
    authorize: bool,
    guard: admission.Guard | None = None,
    check: Callable[[grpc.ServicerContext], None] | None = None,
) -> grpc.RpcMethodHandler[Any, Any]:
    req_cls = GetMessageClass(method.input_type)
    name = method.full_name
    row = f"{method.containing_service.name}/{method.name}"  # the authorization table's key
    serialize = GetMessageClass(method.output_type).SerializeToString

    def admit(context: grpc.ServicerContext) -> contextlib.AbstractContextManager[None]:
        # Who calls, before the request is even parsed; then what the server checks of an
        # authorized call (a coordinator's term); then the caller's place (its cap).
        identity = authz.authorize(row, context) if authorize else None
        if check is not None:
            check(context)
        return guard.hold(context, identity, row) if guard else contextlib.nullcontext()

    def parse(arg: Any, context: grpc.ServicerContext) -> Any:
        # Unary requests arrive as bytes, streamed ones as an iterator of bytes.
        if not method.client_streaming:
            return _parse(req_cls, arg)
        return _parsed_stream(req_cls, guard.streams.watch(arg, context, row) if guard else arg)

    def unary_out(arg: Any, context: grpc.ServicerContext) -> Any:
        try:
            with admit(context):
                return impl(parse(arg, context), context)
        except Exception as exc:
            _abort(context, exc, name)

    def stream_out(arg: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            with admit(context):
                yield from impl(parse(arg, context), context)
        except Exception as exc:
            _abort(context, exc, name)

    factory: Any = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(method.client_streaming, method.server_streaming)]
    body = stream_out if method.server_streaming else unary_out
    handler: grpc.RpcMethodHandler[Any, Any] = factory(
        functools.wraps(impl)(body),
        request_deserializer=None,
        response_serializer=serialize,
    )
    return handler


def add_service(
    server: grpc.Server,
    service: ServiceDescriptor,
    servicer: object,
    authorize: bool = False,
    guard: admission.Guard | None = None,
    check: Callable[[grpc.ServicerContext], None] | None = None,
) -> None:
    """Registers ``servicer`` (methods named as in the .proto) for ``service`` on ``server``.

    Args:
        authorize: check each caller's role against ``elasticpipe.security.authz`` (mutual TLS).
        guard: cap each peer's calls and time out idle client streams (``admission``).
        check: called with each call's context once it is authorized (it raises to refuse
            the call: a stage's ``TermFence``).

    Raises:
        TypeError: the servicer lacks a method of the service.
    """
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        impl = getattr(servicer, method.name, None)
        if impl is None:
            raise TypeError(f"{type(servicer).__name__} does not implement {method.full_name}")
        handlers[method.name] = _handler(method, impl, authorize, guard, check)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
