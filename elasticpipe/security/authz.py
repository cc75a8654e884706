"""Who may call what: one table of the roles allowed to call each RPC (mutual TLS).

With TLS, every caller presents a certificate from the cluster's CA naming its role
(``elasticpipe.security.tls``). A call from a role not in its RPC's row is refused with
``PERMISSION_DENIED`` naming the role and the RPC, before the request is even parsed.
Without TLS (loopback clusters, or ``--insecure``) nothing is checked: anyone who can
reach the port may call anything.

=====================================  =================================================
RPC                                    roles
=====================================  =================================================
StageService data path                 client, stage  (Forward, Backward, Targets, Deliver,
                                         OpenBulk)
StageService RunStep, FetchOutput      client
StageService CommitStep, AbortStep     client, coordinator (settling a run)
StageService Fence                     coordinator
StageService Describe, Profile,        coordinator
  Assign, Freeze, PrepareEpoch,
  CommitEpoch, AbortEpoch, SetSlowdown
StageService ExportLayers              stage (migration, recovery), client (state_dict)
StageService RestoreLayers             client (a checkpoint load)
StageService PushSnapshot              stage
StageService GetStats                  client, coordinator, admin
StageService GetTrace                  admin (timeline spans and the stage's clock)
StageService InjectFault               admin (and only with --enable-fault-injection)
CoordinatorService Register,           stage
  Heartbeat, ResolveRun,
  EpochOutcome, Leave, JobClient
CoordinatorService SetupJob, ...       client (GetPartition, WatchPartition, RenewLease,
                                       ReportFailure, ProfileJob, BeginRestore, EndRestore)
CoordinatorService admin RPCs          admin (Status, Plan, Rebalance, SetPartition,
                                       Drain, Undrain, Slowdown, SetAutoRebalance, Forget)
health, reflection                     every role
=====================================  =================================================

A stage's name is its certificate's name: the coordinator refuses a ``Register`` under
another name, so nobody can take over another stage's registration. Beyond the table, a
stage takes a job's steps (RunStep, CommitStep, AbortStep, FetchOutput and the client's
data) only from the certificate of the client the coordinator granted the job, and a
snapshot copy only from the certificate of its source stage
(``elasticpipe.stage_server.callers``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable

import grpc

from elasticpipe.errors import PermissionDenied
from elasticpipe.security.tls import identity_of, name_matches

CLIENT, STAGE, COORDINATOR, ADMIN = "client", "stage", "coordinator", "admin"


def _rows(service: str, methods: Iterable[str], *roles: str) -> dict[str, frozenset[str]]:
    return {f"{service}/{m}": frozenset(roles) for m in methods}


ALLOWED: dict[str, frozenset[str]] = {
    **_rows(
        "StageService", ("Forward", "Backward", "Targets", "Deliver", "OpenBulk"), CLIENT, STAGE
    ),
    **_rows("StageService", ("RunStep", "FetchOutput"), CLIENT),
    **_rows("StageService", ("CommitStep", "AbortStep"), CLIENT, COORDINATOR),
    **_rows(
        "StageService",
        (
            "Fence",
            "Describe",
            "Profile",
            "Assign",
            "Freeze",
            "PrepareEpoch",
            "CommitEpoch",
            "AbortEpoch",
            "SetSlowdown",
        ),
        COORDINATOR,
    ),
    **_rows("StageService", ("ExportLayers",), STAGE, CLIENT),
    **_rows("StageService", ("RestoreLayers",), CLIENT),
    **_rows("StageService", ("PushSnapshot", "Reduce"), STAGE),
    **_rows("StageService", ("GetStats",), CLIENT, COORDINATOR, ADMIN),
    **_rows("StageService", ("GetTrace",), ADMIN),
    **_rows("StageService", ("InjectFault",), ADMIN),
    **_rows(
        "CoordinatorService",
        ("Register", "Heartbeat", "ResolveRun", "EpochOutcome", "Leave", "JobClient"),
        STAGE,
    ),
    **_rows(
        "CoordinatorService",
        (
            "SetupJob",
            "GetPartition",
            "WatchPartition",
            "RenewLease",
            "ReportFailure",
            "ProfileJob",
            "BeginRestore",
            "EndRestore",
        ),
        CLIENT,
    ),
    **_rows(
        "CoordinatorService",
        (
            "Status",
            "Plan",
            "Rebalance",
            "SetPartition",
            "SetLayout",
            "Drain",
            "Undrain",
            "Slowdown",
            "SetAutoRebalance",
            "Forget",
        ),
        ADMIN,
    ),
}

_CALLER: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar(
    "elasticpipe_caller", default=None
)


def caller() -> tuple[str, str] | None:
    """(name, role) of the current call's peer certificate; None without TLS."""
    return _CALLER.get()


def act_as(identity: tuple[str, str] | None) -> None:
    """Makes ``identity`` the current caller: a bulk connection's thread, which serves the
    caller its one-time token was issued to (``elasticpipe.transport.bulk``)."""
    _CALLER.set(identity)


def permit(method: str) -> None:
    """Checks the current caller (a bulk connection's, ``act_as``) against ``method``'s row,
    as ``authorize`` checks a gRPC call's; without TLS there is nobody to check.

    Raises:
        PermissionDenied: a role the method does not allow.
    """
    identity = _CALLER.get()
    if identity is None:
        return
    name, role = identity
    allowed = ALLOWED[method]
    if role not in allowed:
        raise PermissionDenied(
            f"role {role!r} ({name}) may not call {method} (allowed: {', '.join(sorted(allowed))})"
        )


def _peer_identity(context: grpc.ServicerContext) -> tuple[str, str] | None:
    pems: bytes | list[bytes] = context.auth_context().get("x509_pem_cert") or []
    pem = pems if isinstance(pems, bytes) else (pems[0] if pems else b"")
    return identity_of(pem) if pem else None


def authorize(method: str, context: grpc.ServicerContext) -> tuple[str, str]:
    """Checks the caller's role against ``method``'s row ("Service/Method").

    Returns:
        The caller's (name, role); remembered for the call (``caller()``).

    Raises:
        PermissionDenied: no certificate, or a role the method does not allow.
    """
    identity = _peer_identity(context)
    if identity is None:
        raise PermissionDenied(f"{method} needs a client certificate of the cluster's CA")
    name, role = identity
    allowed = ALLOWED.get(method)
    if allowed is None:  # health checks, reflection: any member of the cluster
        _CALLER.set(identity)
        return identity
    if role not in allowed:
        raise PermissionDenied(
            f"role {role!r} ({name}) may not call {method} (allowed: {', '.join(sorted(allowed))})"
        )
    _CALLER.set(identity)
    return identity


def check_name(claimed: str, act: str = "register as") -> None:
    """With TLS, a stage registers (and heartbeats, leaves...) only under its
    certificate's name.

    Raises:
        PermissionDenied: the caller's certificate names someone else.
    """
    identity = caller()
    if identity is not None and not name_matches(identity[0], claimed):
        raise PermissionDenied(
            f"a stage with the certificate of {identity[0]!r} cannot {act} {claimed!r}"
        )
