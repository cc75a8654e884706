"""The one exception hierarchy of ElasticPipe, and its mapping to gRPC status codes.

::

    ElasticPipeError                  INTERNAL unless a subclass says otherwise
    ├── InvalidRequest(ValueError)    INVALID_ARGUMENT     bad shape, dtype, size, name, argument
    │   └── ModelError                INVALID_ARGUMENT     a factory that fails or has no layers
    ├── PermissionDenied              PERMISSION_DENIED    model outside --allow-models
    ├── TooLarge                      RESOURCE_EXHAUSTED   declared or received size over a limit
    ├── StaleEpoch                    FAILED_PRECONDITION  request of another epoch (retryable)
    ├── NotReady                      FAILED_PRECONDITION  no job / layers / step in that state
    ├── Rebalancing                   UNAVAILABLE          layers are moving; retry shortly
    ├── StageUnavailable              UNAVAILABLE          a stage cannot be reached or died
    ├── StepAborted                   ABORTED              the step was discarded everywhere
    ├── TransferError                 DATA_LOSS            a moved layer failed its checksum
    └── DeadlineExceeded(TimeoutError) DEADLINE_EXCEEDED   a wait ran past its deadline

Remote errors are translated into this tree in exactly one place, ``elasticpipe.rpc``; a
servicer raises these and the adapter turns them into a status + message, never a traceback.
"""

from __future__ import annotations

import grpc


class ElasticPipeError(Exception):
    """Base of every error ElasticPipe raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    retryable: bool = False


class InvalidRequest(ElasticPipeError, ValueError):
    """A request or argument is malformed; the message names the bad value."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ModelError(InvalidRequest):
    """A model factory could not be resolved, failed, or returned something unusable."""


class PermissionDenied(ElasticPipeError, PermissionError):
    """The operator did not allow this (for example a model outside ``--allow-models``)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class TooLarge(ElasticPipeError):
    """A declared or received size is over a configured limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class StaleEpoch(ElasticPipeError):
    """The request was computed under another partition epoch; refetch the partition."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    retryable = True


class NotReady(ElasticPipeError):
    """The receiver is not in the state this request needs (no job, wrong step, ...)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Rebalancing(ElasticPipeError):
    """Layers are being moved between stages; the same request will succeed shortly."""

    code = grpc.StatusCode.UNAVAILABLE
    retryable = True


class StageUnavailable(ElasticPipeError):
    """A stage or the coordinator could not be reached, or died mid-request."""

    code = grpc.StatusCode.UNAVAILABLE


class StepAborted(ElasticPipeError):
    """A step was abandoned and discarded on every stage; nothing of it was committed."""

    code = grpc.StatusCode.ABORTED


class TransferError(ElasticPipeError):
    """A layer transfer was cut short or failed its checksum; the old epoch stays in force."""

    code = grpc.StatusCode.DATA_LOSS


class DeadlineExceeded(ElasticPipeError, TimeoutError):
    """A wait ran past its deadline."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE: dict[grpc.StatusCode, type[ElasticPipeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.RESOURCE_EXHAUSTED: TooLarge,
    grpc.StatusCode.FAILED_PRECONDITION: NotReady,
    grpc.StatusCode.UNAVAILABLE: StageUnavailable,
    grpc.StatusCode.ABORTED: StepAborted,
    grpc.StatusCode.DATA_LOSS: TransferError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}

# Message prefixes that let a receiver recover the precise subclass of a status code.
STALE_EPOCH_PREFIX = "stale epoch"
REBALANCING_PREFIX = "rebalancing"


def from_status(code: grpc.StatusCode, details: str) -> ElasticPipeError:
    """Builds the domain error for a status received from a peer."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and details.startswith(STALE_EPOCH_PREFIX):
        return StaleEpoch(details)
    if code == grpc.StatusCode.UNAVAILABLE and details.startswith(REBALANCING_PREFIX):
        return Rebalancing(details)
    return _BY_CODE.get(code, ElasticPipeError)(details)
