"""Which runs count their stashed bytes (``executor.StashMeter``): the first run of each
kind, one in ``STASH_COUNT_EVERY`` after it, and every run whose kind changed; the others
report the last count."""

from __future__ import annotations

import pytest

from elasticpipe.stage_server.executor import STASH_COUNT_EVERY, StashMeter

pytestmark = pytest.mark.timeout(10)


def test_counts_the_first_run_of_a_kind_then_one_in_every_few() -> None:
    meter = StashMeter()
    counted = [meter.begins(("epoch 1", (4, 8))) for _ in range(3 * STASH_COUNT_EVERY)]
    assert [n for n, c in enumerate(counted) if c] == [0, STASH_COUNT_EVERY, 2 * STASH_COUNT_EVERY]


def test_a_new_kind_counts_at_once_and_the_count_is_kept() -> None:
    meter = StashMeter()
    assert meter.begins(("a",))
    meter.counted(1000)
    assert not meter.begins(("a",))
    assert meter.last_bytes == 1000  # what an uncounted run of the kind reports
    assert meter.begins(("b",))  # other layers, ops or input shapes
    meter.counted(2000)
    assert meter.begins(("a",))  # back to the first kind: counted again, not assumed
    assert meter.last_bytes == 2000
