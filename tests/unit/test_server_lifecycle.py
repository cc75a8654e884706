"""``serving.ServerLifecycle`` and ``serving.metrics_bind_host``: what both servers share."""

from __future__ import annotations

import pytest

from elasticpipe.errors import InvalidRequest
from elasticpipe.transport import serving


class _Recorded(serving.ServerLifecycle):
    """A lifecycle that records its calls instead of binding a port."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> _Recorded:
        self.calls.append("start")
        return self

    def stop(self) -> None:
        self.calls.append("stop")


def test_a_with_block_starts_and_stops_even_when_it_raises() -> None:
    """``with`` returns what ``start`` returned and calls ``stop`` on the way out, also
    when the block raises."""
    server = _Recorded()
    with pytest.raises(RuntimeError), server as started:
        assert started is server
        raise RuntimeError("in the block")
    assert server.calls == ["start", "stop"]


def test_the_address_of_a_server_not_started_is_refused() -> None:
    """``address`` before ``start`` says the server is not started."""
    with pytest.raises(AssertionError, match="server not started"):
        _ = _Recorded().address


def test_metrics_bind_host_is_empty_without_a_metrics_port() -> None:
    """No metrics port: no host, and no check (a wildcard listen is not refused)."""
    assert serving.metrics_bind_host("0.0.0.0:7100", None, "", False) == ""


def test_metrics_bind_host_checks_as_metrics_host_with_a_port() -> None:
    """With a metrics port it is ``metrics_host``: loopback, the operator's choice, or a
    refusal of plaintext metrics beyond loopback."""
    assert serving.metrics_bind_host("127.0.0.1:7100", 0, "", False) == "127.0.0.1"
    assert serving.metrics_bind_host("0.0.0.0:7100", 9100, "[::1]", False) == "::1"
    with pytest.raises(InvalidRequest, match="refusing to serve metrics"):
        serving.metrics_bind_host("0.0.0.0:7100", 9100, "", False)
