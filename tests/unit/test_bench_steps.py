"""bench/shared/steps.py: ``--quick`` runs the fewest steps a bench measures with; fewer are
refused with the bench's own usage error."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.support import benches


@pytest.fixture(scope="module")
def steps() -> Iterator[ModuleType]:
    """bench/shared/steps.py, imported as the benches import it (bench/ on sys.path)."""
    with benches.imported("shared.steps") as module:
        yield module


def _parse(steps: ModuleType, argv: list[str], fewest: int, why: str = "") -> int:
    parser = argparse.ArgumentParser(prog="bench")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    steps.fewest_steps(parser, args, fewest, why)
    return int(args.steps)


@pytest.mark.parametrize(("argv", "want"), [([], 8), (["--steps", "3"], 3), (["--quick"], 2)])
def test_quick_sets_the_fewest_and_steps_are_kept_otherwise(
    steps: ModuleType, argv: list[str], want: int
) -> None:
    """``--quick`` overrides ``--steps`` with the fewest; without it the count stays."""
    assert _parse(steps, [*argv], 2) == want


def test_fewer_steps_are_a_usage_error_that_says_why(
    steps: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fewer than the fewest exits 2 with the bound, the reason and the value given."""
    with pytest.raises(SystemExit) as exited:
        _parse(steps, ["--steps", "1"], 2, ": the first step is not counted")
    assert exited.value.code == 2
    assert "--steps must be >= 2: the first step is not counted (got 1)" in capsys.readouterr().err
