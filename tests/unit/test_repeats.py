"""A job waiting out an outage logs the same warning once, not once per retry."""

from __future__ import annotations

import logging

import pytest

from elasticpipe.client.pipeline import _Repeats


def test_a_repeated_warning_is_logged_once_then_with_its_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    repeats = _Repeats(every=3600.0)
    with caplog.at_level(logging.WARNING):
        counts = [repeats.warn("step_failed", "refused", step=4, dead=[]) for _ in range(5)]
        counts.append(repeats.warn("step_failed", "refused", step=4, dead=["s2"]))  # news
        counts.append(repeats.warn("other", "refused"))
    assert counts == [1, 2, 3, 4, 5, 1, 1]
    assert len(caplog.records) == 3


def test_a_long_outage_is_reported_again_with_how_often_it_recurred(
    caplog: pytest.LogCaptureFixture,
) -> None:
    repeats = _Repeats(every=0.0)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            repeats.warn("failure_not_reported", "connection refused")
    assert len(caplog.records) == 3
    assert "repeated" in caplog.records[-1].getMessage()
