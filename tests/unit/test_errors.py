"""Errors received from peers: the domain kind by reason or by code, with a hint for TLS
handshake failures (which gRPC reports only as an unreachable peer)."""

from __future__ import annotations

import grpc

from elasticpipe import errors


def test_reason_picks_the_kind_and_code_is_the_fallback() -> None:
    err = errors.from_status(grpc.StatusCode.FAILED_PRECONDITION, "fenced", errors.Fenced.reason())
    assert type(err) is errors.Fenced
    err = errors.from_status(grpc.StatusCode.ABORTED, "x", "no-such-reason")
    assert type(err) is errors.StepAborted
    err = errors.from_status(grpc.StatusCode.UNAVAILABLE, "x", errors.Fenced.reason())
    assert type(err) is errors.Unavailable  # a reason that disagrees with the code loses


def test_tls_failures_say_what_to_fix() -> None:
    details = (
        "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.5:7200: "
        "Custom verification check failed with error: UNAUTHENTICATED: Hostname "
        "Verification Check failed."
    )
    err = errors.from_status(grpc.StatusCode.UNAVAILABLE, details)
    assert isinstance(err, errors.Unavailable)
    assert str(err).startswith(details) and "--host HOST" in str(err)
    err = errors.from_status(grpc.StatusCode.UNAVAILABLE, "... BAD_SIGNATURE ...")
    assert "--tls-ca" in str(err)
    assert str(errors.from_status(grpc.StatusCode.UNAVAILABLE, "refused")) == "refused"
