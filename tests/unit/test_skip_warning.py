"""``clipping.warn_if_skipped``: a skipped step is logged once, the same way by both pipelines."""

from __future__ import annotations

import logging

import pytest

from elasticpipe.logs import get_logger
from elasticpipe.training import clipping


def test_a_skipped_step_is_logged_on_the_callers_logger_with_its_norm_and_scale(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A skip decision logs ``step_skipped`` with the step, the norm, why and the loss
    scale, as a warning of the logger given."""
    norm, clip = clipping.decide([float("inf"), 1.0], None)
    with caplog.at_level(logging.WARNING):
        clipping.warn_if_skipped(get_logger("elasticpipe.test"), 5, norm, clip, 1024.0)
    [record] = caplog.records
    assert record.name == "elasticpipe.test"
    assert record.levelno == logging.WARNING
    message = record.getMessage()
    assert message.startswith("step_skipped")
    for part in ("step=5", "grad_norm=inf", "non-finite gradient norm", "loss_scale=1024.0"):
        assert part in message, message


@pytest.mark.parametrize("sq_norms", [[9.0, 16.0], []])
def test_a_step_that_is_not_skipped_logs_nothing(
    caplog: pytest.LogCaptureFixture, sq_norms: list[float]
) -> None:
    """A finite norm (clipped or not) logs nothing."""
    norm, clip = clipping.decide(sq_norms, 1.0)
    with caplog.at_level(logging.DEBUG):
        clipping.warn_if_skipped(get_logger("elasticpipe.test"), 5, norm, clip, None)
    assert caplog.records == []
