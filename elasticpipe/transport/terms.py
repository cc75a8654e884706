"""A coordinator's term on every command it sends, and a stage's refusal of older terms.

A coordinator elected on etcd leads for one **term** (``coordinator.store.election``; terms
only grow). ``TermStamp`` is the client interceptor on the coordinator's channels to its
stages: it adds the term to every call's metadata, and refuses to send at all once the
coordinator no longer leads (its ``term`` callable raises ``NotLeader``). ``TermFence`` is
the stage's server interceptor: it remembers the highest term it has obeyed and refuses a
call with a lower one -- a deposed leader that has not noticed yet cannot command a stage a
newer leader has reached. Calls without a term (a client's steps, a coordinator on SQLite,
which has no election) pass as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from elasticpipe.errors import NotLeader
from elasticpipe.logs import get_logger
from elasticpipe.transport.rpc import status_of

log = get_logger(__name__)

TERM_KEY = "elasticpipe-term"


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _CallDetails(_Details, grpc.ClientCallDetails):
    """``grpc.ClientCallDetails`` with other metadata (gRPC's own type is abstract)."""


class TermStamp(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.StreamStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Stamps each call with ``term()``; ``term`` raises NotLeader when there is none."""

    def __init__(self, term: Callable[[], int]):
        self._term = term

    def _stamped(self, details: Any) -> _CallDetails:
        metadata = [*(details.metadata or ()), (TERM_KEY, str(self._term()))]
        return _CallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._stamped(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._stamped(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._stamped(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._stamped(details), requests)


def term_of(metadata: Any) -> int | None:
    """The term a call carries, or None (no term, or one that is not a whole number > 0)."""
    for key, value in metadata or ():
        if key == TERM_KEY:
            text = value.decode() if isinstance(value, bytes) else str(value)
            return int(text) if text.isdigit() and int(text) > 0 else None
    return None


class TermFence(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses calls whose term is lower than the highest this server has let through."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.highest = 0

    def admit(self, term: int) -> NotLeader | None:
        """Records ``term``; the error to answer with if it is older than one already seen."""
        with self._lock:
            if term >= self.highest:
                self.highest = term
                return None
            highest = self.highest
        log.warning("command_refused", term=term, highest=highest)
        return NotLeader(
            f"a command of coordinator term {term}, older than term {highest} that this "
            "stage already obeys: its coordinator was deposed; nothing was done"
        )

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        term = term_of(details.invocation_metadata)
        if handler is None or term is None:
            return handler
        refused = self.admit(term)
        if refused is None:
            return handler
        return _refusing(handler, refused)


def _refusing(handler: Any, error: NotLeader) -> Any:
    """A handler of ``handler``'s kind that answers every call with ``error``."""

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort_with_status(status_of(error))

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(
        refuse,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
