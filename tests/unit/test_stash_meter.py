"""Which runs count their stashed bytes (``executor.StashMeter``): the first run of each
kind, one in ``STASH_COUNT_EVERY`` after it, every run whose kind changed, and the run after
a counted one that failed; the others report the last count."""

from __future__ import annotations

import pytest

from elasticpipe.stage_server.executor import STASH_COUNT_EVERY, StashMeter

pytestmark = pytest.mark.timeout(10)


def test_counts_the_first_run_of_a_kind_then_one_in_every_few() -> None:
    meter = StashMeter()
    kind = ("epoch 1", (4, 8))
    counted = []
    for _ in range(3 * STASH_COUNT_EVERY):
        counted.append(meter.begins(kind))
        if counted[-1]:
            meter.counted(kind, 1000, {})
    assert [n for n, c in enumerate(counted) if c] == [0, STASH_COUNT_EVERY, 2 * STASH_COUNT_EVERY]


def test_a_new_kind_counts_at_once_and_the_count_is_kept() -> None:
    meter = StashMeter()
    assert meter.begins(("a",))
    meter.counted(("a",), 1000, {})
    assert not meter.begins(("a",))
    assert meter.last_bytes == 1000  # what an uncounted run of the kind reports
    assert meter.begins(("b",))  # other layers, ops or input shapes
    meter.counted(("b",), 2000, {})
    assert meter.begins(("a",))  # back to the first kind: counted again, not assumed
    assert meter.last_bytes == 2000


def test_a_counted_run_that_fails_leaves_the_count_to_the_next_run_of_its_kind() -> None:
    meter = StashMeter()
    assert meter.begins(("old epoch",))
    meter.counted(("old epoch",), 1000, {})
    assert meter.begins(("new epoch",))  # ... and the run fails: no ``counted``
    assert meter.begins(("new epoch",))  # its retry counts, not reporting the old 1000
    meter.counted(("new epoch",), 3000, {0: (4,), 1: (2,)})
    assert not meter.begins(("new epoch",))
    assert meter.last_bytes == 3000
    assert meter.inputs == {0: (4,), 1: (2,)}  # what an uncounted run compares its inputs with


def test_after_forget_the_next_run_counts_whatever_its_kind() -> None:
    meter = StashMeter()
    assert meter.begins(("a",))
    meter.counted(("a",), 1000, {})
    assert not meter.begins(("a",))  # uncounted, and met inputs the counted run did not
    meter.forget()
    assert meter.begins(("a",))
