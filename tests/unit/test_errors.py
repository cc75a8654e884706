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


def _drawn_tree() -> dict[str, tuple[str | None, str]]:
    """The tree in errors' docstring: class name -> (parent drawn above it, status code)."""
    lines = (errors.__doc__ or "").split("::", 1)[1].split("\n\n")[1].splitlines()
    tree: dict[str, tuple[str | None, str]] = {}
    branch: list[str] = []  # the classes above the current line, by depth
    for line in lines:
        prefix = len(line) - len(line.lstrip(" │├└─"))
        depth = (prefix - 4) // 4  # four spaces of indent, then four characters a level
        words = line[prefix:].split()
        name = words[0].split("(")[0]
        code = next(w for w in words[1:] if w in grpc.StatusCode.__members__)
        del branch[depth:]
        tree[name] = (branch[-1] if branch else None, code)
        branch.append(name)
    return tree


def test_the_drawn_hierarchy_is_the_classes() -> None:
    """errors' docstring draws every error class under its real base with its real status
    code, and nothing else, so a new class cannot be added without its place in the tree."""
    drawn = _drawn_tree()
    assert set(drawn) == set(errors.BY_REASON)
    for name, (parent, code) in drawn.items():
        kind = errors.BY_REASON[name]
        bases = [b.__name__ for b in kind.__bases__ if issubclass(b, errors.ElasticPipeError)]
        assert bases == ([parent] if parent else []), name
        assert kind.code.name == code, name


def test_a_closed_pipeline_is_not_ready_and_not_retried() -> None:
    """PipelineClosed is a NotReady (FAILED_PRECONDITION) that is not retryable, and a
    pipeline's recovery re-raises it instead of retrying the step."""
    from elasticpipe.client import pipeline

    assert issubclass(errors.PipelineClosed, errors.NotReady)
    assert errors.PipelineClosed.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not errors.PipelineClosed.retryable
    pipe = pipeline.Pipeline(coordinator="127.0.0.1:9", model="mlp", model_kwargs={"sizes": [2, 2]})
    pipe.close()
    closed = errors.PipelineClosed("closed")
    try:
        pipe._recover(closed, deadline=float("inf"))
    except errors.PipelineClosed as exc:
        assert exc is closed
    else:
        raise AssertionError("_recover did not re-raise PipelineClosed")
