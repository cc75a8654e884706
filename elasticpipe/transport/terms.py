"""A coordinator's term on every command it sends, and a stage's refusal of older terms.

A coordinator elected on etcd leads for one **term** (``coordinator.store.election``; terms
only grow). ``TermStamp`` is the client interceptor on the coordinator's channels to its
stages: it adds the term to every call's metadata, and refuses to send at all once the
coordinator no longer leads (its ``term`` callable raises ``NotLeader``). ``TermFence`` is
the stage's check of every authorized call: it remembers the highest term it has obeyed
and refuses a call with a lower one -- a deposed leader that has not noticed yet cannot
command a stage a newer leader has reached. Calls without a term (a client's steps, a
coordinator on SQLite, which has no election) pass as before.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import grpc

from elasticpipe.errors import InvalidRequest, NotLeader, PermissionDenied
from elasticpipe.logs import get_logger
from elasticpipe.security import authz

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


_TERM = re.compile(r"[1-9][0-9]{0,18}")  # etcd revisions are int64


def term_of(metadata: Any) -> int | None:
    """The term a call carries (None: none).

    Raises:
        InvalidRequest: a term that is not a whole number from 1 to 2**63 - 1 (named).
    """
    for key, value in metadata or ():
        if key == TERM_KEY:
            text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
            if not _TERM.fullmatch(text) or int(text) >= 1 << 63:
                raise InvalidRequest(
                    f"the {TERM_KEY} metadata must be a whole number from 1 to 2**63 - 1, "
                    f"not {text[:40]!r}"
                )
            return int(text)
    return None


class TermFence:
    """Refuses calls whose term is lower than the highest this server has obeyed.

    ``check`` runs on every call once it is authorized (``start_server(check=...)``), so
    under mutual TLS only a caller with the coordinator role moves the highest term: a
    term from any other caller is refused, and cannot lock a stage out of its leader.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.highest = 0

    def admit(self, term: int) -> None:
        """Records ``term``.

        Raises:
            NotLeader: it is older than a term already obeyed.
        """
        with self._lock:
            if term >= self.highest:
                self.highest = term
                return
            highest = self.highest
        log.warning("command_refused", term=term, highest=highest)
        raise NotLeader(
            f"a command of coordinator term {term}, older than term {highest} that this "
            "stage already obeys: its coordinator was deposed; nothing was done"
        )

    def check(self, context: grpc.ServicerContext) -> None:
        """The term of an authorized call, if it carries one, admitted or refused.

        Raises:
            InvalidRequest: a malformed term.
            PermissionDenied: a term from a caller whose certificate is not a coordinator's.
            NotLeader: an older term than one already obeyed.
        """
        term = term_of(context.invocation_metadata())
        if term is None:
            return
        identity = authz.caller()
        if identity is not None and identity[1] != "coordinator":
            raise PermissionDenied(
                f"{identity[0]} (role {identity[1]}) sent a coordinator term: only a "
                "coordinator's certificate may"
            )
        self.admit(term)
