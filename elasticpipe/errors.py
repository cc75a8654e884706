"""The one exception hierarchy of ElasticPipe, and its mapping to gRPC status codes.

::

    ElasticPipeError                   INTERNAL unless a subclass says otherwise
    ├── InvalidRequest(ValueError)     INVALID_ARGUMENT     bad shape, dtype, size, name, argument
    │   ├── ModelError                 INVALID_ARGUMENT     a factory that fails or has no layers
    │   └── UserCodeError              INVALID_ARGUMENT     the user's model, loss or data raised
    ├── PermissionDenied               PERMISSION_DENIED    not allowed here (model, role, fault)
    ├── TooLarge                       RESOURCE_EXHAUSTED   declared or received size over a limit
    ├── NameInUse                      ALREADY_EXISTS       a live stage already holds the name
    ├── NotReady                       FAILED_PRECONDITION  no job / layers / step in that state
    │   ├── StaleEpoch                 FAILED_PRECONDITION  request of another epoch (retryable)
    │   ├── Fenced                     FAILED_PRECONDITION  a newer client holds the job
    │   ├── JobInUse                   FAILED_PRECONDITION  a live client holds the job's lease
    │   ├── NotLeader                  FAILED_PRECONDITION  a deposed coordinator's write or command
    │   ├── LoadForgotten              FAILED_PRECONDITION  the coordinator holds no such load
    │   ├── StagesMissing              FAILED_PRECONDITION  fewer live stages than the job needs
    │   └── PipelineClosed             FAILED_PRECONDITION  a method of a closed pipeline was called
    ├── Unavailable                    UNAVAILABLE          a peer cannot be reached
    │   ├── StageUnavailable           UNAVAILABLE          a stage cannot be reached or died
    │   ├── CoordinatorUnavailable     UNAVAILABLE          the coordinator cannot be reached
    │   │   └── StandingBy             UNAVAILABLE          a standby coordinator: ask its leader
    │   ├── CommitOutcomeUnknown       UNAVAILABLE          a commit's reply lost, unreadable
    │   └── Rebalancing                UNAVAILABLE          layers are moving; retry shortly
    ├── StepAborted                    ABORTED              the step was discarded everywhere
    ├── TransferError                  DATA_LOSS            a moved layer failed its checksum
    ├── LayersLost                     DATA_LOSS            every copy of some layers is gone
    │   └── ReplicaDivergence          DATA_LOSS            replicas hold different bytes of a layer
    └── DeadlineExceeded(TimeoutError) DEADLINE_EXCEEDED    a wait ran past its deadline

The error's kind travels in the gRPC status details (a ``google.rpc.ErrorInfo`` whose
``reason`` names the class, and whose ``metadata`` carries a kind's fields, such as a
standby's ``leader``), so a receiver rebuilds the precise class without reading the
message. Remote errors are translated into this tree in exactly one place,
``elasticpipe.transport.rpc``; a servicer raises these and the adapter turns them into a status,
never a traceback.
"""

from __future__ import annotations

import grpc


class ElasticPipeError(Exception):
    """Base of every error ElasticPipe raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = False

    @classmethod
    def reason(cls) -> str:
        """The kind's name on the wire (the class name)."""
        return cls.__name__

    def metadata(self) -> dict[str, str]:
        """The fields this kind sends along (``ErrorInfo.metadata``); none by default."""
        return {}

    @classmethod
    def from_wire(cls, details: str, metadata: dict[str, str]) -> ElasticPipeError:
        """Rebuilds the error a peer sent (``metadata`` as ``metadata()`` gave it)."""
        return cls(details)


class InvalidRequest(ElasticPipeError, ValueError):
    """A request or argument is malformed; the message names the bad value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelError(InvalidRequest):
    """A model factory could not be resolved, failed, or returned something unusable."""


class UserCodeError(InvalidRequest):
    """The user's model, loss or data raised during a step; the message says where."""


class PermissionDenied(ElasticPipeError, PermissionError):
    """The operator did not allow this (a model outside ``--allow-models``, a caller's role)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class TooLarge(ElasticPipeError):
    """A declared or received size is over a configured limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class NameInUse(ElasticPipeError):
    """A stage registered under a name that a live, answering incarnation holds."""

    code = grpc.StatusCode.ALREADY_EXISTS


class NotReady(ElasticPipeError):
    """The receiver is not in the state this request needs (no job, wrong step, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StaleEpoch(NotReady):
    """The request was computed under another partition epoch; refetch the partition."""

    retryable = True


class Fenced(NotReady):
    """A newer client took over the job; this client's requests are refused."""


class JobInUse(NotReady):
    """Another live client holds the job's lease (use ``resume=True`` to attach instead)."""


class LoadForgotten(NotReady):
    """The coordinator holds no checkpoint load of that epoch in progress: a new leader,
    or a restarted coordinator, settled it from the store (finished if it reached its
    commit point, else undone). The partition says which. (A load the coordinator itself
    abandoned, past its lease, is a ``DeadlineExceeded`` that says so.)"""


class NotLeader(NotReady):
    """A coordinator that no longer leads tried to write to the store or to command a stage
    (nothing was written or done)."""


class StagesMissing(NotReady):
    """Fewer live stages than the job asked for (so far)."""


class PipelineClosed(NotReady):
    """The pipeline was closed (``close()``, or the end of its ``with`` block): it no longer
    holds the job, so it must not touch it; make a new one (``resume=True`` attaches)."""


class Unavailable(ElasticPipeError):
    """A peer could not be reached."""

    code = grpc.StatusCode.UNAVAILABLE


class StageUnavailable(Unavailable):
    """A stage could not be reached, or died mid-request."""


class CoordinatorUnavailable(Unavailable):
    """The coordinator could not be reached."""


class StandingBy(CoordinatorUnavailable):
    """The coordinator called stands by: another leads (``leader``, its address, or ""
    while nobody does). A caller given every coordinator's address goes to the leader."""

    def __init__(self, message: str, leader: str = ""):
        super().__init__(message)
        self.leader = leader

    def metadata(self) -> dict[str, str]:
        return {"leader": self.leader}

    @classmethod
    def from_wire(cls, details: str, metadata: dict[str, str]) -> ElasticPipeError:
        return cls(details, metadata.get("leader", ""))


class CommitOutcomeUnknown(Unavailable):
    """A commit whose reply was lost and that could not be read back: the epoch change
    is neither committed nor undone by its coordinator; a restarted or new leader settles
    it from the store."""


class Rebalancing(Unavailable):
    """Layers are being moved between stages; the same request will succeed shortly."""

    retryable = True


class StepAborted(ElasticPipeError):
    """A step was abandoned and discarded on every stage; nothing of it was committed."""

    code = grpc.StatusCode.ABORTED


class TransferError(ElasticPipeError):
    """A layer transfer was cut short or failed its checksum; the old epoch stays in force."""

    code = grpc.StatusCode.DATA_LOSS


class LayersLost(ElasticPipeError):
    """Every copy of some layers' state is gone: the job cannot recover by itself."""

    code = grpc.StatusCode.DATA_LOSS


class ReplicaDivergence(LayersLost):
    """Holders of a layer in different replicas hold different bytes at the same step
    (mixed hardware computing different bits, or state a layer keeps outside its
    gradients): the replicas no longer train one model, so the job stops."""


# How a LayersLost job goes on (docs/checkpoints.md, docs/failures.md): a lost job cannot be
# resumed, but a checkpoint loads into a new job on any partition, optimizer state and step
# included.
CONTINUE_FROM_SAVE = (
    "to continue from your last pipe.save(DIR): close this Pipeline, start a new one with "
    "the same arguments (without resume=True: a lost job cannot be resumed), then call "
    "pipe.load(DIR)"
)


class DeadlineExceeded(ElasticPipeError, TimeoutError):
    """A wait ran past its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


def _kinds(cls: type[ElasticPipeError]) -> list[type[ElasticPipeError]]:
    return [cls, *(k for sub in cls.__subclasses__() for k in _kinds(sub))]


BY_REASON: dict[str, type[ElasticPipeError]] = {k.reason(): k for k in _kinds(ElasticPipeError)}

# Without a reason in the details (another implementation, a proxy), the code decides.
_BY_CODE: dict[grpc.StatusCode, type[ElasticPipeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.UNAUTHENTICATED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TooLarge,
    grpc.StatusCode.ALREADY_EXISTS: NameInUse,
    grpc.StatusCode.FAILED_PRECONDITION: NotReady,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.ABORTED: StepAborted,
    grpc.StatusCode.DATA_LOSS: TransferError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def from_status(
    code: grpc.StatusCode,
    details: str,
    reason: str = "",
    metadata: dict[str, str] | None = None,
) -> ElasticPipeError:
    """Builds the domain error for a status received from a peer.

    Args:
        code: the status code.
        details: the status message.
        reason: the kind from the status details, if the peer sent one.
        metadata: the kind's fields from the status details.
    """
    kind = BY_REASON.get(reason)
    if kind is not None and kind.code == code:
        return kind.from_wire(details, metadata or {})
    return _BY_CODE.get(code, ElasticPipeError)(details + _tls_hint(details))


_TLS_HINTS = {
    "Hostname Verification Check failed": (
        "the server's certificate does not name the address dialled: issue it with "
        "'elasticpipe certs issue DIR --name NAME --role ROLE --host HOST' for the address "
        "it advertises"
    ),
    "CERTIFICATE_VERIFY_FAILED": "the peer's certificate is not signed by this cluster's CA "
    "(check --tls-ca)",
    "BAD_SIGNATURE": "the peer's certificate is not signed by this cluster's CA (check --tls-ca)",
}


def _tls_hint(details: str) -> str:
    """What to do about a TLS handshake failure gRPC reports in ``details``."""
    for needle, hint in _TLS_HINTS.items():
        if needle in details:
            return f" ({hint})"
    return ""
