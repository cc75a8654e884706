"""A job waiting out an outage logs the same warning once, not once per retry; a client
waiting for a lease says so once, then every ten seconds."""

from __future__ import annotations

import logging

import pytest

from elasticpipe.client.repeats import Repeats, Waiting


def test_a_repeated_warning_is_logged_once_then_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    repeats = Repeats(every=3600.0)
    with caplog.at_level(logging.WARNING):
        counts = [repeats.warn("step_failed", "refused", step=4, dead=[]) for _ in range(5)]
        counts.append(repeats.warn("step_failed", "refused", step=4, dead=["s2"]))  # news
        counts.append(repeats.warn("other", "refused"))
    assert counts == [1, 2, 3, 4, 5, 1, 1]
    assert len(caplog.records) == 3


def test_a_long_outage_is_reported_again_with_how_often_it_recurred(
    caplog: pytest.LogCaptureFixture,
) -> None:
    repeats = Repeats(every=0.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            repeats.warn("failure_not_reported", "connection refused")
    assert len(caplog.records) == 3
    assert "repeated" in caplog.records[-1].getMessage()


def test_a_long_wait_is_logged_once_then_every_ten_seconds_with_its_length(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client waiting out another's lease, retrying every second for 25 s, logs the
    wait when it begins and then at 10 s and 20 s, each with the seconds waited."""
    now = [100.0]
    waiting = Waiting("waiting_for_lease", every=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="elasticpipe"):
        for second in range(26):
            now[0] = 100.0 + second
            waiting.still(reason="job j1 is held by client 'c'")
    fields = [r.elasticpipe for r in caplog.records]
    assert [f.get("waited_s") for f in fields] == [None, 10.0, 20.0]
    assert all(f["event"] == "waiting_for_lease" and "held by" in f["reason"] for f in fields)
