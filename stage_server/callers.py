"""Which caller of a role may act on this stage's job, beyond the role table (mutual TLS).

* **The client holding the job.** The coordinator grants a job to one client at a time (a
  lease, a generation, the holder's certificate name) and pushes the grant to the chain's
  stages (``Fence``). The stage runs, commits and aborts runs only for that generation and,
  with TLS, only for calls from that certificate (or the coordinator settling a run). A
  stage that missed the push -- it joined the job by recovery or scale-out -- asks the
  coordinator (``JobClient``), at most once every ``ASK_INTERVAL_S``.
* **The stage a snapshot copy comes from.** A ``PushSnapshot`` names its source stage: it
  must be in this stage's chain and, with TLS, registered under the caller's certificate
  name; its layers are the source's range, each once -- checked before a byte of a layer
  is assembled.

Without TLS nothing binds a caller to a name: whoever reaches the port is trusted
(``--insecure``, loopback clusters); the generation checks still hold.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from elasticpipe.errors import ElasticPipeError, InvalidRequest, NotReady, PermissionDenied
from elasticpipe.logs import get_logger
from elasticpipe.partition import Placement
from elasticpipe.security import authz
from elasticpipe.security.tls import name_matches

if TYPE_CHECKING:
    from elasticpipe.stage_server.stage import Stage

log = get_logger(__name__)

ASK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Grant:
    """Who drives a job, as the coordinator says."""

    job_id: str
    client: int
    holder: str


class ClientGate:
    """Binds the step protocol and the client's data to the client the coordinator
    granted the job."""

    def __init__(self, stage: Stage, interval_s: float = ASK_INTERVAL_S):
        self.stage = stage
        self.ask: Callable[[], Grant] | None = None  # set by the server: asks the coordinator
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._asked = -math.inf

    def check(self, what: str, client: int | None = None, coordinator_may: bool = False) -> None:
        """Checks the current call may do ``what`` on the job.

        Args:
            what: the request, for the error.
            client: the client generation the request names (None: it names none).
            coordinator_may: the coordinator may make it too (settling a run).

        Raises:
            PermissionDenied: with TLS, a client certificate other than the holder's.
        """
        identity = authz.caller()
        role = identity[1] if identity is not None else ""
        if role == authz.COORDINATOR and coordinator_may:
            return
        as_client = role == authz.CLIENT
        if client is None and not as_client:
            return  # a stage's data, or no TLS: nothing to bind (and no lock taken)
        state = self.stage.state()
        past_fence = client is not None and client > state.fence
        if past_fence or (as_client and identity is not None and identity[0] != state.holder):
            self._learn()  # the stage may have missed the coordinator's Fence
            state = self.stage.state()
        if as_client and identity is not None and identity[0] != state.holder:
            raise PermissionDenied(
                f"{what} refused: client {identity[0]!r} does not hold the job on stage "
                f"{self.stage.config.name} (the coordinator granted it to "
                f"{state.holder or 'nobody'!r}, client generation {state.fence})"
            )

    def _learn(self) -> None:
        """Asks the coordinator for the job's grant and follows it: one question at a
        time -- a request arriving meanwhile waits for its answer (an abort racing the
        run it aborts must see the same fence) -- and at most every ``interval_s``."""
        with self._lock:
            if self.ask is None or time.monotonic() - self._asked < self.interval_s:
                return
            try:
                grant = self.ask()
            except ElasticPipeError as exc:
                log.warning("job_client_unknown", error=str(exc))
                return
            finally:
                self._asked = time.monotonic()
            # Generations are the coordinator's, across jobs: follow its newest grant even
            # while the job is still being installed here (a joining stage asks early).
            self.stage.fence(grant.client, grant.holder)


def check_source(source: str, placement: Placement | None) -> range:
    """Checks that a snapshot copy's source is in this stage's chain and, with TLS, that
    the caller is registered under its name.

    Returns:
        The layers the source owns (those its copy may hold).

    Raises:
        NotReady: no chain, or a source outside it.
        PermissionDenied: the caller's certificate does not name the source.
    """
    chain = placement.chain if placement is not None else ()
    refs = [i for i, ref in enumerate(chain) if ref.stage_id == source]
    if placement is None or not refs:
        raise NotReady(
            f"snapshot copy from {source!r}, which is not in the chain "
            f"{[ref.stage_id for ref in chain]}"
        )
    index = refs[0]
    identity = authz.caller()
    name = placement.names[index] if index < len(placement.names) else ""
    if identity is not None and not (name and name_matches(identity[0], name)):
        raise PermissionDenied(
            f"snapshot copy from {source!r} ({name or 'name unknown'}) refused: the caller's "
            f"certificate names {identity[0]!r}"
        )
    if index < len(placement.ranges):
        lo, hi = placement.ranges[index]
        return range(lo, hi)
    return range(0)


class LayerPiece(Protocol):
    """A message of a layer stream (``LayerChunk``): which layer it belongs to."""

    layer: int


P = TypeVar("P", bound=LayerPiece)


def first_pieces(pieces: Iterable[P], check: Callable[[int], None]) -> Iterator[P]:
    """Passes on a stream of layer pieces, calling ``check(layer)`` at each layer's first
    piece and refusing a layer sent twice, before anything of the layer is assembled.

    Raises:
        InvalidRequest: a layer sent twice; or whatever ``check`` raises.
    """
    seen: set[int] = set()
    current: int | None = None
    for piece in pieces:
        if piece.layer != current:
            if piece.layer in seen:
                raise InvalidRequest(f"layer {piece.layer} sent twice")
            check(piece.layer)
            seen.add(piece.layer)
            current = piece.layer
        yield piece


def in_source_range(layers: range, source: str, changing: bool = False) -> Callable[[int], None]:
    """A ``first_pieces`` check: a copy from ``source`` holds only the layers it owns.
    While an epoch change is in progress here (``changing``), the source may already own
    its new layers, which this stage learns when it commits: such a copy is refused as
    not ready (its sender tries again), not as invalid."""

    def check(layer: int) -> None:
        if layer not in layers:
            outside = (
                f"snapshot copy from {source!r} holds layer {layer}, outside the layers it "
                f"owns [{layers.start}, {layers.stop})"
            )
            if changing:
                raise NotReady(f"{outside} before this stage's epoch change commits")
            raise InvalidRequest(outside)

    return check
